"""Small models with seeded random weights for real vLLM engines: the bench's
(`kvdepot.bench.vllm_models`), which `kvdepot bench serve` builds too."""

from kvdepot.bench.vllm_models import CONFIG_DIRS, build_model

__all__ = ["CONFIG_DIRS", "build_model"]
