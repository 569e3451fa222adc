"""Hooks on the user's optimizer, GradScaler and clip_grad_norm_: what is observed at each step.

One Watcher owns every hook handle and method wrapper it installs and removes them all in remove();
nothing is written onto the user's model. Observations are computed on the device (see _quantities)
and handed to the run's StepSink; the user's own calls run exactly as before (their exceptions
propagate unchanged, ours never reach them).

Where each signal comes from:
- optimizer step pre/post hooks: step counting without a scaler; the parameter snapshot, update
  ratio and rounded-away updates; for non-fused optimizers under a GradScaler, "the optimizer really
  stepped" — so a skipped step is known on the host with no device sync, and only skipped steps pay
  for localisation.
- GradScaler (wrapped on the instance): scale (the unscaled loss of each micro-batch), unscale_
  (gradients are unscaled from here on), step (scale used, found_inf for fused optimizers whose step
  always runs), update (scale after, growth tracker), load_state_dict (a resumed scaler).
- clip_grad_norm_ and clip_grads_with_norm_ (see _clip): the pre-clip total norm is reused as grad/global_norm
  (not with sharded gradients: there it is already the global norm, computed by a collective); its
  max_norm is sent as grad/clip_max_norm. On steps that sample per-layer gradient norms, a run that
  clipped its last step has them taken from the clip's own per-tensor norms (recorded as the clip
  computes them) instead of a second pass over every gradient; a step that turns out not to clip
  computes them itself before the optimizer steps.

Keys recorded here. Every step: amp/scale, amp/skipped, amp/growth_tracker, amp/loss (mean of the
losses passed to scaler.scale in the step), amp/micro_batches (backward passes in the step, from the
last parameter's post-accumulate-grad hook; else the scale() calls), grad/global_norm,
grad/global_norm_post_clip and grad/clip_max_norm (when clipping), lr, lr/1…, perf/step_time,
perf/samples_per_sec, perf/tokens_per_sec. Per layer on sampled steps (WatchOptions; denser during
the first dense_start_steps): grad/norm, param/norm, update/ratio, update/rounded_away_frac,
grad/hist and from it grad/zero_frac, grad/underflow_frac, grad/precision_loss_frac,
grad/overflow_frac (with their grad/global_* scalars) and amp/safe_scale_min / amp/safe_scale_max.
Once, when watching an fp16 run starts: param/max_abs (each layer's largest |weight|).
Events: skip, no_gradient, scaler_state_loaded, scale_below_one, and the misuse kinds
clip_before_unscale, bf16_model_in_fp16, weights_exceed_fp16 (bad_batch comes from the Run).

Collaborators: the run is seen only as a StepSink (_sink: the current step, record, end a step);
the GradScaler's private state only through a ScalerView (_scaler); what the sender thread derives
from the transferred values is _derive's (the Watcher's `derive` is a WatchDerivation).

Distributed (see _distributed): every quantity is computed from this rank's local tensors only (a
DTensor's local shard), so watching adds no collective. With sharded gradients the per-rank norms are
the shards' norms and the server combines them (sqrt of the sum of squares); with replicated ones
(DDP) they are whole and equal on every rank, and histograms are taken on rank 0 only by default.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _clip, _distributed, _quantities
from ._derive import (  # the agent-internal keys this module records for _derive
    CLIP_MAX_NORM,
    MAX_ABS_WEIGHT,
    MAX_LAYERS_IN_EVENT,
    SCALE_BEFORE,
    UNCHANGED_COUNTS,
    WatchDerivation,
)
from ._errors import GradwatchWarning
from ._names import user_layer_names
from ._scaler import SCALE, ScalerView

if TYPE_CHECKING:
    import torch

    from ._sink import StepSink


@dataclass(frozen=True)
class WatchOptions:
    """Sampling schedules (every N optimizer steps; 0 turns a quantity off) and throughput hints.

    Defaults keep the cost near zero: scale, skips, global norm and lr every step; per-layer
    gradient norms every 20 steps; parameter norms, histograms and update ratios every 100.

    dense_start_steps: during the first this many optimizer steps (default 200; 0 = off) each
    sampled quantity is also taken every max(1, every // 5) steps, so that problems present from the
    start (a detached layer, underflowing adapters, bf16 weights that never change) show within ~20
    steps; the steady-state cost is unchanged.

    histogram_ranks: which ranks of a distributed job take the gradient histograms. "auto" (default):
    rank 0 alone when gradients are replicated (DDP: every rank would send the same counts), every
    rank when they are sharded (FSDP: each rank counts its shard; the shards' counts add up); "all";
    or a collection of ranks, e.g. (0, 4).
    """

    layer_norms_every: int = 20
    param_norms_every: int = 100
    histograms_every: int = 100
    update_ratio_every: int = 100
    samples_per_step: int | None = None
    tokens_per_step: int | None = None
    histogram_ranks: str | tuple[int, ...] | frozenset[int] = "auto"
    dense_start_steps: int = 200

    def __post_init__(self) -> None:
        for name in ("layer_norms_every", "param_norms_every", "histograms_every", "update_ratio_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a whole number of steps >= 0 (0 = off), got {value!r}")
        dense = self.dense_start_steps
        if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
            raise ValueError(
                f"dense_start_steps must be a whole number of steps >= 0 (0 = off), got {dense!r}"
            )
        for name in ("samples_per_step", "tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        ranks = self.histogram_ranks
        if isinstance(ranks, str):
            if ranks not in ("auto", "all"):
                raise ValueError(
                    f"histogram_ranks must be 'auto', 'all' or a collection of ranks, got {ranks!r}"
                )
        else:
            try:
                chosen = frozenset(ranks)
            except TypeError:
                raise ValueError(
                    f"histogram_ranks must be 'auto', 'all' or a collection of ranks, got {ranks!r}"
                ) from None
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in chosen):
                raise ValueError(f"histogram_ranks must hold whole numbers >= 0, got {ranks!r}")
            object.__setattr__(self, "histogram_ranks", chosen)

    def takes_histograms(self, rank: int, layout: str) -> bool:
        """Whether `rank` takes gradient histograms for a model whose gradients have `layout`."""
        if self.histogram_ranks == "all":
            return True
        if self.histogram_ranks == "auto":
            return rank == 0 or layout != _distributed.REPLICATED
        return rank in self.histogram_ranks

    def due(self, every: int, step: int) -> bool:
        """Whether a quantity sampled every `every` optimizer steps (one of the *_every options; 0 =
        off) is taken at `step`: every `every` steps, and every max(1, every // 5) steps while
        step < dense_start_steps."""
        if every <= 0:
            return False
        if step < self.dense_start_steps:
            every = max(1, every // 5)
        return step % every == 0


class Watcher:
    """Observes one (model, optimizer, scaler) triple for one run, recording into `sink`."""

    def __init__(
        self,
        sink: StepSink,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        options: WatchOptions,
    ) -> None:
        import torch

        self._torch = torch
        self.sink = sink
        self.options = options
        self.optimizer = optimizer
        view = ScalerView(scaler, on_missing=self._scaler_field_missing) if scaler is not None else None
        self.scaler_view = view if view is not None and view.enabled else None
        self.scaler = scaler if self.scaler_view is not None else None
        # Fused/capturable optimizers take the scaler's found_inf and always run their step.
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        named = list(model.named_parameters())
        names = {
            id(p): name
            for (_, p), name in zip(named, user_layer_names(model, [n for n, _ in named]), strict=True)
        }
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._param_ids = {id(p) for p in self.params}
        self.layer_names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        # DTensor parameters (FSDP2): every quantity reads the local shard, so no collective is added.
        dtensor = _distributed.dtensor_class()
        self._dtensor = (
            dtensor if dtensor is not None and any(isinstance(p, dtensor) for p in self.params) else None
        )
        try:
            self.parallelism, self.layout = _distributed.gradient_layout(model, self.params)
        except Exception as exc:  # noqa: BLE001 - a wrapper we cannot read: watch it as one process's
            sink.features.disable("gradient layout detection", exc)
            self.parallelism, self.layout = "unknown", _distributed.LOCAL
        # A sharded rank's norms are partial: it neither reuses clip_grad_norm_'s (global) total nor
        # derives a post-clip norm from its own.
        self.partial_norms = self.layout in (_distributed.SHARDED, _distributed.HYBRID)
        self.histograms_here = options.takes_histograms(sink.rank, self.layout)
        # Runs on the sender thread (a Packet deriver); shares nothing with the step's state.
        self.derive = WatchDerivation(
            self.layer_names, loss_scaling=self.scaler is not None, partial_norms=self.partial_norms
        )
        self._like = self._local(self.params[0]) if self.params else torch.zeros(())
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, str]] = []
        self._reset_step_state()
        # On the CPU, when the next step takes a snapshot too, this step's copies are kept and written
        # over (_quantities.snapshot); otherwise, and always on other devices, they are freed after
        # the step, so a GPU's peak memory (forward and backward) never holds a second model copy.
        self._cpu_params = all(p.device.type == "cpu" for p in self._local_params())
        self._spent_snapshot: _quantities.Snapshot | None = None
        self._awaiting_update: int | None = None
        self._clipped_last_step = False  # whether to expect a clip_grad_norm_ call this step
        self._last_step_end: float | None = None
        self._misuse_reported: set[str] = set()
        self._missing_reported: tuple[str, ...] = ()  # the layers without a gradient last reported

        # Guarded once here, not per call: the wrappers are on the step's path.
        guard = sink.features.guarded("step observation")
        self.before_clip = guard(self._before_clip)
        self.after_clip = guard(self._after_clip)
        self._handles.append(optimizer.register_step_pre_hook(guard(self._pre_step_hook)))
        self._handles.append(optimizer.register_step_post_hook(guard(self._post_step_hook)))
        if self.scaler is not None:
            self._wrap(self.scaler, "unscale_", after=self._after_unscale)
            self._wrap(self.scaler, "step", before=self._before_scaler_step, after=self._after_scaler_step)
            self._wrap(self.scaler, "update", after=self._after_update)
            self._wrap(self.scaler, "scale", after=self._after_scale)
            self._wrap(self.scaler, "load_state_dict", after=self._after_scaler_load)
        if self.params:
            # Backward passes per optimizer step (gradient accumulation), from one parameter's
            # accumulation hook.
            try:
                self._handles.append(
                    self.params[-1].register_post_accumulate_grad_hook(guard(self._on_backward))
                )
            except (AttributeError, RuntimeError) as exc:  # a torch or tensor subclass without the hook
                sink.features.disable("micro-batch counting", exc)
        _clip.register(self)
        guard(self._check_setup)(model)  # its observations go through the same sink as the step's
        sink.features.guarded("rank report")(self._report_rank)()

    def shift_steps(self, delta: int) -> None:
        """The run's steps were renumbered by `delta` (a resumed run learning its step): a step that
        waits for scaler.update() moves with them."""
        if self._awaiting_update is not None:
            self._awaiting_update += delta

    def remove(self) -> None:
        """Remove every hook and wrapper this watcher installed."""
        _clip.unregister(self)
        for handle in self._handles:
            handle.remove()
        for obj, name in self._wrapped:
            obj.__dict__.pop(name, None)
        self._handles.clear()
        self._wrapped.clear()

    # -- installation -----------------------------------------------------------------------------

    def _wrap(self, obj: Any, name: str, after: Any, before: Any = None) -> None:
        original = getattr(obj, name)
        guard = self.sink.features.guarded("step observation")
        guarded_before = guard(before) if before is not None else None
        guarded_after = guard(after)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if guarded_before is not None:
                guarded_before(*args, **kwargs)
            result = original(*args, **kwargs)  # the user's call: its errors are theirs
            guarded_after(*args, **kwargs)
            return result

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]  # typeshed: functions have no such field
        obj.__dict__[name] = wrapper
        self._wrapped.append((obj, name))

    def _reset_step_state(self) -> None:
        self._grad_norms_seen = False  # per-layer norms / histograms already taken this step
        self._norms_pending = False  # per-layer norms due this step, left for the clip to provide
        self._clipped = False  # clip_grad_norm_ ran on these gradients this step
        self._global_norm: Any = None
        self._global_norm_given = False  # set_global_norm() was called: no norm of our own
        self._optimizer_stepped = False
        self._snapshot: _quantities.Snapshot | None = None
        self._histograms: Any = None  # this step's grad/hist (on the device), when taken
        self._loss_sum: Any = None  # sum of this step's losses passed to scaler.scale (on the device)
        self._loss_count = 0
        self._backwards = 0  # backward passes that reached the last parameter this step

    def set_global_norm(self, norm: Any) -> None:
        """This step's pre-clip global gradient norm as the training framework computed it (DeepSpeed's
        engine: a number, or a 0-dim tensor kept on its device), recorded as grad/global_norm in place
        of the Watcher's own; None: no global norm is recorded for this step."""
        self._global_norm = norm
        self._global_norm_given = True

    # -- gradient observations --------------------------------------------------------------------

    def _local(self, tensor: Any) -> Any:
        return _distributed.local_tensor(tensor, self._dtensor)

    def _grads(self) -> list[Any]:
        if self._dtensor is None:
            return [p.grad for p in self.params]
        return [self._local(p.grad) for p in self.params]

    def _local_params(self) -> list[Any]:
        if self._dtensor is None:
            return self.params
        return [self._local(p) for p in self.params]

    def _observe_gradients(self, norms_from_clip: bool = False) -> None:
        """Per-layer norms and histograms on sampled steps, once per step, before any clipping.

        norms_from_clip: the per-layer norms may wait for a clip_grad_norm_ call to come (see
        _before_clip); any later call without it takes them at once if still pending."""
        if self._grad_norms_seen:
            if self._norms_pending and not norms_from_clip:
                self._record_layer_norms(self._grads())
            return
        self._grad_norms_seen = True
        step = self.sink.step
        options = self.options
        norms_due = options.due(options.layer_norms_every, step)
        histograms_due = self.histograms_here and options.due(options.histograms_every, step)
        if not (norms_due or histograms_due):
            return  # most steps: nothing per layer, not even the list of gradients
        grads = self._grads()
        if norms_due:
            if norms_from_clip:
                self._norms_pending = True
            else:
                self._record_layer_norms(grads)
        if histograms_due:
            self._histograms = _quantities.log2_histograms(grads, self._like)
            self.sink.add_tensor("grad/hist", step, self._histograms)

    def _record_layer_norms(self, grads: list[Any], per_layer: Any = None) -> None:
        """grad/norm of this step (computed here unless given), the global norm from it, and a
        no_gradient event when the layers without a gradient changed."""
        self._norms_pending = False
        if per_layer is None:
            per_layer = _quantities.layer_norms(grads, self._like)
        self.sink.add_tensor("grad/norm", self.sink.step, per_layer)
        self._global_norm = _quantities.global_norm(per_layer)
        self._report_missing_gradients(grads)

    def _clip_norms_usable(self, parameters: list[Any], norm_type: Any, foreach: Any) -> bool:
        """Whether this clip call computes every per-layer norm we need, as we would: the L2 norm by
        torch._foreach_norm of each of our float32 gradients (a half-precision gradient's norm would
        come back rounded to its dtype), unsharded."""
        # norm_type None: clip_grads_with_norm_, whose norms were computed before the call.
        if norm_type is None or self._dtensor is not None or self.partial_norms or foreach is False:
            return False
        try:
            if float(norm_type) != 2.0:
                return False
        except (TypeError, ValueError):
            return False
        torch = self._torch
        clipped = {id(p) for p in parameters}
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            if (
                id(p) not in clipped
                or type(g) is not torch.Tensor
                or g.dtype != torch.float32
                or g.layout != torch.strided
                or g.device.type not in ("cpu", "cuda")
            ):
                return False
        return True

    def _norms_from_clip(self, calls: list[Any], max_norm: Any, total_norm: Any) -> None:
        """Record this step's pending per-layer norms from the clip's torch._foreach_norm calls.

        A gradient the calls did not show (a torch whose clip computes its norms otherwise) is
        measured again, after the clip, and divided by the clip's coefficient (max_norm / (total +
        1e-6), capped at 1: the factor the clip multiplied every gradient by)."""
        torch = self._torch
        by_tensor: dict[int, Any] = {}
        for tensors, args, kwargs, result in calls:
            ord_ = args[0] if args else kwargs.get("ord", 2)
            if float(ord_) == 2.0 and kwargs.get("dtype") in (None, torch.float32):
                for t, n in zip(tensors, result, strict=True):
                    by_tensor[id(t)] = n
        grads = self._grads()
        norms: list[Any] = []
        for g in grads:
            norm = by_tensor.get(id(g)) if g is not None else None
            if g is not None and norm is None:
                coefficient = torch.clamp(max_norm / (total_norm.detach().float() + 1e-6), max=1.0)
                norm = torch.linalg.vector_norm(g.detach(), dtype=torch.float32) / coefficient
            norms.append(norm)
        self._record_layer_norms(grads, _quantities.stack_per_layer(norms, self._like))

    def _report_missing_gradients(self, grads: list[Any]) -> None:
        """A `no_gradient` event when the set of trainable layers whose .grad is None changes (a
        stray .detach() or an unused module: no gradient at all, as opposed to one of all zeros)."""
        missing = tuple(name for name, grad in zip(self.layer_names, grads, strict=True) if grad is None)
        if missing == self._missing_reported:
            return
        self._missing_reported = missing
        self.sink.add_event(
            self.sink.step,
            "no_gradient",
            {
                "layers": list(missing[:MAX_LAYERS_IN_EVENT]),
                "count": len(missing),
            },
        )

    def _after_unscale(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is self.optimizer:
            self._observe_gradients(norms_from_clip=self._clipped_last_step)

    def _before_clip(
        self, parameters: list[Any], max_norm: float | torch.Tensor, norm_type: Any = 2.0, foreach: Any = None
    ) -> bool:
        """Observations due before the clip; True when this call's per-tensor norms are wanted."""
        if not parameters or id(parameters[0]) not in self._param_ids:
            return False
        # None (the scaler's stage cannot be read): not reported, gradients observed as usual.
        if (
            self.scaler_view is not None
            and not self.fused
            and self.scaler_view.unscaled(self.optimizer) is False
        ):
            self._report_misuse(
                "clip_before_unscale",
                "clip_grad_norm_ was called on SCALED gradients (before scaler.unscale_): it compares "
                "S*||g|| with max_norm, clips on nearly every step and shrinks the true gradient to "
                "max_norm/S. Call scaler.unscale_(optimizer) before clipping.",
                max_norm=float(max_norm),
            )
            return False
        usable = (
            (self._norms_pending or not self._grad_norms_seen)
            and self.options.due(self.options.layer_norms_every, self.sink.step)
            and self._clip_norms_usable(parameters, norm_type, foreach)
        )
        self._observe_gradients(norms_from_clip=usable)
        return self._norms_pending

    def _after_clip(
        self,
        parameters: list[Any],
        max_norm: float | torch.Tensor,
        total_norm: Any,
        norm_calls: list[Any] | None = None,
    ) -> None:
        if (
            not parameters
            or id(parameters[0]) not in self._param_ids
            or "clip_before_unscale" in self._misuse_reported
        ):
            return
        self._clipped = True
        if self._norms_pending and norm_calls is not None and type(total_norm) is self._torch.Tensor:
            self._norms_from_clip(norm_calls, max_norm, total_norm)
        if self._global_norm is None and not self.partial_norms and type(total_norm) is self._torch.Tensor:
            self._global_norm = total_norm.detach()  # the user's own pre-clip norm, reused
        # The threshold as given: a number stays on the host, a tensor on its device (no sync).
        threshold = max_norm if isinstance(max_norm, self._torch.Tensor) else float(max_norm)
        self.sink.add_scalar(CLIP_MAX_NORM, self.sink.step, threshold)

    # -- optimizer hooks --------------------------------------------------------------------------

    def _pre_step_hook(self, optimizer: Any, *_: Any) -> None:
        self._optimizer_stepped = True
        self._observe_gradients()  # takes per-layer norms still waiting for a clip that never came
        if self.options.due(self.options.update_ratio_every, self.sink.step):
            self._snapshot = _quantities.snapshot(self._local_params(), reuse=self._spent_snapshot)
            self._spent_snapshot = None

    def _post_step_hook(self, optimizer: Any, *_: Any) -> None:
        step = self.sink.step
        if self._snapshot is not None:
            update = _quantities.update_stats(
                self._local_params(), self._grads(), self._snapshot, histograms=self._histograms
            )
            if self._cpu_params and self.options.due(self.options.update_ratio_every, step + 1):
                self._spent_snapshot = self._snapshot
            self._snapshot = None
            self.sink.add_tensor(UNCHANGED_COUNTS, step, update.unchanged_counts)
            self.sink.add_tensor("update/ratio", step, update.ratios)
        if self.scaler is None:
            self._finish_step()
            self.sink.step_recorded()

    # -- GradScaler -------------------------------------------------------------------------------

    def _after_scale(self, *args: Any, **kwargs: Any) -> None:
        """Sum the one-element losses passed to scaler.scale this step (a device add, no sync): their
        mean is amp/loss, as passed (a loss divided by the accumulation steps stays divided)."""
        outputs = args[0] if args else kwargs.get("outputs")
        if not isinstance(outputs, self._torch.Tensor) or outputs.numel() != 1:
            return  # a list/tuple of losses, or not a loss: left alone
        loss = outputs.detach().reshape(()).float()
        if self._loss_sum is None:
            self._loss_sum = loss  # read at the end of the step, after the mean's division
        else:
            self._loss_sum = self._loss_sum + loss.to(self._loss_sum.device, non_blocking=True)
        self._loss_count += 1

    def _on_backward(self, _param: Any) -> None:
        self._backwards += 1  # a host counter: the hook runs once per backward pass, no device work

    def _after_scaler_load(self, *args: Any, **kwargs: Any) -> None:
        """A `scaler_state_loaded` event: the steps after it are a new calibration, not a scale jump.
        The scale is read from the state dict argument (host values), never from the device."""
        scale = ScalerView.loaded_scale(args[0] if args else kwargs.get("state_dict"))
        data: dict[str, Any] = {} if scale is None else {"scale": scale}
        self.sink.add_event(self.sink.step, "scaler_state_loaded", data)

    # The scaler's methods are wrapped only when there is a scaler_view: `view is None` never holds there.

    def _before_scaler_step(self, optimizer: Any, *_: Any, **__: Any) -> None:
        view = self.scaler_view
        if optimizer is not self.optimizer or view is None:
            return
        self._optimizer_stepped = False
        scale = view.scale()
        if scale is not None:
            self.sink.add_scalar(SCALE_BEFORE, self.sink.step, scale)

    def _after_scaler_step(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is not self.optimizer:
            return
        sink = self.sink
        step = sink.step
        if self.fused:
            # The step ran inside the kernel either way: whether it applied is known on the device only.
            view = self.scaler_view
            skipped = view.found_inf(optimizer) if view is not None else None
            if skipped is not None:
                sink.add_scalar("amp/skipped", step, skipped)
        else:
            skipped_on_host = not self._optimizer_stepped
            sink.add_scalar("amp/skipped", step, 1.0 if skipped_on_host else 0.0)
            if skipped_on_host and not self.options.due(self.options.layer_norms_every, step):
                # Localise the inf/NaN: per-layer norms, paid for on skipped steps only.
                sink.add_tensor("grad/norm", step, _quantities.layer_norms(self._grads(), self._like))
        self._awaiting_update = step
        self._finish_step()

    def _after_update(self, *_: Any, **__: Any) -> None:
        step, view, sink = self._awaiting_update, self.scaler_view, self.sink
        if step is None or view is None:
            return
        self._awaiting_update = None
        scale = view.scale()
        if scale is not None:
            sink.add_scalar("amp/scale", step, scale)
        tracker = view.growth_tracker()
        if tracker is not None:
            sink.add_scalar("amp/growth_tracker", step, tracker)
        sink.step_recorded()

    def _scaler_field_missing(self, signal: str, exc: BaseException) -> None:
        """A GradScaler field the view could not read: that signal is not recorded (one warning)."""
        if signal == SCALE:
            self.derive.loss_scaling = False  # fp16 fractions would be taken at a made-up scale
        self.sink.features.disable(f"{signal} from the GradScaler", exc)

    # -- step bookkeeping -------------------------------------------------------------------------

    def _finish_step(self) -> None:
        """Record the step's remaining observations and advance the run's step counter."""
        sink = self.sink
        step = sink.step
        options = self.options
        if self._norms_pending:  # a skipped step: no clip and no optimizer step came to take them
            self._record_layer_norms(self._grads())
        self._clipped_last_step = self._clipped
        if self._global_norm is None and not self._global_norm_given:
            # No clip call and no sampled per-layer norms: one fused norm over the gradients (at this
            # point unscaled; unchanged since backward, as nothing clipped them).
            self._global_norm = _quantities.global_norm(_quantities.layer_norms(self._grads(), self._like))
        if self._global_norm is not None:
            sink.add_scalar("grad/global_norm", step, self._global_norm)
        if self._loss_count:
            sink.add_scalar("amp/loss", step, self._loss_sum / self._loss_count)
        micro_batches = self._backwards or self._loss_count
        if micro_batches:
            sink.add_scalar("amp/micro_batches", step, float(micro_batches))
        if options.due(options.param_norms_every, step):
            sink.add_tensor("param/norm", step, _quantities.layer_norms(self._local_params(), self._like))
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group.get("lr")
            if lr is not None:
                key = "lr" if i == 0 else f"lr/{i}"
                sink.add_scalar(key, step, lr if isinstance(lr, (int, float)) else lr.detach().clone())
        now = time.perf_counter()
        if self._last_step_end is not None:
            step_time = now - self._last_step_end
            sink.add_scalar("perf/step_time", step, step_time)
            if options.samples_per_step and step_time > 0:
                sink.add_scalar("perf/samples_per_sec", step, options.samples_per_step / step_time)
            if options.tokens_per_step and step_time > 0:
                sink.add_scalar("perf/tokens_per_sec", step, options.tokens_per_step / step_time)
        self._last_step_end = now
        self._reset_step_state()
        sink.advance_step()

    # -- misuse -----------------------------------------------------------------------------------

    def _report_misuse(self, kind: str, hint: str, **evidence: Any) -> None:
        if kind in self._misuse_reported:
            return
        self._misuse_reported.add(kind)
        self.sink.add_event(self.sink.step, kind, {"hint": hint, **evidence})

    def _check_setup(self, model: Any) -> None:
        """One-time checks when watching starts (not in the step: a host read here is fine)."""
        torch = self._torch
        if self.scaler is None:
            return
        config_dtype = getattr(getattr(model, "config", None), "torch_dtype", None)
        bf16_params = any(p.dtype == torch.bfloat16 for p in self.params)
        if bf16_params or config_dtype in (torch.bfloat16, "bfloat16"):
            self._report_misuse(
                "bf16_model_in_fp16",
                "this model was trained/stored in bfloat16 and is now trained with an fp16 GradScaler: "
                "its weights and activations can exceed fp16's range (65504) and overflow every step. "
                "Train it in bf16 (torch.autocast(dtype=torch.bfloat16), no GradScaler).",
                config_dtype=str(config_dtype),
                bf16_parameters=bf16_params,
            )
        local = self._local_params()
        if any(p.numel() for p in local):
            # Checked on the sender thread once the value has arrived: no device sync here. The per-layer
            # maxima (param/max_abs, once) let the server name the layer likely to overflow fp16.
            with torch.no_grad():
                zero = torch.zeros((), dtype=torch.float32, device=self._like.device)
                per_layer = torch.stack(
                    [
                        p.detach().abs().amax().float().to(zero.device, non_blocking=True)
                        if p.numel()
                        else zero
                        for p in local
                    ]
                )
            self.sink.add_tensor("param/max_abs", self.sink.step, per_layer)
            self.sink.add_scalar(MAX_ABS_WEIGHT, self.sink.step, per_layer.amax())

    def _report_rank(self) -> None:
        """A distributed run's "rank" event: who this rank is and how its gradients are laid out
        (the server reads it to list a run's ranks and to combine their values)."""
        sink = self.sink
        identity = _distributed.process_identity()
        if identity.source == "torch.distributed" and identity.rank != sink.rank:
            warnings.warn(
                f"gradwatch: this run reports as rank {sink.rank} but torch.distributed says rank "
                f"{identity.rank}: call gradwatch.init() after init_process_group() (or set RANK), or "
                "several ranks will write over each other's data",
                GradwatchWarning,
                stacklevel=4,
            )
        started_as = sink.identity
        world_size = max(identity.world_size, started_as.world_size)
        if world_size <= 1:
            return
        sink.report_rank_at_finish()
        sink.add_event(
            sink.step,
            "rank",
            {
                "rank": sink.rank,
                "world_size": world_size,
                "local_rank": started_as.local_rank
                if started_as.local_rank is not None
                else identity.local_rank,
                "host": identity.host,
                "pid": os.getpid(),
                "parallelism": self.parallelism,
                "gradients": self.layout,
                "histograms": self.histograms_here and self.options.histograms_every > 0,
            },
        )
