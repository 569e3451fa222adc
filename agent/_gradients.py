"""Where the gradients are read: at the end of each backward pass, before anything can clip them.

A training loop may clip its gradients in any way: torch's clip_grad_norm_ looked up at call time or
imported by name, the two-part get_total_norm + clip_grads_with_norm_, FSDP's model.clip_grad_norm_,
Accelerate's, Lightning's, DeepSpeed's, a hand-written loop of mul_, or not at all. Every one of them
runs after backward, so the pre-clip norms are measured where every loop passes: when autograd has
finished a backward pass. Nothing of torch is patched to see a clip.

How:
- a post-accumulate-grad hook on each watched parameter queues, once per backward pass, a callback on
  autograd's engine (queue_callback: it runs when the backward pass ends). That callback queues a
  second one, which runs after every callback queued during the pass: DDP's and FSDP's own end-of-
  backward work (the all-reduce written back into .grad, the reduce-scatter into the sharded .grad)
  is done by then.
- the per-layer L2 norms of the gradients are taken there, on their device (one foreach pass, no
  sync). With gradient accumulation each pass measures the sum so far and the last pass before the
  optimizer step is the step's. Under an enabled GradScaler (unless the optimizer is fused, or the
  loop clips before unscale_) they are still scaled there, and a float32 sum of squares of S*g
  overflows or underflows when S is far from 1: they are measured once after scaler.unscale_
  instead, where they are unscaled and, by GradScaler's contract, not yet clipped (the Watcher).
- the gradients' version counters (host integers, bumped by every in-place write: a clip's mul_, an
  unscale_) are noted with the measurement. At the optimizer step, a changed counter means something
  rewrote the gradients in between: a clip. Only then is a second pass taken, the post-clip norm.

Nothing here synchronises with the device; host work per pass is one Python call per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Versions = tuple[tuple[int, int] | None, ...]


def versions(grads: Sequence[Any]) -> Versions:
    """Identity and in-place version of each gradient (None: no gradient): what a later look compares
    with to tell whether anything rewrote them. Host integers only."""
    return tuple(None if g is None else (id(g), g._version) for g in grads)


def rewritten(before: Versions, grads: Sequence[Any]) -> bool:
    """Whether any gradient was written in place, replaced or removed since `before` was noted.

    Writes through `.data` (a tensor with a version counter of its own) are not seen: a clip written
    that way looks like none (its pre-clip norm is still right; no post-clip norm is recorded)."""
    return versions(grads) != before


def only_removed(before: Versions, grads: Sequence[Any]) -> bool:
    """Whether the only change since `before` is gradients set to None (some layers left out of the
    step by hand): every other gradient is the same tensor at the same version."""
    now = versions(grads)
    return now != before and all(n is None or n == b for n, b in zip(now, before, strict=True))


class BackwardEnd:
    """Calls `on_end()` once at the end of each backward pass that reaches a watched parameter, after
    the other end-of-backward callbacks (DDP, FSDP) of that pass.

    `hook(param)` is what each parameter's post-accumulate-grad hook calls; `on_end` and `hook` are
    the caller's guarded functions (nothing here may raise into autograd)."""

    def __init__(self, on_end: Any) -> None:
        import torch

        self._queue = torch.autograd.Variable._execution_engine.queue_callback
        self._on_end = on_end
        self._queued = False

    def hook(self, _param: Any) -> None:
        if not self._queued:
            self._queued = True
            self._queue(self._after_the_others)

    def _after_the_others(self) -> None:
        # Callbacks queued while the engine runs its callbacks run after all of those queued before.
        self._queue(self._end)

    def _end(self) -> None:
        self._queued = False
        self._on_end()

    def reset(self) -> None:
        """A new step: a pass that failed before its callbacks ran leaves nothing queued behind."""
        self._queued = False
