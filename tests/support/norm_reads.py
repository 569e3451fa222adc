"""Counting how often code reads tensors through torch's norm functions (issue 40: gradwatch should read
the gradients once per optimizer step). Used by tests/agent/test_gradient_reads.py and
bench/gradient_reads.py."""

from __future__ import annotations

import os
import traceback
from collections import Counter

import torch

__all__ = ["CountNormReads"]


class CountNormReads:
    """Counts the elements the norm functions read while it is entered, split by whether gradwatch's
    code called them. It wraps torch's Python entry points (torch._foreach_norm, torch.linalg.vector_norm,
    torch.norm, Tensor.norm) for the block: a TorchDispatchMode does not see what runs in autograd's
    callbacks at the end of backward, where gradwatch measures."""

    TARGETS = (
        (torch, "_foreach_norm"),
        (torch.linalg, "vector_norm"),
        (torch, "norm"),
        (torch.Tensor, "norm"),
    )

    def __init__(self) -> None:
        self.elements: Counter[str] = Counter()
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> CountNormReads:  # noqa: PYI034
        for owner, name in self.TARGETS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._counting(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _counting(self, original):  # type: ignore[no-untyped-def]
        def counted(first, *args, **kwargs):  # type: ignore[no-untyped-def]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            count = sum(t.numel() for t in tensors if isinstance(t, torch.Tensor))
            self.elements["gradwatch" if _from_gradwatch() else "loop"] += count
            return original(first, *args, **kwargs)

        return counted


def _gradwatch_dir() -> str:
    import gradwatch

    return os.path.dirname(os.path.abspath(gradwatch.__file__)) + os.sep


def _from_gradwatch() -> bool:
    """Whether gradwatch's own code is on the stack (its package folder: agent/ in this checkout)."""
    folder = _gradwatch_dir()
    return any(os.path.abspath(frame.filename).startswith(folder) for frame in traceback.extract_stack())
