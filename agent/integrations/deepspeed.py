"""DeepSpeed integration: watch a DeepSpeedEngine's optimizer steps.

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=..., config=ds_config)
    run = gradwatch.init(project="llm", name="zero2-fp16")  # on every rank, after init_distributed
    gradwatch.integrations.deepspeed.watch(run, engine)  # options as run.watch's
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        run.log({"loss": loss})
    run.finish()

One gradwatch step per optimizer step of the engine (each gradient-accumulation boundary, applied or
skipped), read from the engine's own bookkeeping, which DeepSpeed keeps on the host (no sync added):
- amp/scale: the loss scale after the step (fp16 only; DeepSpeed's optimizer's `loss_scale`, the
  DynamicLossScaler's cur_scale), and the scale the step was taken with (in `skip` events);
- amp/skipped: 1 when the engine skipped the step because a gradient (or the global norm) was not
  finite (`engine.was_step_applied()`), under fp16, bf16 and fp32 alike; a skipped step gives the
  same `skip` event as a GradScaler's, so the server's scale-drop and skip-storm rules apply as is;
- grad/global_norm: `engine.get_global_grad_norm()` (unscaled, before clipping; under ZeRO a 0-dim
  tensor, kept on its device; inf on an overflow step), or, where the engine computes none (fp32
  at ZeRO stage 0), gradwatch's own norm of the model's gradients, taken before DeepSpeed clips;
- lr per param group, step time, micro-batches (backward passes) per step.

Per layer, from the model's own parameters (engine.module): at ZeRO stage 0 the gradients are
visible on them after backward, so grad/norm, grad/hist (rank 0 by default: the gradients are
all-reduced), no_gradient and the update ratios are recorded as for a plain loop. Left out: with
ZeRO stage 1 and 2 the gradients live in DeepSpeed's flat partitions, not on the parameters, so the
per-layer gradient quantities are not taken (reading them would need DeepSpeed's gather, a
collective); parameter norms and update ratios are (every rank holds the whole parameters); with
stage 3 the parameters are partitioned too, and only the engine-level signals above are recorded.
The fp16 underflow fractions are not derived (DeepSpeed's stage-0 fp16 gradients are not
loss-scaled the way a GradScaler's are), and a skip event names its non-finite layers only on steps
whose per-layer norms were sampled (the gradients are gone once the engine has stepped).

Distributed: every rank calls gradwatch.init() and watch(); the ranks share one run (see
gradwatch.init) and each reports under its rank. DeepSpeed's global norm is the global one on
every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - exercised only where DeepSpeed is missing
    raise ImportError(
        "gradwatch.integrations.deepspeed needs DeepSpeed: pip install deepspeed "
        f"(importing it failed: {exc})"
    ) from exc

import gradwatch
from gradwatch._derive import SCALE_BEFORE

__all__ = ["watch"]

_FEATURE = "DeepSpeed step observation"
_GRADIENT_OPTIONS = ("layer_norms_every", "histograms_every")  # need the gradients on the parameters
_PARAMETER_OPTIONS = ("param_norms_every", "update_ratio_every")  # need the whole parameters


def watch(run: gradwatch.Run, engine: Any, **options: Any) -> gradwatch.Run:
    """Watch `engine` (what deepspeed.initialize returned first) for `run`: every optimizer step of
    the engine is a step of the run. options: as run.watch's (layer_norms_every=20 optimizer steps,
    histograms_every=100, ...; histogram_ranks defaults to (0,), the gradients being all-reduced);
    the per-layer quantities the engine's ZeRO stage hides are turned off (see the module
    docstring). Returns the run. Call it once, after deepspeed.initialize and before training."""
    if not isinstance(engine, DeepSpeedEngine):
        raise ValueError(  # noqa: TRY004 - misuse is a ValueError naming the value, as in run.watch
            f"engine must be the DeepSpeedEngine deepspeed.initialize() returned, got {type(engine).__name__}"
        )
    if getattr(engine.optimizer, "param_groups", None) is None:
        raise ValueError(
            "the engine has no optimizer: pass one (or an optimizer config) to deepspeed.initialize"
        )
    stage = int(engine.zero_optimization_stage())
    options.setdefault("histogram_ranks", (0,))
    hidden: tuple[str, ...] = _GRADIENT_OPTIONS if stage >= 1 else ()
    hidden += _PARAMETER_OPTIONS if stage >= 3 else ()
    options.update(dict.fromkeys(hidden, 0))
    steps = _EngineSteps(engine, [p for p in engine.module.parameters() if p.requires_grad])
    run.watch(engine.module, steps, **options)
    steps.start(run._watchers[-1], gradients_visible=stage == 0)
    return run


class _Handle:
    """What register_step_pre_hook / register_step_post_hook return: remove() takes the hook out."""

    def __init__(self, hooks: dict[int, Callable[..., Any]], key: int, removed: Callable[[], None]) -> None:
        self._hooks, self._key, self._removed = hooks, key, removed

    def remove(self) -> None:
        self._hooks.pop(self._key, None)
        self._removed()


class _EngineSteps:
    """The optimizer the Watcher sees: its steps are the engine's optimizer steps, its parameters the
    model's (engine.module), its param groups' lr the engine's optimizer's.

    start() wraps engine.step on the instance (the engine is otherwise left alone); the wrapper runs
    the Watcher's pre-step hooks before a step at an accumulation boundary and its post-step hooks
    after it, and records the engine's scale, skip and global norm in between. When the Watcher
    removes its hooks (run.finish), the wrapper is removed too.
    """

    _step_supports_amp_scaling = False  # for the Watcher: not a fused optimizer taking a GradScaler

    def __init__(self, engine: Any, params: list[Any]) -> None:
        self._engine = engine
        self._params = params
        self._pre: dict[int, Callable[..., Any]] = {}
        self._post: dict[int, Callable[..., Any]] = {}
        self._next_key = 0
        self._watcher: Any = None
        self._own_norm = False
        self._fp16 = bool(engine.fp16_enabled())
        self._steps_before: int | None = None
        self._wrapper: Any = None  # the engine.step wrapper installed by start()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups = getattr(self._engine.optimizer, "param_groups", None) or [{}]
        return [{"params": self._params if i == 0 else [], "lr": g.get("lr")} for i, g in enumerate(groups)]

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> _Handle:
        return self._register(self._pre, hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> _Handle:
        return self._register(self._post, hook)

    def _register(self, hooks: dict[int, Callable[..., Any]], hook: Callable[..., Any]) -> _Handle:
        key, self._next_key = self._next_key, self._next_key + 1
        hooks[key] = hook
        return _Handle(hooks, key, self._hook_removed)

    def start(self, watcher: Any, *, gradients_visible: bool) -> None:
        """Begin observing the engine's steps for `watcher` (the Watcher built over this object)."""
        self._watcher = watcher
        self._gradients_visible = gradients_visible
        # Only a plain torch optimizer (fp32, ZeRO stage 0) leaves the global norm to us (the
        # watcher's measurement); DeepSpeed's own optimizers compute it (its clipping needs it).
        self._own_norm = gradients_visible and not hasattr(self._engine.optimizer, "_global_grad_norm")
        guard = watcher.sink.features.guarded(_FEATURE)
        before, after = guard(self._before_step), guard(self._after_step)
        engine = self._engine
        original = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            stepping = before()
            result = original(*args, **kwargs)  # the user's call: its errors are theirs
            if stepping:
                after()
            return result

        step.__wrapped__ = original  # type: ignore[attr-defined]  # typeshed: functions have no such field
        engine.__dict__["step"] = step
        self._wrapper = step

    def _hook_removed(self) -> None:
        if not self._pre and not self._post and self._engine.__dict__.get("step") is self._wrapper:
            del self._engine.__dict__["step"]

    def _loss_scale(self) -> Any:
        """The engine's loss scale (fp16 only): a host number, or a copy of a tensor; None if none."""
        if not self._fp16:
            return None
        scale = getattr(self._engine.optimizer, "loss_scale", None)
        if isinstance(scale, torch.Tensor):
            return scale.detach().clone()
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            return float(scale)
        return None

    def _before_step(self) -> bool:
        engine, watcher = self._engine, self._watcher
        if not engine.is_gradient_accumulation_boundary():
            return False  # a micro-batch: the engine only accumulates
        sink = watcher.sink
        self._steps_before = engine.global_steps
        scale = self._loss_scale()
        if scale is not None:
            sink.add_scalar(SCALE_BEFORE, sink.step, scale)
        if self._gradients_visible:
            # After the engine's all-reduce, before it clips and clears them: the step's gradients.
            self._watcher.measure_gradients()
        for hook in list(self._pre.values()):
            hook(self, (), {})  # the Watcher: the parameter snapshot
        return True

    def _after_step(self) -> None:
        engine, watcher = self._engine, self._watcher
        sink = watcher.sink
        if engine.global_steps == self._steps_before:
            return  # the engine did not step after all: nothing to record
        step = sink.step
        if hasattr(engine.optimizer, "overflow"):  # DeepSpeed's optimizers check for inf/NaN
            sink.add_scalar("amp/skipped", step, 0.0 if engine.was_step_applied() else 1.0)
        scale = self._loss_scale()
        if scale is not None:
            sink.add_scalar("amp/scale", step, scale)
        if not self._own_norm:
            norm = engine.get_global_grad_norm()
            if isinstance(norm, torch.Tensor):
                norm = norm.detach().clone()  # a 0-dim tensor: stays on its device until the flush
            elif norm is not None:
                norm = float(norm)
            watcher.set_global_norm(norm)
        for hook in list(self._post.values()):
            hook(self, (), {})  # the Watcher: update ratios, lr, step time; ends the step
