"""What a Watcher has seen of the current optimizer step: one StepState, made fresh as each step starts.

The Watcher's own attributes are the run-long ones (its hooks, the layers, the schedules, what was
reported once); everything that belongs to one step is here, so a step's end forgets it in one
assignment and nothing of a step can leak into the next. Device values stay on the device: they are
recorded (and transferred on the sender thread) as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from weakref import ref

if TYPE_CHECKING:
    from ._gradients import Versions
    from ._quantities import Snapshot


@dataclass
class StepState:
    """The current step's observations, from its first backward pass (or scaled loss) to its end."""

    begun: bool = False  # a backward pass, a scaled loss or an unscale_ of this step was seen
    # Backward passes that reached each watched parameter (by id), and a reference to the .grad they
    # accumulated into: their most is the step's passes. pass_layers: those the running pass reached.
    layer_passes: dict[int, tuple[int, Any]] = field(default_factory=dict)
    pass_layers: dict[int, Any] = field(default_factory=dict)
    pre_clip: Any = None  # per-layer unscaled norms of the last backward pass (on the device)
    unwatched_sq: Any = None  # the squared norm of the unwatched trainable parameters' gradients (_unwatched)
    measured_grads: list[Any] = field(default_factory=list)  # held until the end: an engine may clear them
    measured_at: Versions | None = None  # the gradients' versions when measured
    probes: Any = None  # a few of their elements then (_clip_factor): the clip's factor, read later
    deferred: bool = False  # the last pass was not measured: more passes were expected (accumulation)
    measure_at_unscale: bool = False  # still scaled at the end of backward: measured after unscale_
    rewritten_while_scaled: bool = False  # rewritten before unscale_ (a misuse): this step's norms are lost
    gradients_settled: bool = False  # the optimizer step (or the skip) came: no clip after it
    post_clip: Any = None  # the global norm after a clip rewrote the gradients (on the device)
    rewrite_spread: Any = None  # how unevenly that rewrite scaled the layers (_quantities.factor_spread)
    global_norm: Any = None  # the training framework's own pre-clip global norm (set_global_norm)
    global_norm_given: bool = False  # set_global_norm() was called: no norm of our own
    optimizer_stepped: bool = False  # the optimizer's step ran (under a GradScaler: it was not skipped)
    layer_norms_wanted: bool = False  # a skipped step: per-layer norms name the non-finite layers
    snapshot: Snapshot | None = None  # the parameters before the optimizer step, for update ratios
    histograms: Any = None  # grad/hist (on the device), when taken
    loss_sum: Any = None  # sum of the losses passed to scaler.scale (on the device)
    loss_count: int = 0

    def count_pass(self) -> None:
        """A backward pass ended: each parameter it reached has one more pass, once however often its
        gradient accumulated in it (a weight shared by blocks that a reentrant checkpoint recomputes
        accumulates once per nested backward). A .grad replaced since the last pass (set to None in
        between: another optimizer's zero_grad in a GAN loop) starts its count again."""
        for key, param in self.pass_layers.items():
            grad, seen = param.grad, self.layer_passes.get(key)
            if grad is None:
                continue
            if seen is not None and seen[1]() is grad:
                self.layer_passes[key] = (seen[0] + 1, seen[1])
            else:
                self.layer_passes[key] = (1, ref(grad))
        self.pass_layers.clear()

    def unmeasured_reason(self) -> str:
        """Why this step's gradient norms were not measured (the `norms_unmeasured` event)."""
        if self.rewritten_while_scaled:
            return (
                "the gradients were rewritten while still scaled, before scaler.unscale_ and before "
                "they were measured (a clip there is a misuse, told by a clip_before_unscale event; a "
                "division by the accumulation steps is not): this step records no grad/global_norm "
                "or grad/norm; later steps measure them at the end of backward"
            )
        if self.deferred:
            return (
                "a step had fewer backward passes than the step before and its gradients were rewritten "
                "(clipped) after its last pass: gradwatch measures them once a step, at the pass it "
                "expects to be the last, so that step records no grad/global_norm or grad/norm; the "
                "steps after it are measured at every pass until the count is known again"
            )
        if self.measure_at_unscale:
            return (
                "the gradients were rewritten after backward and the GradScaler did not unscale them "
                "for the watched optimizer before its step: their pre-clip norms cannot be told from "
                "clipped ones, so grad/global_norm and grad/norm are not recorded for such steps"
            )
        return (
            "no backward pass reached the watched parameters before this optimizer step "
            "(gradients assigned by hand?) and no GradScaler unscaled them: their pre-clip norms "
            "cannot be told from clipped ones, so grad/global_norm and grad/norm are not recorded "
            "for such steps"
        )

    @property
    def micro_batches(self) -> int:
        """Backward passes of the step, or else the losses scaled in it (0: neither was seen)."""
        return max((count for count, _ in self.layer_passes.values()), default=0) or self.loss_count
