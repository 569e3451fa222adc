"""Hooks on the user's optimizer, GradScaler and parameters: what is observed at each step.

One Watcher owns every hook handle and method wrapper it installs and removes them all in remove();
nothing is written onto the user's model and nothing of torch is patched. Observations are computed
on the device (see _quantities) and handed to the run's StepSink; the user's own calls run exactly as
before (their exceptions propagate unchanged, ours never reach them).

Where each signal comes from:
- the end of each backward pass (see _gradients): the pre-clip, unscaled per-layer gradient norms
  and from them grad/global_norm, however (or whether) the loop clips (under a GradScaler: after
  unscale_, where they are unscaled and not yet clipped); the gradients' version
  counters, to see a clip later; the histograms of a run without a GradScaler; backward passes per
  step (amp/micro_batches).
- optimizer step pre/post hooks: step counting without a scaler; the post-clip norm when the
  gradients were rewritten since they were measured; the parameter snapshot, update ratio and
  rounded-away updates; for non-fused optimizers under a GradScaler, "the optimizer really stepped" —
  so a skipped step is known on the host with no device sync.
- GradScaler (wrapped on the instance): scale (the unscaled loss of each micro-batch), unscale_
  (gradients rewritten before it: a clip of scaled gradients; the histograms of unscaled gradients
  after it), step (scale used, found_inf for fused optimizers whose step always runs), update (scale
  after, growth tracker), load_state_dict (a resumed scaler).

Keys recorded here. Every step: amp/scale, amp/skipped, amp/growth_tracker, amp/loss (mean of the
losses passed to scaler.scale in the step), amp/micro_batches, grad/global_norm,
grad/global_norm_post_clip (when a clip rewrote the gradients; grad/clip_max_norm is inferred from it
on the sender thread, see _derive), lr, lr/1…, perf/step_time, perf/samples_per_sec,
perf/tokens_per_sec. Per layer on sampled steps (WatchOptions; denser during the first
dense_start_steps) and on every skipped step (grad/norm: which layer went non-finite): grad/norm,
param/norm, update/ratio, update/rounded_away_frac, grad/hist and from it grad/zero_frac,
grad/underflow_frac, grad/precision_loss_frac, grad/overflow_frac (with their grad/global_* scalars)
and amp/safe_scale_min / amp/safe_scale_max. Once, when watching an fp16 run starts: param/max_abs
(each layer's largest |weight|). Events: skip, no_gradient, scaler_state_loaded, scale_below_one,
norms_unmeasured, and the misuse kinds clip_before_unscale, bf16_model_in_fp16, weights_exceed_fp16,
params_not_in_optimizer (parameters with a gradient that no param group holds: see _coverage)
(bad_batch comes from the Run).

Layers are the trainable parameters the optimizer holds, in the model's named_parameters() order
(parameters the optimizer holds that the model does not name come last).

Collaborators: the run is seen only as a StepSink (_sink: the current step, record, end a step);
the GradScaler's private state only through a ScalerView (_scaler); what the sender thread derives
from the transferred values is _derive's (the Watcher's `derive` is a WatchDerivation); what is
observed once, when watching starts, is _watch_start's. The Watcher keeps the run-long state; what it
has seen of the current step is one StepState (_step_state), made fresh as each step starts.

A step ends in _end_step alone, reached from the optimizer's post-step hook without a GradScaler and
from scaler.step() with one; under a GradScaler the step's scale after scaler.update() is its last
value (_after_update records it, then lets the run flush).

Distributed (see _distributed): every quantity is computed from this rank's local tensors only (a
DTensor's local shard), so watching adds no collective. With sharded gradients the per-rank norms are
the shards' norms and the server combines them (sqrt of the sum of squares); with replicated ones
(DDP) they are whole and equal on every rank, and histograms are taken on rank 0 only by default.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from . import _distributed, _gradients, _quantities, _watch_start
from ._clip_factor import ClipFactor
from ._coverage import OptimizerCoverage
from ._derive import (  # the agent-internal keys this module records for _derive
    CLIP_FACTOR_CHECK,
    MAX_LAYERS_IN_EVENT,
    NORMS_IF_SKIPPED,
    POST_CLIP_NORM,
    REWRITE_SPREAD,
    SCALE_BEFORE,
    SCALED_REWRITE,
    SCALED_REWRITE_SPREAD,
    UNCHANGED_COUNTS,
    WatchDerivation,
)
from ._names import user_layer_names
from ._scaler import SCALE, ScalerView
from ._step_state import StepState
from ._unwatched import UnwatchedParameters
from ._watch_options import WatchOptions

if TYPE_CHECKING:
    import torch

    from ._sink import StepSink

__all__ = ["WatchOptions", "Watcher"]  # WatchOptions too: the run builds it from here (_watch_options)


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
        self.params = _watch_start.in_model_order(
            [p for _, p in named],
            [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad],
        )
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
        # A sharded rank's norms are partial (the server combines the ranks'): no clip threshold is
        # inferred from them.
        self.partial_norms = self.layout in (_distributed.SHARDED, _distributed.HYBRID)
        self.histograms_here = options.takes_histograms(sink.rank, self.layout)
        # Runs on the sender thread (a Packet deriver); shares nothing with the step's state.
        self.derive = WatchDerivation(
            self.layer_names, loss_scaling=self.scaler is not None, partial_norms=self.partial_norms
        )
        self._like = self._local(self.params[0]) if self.params else torch.zeros(())
        self.coverage = OptimizerCoverage(
            [(names[id(p)], p) for _, p in named],
            optimizer,
            self._local,
            self._like,
            self.derive.unheld,
            dense_start_steps=options.dense_start_steps,
        )
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, str]] = []
        # Guarded once here, not per call: the hooks and wrappers are on the step's path.
        guard = sink.features.guarded("step observation")
        self._check_coverage = sink.features.guarded("optimizer coverage check")(self.coverage.check)
        self._backward_end = _gradients.BackwardEnd(guard(self._on_backward_end))
        self._this_step = StepState()  # what has been seen of the current step (see _start_step)
        # On the CPU, when the next step takes a snapshot too, this step's copies are kept and written
        # over (_quantities.snapshot); otherwise, and always on other devices, they are freed after
        # the step, so a GPU's peak memory (forward and backward) never holds a second model copy.
        self._cpu_params = all(p.device.type == "cpu" for p in self._local_params())
        self._spent_snapshot: _quantities.Snapshot | None = None
        self._awaiting_update: int | None = None
        self._last_step_end: float | None = None
        self._misuse_reported: set[str] = set()
        self._missing_reported: tuple[str, ...] = ()  # the layers without a gradient last reported
        self._unmeasured_reported = False
        # A rewrite of still-scaled gradients was seen: from then on they are measured at the end of
        # backward, scaled (the only moment they are not yet rewritten), and again before unscale_.
        self._rewrites_while_scaled = False
        # One read of the gradients per optimizer step (issue 40): the post-clip norm from the clip's
        # factor (_clip_factor), and with gradient accumulation, the measurement deferred to the
        # step's last backward pass once the passes per step are known (_on_backward_end).
        self._clip_factor = self.derive.clip_factor = ClipFactor(self.params)
        self._last_pass = 0  # the pass expected to be a step's last (0: unknown, every pass is measured)
        self._short_steps: set[int] = set()  # pass counts of steps that ended early and lost their norms

        self._handles.append(optimizer.register_step_pre_hook(guard(self._pre_step_hook)))
        self._handles.append(optimizer.register_step_post_hook(guard(self._post_step_hook)))
        if self.scaler is not None:
            self._wrap(self.scaler, "unscale_", before=self._before_unscale, after=self._after_unscale)
            self._wrap(self.scaler, "step", before=self._before_scaler_step, after=self._after_scaler_step)
            self._wrap(self.scaler, "update", after=self._after_update)
            self._wrap(self.scaler, "scale", after=self._after_scale)
            self._wrap(self.scaler, "load_state_dict", after=self._after_scaler_load)
        layer_hook = guard(self._on_layer_grad)
        self._unwatched = UnwatchedParameters(
            model, optimizer, self.params, layer_hook, self._handles, enabled=self._dtensor is None
        )
        try:
            # The end of each backward pass (the gradients' measurement) and how many passes reach the
            # model per step (gradient accumulation): the most passes any one layer saw, so a layer left
            # without a gradient (an unused head) cannot hide them and a nested backward of reentrant
            # checkpointing is not a micro-batch of its own (a layer's gradient accumulates once a pass).
            for param in self.params:
                self._handles.append(param.register_post_accumulate_grad_hook(layer_hook))
        except (AttributeError, RuntimeError) as exc:  # a torch or tensor subclass without the hook
            sink.features.disable("gradient measurement at the end of backward", exc)
        guard(self._check_setup)(model)  # its observations go through the same sink as the step's
        sink.features.guarded("rank report")(_watch_start.report_rank)(
            sink, self.parallelism, self.layout, self.histograms_here and options.histograms_every > 0
        )

    def shift_steps(self, delta: int) -> None:
        """The run's steps were renumbered by `delta` (a resumed run learning its step): a step that
        waits for scaler.update() moves with them."""
        if self._awaiting_update is not None:
            self._awaiting_update += delta

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

    @property
    def step_open(self) -> bool:
        """Whether the current step has begun (a backward pass or a scaled loss was seen) and not yet
        ended: its values are not all recorded, so the run does not flush them yet."""
        return self._this_step.begun or self._awaiting_update is not None

    def measure_gradients(self) -> None:
        """For an integration whose engine rewrites the gradients after backward itself (DeepSpeed's
        all-reduce at the accumulation boundary): the gradients as they are now are this step's,
        not yet clipped and not loss-scaled by a GradScaler. Measured again, histograms included."""
        self._this_step.begun = True
        grads = self._grads()
        self._measure(grads, scaled=False)
        if self._histograms_due():
            self._take_histograms(grads)

    def set_global_norm(self, norm: Any) -> None:
        """This step's pre-clip global gradient norm as the training framework computed it (DeepSpeed's
        engine: a number, or a 0-dim tensor kept on its device), recorded as grad/global_norm in place
        of the Watcher's own; None: no global norm is recorded for this step."""
        self._this_step.global_norm = norm
        self._this_step.global_norm_given = True

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

    def _histograms_due(self) -> bool:
        return self.histograms_here and self.options.due(self.options.histograms_every, self.sink.step)

    def _on_layer_grad(self, param: Any) -> None:
        self._this_step.pass_layers[id(param)] = param  # host work only: counted when the pass ends
        self._backward_end.hook(param)

    def _on_backward_end(self) -> None:
        """A backward pass has ended (see _gradients): measure the gradients as they are now, before
        any clip; under a GradScaler, note their versions and measure them after unscale_. A run
        without a scaler takes its sampled histograms here too (with one, after unscale_: they are
        binned unscaled)."""
        this_step = self._this_step
        this_step.begun = True
        this_step.count_pass()
        unwatched = self._unwatched.changed()
        if unwatched:  # unfrozen since watching started, or added with add_param_group
            self.sink.add_event(self.sink.step, "params_unwatched", self._unwatched.event_data(unwatched))
        grads = self._grads()
        if self._measures_at_unscale():
            # Still scaled by S here, and their float32 sum of squares overflows once S*||g|| passes
            # ~1.8e19 (a scaler that never meets an overflow, in fp32 or bf16, doubles S without end)
            # or underflows at a tiny S. unscale_ comes before any clip (a clip before it is a misuse,
            # told by the versions): measured after it, unscaled, once however many micro-batches.
            self._note_unmeasured(grads)
            this_step.measure_at_unscale = True
        elif (
            not self._rewrites_while_scaled
            and this_step.micro_batches < self._last_pass
            and this_step.micro_batches not in self._short_steps
        ):
            # More backward passes are due before the step (as many as the last step had): the norms
            # are the last pass's, so they are taken there; a step that ends early is measured at the
            # optimizer step if nothing rewrote its gradients since (see _settle_gradients).
            self._note_unmeasured(grads)
            this_step.deferred = True
        else:
            this_step.deferred = False
            self._measure_as_they_are(grads)

    def _note_unmeasured(self, grads: list[Any]) -> None:
        """Measured later, not now: their versions tell then whether anything rewrote them since."""
        this_step = self._this_step
        this_step.pre_clip, this_step.probes = None, None
        this_step.measured_grads = grads
        this_step.measured_at = _gradients.versions(grads)

    def _measure_as_they_are(self, grads: list[Any]) -> None:
        """Measured now, still scaled unless unscaled already; a run without a GradScaler takes its
        sampled histograms here too (with one, after unscale_: they are binned unscaled)."""
        self._measure(grads, scaled=self.scaler_view is not None and self._unscaled() is not True)
        if self.scaler is None and self._histograms_due():
            self._take_histograms(grads)

    def _measures_at_unscale(self) -> bool:
        """Whether this backward pass's gradients are measured after scaler.unscale_ rather than now:
        under an enabled GradScaler that has not unscaled them yet, with a step that unscales (a
        fused optimizer's step unscales inside its kernel), unless the loop clips before unscale_."""
        return (
            self.scaler_view is not None
            and not self.fused
            and not self._rewrites_while_scaled
            and self._unscaled() is False
        )

    def _unscaled(self) -> bool | None:
        view = self.scaler_view
        return view.unscaled(self.optimizer) if view is not None else None

    def _measure(self, grads: list[Any], scaled: bool) -> None:
        scale = self.scaler_view.scale() if scaled and self.scaler_view is not None else None
        per_layer = _quantities.layer_norms(grads, self._like, divide_by=scale)
        this_step = self._this_step
        this_step.unwatched_sq = self._unwatched.squared_norm(self._like, scale)
        this_step.pre_clip = per_layer
        this_step.measured_grads = grads
        this_step.measured_at = _gradients.versions(grads)
        # Still scaled, the probes would give the clip's factor divided by the scale: read fully then.
        this_step.probes = None if scale is not None else self._clip_factor.probes(grads)

    def _take_histograms(self, grads: list[Any]) -> None:
        self._this_step.histograms = _quantities.log2_histograms(grads, self._like)
        self.sink.add_tensor("grad/hist", self.sink.step, self._this_step.histograms)

    def _before_unscale(self, optimizer: Any, *_: Any, **__: Any) -> None:
        this_step = self._this_step
        if optimizer is not self.optimizer or this_step.measured_at is None or self.fused:
            return
        grads = self._grads()
        if not _gradients.rewritten(this_step.measured_at, grads) or _gradients.only_removed(
            this_step.measured_at, grads
        ):
            return  # untouched, or some set to None (layers left out of the step): no clip
        if this_step.measure_at_unscale:
            # Rewritten while scaled, before any measurement: a clip there is a misuse, a division by
            # the accumulation steps is not. This step's norms are lost; later ones are measured at
            # the end of backward and here, and the sender tells which (clip_before_unscale or none).
            this_step.rewritten_while_scaled = True
            self._rewrites_while_scaled = True
        elif this_step.pre_clip is not None and self.scaler_view is not None:
            scale = self.scaler_view.scale()
            if scale is not None:
                per_layer = _quantities.layer_norms(grads, self._like, divide_by=scale)
                step = self.sink.step
                self.sink.add_scalar(SCALED_REWRITE, step, _quantities.global_norm(per_layer))
                spread = _quantities.factor_spread(this_step.pre_clip, per_layer)
                self.sink.add_scalar(SCALED_REWRITE_SPREAD, step, spread)

    def _after_unscale(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is not self.optimizer:
            return
        this_step = self._this_step
        this_step.begun = True
        grads = self._grads()
        measured_here = this_step.pre_clip is None and not this_step.rewritten_while_scaled
        if measured_here:
            # Unscaled and not yet clipped here (a clip of scaled gradients is a misuse): measured after
            # the backward passes of the step (measure_at_unscale), or after none (assigned by hand).
            self._measure(grads, scaled=False)  # notes their versions and probes too
        if self._histograms_due() and this_step.histograms is None:
            self._take_histograms(grads)
        if not measured_here and not self._rewrites_while_scaled:
            # Measured at the end of backward, still scaled: unscale_ itself rewrote them since (there,
            # what was rewritten before unscale_ is seen at the step instead).
            this_step.measured_at = _gradients.versions(grads)
            this_step.probes = self._clip_factor.probes(grads)  # as unscaled

    def _settle_gradients(self) -> None:
        """The optimizer step (or the skip) has come: whatever clip there was is done. A gradient
        rewritten since it was measured was clipped: its post-clip global norm, one more pass."""
        this_step = self._this_step
        if this_step.gradients_settled:
            return
        this_step.gradients_settled = True
        if this_step.measured_at is None:
            return
        grads = self._grads()
        if this_step.deferred and this_step.pre_clip is None:
            # Deferred to a later pass that did not come (fewer micro-batches than the step before):
            # as the last pass left them, unless something rewrote them since: lost (said once), and
            # from then on a pass of that count is measured too (an epoch's last, partial window of
            # accumulation costs a read more on the other steps, and is never lost twice).
            if _gradients.rewritten(this_step.measured_at, grads):
                self._short_steps.add(this_step.micro_batches)
                return
            self._measure_as_they_are(grads)
            return
        if (
            this_step.measure_at_unscale
            and this_step.pre_clip is None
            and not this_step.rewritten_while_scaled
        ):
            # No unscale_ of this optimizer was seen (a step that did not unscale it): as backward
            # left them, still scaled, they are measured now; rewritten since, they cannot be.
            if _gradients.rewritten(this_step.measured_at, grads):
                return
            self._measure(grads, scaled=self._unscaled() is not True)
            return
        if not _gradients.rewritten(this_step.measured_at, grads) or this_step.pre_clip is None:
            return
        if _gradients.only_removed(this_step.measured_at, grads):
            # Some .grad set to None by hand (layers left out of this step), the others untouched: no
            # clip. The norms are those the optimizer sees (none for them: a no_gradient event).
            this_step.pre_clip, this_step.measured_grads = _quantities.layer_norms(grads, self._like), grads
            return
        # The norm the optimizer steps with, and how evenly the rewrite scaled each layer (_derive): from
        # the clip's factor, or read fully on the per-layer sampling steps (which verify the factor).
        pre_global = _quantities.global_norm(this_step.pre_clip, this_step.unwatched_sq)
        verify = this_step.layer_norms_wanted or self.options.due(
            self.options.layer_norms_every, self.sink.step
        )
        by_factor = None if verify else self._clip_factor.post_clip(this_step.probes, grads, pre_global)
        if by_factor is not None:
            this_step.post_clip, this_step.rewrite_spread = by_factor
            return
        after = _quantities.layer_norms(grads, self._like)
        this_step.post_clip = _quantities.global_norm(after, self._unwatched.squared_norm(self._like))
        this_step.rewrite_spread = _quantities.factor_spread(this_step.pre_clip, after)
        check = self._clip_factor.check(
            this_step.probes, grads, pre_global, this_step.post_clip, this_step.rewrite_spread
        )
        if check is not None:  # judged on the sender thread (WatchDerivation): no sync here
            self.sink.add_scalar(CLIP_FACTOR_CHECK, self.sink.step, check)

    def _record_gradient_norms(self, step: int) -> None:
        """grad/global_norm (and post-clip), and per-layer grad/norm on sampled and skipped steps,
        from the step's measurement; a step that could not be measured records none (said once)."""
        sink, this_step = self.sink, self._this_step
        if this_step.global_norm_given:
            if this_step.global_norm is not None:
                sink.add_scalar("grad/global_norm", step, this_step.global_norm)
        elif this_step.pre_clip is not None:
            sink.add_scalar(
                "grad/global_norm", step, _quantities.global_norm(this_step.pre_clip, this_step.unwatched_sq)
            )
        else:
            self._report_unmeasured(step, this_step)
        if this_step.pre_clip is None:
            return
        if this_step.post_clip is not None:
            sink.add_scalar(POST_CLIP_NORM, step, this_step.post_clip)
            sink.add_scalar(REWRITE_SPREAD, step, this_step.rewrite_spread)
        if this_step.layer_norms_wanted or self.options.due(self.options.layer_norms_every, step):
            sink.add_tensor("grad/norm", step, this_step.pre_clip)
            self._report_missing_gradients(this_step.measured_grads)
        elif self.fused and self.scaler_view is not None:  # whether it skipped is known on the device only
            sink.add_tensor(NORMS_IF_SKIPPED, step, this_step.pre_clip)

    def _report_unmeasured(self, step: int, this_step: StepState) -> None:
        if self._unmeasured_reported or not self.params:
            return
        self._unmeasured_reported = True
        self.sink.add_event(step, "norms_unmeasured", {"reason": this_step.unmeasured_reason()})

    def _report_missing_gradients(self, grads: list[Any]) -> None:
        """A `no_gradient` event when the set of trainable layers whose .grad is None changes (a
        stray .detach() or an unused module: no gradient at all, as opposed to one of all zeros)."""
        missing = tuple(name for name, grad in zip(self.layer_names, grads, strict=True) if grad is None)
        if missing == self._missing_reported:
            return
        self._missing_reported = missing
        data = {"layers": list(missing[:MAX_LAYERS_IN_EVENT]), "count": len(missing)}
        self.sink.add_event(self.sink.step, "no_gradient", data)

    # -- optimizer hooks --------------------------------------------------------------------------

    def _pre_step_hook(self, optimizer: Any, args: Any = (), kwargs: Any = None) -> None:
        self._this_step.optimizer_stepped = True
        if not (args or (kwargs or {}).get("closure")):  # else the closure's backward and clip are to come
            self._settle_gradients()
        self._check_coverage(self.sink.step, self.sink)
        if self.options.due(self.options.update_ratio_every, self.sink.step):
            self._this_step.snapshot = _quantities.snapshot(self._local_params(), reuse=self._spent_snapshot)
            self._spent_snapshot = None

    def _post_step_hook(self, optimizer: Any, *_: Any) -> None:
        step, this_step = self.sink.step, self._this_step
        if this_step.snapshot is not None:
            update = _quantities.update_stats(
                self._local_params(), self._grads(), this_step.snapshot, histograms=this_step.histograms
            )
            if self._cpu_params and self.options.due(self.options.update_ratio_every, step + 1):
                self._spent_snapshot = this_step.snapshot
            this_step.snapshot = None
            self.sink.add_tensor(UNCHANGED_COUNTS, step, update.unchanged_counts)
            self.sink.add_tensor("update/ratio", step, update.ratios)
        if self.scaler is None:
            self._end_step(scale_follows=False)

    # -- GradScaler -------------------------------------------------------------------------------

    def _after_scale(self, *args: Any, **kwargs: Any) -> None:
        """Sum the one-element losses passed to scaler.scale this step (a device add, no sync): their
        mean is amp/loss, as passed (a loss divided by the accumulation steps stays divided)."""
        this_step = self._this_step
        this_step.begun = True
        outputs = args[0] if args else kwargs.get("outputs")
        if not isinstance(outputs, self._torch.Tensor) or outputs.numel() != 1:
            return  # a list/tuple of losses, or not a loss: left alone
        loss = outputs.detach().reshape(()).float()
        if this_step.loss_sum is None:
            this_step.loss_sum = loss  # read at the end of the step, after the mean's division
        else:
            this_step.loss_sum = this_step.loss_sum + loss.to(this_step.loss_sum.device, non_blocking=True)
        this_step.loss_count += 1

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
        self._this_step.optimizer_stepped = False
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
            skipped_on_host = not self._this_step.optimizer_stepped
            sink.add_scalar("amp/skipped", step, 1.0 if skipped_on_host else 0.0)
            # Localise the inf/NaN: the per-layer norms (measured anyway) recorded on skipped steps.
            self._this_step.layer_norms_wanted = skipped_on_host
        self._end_step(scale_follows=True)

    def _after_update(self, *_: Any, **__: Any) -> None:
        """The last values of a step that ended in scaler.step(): the scale and growth tracker after
        the update; then the run may flush the step."""
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

    # -- the end of a step -------------------------------------------------------------------------

    def _end_step(self, *, scale_follows: bool) -> None:
        """The one way a step ends (see the module docstring): record its remaining observations,
        start the next step and advance the run's counter; then the run may flush, unless
        `scale_follows`: under a GradScaler the step's scale after scaler.update() is still to come."""
        sink = self.sink
        step = sink.step
        if scale_follows:
            self._awaiting_update = step
        self._record_step_end(step)
        self._start_step()
        sink.advance_step()
        if not scale_follows:
            sink.step_recorded()

    def _start_step(self) -> None:
        """Nothing of the step that ended carries over (a backward pass that failed included)."""
        self._this_step = StepState()
        self._backward_end.reset()

    def _record_step_end(self, step: int) -> None:
        """What is recorded once the optimizer step (or the skip) is done: the gradient norms, the
        loss and micro-batches, parameter norms, lr and step time."""
        sink, this_step, options = self.sink, self._this_step, self.options
        self._settle_gradients()
        self._record_gradient_norms(step)
        # The pass expected to be the next step's last, measured (with accumulation; as this one's); a
        # step measured some other way (at unscale_, by hand) or not at all: every pass is.
        measured = this_step.pre_clip is not None and this_step.measured_at is not None
        self._last_pass = this_step.micro_batches if measured and not self._rewrites_while_scaled else 0
        if this_step.loss_count:
            sink.add_scalar("amp/loss", step, this_step.loss_sum / this_step.loss_count)
        if this_step.micro_batches:
            sink.add_scalar("amp/micro_batches", step, float(this_step.micro_batches))
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

    # -- misuse -----------------------------------------------------------------------------------

    def _report_misuse(self, kind: str, hint: str, **evidence: Any) -> None:
        if kind in self._misuse_reported:
            return
        self._misuse_reported.add(kind)
        self.sink.add_event(self.sink.step, kind, {"hint": hint, **evidence})

    def _check_setup(self, model: Any) -> None:
        """One-time checks when watching starts (see _watch_start)."""
        if self.scaler is not None:
            _watch_start.check_fp16_setup(
                self.sink, model, self.params, self._local_params(), self._like, self._report_misuse
            )
