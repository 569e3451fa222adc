"""Parameters the optimizer does not hold: layers that get a gradient on every step but are in no param
group (an optimizer built from the head's parameters only, or before the backbone was unfrozen), so
they never change while the loss looks merely "a bit worse".

How it is judged, without a device sync in the step:
- on the host, every few optimizer steps (OptimizerCoverage.check, from the optimizer's pre-step hook):
  which of the model's parameters have a .grad but are in no param group. The param groups are read
  again only when their sizes change (add_param_group). Frozen parameters (requires_grad=False, LoRA
  base weights, a backbone frozen on purpose) never get a .grad and are never candidates.
- when the optimizer holds any parameter that is not the watched model's own (FSDP1 flat parameters,
  DeepSpeed's partitions, the parameters of a second model), nothing is judged at all.
- a candidate is reported only once it is seen unchanged CONFIRM_AFTER_STEPS later (its L2 norm
  bit-identical, compared on the device): a parameter another optimizer steps (SparseAdam for a
  sparse embedding, a GAN's second optimizer, Muon beside AdamW) changes and is left alone. The
  comparison travels with the next flush under an agent-internal key (UNHELD_UNCHANGED_PREFIX + a
  token) and the sender thread turns it into a `params_not_in_optimizer` event (_derive).

Each parameter is judged once: reported, or seen changing and left alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _quantities
from ._derive import UNHELD_UNCHANGED_PREFIX, UnheldCandidates

if TYPE_CHECKING:
    from ._sink import StepSink

__all__ = ["CHECK_EVERY", "CONFIRM_AFTER_STEPS", "DENSE_CHECK_EVERY", "OptimizerCoverage"]

CHECK_EVERY = 20  # optimizer steps between two host checks of which parameters have a gradient
DENSE_CHECK_EVERY = 4  # ... during the run's first dense_start_steps (WatchOptions)
CONFIRM_AFTER_STEPS = 10  # a candidate unchanged this many steps later is reported


class _Pending:
    """Candidates whose norms were taken at `step`, waiting to be compared."""

    __slots__ = ("candidates", "norms", "params", "step")

    def __init__(self, step: int, params: list[Any], norms: Any, candidates: UnheldCandidates) -> None:
        self.step, self.params, self.norms, self.candidates = step, params, norms, candidates


class OptimizerCoverage:
    """Finds the watched model's parameters that get a gradient but that `optimizer` does not hold.

    named: (layer name, parameter) of every model parameter, in the model's order; local: a DTensor's
    local shard (identity otherwise); like: a tensor on the device the comparison lives on;
    expected: where the sender thread finds each comparison's names (WatchDerivation.unheld)."""

    def __init__(
        self,
        named: list[tuple[str, Any]],
        optimizer: Any,
        local: Callable[[Any], Any],
        like: Any,
        expected: dict[int, UnheldCandidates],
        dense_start_steps: int = 0,
    ) -> None:
        self._named = named
        self._model_ids = {id(p) for _, p in named}
        self._optimizer = optimizer
        self._local = local
        self._like = like
        self._expected = expected
        self._dense_start_steps = dense_start_steps
        self._group_sizes: tuple[int, ...] | None = None
        self._held: set[int] = set()
        self._judged = False  # the optimizer holds only the model's own parameters
        self._settled: set[int] = set()  # parameters already judged (reported, or seen changing)
        self._pending: _Pending | None = None
        self._next_check = 0
        self._tokens = itertools.count(1)

    def check(self, step: int, sink: StepSink) -> None:
        """Called before each optimizer step: on a check step, look for parameters with a gradient
        that no param group holds (host reads only), or compare the ones found earlier."""
        if step < self._next_check:
            return
        self._next_check = step + (DENSE_CHECK_EVERY if step < self._dense_start_steps else CHECK_EVERY)
        self._read_groups()
        if not self._judged:
            return
        pending = self._pending
        if pending is not None:
            if step >= pending.step + CONFIRM_AFTER_STEPS:
                self._confirm(step, pending, sink)
            return
        unheld = [(name, p) for name, p in self._named if id(p) not in self._held and p.grad is not None]
        fresh = [(name, p) for name, p in unheld if id(p) not in self._settled]
        if not fresh:
            return
        held_elements = sum(p.numel() for _, p in self._named if id(p) in self._held and p.requires_grad)
        candidates = UnheldCandidates(
            names=tuple(name for name, _ in fresh),
            elements=tuple(p.numel() for _, p in fresh),
            gradient_elements=held_elements + sum(p.numel() for _, p in unheld),
        )
        params = [p for _, p in fresh]
        self._settled.update(id(p) for p in params)
        self._pending = _Pending(step, params, self._norms(params), candidates)

    def _read_groups(self) -> None:
        groups = self._optimizer.param_groups
        sizes = tuple(len(group["params"]) for group in groups)
        if sizes == self._group_sizes:
            return
        self._group_sizes = sizes
        self._held = {id(p) for group in groups for p in group["params"]}
        self._judged = self._held <= self._model_ids

    def _norms(self, params: list[Any]) -> Any:
        import torch

        with torch.no_grad():
            return _quantities.layer_norms([self._local(p).detach() for p in params], self._like)

    def _confirm(self, step: int, pending: _Pending, sink: StepSink) -> None:
        """Record, per candidate, whether its norm is bit-identical to CONFIRM_AFTER_STEPS ago (a
        device comparison; read on the sender thread)."""
        self._pending = None
        unchanged = (self._norms(pending.params) == pending.norms).float()
        token = next(self._tokens)
        self._expected[token] = pending.candidates  # before the values: the sender reads it with them
        sink.add_tensor(f"{UNHELD_UNCHANGED_PREFIX}{token}", step, unchanged)
