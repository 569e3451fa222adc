"""Interception of torch.nn.utils.clip_grad_norm_ while at least one Watcher wants it.

The total norm clip_grad_norm_ returns is the pre-clip gradient norm the user already paid for;
watchers reuse it instead of computing their own. On steps that sample per-layer gradient norms, a
watcher may also ask for the per-tensor norms the clip computes on its way to the total (its
torch._foreach_norm call): they are recorded as they pass, never recomputed, so the clip runs the
very same operations on the very same tensors. The patch is installed with the first watcher and
removed with the last; behaviour of the call itself is unchanged (same arguments, same result).

torch.nn.utils.clip_grads_with_norm_ (torch >= 2.6) is intercepted too: code that clips in two parts,
get_total_norm then clip_grads_with_norm_(parameters, max_norm, total_norm) (Accelerate >= 1.x, and so
the Hugging Face Trainer), hands it the pre-clip total norm, which is reused the same way. Its
per-tensor norms were computed before the call: a watcher that wants per-layer norms that step takes
them from the gradients before they are scaled.
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


# Depth of intercepted clip calls on this thread: a clip inside a clip (a torch whose clip_grad_norm_
# calls the public clip_grads_with_norm_) is the outer call's business, seen once.
_inside = threading.local()


def _nested() -> bool:
    return getattr(_inside, "depth", 0) > 0


class _Inside:
    def __enter__(self) -> None:
        _inside.depth = getattr(_inside, "depth", 0) + 1

    def __exit__(self, *_: object) -> None:
        _inside.depth -= 1


def _patched(original: Any) -> Any:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        if not _watchers or _nested():
            return original(parameters, max_norm, *args, **kwargs)
        with _Inside():
            return _observed_clip(original, parameters, max_norm, *args, **kwargs)

    clip_grad_norm_.__gradwatch_original__ = original  # type: ignore[attr-defined]  # a marker on a function
    return clip_grad_norm_


def _as_list(parameters: Any) -> Any:
    """A generator would be consumed by our look at it: the original gets the same items as a list
    (a single tensor stays as it is)."""
    return parameters if hasattr(parameters, "grad") else list(parameters)


def _observed_clip(original: Any, parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
    parameters = _as_list(parameters)
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


def _patched_with_norm(original: Any) -> Any:
    @functools.wraps(original)
    def clip_grads_with_norm_(
        parameters: Any, max_norm: float, total_norm: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not _watchers or _nested():
            return original(parameters, max_norm, total_norm, *args, **kwargs)
        with _Inside():
            parameters = _as_list(parameters)
            foreach = args[0] if args else kwargs.get("foreach")
            # norm_type None: the norms were computed before this call, none pass through it.
            for watcher in _watchers:
                watcher.before_clip(parameters, max_norm, None, foreach)
            result = original(parameters, max_norm, total_norm, *args, **kwargs)
            for watcher in _watchers:
                watcher.after_clip(parameters, max_norm, total_norm, None)
            return result

    clip_grads_with_norm_.__gradwatch_original__ = original  # type: ignore[attr-defined]  # a marker on a function
    return clip_grads_with_norm_


def _patch_points() -> list[tuple[Any, str, Any]]:
    """(module, attribute, wrapper factory) of each function replaced: torch.nn.utils re-exports
    clip_grad's clip_grad_norm_, and code calls either; the two-part API is public in torch.nn.utils
    only (torch's own clip_grad_norm_ calls clip_grad's private _clip_grads_with_norm_, not this)."""
    import torch.nn.utils
    import torch.nn.utils.clip_grad

    points: list[tuple[Any, str, Any]] = [
        (torch.nn.utils, "clip_grad_norm_", _patched),
        (torch.nn.utils.clip_grad, "clip_grad_norm_", _patched),
    ]
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        points.append((torch.nn.utils, "clip_grads_with_norm_", _patched_with_norm))
    return points


def register(watcher: Any) -> None:
    points = _patch_points()
    with _lock:
        if not _watchers:
            for module, name, wrap in points:
                original = getattr(module, name)
                _originals[f"{module.__name__}.{name}"] = original
                setattr(module, name, wrap(original))
        _watchers.append(watcher)


def unregister(watcher: Any) -> None:
    points = _patch_points()
    with _lock:
        if watcher in _watchers:
            _watchers.remove(watcher)
        if not _watchers and _originals:
            for module, name, _ in points:
                setattr(module, name, _originals.pop(f"{module.__name__}.{name}"))
