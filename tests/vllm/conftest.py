"""vLLM tests: the real vLLM 0.33.0 Scheduler and worker connectors, on CPU.

vLLM decides its platform when first imported, so the CPU settings go into the
environment here, before any test module imports vllm.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
