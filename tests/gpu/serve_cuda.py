"""`kvdepot serve` with the CUDA path, for the GPU tests and benchmark.

The daemon enables CUDA itself (kvdepot.server.daemon calls `enable_cuda` before
the pool's warm-up, which page-locks each chunk), so this is plain `kvdepot
serve`; the GPU scripts keep calling it by this path.

    python tests/gpu/serve_cuda.py serve --socket /tmp/x.sock --pool-size 4GiB
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def wire_cuda_if_missing() -> bool:
    """Kept for the scripts that call it: daemon.py enables CUDA itself (before the
    warm-up, which page-locks each chunk through the arena's warm-up hook)."""
    return False


if __name__ == "__main__":
    if wire_cuda_if_missing():
        print(
            "serve_cuda.py: daemon.py does not call enable_cuda yet; wired it here",
            file=sys.stderr,
            flush=True,
        )
    from kvdepot.server.cli import main

    sys.exit(main())
