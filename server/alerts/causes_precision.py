"""The causes in fp16's range and the GradScaler: clip before unscale_, a bf16-range model, a forward
pass that overflows, overflows at any scale (a .grad never cleared), non-finite gradients applied, a
scale set below one, a scale that collapses, overflow storms, underflow."""

from __future__ import annotations

import math

from . import advice
from .diagnosis_context import (
    ByRule,
    Findings,
    Misuse,
    Result,
    RunContext,
    _divergence_trigger,
    _layers,
    _named,
    _non_finite,
    _power,
    _x,
    scaler_settings,
)
from .evidence import (
    LossNonFiniteEvidence,
    ScaleFloorEvidence,
    ScalerCalibrationEvidence,
    SkipStormEvidence,
    UnderflowEvidence,
)

ONGOING_GAP = 3  # finite losses since the last non-finite one: the forward pass no longer overflows
STALE_STREAK = 10  # overflows in a row with a finite loss: the scale fell 1024x and it still overflows


def _suspect_weights(context: RunContext) -> list[tuple[str, float]]:
    """Layers whose weights are far larger than the rest (bf16-trained outlier features): the likely place
    an fp16 forward overflows. Largest first."""
    finite = [(name, value) for name, value in context.max_abs_weights if math.isfinite(value) and value > 0]
    if not finite:
        return []
    typical = sorted(v for _, v in finite)[len(finite) // 2]
    return sorted(((n, v) for n, v in finite if v >= 256 and v >= 20 * typical), key=lambda item: -item[1])


def _clip_before_unscale(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    if "clip_before_unscale" not in misuse:
        return None
    max_norm = misuse["clip_before_unscale"].get("max_norm", context.clip_max_norm)
    scale = context.scale
    cut = ""
    if isinstance(max_norm, (int, float)) and scale:
        cut = (
            f" (max_norm={max_norm:g} against S·‖g‖ with S={_power(scale)}: the true gradient is cut to "
            f"≈{max_norm / scale:.2g})"
        )
    return (
        "clip_before_unscale",
        "clip_grad_norm_ runs before scaler.unscale_: every step is clipped to almost nothing",
        (
            "clip_grad_norm_ is called on the SCALED gradients, before scaler.unscale_(optimizer): it clips "
            f"on nearly every step and shrinks the true gradient by the loss scale{cut}, so the model barely "
            "learns."
        ),
        advice.clip_before_unscale_steps(),
    )


def _fp16_range(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    kind = next((k for k in ("bf16_model_in_fp16", "weights_exceed_fp16") if k in misuse), None)
    if kind is None:
        return None
    layers = _layers(findings)
    largest = misuse[kind].get("max_abs_weight")
    what = (
        f"a weight of magnitude {largest:.3g} does not fit fp16 (max 65504)"
        if isinstance(largest, (int, float))
        else "the model was trained or stored in bfloat16"
    )
    return (
        kind,
        "bf16-range model trained in fp16: it overflows on every step",
        f"The model does not fit fp16's range: {what}, so fp16 autocast overflows on nearly every step and "
        "no loss scale can help" + (f" (first non-finite layers: {_named(layers)})" if layers else "") + ".",
        advice.fp16_range_steps(_named(layers) if layers else None),
    )


def _forward_overflow(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    """A loss non-finite on (nearly) every step under fp16 autocast: the forward pass overflows fp16."""
    finding = by_rule.get("loss_non_finite")
    if finding is None or not context.fp16_scaler:
        return None
    evidence: LossNonFiniteEvidence = finding["evidence"]
    bad = [s for s in evidence.get("steps") or [] if isinstance(s, int)]
    # steps holds the first and the latest 49; count is every one of them (a list is no count)
    count = evidence.get("count")
    count = count if isinstance(count, int) and count >= len(bad) else len(bad)
    if count < 5 or count < 0.8 * (bad[-1] - bad[0] + 1):
        return None
    if context.reached_step is not None and context.reached_step - bad[-1] >= ONGOING_GAP:
        return None  # the losses are finite again: not "every step" (a burst: _bad_loss, then _transient)
    if _divergence_trigger(by_rule, context, bad[0]) is not None:
        return None
    suspects = _suspect_weights(context)
    named = [name for name, _ in suspects[:5]]
    where = (
        " — the largest weights are in " + ", ".join(f"{n} (|w| up to {v:.3g})" for n, v in suspects[:3])
        if suspects
        else ""
    )
    return (
        "fp16_forward_overflow",
        "the forward pass overflows fp16 on every step" + (f" (likely {named[0]})" if named else ""),
        (
            f"The loss is non-finite on {count} of {bad[-1] - bad[0] + 1} steps since step {bad[0]} under "
            f"fp16 autocast: activations exceed fp16's 65504 in the forward pass{where}, as a model trained "
            "in bf16 (outlier features) does in fp16; no loss scale helps, and the GradScaler skips every "
            "step (or every batch is corrupt)."
        ),
        advice.forward_overflow_steps(named),
        named or _layers(findings),
    )


def _scaler(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    rules = ("scaler_calibration", "scale_floor", "skip_storm", "scale_drop", "non_finite", "no_scale_growth")
    present = [r for r in rules if r in by_rule]
    if not present:
        return None
    layers = _layers(findings, *present)
    where = f" in {_named(layers)}" if layers else ""
    settings = scaler_settings(context.safe_scale)
    streak = _stale_streak(by_rule)
    if streak is not None:
        count, since = streak
        return (
            "overflow_at_any_scale",
            (
                f"{count} steps in a row overflowed with a finite loss since step {since}: is .grad ever "
                "cleared?"
            ),
            (
                f"Every step since step {since} ({count} in a row) overflowed although the loss stayed "
                f"finite and the GradScaler halved its scale each time ({_x(2.0**count)}x by now): a real "
                "overflow of scaled gradients stops after a few halvings. Likeliest: .grad is never "
                "cleared (no optimizer.zero_grad() in the loop), so the inf of one overflow stays in .grad "
                f"and every later step adds to it; else an operation{where} produces inf in backward at "
                "any scale."
            ),
            advice.stale_grad_steps(since),
        )
    if "non_finite" in by_rule and _non_finite(by_rule["non_finite"]).get("applied"):
        return (
            "non_finite_applied",
            f"non-finite gradients reached the weights at step {by_rule['non_finite']['step']}",
            (
                f"A non-finite gradient{where} was applied by the optimizer at step "
                f"{by_rule['non_finite']['step']}: no GradScaler skipped it, so the weights are probably NaN "
                "from here on."
            ),
            advice.non_finite_applied_steps(by_rule["non_finite"]["step"]),
        )
    overflowed = bool({"skip_storm", "scale_drop", "non_finite"} & set(by_rule))
    calibration: ScalerCalibrationEvidence | None = (by_rule.get("scaler_calibration") or {}).get("evidence")
    if (
        calibration is not None
        and not overflowed
        and not calibration.get("skipped")
        and ((calibration.get("values") or [None])[-1] or 1.0) < 1.0
    ):
        scale = calibration["values"][-1]
        settings = scaler_settings(context.safe_scale, prefer="high")
        return (
            "scale_set_below_one",
            f"the loss scale is {_power(scale)} without any overflow: init_scale below 1",
            f"The loss scale is {_power(scale)}, below 1, although nothing overflowed: the GradScaler was "
            "created (or restored) with init_scale below 1, so small gradients underflow to zero in fp16"
            + (f" ({_named(_layers(findings, 'underflow'))})" if "underflow" in by_rule else "")
            + ".",
            advice.scale_set_below_one_steps(settings),
        )
    if "scaler_calibration" in by_rule or "scale_floor" in by_rule:
        scale_evidence: ScalerCalibrationEvidence | ScaleFloorEvidence = (
            by_rule.get("scaler_calibration") or by_rule["scale_floor"]
        )["evidence"]
        values = scale_evidence.get("values") or [None]
        last_scale = values[-1]
        if isinstance(last_scale, (int, float)) and last_scale < 1.0 and overflowed:
            # Below 1 a scaled gradient cannot overflow fp16 unless it is already inf: what overflows is
            # not the scaling. Two causes fit; a stale .grad first, since it needs no bad layer at all.
            stale = ".grad is never cleared (no optimizer.zero_grad() in the loop)"
            return (
                "overflow_at_any_scale",
                f"gradients stay non-finite even at loss scale {_power(last_scale)}: is .grad ever cleared?",
                (
                    f"Every step overflows although the loss scale is down to {_power(last_scale)}, where a "
                    "scaled gradient cannot overflow fp16 unless it is already inf. Likeliest: "
                    f"{stale}, so the inf of one overflow stays in .grad and every later step adds to "
                    f"it; else a layer{where} outputs inf in the forward pass."
                ),
                advice.overflow_below_one_steps(_named(layers) if layers else None, step),
            )
        cause = (
            f"Gradients overflow fp16 on (nearly) every step{where}: the GradScaler keeps halving the loss "
            f"scale (now {_power(values[-1])}) and never finds one that works, so no optimizer step is "
            "applied."
        )
        title = "the loss scale never settles: gradients overflow at any scale" + where
    else:
        skipped, scales = _skips(by_rule, present[0])
        cause = (
            f"Gradients overflow fp16 again and again from step {step}{where}"
            + (
                f" ({skipped} skipped steps" + (f", scale now {_power(scales[-1])})" if scales else ")")
                if skipped
                else ""
            )
            + ": after calibration this is not the scaler's sawtooth but values growing past fp16's range."
        )
        title = f"fp16 overflow storm from step {step}" + where
    steps = advice.overflow_steps(settings, _named(layers) if layers else None, step)
    return ("scale_collapse" if "scaler_calibration" in by_rule else "overflow", title, cause, steps)


def _skips(by_rule: ByRule, first: str) -> tuple[object, list[float]]:
    """The skipped steps and the latest scales an overflow storm's cause names, from the first of
    skip_storm, scale_drop and `first` (the first scaler rule present) that fired: skip_storm's count and
    scales, non_finite's count (its streak); scale_drop and no_scale_growth count none."""
    if "skip_storm" in by_rule:
        storm: SkipStormEvidence = by_rule["skip_storm"]["evidence"]
        return storm.get("count"), storm.get("scales") or []
    if "scale_drop" not in by_rule and first == "non_finite":
        return _non_finite(by_rule["non_finite"]).get("count"), []
    return None, []


def _stale_streak(by_rule: ByRule) -> tuple[int, int] | None:
    """(steps in a row, first step) of an overflow streak that no real overflow of scaled gradients
    makes: STALE_STREAK or more skipped steps with a finite loss (each halving the scale), none
    applied; None otherwise."""
    finding = by_rule.get("non_finite")
    if finding is None or "loss_non_finite" in by_rule:
        return None
    evidence = _non_finite(finding)
    count, since = evidence.get("count"), evidence.get("first_step")
    if evidence.get("applied") or not isinstance(count, int) or not isinstance(since, int):
        return None
    return (count, since) if count >= STALE_STREAK else None


def _underflow(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("underflow")
    if finding is None:
        return None
    layers = _layers(findings, "underflow")
    underflow: UnderflowEvidence = finding["evidence"]
    values = underflow.get("values") or []
    share = f"{values[0]:.0%} of " if values and isinstance(values[0], (int, float)) else ""
    at_scale = f" at loss scale {_power(context.scale)}" if context.scale else ""
    settings = scaler_settings(context.safe_scale, prefer="high")
    return (
        "underflow",
        f"gradients of {_named(layers)} underflow in fp16",
        (
            f"Gradients of {_named(layers)} underflow in fp16: {share}their elements are exactly "
            f"zero{at_scale}, so those weights barely learn (tiny adapter gradients, as LoRA/QLoRA has, are "
            "the usual case)."
        ),
        advice.underflow_steps(settings),
    )
