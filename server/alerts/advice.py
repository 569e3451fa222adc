"""What to do about it: every text of advice gradwatch gives, in one place.

Two readers share it. An alert carries a hint (alert_hint: HINTS by the finding's cause or the rule
type, after the fixes of the setup mistakes the run showed); an incident carries the next steps of the
cause diagnosis.py names (the *_steps functions below, one per cause, with the numbers the diagnosis
measured). The texts are the product: a change of wording here is a change of what people are told.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "CLEAR_GRAD_ADVICE",
    "EXPLAINED_BY_MISUSE",
    "HINTS",
    "MISUSE_HINTS",
    "alert_hint",
    "bad_loss_steps",
    "clip_before_unscale_steps",
    "clip_saturation_accumulation_steps",
    "clip_saturation_steps",
    "dead_layers_steps",
    "divergence_steps",
    "divergence_warning_steps",
    "forward_overflow_steps",
    "fp16_range_steps",
    "lr_ramp_steps",
    "lr_zero_steps",
    "non_finite_applied_steps",
    "overflow_below_one_steps",
    "overflow_steps",
    "params_not_in_optimizer_steps",
    "rounded_away_steps",
    "scale_set_below_one_steps",
    "stale_grad_steps",
    "transient_burst_steps",
    "underflow_steps",
    "update_ratio_outlier_steps",
    "vanishing_gradients_steps",
]

# -- hints of alerts ------------------------------------------------------------------------------

HINTS = {
    "scale_drop": "Gradients keep overflowing fp16. Look at the layers named in the evidence; lower the "
    "learning rate or add warmup; if the model was pretrained in bf16, train it in bf16 (no GradScaler).",
    "skip_storm": "Optimizer steps are being skipped because gradients overflow fp16: lower the learning "
    "rate, check the named layers, or switch to bf16. A few skips at the start are the scaler calibrating.",
    "scale_floor": "The loss scale collapsed: a layer produces inf/NaN whatever the scale (often a NaN in "
    "the forward pass, not overflow). Check the layers in the skip events, lower the learning rate or switch "
    "to bf16; if the scale reaches ~3e-39 the weights turn NaN.",
    "non_finite": "NaN/Inf in the loss or gradients: check the named layer's inputs (log of 0, division, "
    "fp16 overflow in attention/softmax), lower the learning rate, or switch to bf16.",
    "non_finite_applied": "A non-finite value reached the optimizer and the weights may now be NaN: use a "
    "GradScaler with fp16 (or train in bf16), lower the learning rate, and restart from the last good "
    "checkpoint.",
    "grad_norm_spike": "The learning rate is likely too high (or a bad batch): lower it or add warmup, and "
    "clip gradients after scaler.unscale_(optimizer).",
    "no_scale_growth": "An overflow recurs within every growth interval, so the scale never grows back: a "
    "layer sits at fp16's limit. If small gradients start to underflow, raise init_scale or switch to bf16.",
    "update_ratio_high": "Updates above the band each step: the learning rate is too high for that layer; "
    "lower it (or use a per-layer learning rate) and add warmup.",
    "update_ratio_low": "Updates below the band: the layer barely learns: frozen by mistake, learning rate "
    "too low, or gradients underflowing in fp16 (raise init_scale / switch to bf16).",
    "underflow": "Gradients underflow to zero in fp16: raise the GradScaler's init_scale (or let it grow), "
    "or switch to bf16; tiny LoRA/QLoRA adapter gradients are the usual case.",
    "heartbeat": "The run stopped reporting: the process may have crashed, hung (NCCL timeout, data loader) "
    "or exited (e.g. DeepSpeed's 'Current loss scale already at minimum'). Check its logs.",
    "rank_disagreement": "Ranks disagree on skipping a step, so their weights diverge: their found-inf "
    "checks are not synchronised. With FSDP use ShardedGradScaler; every rank must unscale_/step the same "
    "optimizer.",
    "scaler_calibration": "The GradScaler never finds a working scale: a layer overflows fp16 whatever the "
    "scale (often a model trained in bf16, or activations beyond 65504). Train in bf16 or keep that layer in "
    "fp32.",
    "loss_non_finite": "The loss is NaN/Inf before any scaling: a bad sample or an unstable op in the "
    "forward pass (log of 0, division by 0). Drop the batch named in the evidence (log ids with "
    "run.log_batch) and check the loss.",
    "misuse": "A setup mistake: follow the fix named in the evidence.",
    "params_not_in_optimizer": "These layers get gradients but no optimizer param group holds them, so they "
    "never train: build the optimizer after unfreezing, from model.parameters() (or add them with "
    "optimizer.add_param_group).",
    "update_ratio": "A layer's update ratio ||dW||/||W|| left the band the rule allows: far above it the "
    "learning rate is too high for that layer; far below, the layer barely learns (in bf16, updates may "
    "round away: keep fp32 master weights).",
    "update_ratio_outlier": "One layer's updates are far larger, relative to its weights, than every other "
    "layer's: most often its param group's learning rate is far too high (a typo); else its weights were "
    "initialised far smaller. Compare the optimizer's param groups.",
    "loss_spike": "The loss jumped and stays up: lower the learning rate by half and rewind to the "
    "checkpoint before the spike; look for an lr change just before it.",
    "lr_jump": "The learning rate jumped far above anything the run used: check the scheduler and the "
    "config.",
    "divergence_warning": "The loss started to climb while the gradient norm or the learning rate rose: "
    "lower the learning rate before it diverges, and keep a checkpoint from before the climb.",
    "loss_divergence": "The loss left the range it had reached and has not come back: lower the learning "
    "rate (check the schedule's peak and warm-up) and rewind to the checkpoint before its best step.",
    "clip_saturation": "The clip fires on nearly every step at several times max_norm for a long stretch, so "
    "it sets the step size: raise max_norm or lower the learning rate.",
    "clip_saturation_accumulation": "Each step accumulates several micro-batches and the clip fires every "
    "time at about that many times max_norm: divide the loss by the number of micro-batches before backward.",
    "dead_layers": "Layers get no gradient: a .detach(), torch.no_grad() or unused branch cuts them off the "
    "loss.",
    "dead_layers_none": "These layers' .grad stays None: a .detach(), torch.no_grad() or an unused branch "
    "cuts them off the loss. Freeze them on purpose with requires_grad_(False), or find the detach.",
    "dead_layers_zero": "These layers' gradients are exactly zero: a multiplication by zero, dead ReLUs, or "
    "fp16 underflow (with a GradScaler).",
    "not_learning": "Weights stop changing: updates are rounded away (weights stored in bf16/fp16; keep fp32 "
    "master weights) or the learning rate is 0.",
}
# When a run has a misuse event, its hint comes first in the rules it explains.
EXPLAINED_BY_MISUSE = {
    "scale_drop",
    "skip_storm",
    "scale_floor",
    "non_finite",
    "no_scale_growth",
    "grad_norm_spike",
    "underflow",
    "scaler_calibration",
    "clip_saturation",
    "not_learning",
}
# The fix of a misuse kind whose event carries numbers, not a hint (the agent's hints travel with the
# others).
MISUSE_HINTS = {
    "params_not_in_optimizer": "build the optimizer after unfreezing, from model.parameters() (or add the "
    "missing ones with optimizer.add_param_group); if they are frozen on purpose, call requires_grad_(False) "
    "on them so they get no gradient.",
}


def alert_hint(rule_name: str, cause: str, misuse_hints: Mapping[str, str]) -> str:
    """The hint of an alert of `rule_name` whose finding names `cause` ("" for the rule's default):
    HINTS', after "Likely cause (kind): hint" for each setup mistake of the run (misuse_hints: kind ->
    the agent's hint, in the order the run reported them) where the rule is one a setup mistake explains."""
    base = HINTS.get(cause or rule_name, HINTS.get(rule_name, ""))
    if rule_name not in EXPLAINED_BY_MISUSE:
        return base
    causes = [f"Likely cause ({kind.replace('_', ' ')}): {hint}" for kind, hint in misuse_hints.items()]
    return " ".join([*causes, base]).strip()


# -- next steps of incidents, by the cause diagnosis.py names --------------------------------------

CLEAR_GRAD_ADVICE = (
    "Call optimizer.zero_grad(set_to_none=True) once per optimizer step (after step(), or before the first "
    "backward of the next step)."
)


def lr_ramp_steps(peak_lr: float, ramp_start: int) -> list[str]:
    """lr_ramp: the lr ramped to `peak_lr` from step `ramp_start` while the loss rose."""
    return [
        (
            f"Lower the peak learning rate (to {peak_lr / 10:.3g}, a tenth) or lengthen the warm-up, and "
            f"restart from the checkpoint before step {ramp_start}."
        ),
        "Clip gradients at max_norm=1.0 (after scaler.unscale_ with fp16) while the lr ramps.",
    ]


def clip_before_unscale_steps() -> list[str]:
    return [
        (
            "Call scaler.unscale_(optimizer) right before torch.nn.utils.clip_grad_norm_(...), then "
            "scaler.step(optimizer) and scaler.update() as before."
        ),
        "Keep max_norm as it is: after unscale_ it compares the true gradient norm.",
    ]


def fp16_range_steps(layers: str | None) -> list[str]:
    """bf16_model_in_fp16 / weights_exceed_fp16; layers: the overflowing layers named (None if none)."""
    return [
        "Train in bf16: torch.autocast(device_type, dtype=torch.bfloat16) and no GradScaler.",
        "If you must use fp16, keep "
        + (layers if layers is not None else "the overflowing layers")
        + " in fp32.",
    ]


def transient_burst_steps() -> list[str]:
    return [
        "Nothing to fix if it does not come back.",
        (
            "If it recurs, log each batch's sample ids with run.log_batch(ids): the next burst names "
            "its batches."
        ),
        ("If bursts come more often or grow, lower the learning rate by half and look at the layers named."),
    ]


def forward_overflow_steps(suspects: list[str]) -> list[str]:
    """fp16_forward_overflow; suspects: the layers with outlier weights, largest first (up to 3 named)."""
    return [
        "Train in bf16: torch.autocast(device_type, dtype=torch.bfloat16) and no GradScaler.",
        ("Or keep " + ", ".join(suspects[:3]) + " in fp32 (run it under torch.autocast(..., enabled=False))")
        if suspects
        else "Or find the layer whose output exceeds 65504 and keep it in fp32.",
    ]


def bad_loss_steps(batch_ids: list[object], nan_step: int, applied: bool, fp16_scaler: bool) -> list[str]:
    """loss_non_finite: a NaN/Inf loss at `nan_step` on the batch of `batch_ids` (if logged); applied: the
    optimizer applied that step; fp16_scaler: a GradScaler skipped it."""
    steps = [
        f"Inspect and drop the samples of batch {', '.join(map(str, batch_ids[:10]))} (step {nan_step})."
        if batch_ids
        else "Log each batch's sample ids with run.log_batch(ids): the next NaN loss will name its batch.",
        (
            "Look for log(0), division by zero, sqrt of a negative or an empty mask in the loss on that "
            "batch; torch.autograd.set_detect_anomaly(True) on it names the operation."
        ),
    ]
    if applied:
        steps.append(
            f"The optimizer applied that step and the weights may be NaN: restart from the checkpoint "
            f"before step {nan_step}."
        )
    elif fp16_scaler:
        steps.append(
            "The GradScaler skipped the step; lowering the scale will not help, since the loss is NaN "
            "before any scaling."
        )
    return steps


def divergence_steps(jump: tuple[int, str] | None, good_lr: float | None, rewind: int) -> list[str]:
    """lr_jump / divergence; jump: (step, factor as worded) of the lr jump that triggered it, if one did;
    good_lr: the lr before it (halved in the advice); rewind: the step to rewind before."""
    first = []
    if jump is not None:
        at, factor = jump
        first = [f"Fix the schedule: the lr at step {at} is {factor}x the step before."]
    lr_text = f" (to {good_lr / 2:.3g})" if good_lr else ""
    return [
        *first,
        f"Lower the learning rate by half{lr_text} and rewind to the checkpoint before step {rewind}.",
        "Clip gradients at max_norm=0.5 (after scaler.unscale_ with fp16) for the next 1,000 steps.",
    ]


def warm_up_divergence_steps(lr_then: float, rewind: int) -> list[str]:
    """divergence while a warm-up still raises the lr; lr_then: the lr where it began."""
    return [
        (
            f"Warm up more slowly or to a lower peak: the lr passed what the model takes near "
            f"{lr_then:.3g} (a peak of {lr_then / 2:.3g}, or a ramp twice as long)."
        ),
        f"Rewind to the checkpoint before step {rewind}.",
        "Clip gradients at max_norm=0.5 (after scaler.unscale_ with fp16) for the next 1,000 steps.",
    ]


def stale_grad_steps(since: int) -> list[str]:
    """overflow_at_any_scale from a streak of overflows with a finite loss since `since`."""
    return [
        CLEAR_GRAD_ADVICE,
        f"Restart from the checkpoint before step {since}: no step was applied since.",
    ]


def non_finite_applied_steps(step: int) -> list[str]:
    return [
        (f"Restart from the checkpoint before step {step} with half the learning rate."),
        "Train in bf16, or use torch.amp.GradScaler with fp16 so overflowing steps are skipped.",
    ]


def scale_set_below_one_steps(settings: str | None) -> list[str]:
    """scale_set_below_one; settings: GradScaler arguments from the safe-scale band, if known."""
    return [
        (settings + ".")
        if settings
        else "Use the default GradScaler(init_scale=2**16); it backs off by itself if that overflows.",
        "Or train in bf16 (no GradScaler needed).",
    ]


def overflow_below_one_steps(layers: str | None, step: int) -> list[str]:
    """overflow_at_any_scale with the scale below 1; layers: the overflowing layers named (None if none)."""
    return [
        CLEAR_GRAD_ADVICE,
        "If the loop does clear .grad: keep "
        + (layers if layers is not None else "the overflowing layers")
        + " in fp32 or train in bf16.",
        f"Restart from the checkpoint before step {step}: no step was applied since.",
    ]


def overflow_steps(settings: str | None, layers: str | None, step: int) -> list[str]:
    """scale_collapse / overflow; settings: GradScaler arguments from the safe-scale band, if any fits;
    layers: the overflowing layers named (None if none); step: where the overflows began."""
    return [
        (settings + ".")
        if settings
        else (
            "No fp16 loss scale fits these gradients: train in bf16 (torch.autocast(dtype=torch.bfloat16), "
            "no GradScaler)."
        ),
        "Keep "
        + (layers if layers is not None else "the overflowing layers")
        + " in fp32, or train in bf16.",
        (
            f"If the overflows began mid-run, lower the learning rate by half and rewind to the checkpoint "
            f"before step {step}."
        ),
    ]


def underflow_steps(settings: str | None) -> list[str]:
    """underflow; settings: GradScaler arguments from the safe-scale band (preferring a high scale)."""
    return (
        [settings + "."]
        if settings
        else [
            (
                "Raise the GradScaler's init_scale (and lower growth_interval to 100 so "
                "it climbs) until the zero fraction falls."
            )
        ]
    ) + [
        (
            "Or train in bf16 (fp32's exponent range: nothing underflows), or keep the adapters' "
            "matmuls in fp32."
        )
    ]


def clip_saturation_accumulation_steps(micro_batches: str, max_norm: float) -> list[str]:
    """clip_saturation_accumulation; micro_batches: their number as worded ("4")."""
    k = micro_batches
    return [
        (
            f"Divide the loss by the accumulation steps before backward: (loss / {k}).backward() "
            f"(scaler.scale(loss / {k}) with fp16)."
        ),
        f"Then keep max_norm={max_norm:g}.",
    ]


def clip_saturation_steps(median_norm: float) -> list[str]:
    """clip_saturation; median_norm: the median pre-clip gradient norm."""
    return [
        (
            f"Raise max_norm to about {median_norm:.2g} (the median pre-clip norm) or lower the learning "
            "rate; if the loss is a sum over micro-batches or over tokens (reduction='sum'), divide it first."
        )
    ]


def dead_layers_steps(first_layer: str | None) -> list[str]:
    """dead_layers; first_layer: the first layer named (None if none)."""
    where = first_layer if first_layer is not None else "those layers"
    return [
        (
            f"Find the .detach() / .data / torch.no_grad() between {where} and the loss (print the grad_fn "
            "of the activations along the forward)."
        ),
        (
            "If they are frozen on purpose, call requires_grad_(False) on them and leave them out of the "
            "optimizer."
        ),
    ]


def lr_zero_steps() -> list[str]:
    return [
        ("Check the scheduler: its value at this step should not be 0 (e.g. eta_min, warm-up start_factor).")
    ]


def rounded_away_steps() -> list[str]:
    return [
        "Keep fp32 master weights: model.float() and torch.autocast(dtype=torch.bfloat16) for the speed.",
        (
            "Or use an optimizer with stochastic rounding / Kahan summation for bf16 weights; a higher "
            "learning rate only hides it."
        ),
    ]


def divergence_warning_steps(warned_at: int) -> list[str]:
    """divergence_warning; warned_at: the first step of the precursors."""
    return [
        "Lower the learning rate now (halve it), or check the schedule's peak and warm-up.",
        (
            f"Keep the checkpoint from before step {warned_at}: if the loss goes on climbing, rewind to it "
            "(a guard, run.watch(..., guard=gradwatch.Guard()), can stop the job on the critical incident)."
        ),
    ]


def vanishing_gradients_steps() -> list[str]:
    return [
        (
            "Give the gradient a path down the stack: residual connections, a normalisation layer "
            "(LayerNorm/BatchNorm) between blocks, ReLU/GELU instead of sigmoid/tanh."
        ),
        "Initialise for the activation (torch.nn.init.kaiming_normal_ for ReLU, xavier for tanh).",
        "Not a precision problem: bf16/fp32 master weights or a higher learning rate will not fix it.",
    ]


def params_not_in_optimizer_steps() -> list[str]:
    return [
        (
            "Build the optimizer after unfreezing, from model.parameters() (or every parameter "
            "with requires_grad), or add the missing ones with optimizer.add_param_group("
            "{'params': [...]}); the steps so far trained only the layers it holds."
        ),
        (
            "If they are frozen on purpose, call requires_grad_(False) on them: they then get no "
            "gradient and cost no backward pass."
        ),
    ]


def update_ratio_outlier_steps(layer: str, factor: str, step: int) -> list[str]:
    """update_ratio_outlier; factor: the layer's update ratio over the median layer's, as worded."""
    return [
        (
            f"Check the learning rate of the param group holding {layer} (the run records each "
            f"group's as lr, lr/1, lr/2…): if it is ~{factor}x the others', fix it and restart from "
            f"the checkpoint before step {step}."
        ),
        (
            "If the larger learning rate is deliberate, lower it until the layer's update ratio is "
            "within ~10x of the other layers' (a healthy update ratio is near 1e-3 per step)."
        ),
    ]
