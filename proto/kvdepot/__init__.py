"""kvdepot: a node-local, out-of-process KV-cache offload daemon for vLLM."""

__version__ = "0.1.0"
