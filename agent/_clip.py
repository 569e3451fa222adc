"""Interception of torch.nn.utils.clip_grad_norm_ while at least one Watcher wants it.

The total norm clip_grad_norm_ returns is the pre-clip gradient norm the user already paid for;
watchers reuse it instead of computing their own. The patch is installed with the first watcher and
removed with the last; behaviour of the call itself is unchanged (same arguments, same result).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_lock = threading.Lock()
_watchers: list[Any] = []
_originals: dict[str, Any] = {}


def _patched(original: Any) -> Any:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        if not _watchers:
            return original(parameters, max_norm, *args, **kwargs)
        # A generator would be consumed by our look at it: hand the original the same items as a list.
        if not hasattr(parameters, "grad"):
            parameters = list(parameters)
        for watcher in _watchers:
            watcher.before_clip(parameters, max_norm)
        total_norm = original(parameters, max_norm, *args, **kwargs)
        for watcher in _watchers:
            watcher.after_clip(parameters, max_norm, total_norm)
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
