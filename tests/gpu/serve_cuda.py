"""`kvdepot serve` with the CUDA path wired in, for the GPU tests and benchmark.

Once `kvdepot.server.daemon` calls `enable_cuda` itself, this is plain
`kvdepot serve`. Until then it does what those lines will do: enable CUDA before
the pool's warm-up starts and page-lock each warm-up chunk (the `after_chunk`
hook), and it says so on stderr (the daemon log).

    python tests/gpu/serve_cuda.py serve --socket /tmp/x.sock --pool-size 4GiB
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def wire_cuda_if_missing() -> bool:
    """Patches Daemon._start_warmup when daemon.py does not enable CUDA; True if patched."""
    from kvdepot.server import daemon

    if "enable_cuda" in inspect.getsource(daemon):
        return False
    from kvdepot.server.cuda import enable_cuda, page_lock_hook  # older daemons only
    original = daemon.Daemon._start_warmup

    def _start_warmup(self: Any, st: Any) -> None:
        enable_cuda(st, st.arena)
        hook = page_lock_hook(st.arena)
        arena_start = st.arena.start_warmup

        def start_warmup(chunk_bytes: int = 256 << 20, on_progress: Any = None,
                         after_chunk: Any = None) -> None:
            arena_start(chunk_bytes=chunk_bytes, on_progress=on_progress,
                        after_chunk=after_chunk or hook)

        st.arena.start_warmup = start_warmup
        original(self, st)

    daemon.Daemon._start_warmup = _start_warmup  # type: ignore[method-assign]
    return True


if __name__ == "__main__":
    if wire_cuda_if_missing():
        print("serve_cuda.py: daemon.py does not call enable_cuda yet; wired it here",
              file=sys.stderr, flush=True)
    from kvdepot.server.cli import main

    sys.exit(main())
