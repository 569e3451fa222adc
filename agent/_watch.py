"""Hooks on the user's optimizer, GradScaler and clip_grad_norm_: what is observed at each step.

One Watcher owns every hook handle and method wrapper it installs and removes them all in remove();
nothing is written onto the user's model. Observations are computed on the device (see _quantities)
and handed to the run's StepBuffer; the user's own calls run exactly as before (their exceptions
propagate unchanged, ours never reach them).

Where each signal comes from:
- optimizer step pre/post hooks: step counting without a scaler; the parameter snapshot, update
  ratio and rounded-away updates; for non-fused optimizers under a GradScaler, "the optimizer really
  stepped" — so a skipped step is known on the host with no device sync, and only skipped steps pay
  for localisation.
- GradScaler (wrapped on the instance): scale (the unscaled loss of each micro-batch), unscale_
  (gradients are unscaled from here on), step (scale used, found_inf for fused optimizers whose step
  always runs), update (scale after, growth tracker), load_state_dict (a resumed scaler).
- clip_grad_norm_ (see _clip): the pre-clip total norm it returns is reused as grad/global_norm
  (not with sharded gradients: there it is already the global norm, computed by a collective); its
  max_norm is sent as grad/clip_max_norm.

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

Distributed (see _distributed): every quantity is computed from this rank's local tensors only (a
DTensor's local shard), so watching adds no collective. With sharded gradients the per-rank norms are
the shards' norms and the server combines them (sqrt of the sum of squares); with replicated ones
(DDP) they are whole and equal on every rank, and histograms are taken on rank 0 only by default.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _clip, _distributed, _quantities
from ._buffer import Resolved
from ._errors import GradwatchWarning

if TYPE_CHECKING:
    import torch

    from ._run import Run

SCALE_BEFORE = "_amp/scale_before"  # agent-internal keys (leading "_") never leave the process
UNCHANGED_COUNTS = "_update/unchanged_counts"  # per layer [unchanged, non-zero gradient] → rounded_away_frac
CLIP_MAX_NORM = "grad/clip_max_norm"
MAX_ABS_WEIGHT = "_setup/max_abs_weight"
MAX_LAYERS_IN_EVENT = 50


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
            raise ValueError(f"dense_start_steps must be a whole number of steps >= 0 (0 = off), got {dense!r}")
        for name in ("samples_per_step", "tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        ranks = self.histogram_ranks
        if isinstance(ranks, str):
            if ranks not in ("auto", "all"):
                raise ValueError(f"histogram_ranks must be 'auto', 'all' or a collection of ranks, got {ranks!r}")
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
        return rank in self.histogram_ranks  # type: ignore[operator]

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
    """Observes one (model, optimizer, scaler) triple for one run."""

    def __init__(
        self, run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
        options: WatchOptions,
    ) -> None:
        import torch

        self._torch = torch
        self.run = run
        self.options = options
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        # Fused/capturable optimizers take the scaler's found_inf and always run their step.
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        names = {id(p): name for name, p in model.named_parameters()}
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._param_ids = {id(p) for p in self.params}
        self.layer_names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        # DTensor parameters (FSDP2): every quantity reads the local shard, so no collective is added.
        dtensor = _distributed.dtensor_class()
        self._dtensor = dtensor if dtensor is not None and any(isinstance(p, dtensor) for p in self.params) else None
        try:
            self.parallelism, self.layout = _distributed.gradient_layout(model, self.params)
        except Exception as exc:  # noqa: BLE001 - a wrapper we cannot read: watch it as one process's
            run.features.disable("gradient layout detection", exc)
            self.parallelism, self.layout = "unknown", _distributed.LOCAL
        # A sharded rank's norms are partial: it neither reuses clip_grad_norm_'s (global) total nor
        # derives a post-clip norm from its own.
        self.partial_norms = self.layout in (_distributed.SHARDED, _distributed.HYBRID)
        self.histograms_here = options.takes_histograms(run.rank, self.layout)
        self._like = self._local(self.params[0]) if self.params else torch.zeros(())
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, str]] = []
        self._reset_step_state()
        self._awaiting_update: int | None = None
        self._last_step_end: float | None = None
        self._scale_below_one_reported = False
        self._misuse_reported: set[str] = set()
        self._missing_reported: tuple[str, ...] = ()  # the layers without a gradient last reported

        # Guarded once here, not per call: the wrappers are on the step's path.
        guard = run.features.guarded("step observation")
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
            # Backward passes per optimizer step (gradient accumulation), from one parameter's accumulation hook.
            try:
                self._handles.append(self.params[-1].register_post_accumulate_grad_hook(guard(self._on_backward)))
            except (AttributeError, RuntimeError) as exc:  # a torch or tensor subclass without the hook
                run.features.disable("micro-batch counting", exc)
        _clip.register(self)
        guard(self._check_setup)(model)  # its observations go through the same buffer as the step's
        run.features.guarded("rank report")(self._report_rank)()

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
        guard = self.run.features.guarded("step observation")
        guarded_before = guard(before) if before is not None else None
        guarded_after = guard(after)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if guarded_before is not None:
                guarded_before(*args, **kwargs)
            result = original(*args, **kwargs)  # the user's call: its errors are theirs
            guarded_after(*args, **kwargs)
            return result

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        obj.__dict__[name] = wrapper
        self._wrapped.append((obj, name))

    def _reset_step_state(self) -> None:
        self._grad_norms_seen = False  # per-layer norms / histograms already taken this step
        self._global_norm: Any = None
        self._optimizer_stepped = False
        self._snapshot: list[Any] | None = None
        self._loss_sum: Any = None  # sum of this step's losses passed to scaler.scale (on the device)
        self._loss_count = 0
        self._backwards = 0  # backward passes that reached the last parameter this step

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

    def _observe_gradients(self) -> None:
        """Per-layer norms and histograms on sampled steps, once per step, before any clipping."""
        if self._grad_norms_seen:
            return
        self._grad_norms_seen = True
        step = self.run.step
        options = self.options
        grads = self._grads()
        if options.due(options.layer_norms_every, step):
            per_layer = _quantities.layer_norms(grads, self._like)
            self.run.buffer.add_tensor("grad/norm", step, per_layer)
            self._global_norm = _quantities.global_norm(per_layer)
            self._report_missing_gradients(grads)
        if self.histograms_here and options.due(options.histograms_every, step):
            self.run.buffer.add_tensor("grad/hist", step, _quantities.log2_histograms(grads, self._like))

    def _report_missing_gradients(self, grads: list[Any]) -> None:
        """A `no_gradient` event when the set of trainable layers whose .grad is None changes (a
        stray .detach() or an unused module: no gradient at all, as opposed to one of all zeros)."""
        missing = tuple(name for name, grad in zip(self.layer_names, grads) if grad is None)
        if missing == self._missing_reported:
            return
        self._missing_reported = missing
        self.run.buffer.add_event(self.run.step, "no_gradient", {
            "layers": list(missing[:MAX_LAYERS_IN_EVENT]), "count": len(missing),
        })

    def _after_unscale(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is self.optimizer:
            self._observe_gradients()

    def _before_clip(self, parameters: list[Any], max_norm: float) -> None:
        if not parameters or id(parameters[0]) not in self._param_ids:
            return
        if self.scaler is not None and not self.fused:
            from torch.amp.grad_scaler import OptState

            stage = self.scaler._per_optimizer_states[id(self.optimizer)]["stage"]
            if stage is OptState.READY:
                self._report_misuse(
                    "clip_before_unscale",
                    "clip_grad_norm_ was called on SCALED gradients (before scaler.unscale_): it compares "
                    "S*||g|| with max_norm, clips on nearly every step and shrinks the true gradient to "
                    "max_norm/S. Call scaler.unscale_(optimizer) before clipping.",
                    max_norm=float(max_norm),
                )
                return
        self._observe_gradients()

    def _after_clip(self, parameters: list[Any], max_norm: float, total_norm: Any) -> None:
        if not parameters or id(parameters[0]) not in self._param_ids or "clip_before_unscale" in self._misuse_reported:
            return
        if self._global_norm is None and not self.partial_norms and type(total_norm) is self._torch.Tensor:
            self._global_norm = total_norm.detach()  # the user's own pre-clip norm, reused
        # The threshold as given: a number stays on the host, a tensor on its device (no sync).
        threshold = max_norm if isinstance(max_norm, self._torch.Tensor) else float(max_norm)
        self.run.buffer.add_scalar(CLIP_MAX_NORM, self.run.step, threshold)

    # -- optimizer hooks --------------------------------------------------------------------------

    def _pre_step_hook(self, optimizer: Any, *_: Any) -> None:
        self._optimizer_stepped = True
        self._observe_gradients()
        if self.options.due(self.options.update_ratio_every, self.run.step):
            self._snapshot = _quantities.snapshot(self._local_params())

    def _post_step_hook(self, optimizer: Any, *_: Any) -> None:
        step = self.run.step
        if self._snapshot is not None:
            params = self._local_params()
            # Counted before update_ratios, which turns the snapshot's copies into the differences.
            self.run.buffer.add_tensor(
                UNCHANGED_COUNTS, step, _quantities.unchanged_counts(params, self._grads(), self._snapshot)
            )
            self.run.buffer.add_tensor("update/ratio", step, _quantities.update_ratios(params, self._snapshot))
            self._snapshot = None
        if self.scaler is None:
            self._finish_step()
            self.run._after_step()

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
        state = args[0] if args else kwargs.get("state_dict")
        data: dict[str, Any] = {}
        scale = state.get("scale") if isinstance(state, dict) else None
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            data["scale"] = float(scale)
        self.run.buffer.add_event(self.run.step, "scaler_state_loaded", data)

    def _before_scaler_step(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is not self.optimizer:
            return
        self._optimizer_stepped = False
        self.run.buffer.add_scalar(SCALE_BEFORE, self.run.step, self.scaler._scale.detach().clone())

    def _after_scaler_step(self, optimizer: Any, *_: Any, **__: Any) -> None:
        if optimizer is not self.optimizer:
            return
        step = self.run.step
        buffer = self.run.buffer
        if self.fused:
            # The step ran inside the kernel either way: whether it applied is known on the device only.
            torch = self._torch
            found = list(self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
            skipped = (
                torch.stack([f.to(found[0].device, non_blocking=True) for f in found]).sum().clamp(max=1)
                if found else torch.zeros((), device=self.scaler._scale.device)
            )
            buffer.add_scalar("amp/skipped", step, skipped)
        else:
            skipped_on_host = not self._optimizer_stepped
            buffer.add_scalar("amp/skipped", step, 1.0 if skipped_on_host else 0.0)
            if skipped_on_host and not self.options.due(self.options.layer_norms_every, step):
                # Localise the inf/NaN: per-layer norms, paid for on skipped steps only.
                buffer.add_tensor("grad/norm", step, _quantities.layer_norms(self._grads(), self._like))
        self._awaiting_update = step
        self._finish_step()

    def _after_update(self, *_: Any, **__: Any) -> None:
        step = self._awaiting_update
        if step is None:
            return
        self._awaiting_update = None
        buffer = self.run.buffer
        scale = self.scaler._scale.detach().clone()
        buffer.add_scalar("amp/scale", step, scale)
        buffer.add_scalar("amp/growth_tracker", step, self.scaler._growth_tracker.detach().clone())
        self.run._after_step()

    # -- step bookkeeping -------------------------------------------------------------------------

    def _finish_step(self) -> None:
        """Record the step's remaining observations and advance the run's step counter."""
        step = self.run.step
        buffer = self.run.buffer
        options = self.options
        if self._global_norm is None:
            # No clip call and no sampled per-layer norms: one fused norm over the gradients (at this
            # point unscaled; unchanged since backward, as nothing clipped them).
            self._global_norm = _quantities.global_norm(_quantities.layer_norms(self._grads(), self._like))
        buffer.add_scalar("grad/global_norm", step, self._global_norm)
        if self._loss_count:
            buffer.add_scalar("amp/loss", step, self._loss_sum / self._loss_count)
        micro_batches = self._backwards or self._loss_count
        if micro_batches:
            buffer.add_scalar("amp/micro_batches", step, float(micro_batches))
        if options.due(options.param_norms_every, step):
            buffer.add_tensor("param/norm", step, _quantities.layer_norms(self._local_params(), self._like))
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group.get("lr")
            if lr is not None:
                key = "lr" if i == 0 else f"lr/{i}"
                buffer.add_scalar(key, step, lr if isinstance(lr, (int, float)) else lr.detach().clone())
        now = time.perf_counter()
        if self._last_step_end is not None:
            step_time = now - self._last_step_end
            buffer.add_scalar("perf/step_time", step, step_time)
            if options.samples_per_step and step_time > 0:
                buffer.add_scalar("perf/samples_per_sec", step, options.samples_per_step / step_time)
            if options.tokens_per_step and step_time > 0:
                buffer.add_scalar("perf/tokens_per_sec", step, options.tokens_per_step / step_time)
        self._last_step_end = now
        self._reset_step_state()
        self.run.step = step + 1

    # -- misuse -----------------------------------------------------------------------------------

    def _report_misuse(self, kind: str, hint: str, **evidence: Any) -> None:
        if kind in self._misuse_reported:
            return
        self._misuse_reported.add(kind)
        self.run.buffer.add_event(self.run.step, kind, {"hint": hint, **evidence})

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
                per_layer = torch.stack([
                    p.detach().abs().amax().float().to(zero.device, non_blocking=True) if p.numel() else zero
                    for p in local
                ])
            self.run.buffer.add_tensor("param/max_abs", self.run.step, per_layer)
            self.run.buffer.add_scalar(MAX_ABS_WEIGHT, self.run.step, per_layer.amax())

    def _report_rank(self) -> None:
        """A distributed run's "rank" event: who this rank is and how its gradients are laid out
        (the server reads it to list a run's ranks and to combine their values)."""
        run = self.run
        identity = _distributed.process_identity()
        if identity.source == "torch.distributed" and identity.rank != run.rank:
            warnings.warn(
                f"gradwatch: this run reports as rank {run.rank} but torch.distributed says rank {identity.rank}: "
                "call gradwatch.init() after init_process_group() (or set RANK), or several ranks will write "
                "over each other's data",
                GradwatchWarning,
                stacklevel=4,
            )
        world_size = max(identity.world_size, run.identity.world_size)
        if world_size <= 1:
            return
        run.reports_rank = True
        run.buffer.add_event(run.step, "rank", {
            "rank": run.rank,
            "world_size": world_size,
            "local_rank": run.identity.local_rank if run.identity.local_rank is not None else identity.local_rank,
            "host": identity.host,
            "pid": os.getpid(),
            "parallelism": self.parallelism,
            "gradients": self.layout,
            "histograms": self.histograms_here and self.options.histograms_every > 0,
        })

    # -- host side, on the sender thread ----------------------------------------------------------

    def derive(self, resolved: Resolved) -> None:
        """Host-side quantities from the transferred values: skip events, fp16 and zero fractions,
        rounded-away updates, the safe-scale band, post-clip norm, scale-below-1 events; drops the
        update ratios and rounded-away fractions of skipped steps."""
        scalars, vectors = resolved.scalars, resolved.vectors
        resolved.layers = self.layer_names
        for step, largest in scalars.get(MAX_ABS_WEIGHT, []):
            if largest > _quantities.FP16_MAX:
                resolved.events.append({"step": step, "kind": "weights_exceed_fp16", "data": {
                    "max_abs_weight": largest,
                    "hint": f"a weight of magnitude {largest:.3g} does not fit in fp16 (max 65504): fp16 "
                    "autocast will produce inf. Train in bf16, or keep that layer in fp32.",
                }})
        skipped_steps = {step for step, flag in scalars.get("amp/skipped", []) if flag >= 0.5}
        before = dict(scalars.get(SCALE_BEFORE, []))
        after = dict(scalars.get("amp/scale", []))
        layer_norms = dict(vectors.get("grad/norm", []))
        for step in sorted(skipped_steps):
            norms = layer_norms.get(step)
            data: dict[str, Any] = {"scale_before": before.get(step), "scale_after": after.get(step)}
            if norms is not None:
                bad = [n for n, v in zip(self.layer_names, norms) if not math.isfinite(v)]
                data["non_finite_layers"] = bad[:MAX_LAYERS_IN_EVENT]
                data["non_finite_layer_count"] = len(bad)
            resolved.events.append({"step": step, "kind": "skip", "data": data})
        if "update/ratio" in vectors and skipped_steps:
            vectors["update/ratio"] = [(s, v) for s, v in vectors["update/ratio"] if s not in skipped_steps]
        rounded_away = [
            (step, [_quantities.rounded_away_fraction(unchanged, stepped) for unchanged, stepped in rows])
            for step, rows in resolved.matrices.get(UNCHANGED_COUNTS, [])
            if step not in skipped_steps
        ]
        if rounded_away:
            vectors["update/rounded_away_frac"] = rounded_away
        if not self._scale_below_one_reported:
            for step, value in scalars.get("amp/scale", []):
                if value < 1.0:
                    self._scale_below_one_reported = True
                    resolved.events.append({"step": step, "kind": "scale_below_one", "data": {
                        "scale": value,
                        "hint": "the loss scale fell below 1: gradients overflow even unscaled; look for a "
                        "layer producing inf (skip events name it), lower the learning rate or switch to bf16",
                    }})
                    break
        max_norms = dict(scalars.get(CLIP_MAX_NORM, []))
        if max_norms and not self.partial_norms:
            post = []
            for step, norm in scalars.get("grad/global_norm", []):
                if step in max_norms:  # clip_grad_norm_ multiplies by max_norm / (norm + 1e-6), capped at 1
                    post.append((step, norm * min(1.0, max_norms[step] / (norm + 1e-6))))
            scalars["grad/global_norm_post_clip"] = post
        self._derive_fp16_fractions(resolved, before)

    def _derive_fp16_fractions(self, resolved: Resolved, scale_at: dict[int, float]) -> None:
        histograms = resolved.matrices.get("grad/hist", [])
        for step, rows in histograms:
            resolved.vectors.setdefault("grad/zero_frac", []).append(
                (step, [_quantities.zero_fraction(row) for row in rows])
            )
            scale = scale_at.get(step, 1.0) if self.scaler is not None else None
            if scale is None:
                continue
            fractions = [_quantities.fp16_fractions(row, scale) for row in rows]
            for index, key in enumerate(("grad/underflow_frac", "grad/precision_loss_frac", "grad/overflow_frac")):
                resolved.vectors.setdefault(key, []).append((step, [f[index] for f in fractions]))
            total = [sum(column) for column in zip(*rows)] if rows else []
            if total:
                under, precision, over = _quantities.fp16_fractions(total, scale)
                resolved.scalars.setdefault("grad/global_underflow_frac", []).append((step, under))
                resolved.scalars.setdefault("grad/global_precision_loss_frac", []).append((step, precision))
                resolved.scalars.setdefault("grad/global_overflow_frac", []).append((step, over))
            low, high = _quantities.safe_scale_band(rows)
            resolved.scalars.setdefault("amp/safe_scale_min", []).append((step, low))
            resolved.scalars.setdefault("amp/safe_scale_max", []).append((step, high))
