"""ScalerView: the one place that reads a GradScaler's private state.

GradScaler's public API gives the loss scale only as get_scale(), a host-device synchronisation,
and says nothing about which optimizers were unscaled or found inf/NaN this iteration. The Watcher
needs all of these as device tensors, in the step, without a sync, so it reads private fields, and
only through this class.

Checked against torch 2.13.0 (torch/amp/grad_scaler.py); torch.cuda.amp.GradScaler and FSDP's
ShardedGradScaler subclass torch.amp.GradScaler and have the same fields. The fields read:

    _scale                 float32 0-dim tensor on the scaler's device: the loss scale S
                           (None until the first scale() call; updated in place by update())
    _growth_tracker        int32 0-dim tensor: clean steps since the scale last changed
    _per_optimizer_states  {id(optimizer): {"stage": OptState, "found_inf_per_device": {device:
                           float32 0-dim tensor, 1.0 where inf/NaN was found}}}, filled by
                           unscale_ / step, emptied by update()
    torch.amp.grad_scaler.OptState.READY   an optimizer's stage before unscale_ or step

and the public is_enabled() and state-dict "scale" entry. Reading never adds an entry to
_per_optimizer_states (it is a defaultdict: the view uses .get) and never synchronises. A disabled
scaler has none of these fields (and scales nothing): every reading is None, and nothing is reported.

When a field is missing or unreadable (another torch version, a look-alike object) the signal built
from it is absent: the method returns None, the Watcher records nothing for that signal, and
on_missing(signal, exc) is called once for it. Nothing here raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Signals, named as the on_missing callback receives them (the wire keys they produce, where any).
SCALE = "amp/scale"
GROWTH_TRACKER = "amp/growth_tracker"
FOUND_INF = "amp/skipped"
UNSCALE_STAGE = "clip_before_unscale"
SIGNALS = (SCALE, GROWTH_TRACKER, FOUND_INF, UNSCALE_STAGE)


def _ready_stage() -> Any:
    try:
        from torch.amp.grad_scaler import OptState

        return OptState.READY
    except (ImportError, AttributeError):
        return None


class ScalerView:
    """Read-only access to one GradScaler's loss scale, growth tracker and per-optimizer inf checks.

    Each reading is a device tensor (or a host value from host state), taken without a sync; None
    when the scaler is disabled or the field it comes from cannot be read.

    Attributes: scaler (the object viewed); enabled (its is_enabled() when the view was made; False
    when that cannot be asked); missing (the signals found unreadable so far).
    """

    def __init__(self, scaler: Any, on_missing: Callable[[str, BaseException], None] | None = None) -> None:
        """on_missing(signal, exc): called once per signal (SCALE, GROWTH_TRACKER, FOUND_INF,
        UNSCALE_STAGE) whose field cannot be read; its own errors are swallowed."""
        self.scaler = scaler
        self._on_missing = on_missing
        self.missing: set[str] = set()
        try:
            self.enabled = bool(scaler.is_enabled())
        except Exception:  # noqa: BLE001 - a scaler that cannot say is treated as disabled
            self.enabled = False
        self._absent: set[str] = set() if self.enabled else set(SIGNALS)  # readings that return None
        self._ready = _ready_stage()

    def scale(self) -> Any | None:
        """A copy of the loss scale S: float32, 0-dim, on the scaler's device (a copy because update()
        changes the scaler's own tensor in place). None before the first scale() call or unreadable."""
        if SCALE in self._absent:
            return None
        try:
            scale = self.scaler._scale
            return None if scale is None else scale.detach().clone()
        except Exception as exc:  # noqa: BLE001 - see the module docstring: degrade, never raise
            self._lost(SCALE, exc)
            return None

    def growth_tracker(self) -> Any | None:
        """A copy of the growth tracker (int32, 0-dim, on the scaler's device), or None."""
        if GROWTH_TRACKER in self._absent:
            return None
        try:
            tracker = self.scaler._growth_tracker
            return None if tracker is None else tracker.detach().clone()
        except Exception as exc:  # noqa: BLE001
            self._lost(GROWTH_TRACKER, exc)
            return None

    def found_inf(self, optimizer: Any) -> Any | None:
        """1.0 if this iteration's inf/NaN check found a non-finite gradient of `optimizer` on any
        device, else 0.0: a float32 0-dim device tensor, no sync. Read between scaler.step and
        scaler.update (update forgets the checks). For a fused optimizer, whose step always runs, it
        is the only sign that the step applied nothing."""
        if FOUND_INF in self._absent:
            return None
        try:
            import torch

            state = self.scaler._per_optimizer_states.get(id(optimizer))
            found = list(state["found_inf_per_device"].values()) if state is not None else []
            if not found:
                return torch.zeros((), device=self.scaler._scale.device)
            if len(found) == 1:  # the usual case: one op instead of four (a copy: see below)
                return found[0].clone()
            # A copy in either case: scaler.update() adds the other checks into the first in place.
            return torch.stack([f.to(found[0].device, non_blocking=True) for f in found]).sum().clamp(max=1)
        except Exception as exc:  # noqa: BLE001
            self._lost(FOUND_INF, exc)
            return None

    def unscaled(self, optimizer: Any) -> bool | None:
        """Whether `optimizer`'s gradients are unscaled already in this iteration (unscale_ or step
        was called for it since the last update), from host state; None when that cannot be told."""
        if UNSCALE_STAGE in self._absent:
            return None
        try:
            if self._ready is None:
                raise AttributeError("torch.amp.grad_scaler.OptState.READY is not available")
            state = self.scaler._per_optimizer_states.get(id(optimizer))
            return state is not None and state["stage"] is not self._ready
        except Exception as exc:  # noqa: BLE001
            self._lost(UNSCALE_STAGE, exc)
            return None

    @staticmethod
    def loaded_scale(state_dict: Any) -> float | None:
        """The loss scale in a state dict passed to load_state_dict (GradScaler.state_dict()'s public
        format, a host float), or None when it holds none."""
        scale = state_dict.get("scale") if isinstance(state_dict, dict) else None
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            return float(scale)
        return None

    def _lost(self, signal: str, exc: BaseException) -> None:
        self.missing.add(signal)
        self._absent.add(signal)
        if self._on_missing is not None:
            try:
                self._on_missing(signal, exc)
            except Exception:  # noqa: BLE001, S110 - reporting must not turn into a raise
                pass
