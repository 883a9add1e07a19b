"""Optional sections measured by sibling modules: the vLLM connector and the CUDA path.

`kvdepot.bench.connector_bench` (needs vLLM) and `kvdepot.bench.gpu_bench` (needs
CUDA) are separate modules, written and owned beside this one. The CLI calls
them when they exist and their environment is there, passing what it knows by
keyword (only the keywords their entry point accepts), and reports their dict
as it is. A missing module or environment is a reason in the report, never a
failure; an error inside one is reported too, and the rest of the bench stands.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import traceback
from collections.abc import Callable
from typing import Any

ENTRY_POINTS = ("run_connector_bench", "run_gpu_bench", "run_bench", "run", "measure", "bench")


def _module(name: str) -> Any | None:
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):
        return None
    return importlib.import_module(name)


def _entry(module: Any) -> Callable[..., Any] | None:
    for name in ENTRY_POINTS:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _call(fn: Callable[..., Any], offered: dict[str, Any]) -> Any:
    """Calls `fn` with the offered keywords it accepts (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**offered)
    return fn(**{k: v for k, v in offered.items() if k in params})


def run_optional(
    module_name: str, requirement: Callable[[], str | None], offered: dict[str, Any]
) -> dict[str, Any]:
    """Runs a sibling bench module; returns its dict, or {"skipped"/"error": why}."""
    why_not = requirement()
    if why_not:
        return {"skipped": why_not}
    try:
        module = _module(module_name)
    except Exception as exc:  # a sibling that fails to import must not sink the bench
        return {"error": f"importing {module_name}: {type(exc).__name__}: {exc}"}
    if module is None:
        return {"skipped": f"{module_name} is not in this installation"}
    fn = _entry(module)
    if fn is None:
        return {"skipped": f"{module_name} has no entry point ({', '.join(ENTRY_POINTS)})"}
    try:
        result = _call(fn, offered)
    except Exception as exc:
        return {"error": f"{module_name}: {type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=5)}
    if not isinstance(result, dict):
        return {"error": f"{module_name} returned {type(result).__name__}, not a dict"}
    return result


def need_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'kvdepot[vllm]')"
    return None


def need_cuda() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "no torch, so no CUDA"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return None


def find_number(result: dict[str, Any], *words: str) -> float | None:
    """The first numeric value whose (dotted) key contains every one of `words`.

    The sibling modules' key names are theirs; this reads a headline figure out
    of them for the target check without tying the two files together.
    """
    stack: list[tuple[str, Any]] = [("", result)]
    while stack:
        prefix, obj = stack.pop(0)
        if isinstance(obj, dict):
            stack.extend((f"{prefix}.{k}" if prefix else str(k), v) for k, v in obj.items())
        elif (
            isinstance(obj, int | float) and not isinstance(obj, bool)
            and all(w in prefix.lower() for w in words)
        ):
            return float(obj)
    return None
