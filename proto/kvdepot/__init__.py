"""kvdepot: a node-local, out-of-process KV-cache offload daemon for vLLM."""

import os

__version__ = "0.1.0"

# gRPC core's fork handlers crash a forked child (SIGSEGV, in 10-50 % of children in
# our runs) while a grpc.aio stream is open in the parent, as every kvdepot client
# keeps one. Python's gRPC leaves fork support off unless asked; this makes gRPC core
# agree. It must be set before the process's first `import grpc`, which is ours in a
# vLLM engine; an explicit setting wins. (kvdepot.client.stream_loop: what a child
# forked with streams open can and cannot do.)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
