"""Interception of torch.nn.utils.clip_grad_norm_ while at least one Watcher wants it.

The total norm clip_grad_norm_ returns is the pre-clip gradient norm the user already paid for;
watchers reuse it instead of computing their own. On steps that sample per-layer gradient norms, a
watcher may also ask for the per-tensor norms the clip computes on its way to the total (its
torch._foreach_norm call): they are recorded as they pass, never recomputed, so the clip runs the
very same operations on the very same tensors. The patch is installed with the first watcher and
removed with the last; behaviour of the call itself is unchanged (same arguments, same result).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_lock = threading.Lock()
_watchers: list[Any] = []
_originals: dict[str, Any] = {}

# torch._foreach_norm is replaced only while some thread's clip call records its norms; each thread
# records into its own list, so concurrent clips (rare) neither see each other's calls nor leave the
# wrapper behind.
_recording_lock = threading.Lock()
_recording_threads = 0
_original_foreach_norm: Any = None
_recorded = threading.local()


def _recording_foreach_norm(tensors: Any, *args: Any, **kwargs: Any) -> Any:
    result = _original_foreach_norm(tensors, *args, **kwargs)
    calls = getattr(_recorded, "calls", None)
    if calls is not None:
        calls.append((tensors, args, kwargs, result))
    return result


def _call_recording_norms(original: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
    """original(*args, **kwargs), with the torch._foreach_norm calls it makes on this thread
    recorded as (tensors, args, kwargs, result)."""
    global _recording_threads, _original_foreach_norm
    import torch

    calls: list[Any] = []
    with _recording_lock:
        if _recording_threads == 0:
            _original_foreach_norm = torch._foreach_norm
            torch._foreach_norm = _recording_foreach_norm  # type: ignore[assignment]  # a wrapper, same calls
        _recording_threads += 1
    _recorded.calls = calls
    try:
        return original(*args, **kwargs), calls
    finally:
        _recorded.calls = None
        with _recording_lock:
            _recording_threads -= 1
            if _recording_threads == 0:
                torch._foreach_norm = _original_foreach_norm


def _compiling() -> bool:
    import torch

    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _norm_options(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(norm_type, foreach) of a clip_grad_norm_(parameters, max_norm, norm_type=2.0,
    error_if_nonfinite=False, foreach=None) call, from the arguments after max_norm."""
    norm_type = args[0] if args else kwargs.get("norm_type", 2.0)
    foreach = args[2] if len(args) > 2 else kwargs.get("foreach")
    return norm_type, foreach


def _patched(original: Any) -> Any:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        if not _watchers:
            return original(parameters, max_norm, *args, **kwargs)
        # A generator would be consumed by our look at it: hand the original the same items as a list.
        if not hasattr(parameters, "grad"):
            parameters = list(parameters)
        norm_type, foreach = _norm_options(args, kwargs)
        # A watcher answers True when it wants the per-tensor norms of this call.
        recording = [watcher.before_clip(parameters, max_norm, norm_type, foreach) for watcher in _watchers]
        calls: list[Any] | None = None
        # Not while torch.compile traces the call: the graph would capture the swap of torch's
        # function; the watcher then measures the norms itself, in eager code.
        if any(recording) and not _compiling():
            total_norm, calls = _call_recording_norms(original, parameters, max_norm, *args, **kwargs)
        else:
            total_norm = original(parameters, max_norm, *args, **kwargs)
        for watcher, records in zip(_watchers, recording, strict=False):
            watcher.after_clip(parameters, max_norm, total_norm, calls if records else None)
        return total_norm

    clip_grad_norm_.__gradwatch_original__ = original  # type: ignore[attr-defined]  # a marker on a function
    return clip_grad_norm_


def _patched_modules() -> tuple[Any, ...]:
    """The modules whose clip_grad_norm_ is replaced: torch.nn.utils re-exports clip_grad's, and code
    calls either. Typed Any: to a type checker a tuple of modules holds plain ModuleTypes."""
    import torch.nn.utils
    import torch.nn.utils.clip_grad

    return (torch.nn.utils, torch.nn.utils.clip_grad)


def register(watcher: Any) -> None:
    modules = _patched_modules()
    with _lock:
        if not _watchers:
            for module in modules:
                original = module.clip_grad_norm_
                _originals[module.__name__] = original
                module.clip_grad_norm_ = _patched(original)
        _watchers.append(watcher)


def unregister(watcher: Any) -> None:
    modules = _patched_modules()
    with _lock:
        if watcher in _watchers:
            _watchers.remove(watcher)
        if not _watchers and _originals:
            for module in modules:
                module.clip_grad_norm_ = _originals.pop(module.__name__)
