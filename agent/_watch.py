"""Hooks on the user's optimizer and GradScaler: what is observed at each optimizer step.

One Watcher owns every hook handle and method wrapper it installs and removes them all in remove().
Nothing is written onto the user's model. Every observation is computed on the device and handed to
the run's StepBuffer; the user's own calls run exactly as before (their exceptions propagate
unchanged, ours never do).

With a GradScaler (enabled), the scaler's unscale_/step/update are wrapped on the instance:
- unscale_: gradient norms right after unscaling, i.e. of UNSCALED gradients before any clipping;
- step: the loss scale used, and found_inf (did this step get skipped?) read as device tensors;
- update: the scale after the update and the growth tracker.
Without one, optimizer step pre/post hooks observe the gradients and count the steps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ._buffer import Resolved

if TYPE_CHECKING:
    import torch

    from ._run import Run

LAYER_GRAD_NORMS = "_grad/layer_norms"  # agent-internal: used to name the layers behind a skip
SCALE_BEFORE = "_amp/scale_before"


class Watcher:
    """Observes one (model, optimizer, scaler) triple for one run."""

    def __init__(self, run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        import torch

        self._torch = torch
        self.run = run
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.features = run.features
        names = {id(p): name for name, p in model.named_parameters()}
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.layer_names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, str]] = []
        self._pending: dict[str, Any] = {}  # observations of the step in progress
        self._awaiting_update: int | None = None
        self._last_step_end: float | None = None
        if self.scaler is not None:
            self._wrap(self.scaler, "unscale_", self._after_unscale)
            self._wrap(self.scaler, "step", self._after_scaler_step, before=self._before_scaler_step)
            self._wrap(self.scaler, "update", self._after_update)
        else:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_step_hook))
            self._handles.append(optimizer.register_step_post_hook(self._post_step_hook))

    def remove(self) -> None:
        """Remove every hook and wrapper this watcher installed."""
        for handle in self._handles:
            handle.remove()
        for obj, name in self._wrapped:
            obj.__dict__.pop(name, None)
        self._handles.clear()
        self._wrapped.clear()

    # -- installation -----------------------------------------------------------------------------

    def _wrap(self, obj: Any, name: str, after: Any, before: Any = None) -> None:
        original = getattr(obj, name)
        watcher = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                watcher._guarded(before, *args, **kwargs)
            result = original(*args, **kwargs)  # the user's call: its errors are theirs
            watcher._guarded(after, *args, **kwargs)
            return result

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        obj.__dict__[name] = wrapper
        self._wrapped.append((obj, name))

    def _guarded(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self.features.guarded("step observation")(fn)(*args, **kwargs)

    # -- observations -----------------------------------------------------------------------------

    def _gradient_norms(self) -> None:
        """Per-layer and global L2 norms of the current gradients, on the device, in float32."""
        torch = self._torch
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        if len(grads) != len(self.params):  # a layer without a gradient this step counts as 0
            it = iter(norms)
            zero = torch.zeros((), dtype=torch.float32, device=grads[0].device)
            norms = [next(it) if p.grad is not None else zero for p in self.params]
        devices = {n.device for n in norms}
        if len(devices) > 1:  # model parallel: bring the norms to one device (async copies)
            norms = [n.to(grads[0].device, non_blocking=True) for n in norms]
        layer_norms = torch.stack(norms)
        self._pending[LAYER_GRAD_NORMS] = layer_norms
        self._pending["grad/global_norm"] = torch.linalg.vector_norm(layer_norms)

    def _after_unscale(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is self.optimizer:
            self._gradient_norms()

    def _before_scaler_step(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is not self.optimizer:
            return
        self._pending[SCALE_BEFORE] = self.scaler._scale.detach().clone()

    def _after_scaler_step(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is not self.optimizer:
            return
        torch = self._torch
        state = self.scaler._per_optimizer_states[id(optimizer)]
        found = list(state["found_inf_per_device"].values())
        if found:
            skipped = torch.stack([f.to(found[0].device, non_blocking=True) for f in found]).sum().clamp(max=1)
        else:
            skipped = torch.zeros((), device=self.scaler._scale.device)
        self._pending["amp/skipped"] = skipped
        self._awaiting_update = self._record_step()

    def _after_update(self, *_: Any, **__: Any) -> None:
        step = self._awaiting_update
        if step is None:
            return
        self._awaiting_update = None
        buffer = self.run.buffer
        buffer.add_scalar("amp/scale", step, self.scaler._scale.detach().clone())
        buffer.add_scalar("amp/growth_tracker", step, self.scaler._growth_tracker.detach().clone())
        self.run._after_step()

    def _pre_step_hook(self, optimizer: Any, *_: Any) -> None:
        self._gradient_norms()

    def _post_step_hook(self, optimizer: Any, *_: Any) -> None:
        self._record_step()
        self.run._after_step()

    def _record_step(self) -> int:
        """Hand this step's observations to the buffer and advance the run's step counter."""
        step = self.run.step
        buffer = self.run.buffer
        for key, value in self._pending.items():
            if key == LAYER_GRAD_NORMS:
                buffer.add_vector(key, step, value)
            else:
                buffer.add_scalar(key, step, value)
        self._pending.clear()
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group.get("lr")
            if lr is not None:
                buffer.add_scalar("lr" if i == 0 else f"lr/{i}", step, lr if isinstance(lr, (int, float)) else lr.detach().clone())
        now = time.perf_counter()
        if self._last_step_end is not None:
            buffer.add_scalar("perf/step_time", step, now - self._last_step_end)
        self._last_step_end = now
        self.run.step = step + 1
        return step

    # -- host side, on the sender thread ----------------------------------------------------------

    def derive_events(self, resolved: Resolved) -> None:
        """Turn the resolved per-step values into `skip` events (scale before/after, culprit layers)."""
        skipped = resolved.scalars.get("amp/skipped", [])
        if not skipped:
            return
        before = dict(resolved.scalars.get(SCALE_BEFORE, []))
        after = dict(resolved.scalars.get("amp/scale", []))
        layer_norms = dict(resolved.vectors.get(LAYER_GRAD_NORMS, []))
        for step, flag in skipped:
            if flag < 0.5:
                continue
            norms = layer_norms.get(step, [])
            bad = [name for name, norm in zip(self.layer_names, norms) if norm != norm or abs(norm) == float("inf")]
            resolved.events.append(
                {
                    "step": step,
                    "kind": "skip",
                    "data": {
                        "scale_before": before.get(step),
                        "scale_after": after.get(step),
                        "non_finite_layers": bad[:50],
                        "non_finite_layer_count": len(bad),
                    },
                }
            )
