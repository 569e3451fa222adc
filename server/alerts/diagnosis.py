"""What one incident most likely is: a pure function of its findings and what the run showed around them.

An incident groups the findings of several rules (see incidents.py). diagnose() names the one cause
that explains them best, in one sentence, and the next steps with numbers: GradScaler settings from
the safe-scale band, the learning rate to go back to and the step to rewind to, the divisor a gradient
accumulation forgot. Causes are tried from the most specific to the most generic: a setup mistake the
agent saw explains everything after it; a NaN loss with no divergence before it is the data; an lr
jump explains a divergence that follows it; the scaler's own findings come after those.

No database, no clock here: the engine gathers a RunContext and the findings, tests pass plain values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from .rules.misuse import share, unheld_parameters_title

__all__ = [
    "Diagnosis",
    "RunContext",
    "diagnose",
    "finding_onset",
    "lr_jump_near",
    "lr_ramp_near",
    "scaler_settings",
]

SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}
DIVERGENCE_LOOKBACK = 50  # steps before an incident in which an lr jump is taken as its trigger
LR_JUMP_FACTOR = 10.0  # an lr change this large in one step is named as a trigger
LR_HISTORY = 10  # lr points needed before a rise can be a jump (not the first steps of a warm-up)
LR_RAMP_FACTOR = 10.0  # an lr that rose this much within DIVERGENCE_LOOKBACK steps is a ramp...
LOSS_RISE_FACTOR = 2.0  # ...to blame when the loss rose this much over it
TRANSIENT_SPAN = 50  # steps from a burst's first finding to its last: a longer one is not a burst
ONGOING_GAP = 3  # finite losses since the last non-finite one: the forward pass no longer overflows
_WINDOWED_RULES = frozenset({"skip_storm", "scale_drop"})
# The rules whose findings a burst that passes can raise (a setup mistake, an lr jump, stalled layers or
# a scaler that never settles are not bursts, whatever happens after).
_BURST_RULES = frozenset(
    {"loss_non_finite", "non_finite", "skip_storm", "scale_drop", "grad_norm_spike", "loss_spike"}
)


@dataclass
class RunContext:
    """What the run showed around the incident (read by the engine from the stored run)."""

    fp16_scaler: bool = False  # the run reports amp/scale: fp16 with a GradScaler
    misuse: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> the agent's event data
    lr: list[tuple[int, float]] = field(default_factory=list)  # (step, lr) before and at the incident
    scale: float | None = None  # the loss scale at the incident's first step
    safe_scale: tuple[float, float] | None = None  # (low, high): the latest safe-scale band
    micro_batches: float | None = None
    clip_max_norm: float | None = None
    lr_peak_before: float | None = None  # the highest lr before the `lr` window, and how many points it had
    lr_points_before: int = 0
    max_abs_weights: list[tuple[str, float]] = field(
        default_factory=list
    )  # (layer, max |w|) when watching began
    recovered_step: int | None = None  # every finding's rule judged the run healthy again, by this step
    loss: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) before and at the incident
    reached_step: int | None = None  # the run's latest step when the incident was summarised


@dataclass
class Diagnosis:
    cause_key: str
    title: str  # a short headline
    cause: str  # one sentence: the most likely cause
    next_steps: list[str]
    severity: str
    layers: list[str] = field(default_factory=list)  # the layers it names, most likely first


def _power(value: float | None) -> str:
    if value is None or not math.isfinite(value) or value <= 0:
        return str(value)
    exponent = math.log2(value)
    return f"2^{int(exponent)}" if exponent == int(exponent) else f"{value:.3g}"


def _x(value: Any) -> str:
    """A ratio for a sentence: 3.2, 47, 3,234; "many" for a stored infinity or anything else."""
    if not (isinstance(value, (int, float)) and math.isfinite(value)):
        return "many"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _layers(findings: list[dict[str, Any]], *rules: str) -> list[str]:
    names: list[str] = []
    for finding in findings:
        if rules and finding["rule"] not in rules:
            continue
        for name in finding["evidence"].get("layers") or []:
            if name not in names:
                names.append(str(name))
    return names


def _named(layers: list[str], most: int = 3, total: int | None = None) -> str:
    """The first `most` layers and how many more; total: how many there are, when `layers` (evidence,
    capped) lists only some."""
    count = max(total, len(layers)) if isinstance(total, int) else len(layers)
    shown = ", ".join(layers[:most])
    return shown + (f" and {count - min(most, len(layers))} more" if count > most else "")


def lr_jump_near(
    lr: list[tuple[int, float]],
    step: int,
    lookback: int = DIVERGENCE_LOOKBACK,
    peak_before: float | None = None,
    points_before: int = 0,
) -> tuple[int, float, float] | None:
    """The largest one-step rise of the lr by LR_JUMP_FACTOR or more within `lookback` steps up to `step`
    that also reaches twice the highest lr used before it, after at least LR_HISTORY points (a warm-up
    from a tiny start factor and a warm restart back to an earlier peak are not jumps): (step, lr
    before, lr after), or None. peak_before / points_before: the lr history older than `lr`."""
    best: tuple[int, float, float] | None = None
    points = sorted(lr)
    peak = peak_before if peak_before is not None and math.isfinite(peak_before) else 0.0
    for index, ((_, before), (at, after)) in enumerate(itertools.pairwise(points)):
        peak = max(peak, before) if math.isfinite(before) else peak
        if points_before + index + 1 < LR_HISTORY or not (step - lookback <= at <= step):
            continue
        if not (before > 0 and math.isfinite(after)) or after < 2 * peak:
            continue
        if after >= LR_JUMP_FACTOR * before and (best is None or after / before > best[2] / best[1]):
            best = (at, before, after)
    return best


def lr_ramp_near(
    lr: list[tuple[int, float]], loss: list[tuple[int, float]], step: int, lookback: int = DIVERGENCE_LOOKBACK
) -> tuple[int, float, int, float, float] | None:
    """A rise of the lr by LR_RAMP_FACTOR or more over the `lookback` steps up to `step` (a warm-up, or
    any schedule) while the loss rose LOSS_RISE_FACTOR or more: (first step, lr there, last step, lr
    there, the loss's rise), or None. The loss must rise too: a bad batch during a short warm-up is no
    ramp's doing."""
    window = [(s, v) for s, v in sorted(lr) if step - lookback <= s <= step and math.isfinite(v) and v > 0]
    if len(window) < 2:
        return None
    low_at, low = min(window, key=lambda p: (p[1], p[0]))
    high_at, high = max(((s, v) for s, v in window if s >= low_at), key=lambda p: (p[1], -p[0]))
    if high < LR_RAMP_FACTOR * low:
        return None
    losses = [(s, v) for s, v in sorted(loss) if low_at <= s <= step and math.isfinite(v)]
    if len(losses) < 2 or losses[0][1] <= 0:
        return None
    rise = max(v for _, v in losses) / losses[0][1]
    if rise < LOSS_RISE_FACTOR:
        return None
    return low_at, low, high_at, high, rise


def _ramp(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    """The lr ramped up (a warm-up to a peak far too high) and the loss rose with it, then the run
    broke (a NaN loss, overflows, a spike): the schedule's peak is the cause, not the data or fp16."""
    if "lr_jump" in by_rule or lr_jump_near(
        context.lr, step, peak_before=context.lr_peak_before, points_before=context.lr_points_before
    ):
        return None  # one step's jump: _divergence names it
    ramp = lr_ramp_near(context.lr, context.loss, step)
    if ramp is None:
        return None
    low_at, low, high_at, high, rise = ramp
    return (
        "lr_ramp",
        (
            f"the learning rate ramped {_x(high / low)}x to {high:.3g} by step {high_at} and the loss rose "
            f"{_x(rise)}x: the peak lr is too high"
        ),
        (
            f"The learning rate rose from {low:.3g} at step {low_at} to {high:.3g} at step {high_at} and the "
            f"loss rose {_x(rise)}x over the same steps before the run broke at step {step}: a warm-up (or "
            "schedule) whose peak learning rate is too high for this model, not the data or fp16's range."
        ),
        [
            (
                f"Lower the peak learning rate (to {high / 10:.3g}, a tenth) or lengthen the warm-up, and "
                f"restart from the checkpoint before step {low_at}."
            ),
            "Clip gradients at max_norm=1.0 (after scaler.unscale_ with fp16) while the lr ramps.",
        ],
    )


def scaler_settings(band: tuple[float, float] | None, prefer: str = "middle") -> str | None:
    """GradScaler arguments implied by the safe-scale band (eps_fp16/g_min < S < 65504/g_max); None when
    no band is known or it is empty. prefer="high" for underflow, "middle" otherwise."""
    if band is None:
        return None
    low, high = band
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
        return None
    low_exp, high_exp = math.ceil(math.log2(low)), math.floor(math.log2(high))
    if low_exp > high_exp:
        return None
    exponent = max(low_exp, high_exp - 1) if prefer == "high" else (low_exp + high_exp) // 2
    growth = 100 if prefer == "high" else 2000
    return (
        f"GradScaler(init_scale=2**{exponent}, growth_interval={growth}): the gradients fit fp16 for loss "
        f"scales between 2^{low_exp} and 2^{high_exp}"
    )


def diagnose(findings: list[dict[str, Any]], context: RunContext) -> Diagnosis:
    """The incident's most likely cause. findings: [{"rule", "title", "step", "severity", "evidence"}]
    in step order (at least one)."""
    severity = max((f["severity"] for f in findings), key=lambda s: SEVERITY_ORDER.get(s, 0))
    by_rule: dict[str, dict[str, Any]] = {}
    for finding in sorted(findings, key=lambda f: f["step"]):
        by_rule.setdefault(finding["rule"], finding)
    first_step = min(f["step"] for f in findings)
    misuse = dict(context.misuse)
    if "misuse" in by_rule:
        evidence = by_rule["misuse"]["evidence"]
        # Stored evidence: a document without hints (or a shorter list) names no hints, not an error.
        for kind, hint in zip(evidence.get("kinds") or [], evidence.get("hints") or [], strict=False):
            misuse.setdefault(kind, {"hint": hint})
    for diagnose_one in _CAUSES:
        result = diagnose_one(by_rule, findings, context, misuse, first_step)
        if result is not None:
            cause_key, title, cause, steps = result[:4]
            layers = result[4] if len(result) > 4 else _layers(findings)
            return Diagnosis(cause_key, title, cause, steps, severity, layers)
    first = findings[0]
    return Diagnosis(first["rule"], first["title"], first["title"], [], severity, _layers(findings))


# (cause_key, title, cause, next steps[, layers named]) or None when the cause does not apply.
Result = tuple[str, str, str, list[str]] | tuple[str, str, str, list[str], list[str]] | None
# What a cause is tried on: the findings (JSON documents) and the first one of each rule, the misuse
# events' data by kind (see diagnose).
Findings = list[dict[str, Any]]
ByRule = dict[str, dict[str, Any]]
Misuse = dict[str, dict[str, Any]]


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
        [
            (
                "Call scaler.unscale_(optimizer) right before torch.nn.utils.clip_grad_norm_(...), then "
                "scaler.step(optimizer) and scaler.update() as before."
            ),
            "Keep max_norm as it is: after unscale_ it compares the true gradient norm.",
        ],
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
        [
            "Train in bf16: torch.autocast(device_type, dtype=torch.bfloat16) and no GradScaler.",
            "If you must use fp16, keep "
            + (_named(layers) if layers else "the overflowing layers")
            + " in fp32.",
        ],
    )


def _divergence_trigger(by_rule: ByRule, context: RunContext, step: int) -> tuple[int, float, float] | None:
    if "lr_jump" in by_rule:
        evidence = by_rule["lr_jump"]["evidence"]
        values = evidence.get("values") or []
        if len(values) == 2:
            return by_rule["lr_jump"]["step"], float(values[0]), float(values[1])
    return lr_jump_near(
        context.lr, step, peak_before=context.lr_peak_before, points_before=context.lr_points_before
    )


def _onset(by_rule: ByRule, rules: tuple[str, ...]) -> int | None:
    steps = [by_rule[r]["evidence"].get("onset_step", by_rule[r]["step"]) for r in rules if r in by_rule]
    return min(steps) if steps else None


def _lr_at(context: RunContext, step: int) -> float | None:
    before = [lr for s, lr in sorted(context.lr) if s <= step]
    return before[-1] if before else None


def finding_onset(finding: dict[str, Any], rules: Collection[str] | None = None) -> int:
    """Where a finding's condition began: its evidence's onset_step or first_step (a sustained rule, a
    streak) when it has one and its rule is among `rules` (None: any rule), else the step it fired."""
    evidence = finding.get("evidence") or {}
    step = int(finding["step"])
    onset = (
        evidence.get("onset_step", evidence.get("first_step"))
        if rules is None or finding["rule"] in rules
        else None
    )
    return min(step, onset) if isinstance(onset, int) else step


def _transient(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    """A burst (non-finite losses, overflows the scaler skipped, a spike) over at most TRANSIENT_SPAN
    steps, after which every rule that fired has cleared by itself: a burst that passed, described as one
    rather than as a lasting cause to act on (the demo's injected activation blow-up; a few bad batches)."""
    recovered = context.recovered_step
    if recovered is None or not set(by_rule) <= _BURST_RULES:
        return None
    if "non_finite" in by_rule and by_rule["non_finite"]["evidence"].get("applied"):
        return None  # non-finite gradients reached the weights: nothing a run recovers from by itself
    first = min(finding_onset(f) for f in findings)
    # skip_storm and scale_drop hold as long as their window still shows the burst (and scale_drop while
    # the scale stays low: it grows back every growth_interval): when they fired is the burst's
    last = max(
        f["step"] if f["rule"] in _WINDOWED_RULES else max(f.get("last_step") or f["step"], f["step"])
        for f in findings
    )
    if last - first > TRANSIENT_SPAN or _divergence_trigger(by_rule, context, first) is not None:
        return None
    what = []
    if "loss_non_finite" in by_rule:
        what.append("non-finite losses")
    if {"skip_storm", "scale_drop", "non_finite"} & set(by_rule):
        what.append(
            "overflowing gradients the GradScaler skipped" if context.fp16_scaler else "non-finite gradients"
        )
    if {"grad_norm_spike", "loss_spike"} & set(by_rule):
        what.append(
            " and ".join(
                w for r, w in (("grad_norm_spike", "gradient norm"), ("loss_spike", "loss")) if r in by_rule
            )
            + " far above the run's median"
        )
    span = f"steps {first}-{last}" if last > first else f"step {first}"
    return (
        "transient_burst",
        f"a transient burst at {span} ({'; '.join(what)}); training recovered by step {recovered}",
        (
            f"For {last - first + 1} step{'s' if last > first else ''} ({span}) the run showed "
            f"{'; '.join(what)}, and every rule that fired has cleared since (by step {recovered}): a burst "
            "that passed, such as a few bad batches or a transient activation spike, not a lasting problem."
        ),
        [
            "Nothing to fix if it does not come back.",
            (
                "If it recurs, log each batch's sample ids with run.log_batch(ids): the next burst names "
                "its batches."
            ),
            (
                "If bursts come more often or grow, lower the learning rate by half and look at the layers "
                "named."
            ),
        ],
    )


def _forward_overflow(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    """A loss non-finite on (nearly) every step under fp16 autocast: the forward pass overflows fp16."""
    finding = by_rule.get("loss_non_finite")
    if finding is None or not context.fp16_scaler:
        return None
    bad = [s for s in finding["evidence"].get("steps") or [] if isinstance(s, int)]
    # steps holds the first and the latest 49; count is every one of them (a list is no count)
    count = finding["evidence"].get("count")
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
        [
            "Train in bf16: torch.autocast(device_type, dtype=torch.bfloat16) and no GradScaler.",
            ("Or keep " + ", ".join(named[:3]) + " in fp32 (run it under torch.autocast(..., enabled=False))")
            if named
            else "Or find the layer whose output exceeds 65504 and keep it in fp32.",
        ],
        named or _layers(findings),
    )


def _bad_loss(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("loss_non_finite")
    if finding is None:
        return None
    evidence = finding["evidence"]
    nan_step = int(evidence.get("first_step", finding["step"]))
    spikes = _onset(by_rule, ("grad_norm_spike", "loss_spike"))
    if _divergence_trigger(by_rule, context, nan_step) is not None or (
        spikes is not None and spikes < nan_step
    ):
        return None  # a divergence that ended in NaN: _divergence explains it
    ids = evidence.get("batch_ids") or []
    value = (evidence.get("values") or ["NaN"])[0]
    batch = f" on batch {', '.join(map(str, ids[:10]))}" if ids else ""
    applied = any(f["rule"] == "non_finite" and f["evidence"].get("applied") for f in findings)
    steps = [
        f"Inspect and drop the samples of batch {', '.join(map(str, ids[:10]))} (step {nan_step})."
        if ids
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
    elif context.fp16_scaler:
        steps.append(
            "The GradScaler skipped the step; lowering the scale will not help, since the loss is NaN "
            "before any scaling."
        )
    return (
        "loss_non_finite",
        f"the loss is {value} at step {nan_step}{batch}",
        (
            f"The loss itself was {value} at step {nan_step}{batch}: the forward pass or the data produced "
            "it, not an overflow of the gradients that the GradScaler could cure."
        ),
        steps,
    )


def _divergence(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    spikes = _onset(by_rule, ("grad_norm_spike", "loss_spike"))
    trigger = _divergence_trigger(by_rule, context, step if spikes is None else max(step, spikes))
    if trigger is None and spikes is None:
        return None
    if trigger is None and not ({"grad_norm_spike", "loss_spike"} & set(by_rule)):
        return None
    symptoms = []
    for rule, what in (("grad_norm_spike", "gradient norm"), ("loss_spike", "loss")):
        if rule in by_rule:
            symptoms.append(f"{what} {_x(by_rule[rule]['evidence'].get('ratio'))}x its running median")
    if any(r in by_rule for r in ("skip_storm", "scale_drop", "scaler_calibration")):
        symptoms.append("fp16 overflows that make the scaler skip steps")
    if "loss_non_finite" in by_rule:
        symptoms.append(f"a {by_rule['loss_non_finite']['evidence'].get('values', ['NaN'])[0]} loss")
    since = " (" + "; ".join(symptoms) + ")" if symptoms else ""
    if trigger is not None:
        at, before, after = trigger
        rewind = at
        good_lr: float | None = before
        cause = (
            f"The learning rate jumped {_x(after / before)}x at step {at} ({before:.3g} -> {after:.3g}): a "
            f"scheduler or config bug, and the run diverges since{since}."
        )
        title = f"the learning rate jumped {_x(after / before)}x at step {at}; the run diverges"
        first_step = [f"Fix the schedule: the lr at step {at} is {_x(after / before)}x the step before."]
    else:
        rewind = spikes if spikes is not None else step
        good_lr = _lr_at(context, rewind)
        lr_now = f" ({good_lr:.3g})" if good_lr else ""
        # With the lr unchanged, the evidence so far fits two causes: which one tells itself in the next
        # steps (a burst clears, and the incident is then updated; a divergence stays up).
        cause = (
            f"Training diverges from step {rewind}{since}, with no change of the learning rate before it. "
            f"Two causes fit, the likelier first: the learning rate{lr_now} is too high for this point, if "
            "the loss stays up; or a burst that passes (a few bad batches, activations past fp16's range), "
            "if the loss is back near its median within ~50 steps."
        )
        title = f"training diverges from step {rewind} (learning rate unchanged), or a burst"
        first_step = []
    lr_text = f" (to {good_lr / 2:.3g})" if good_lr else ""
    return (
        "divergence" if trigger is None else "lr_jump",
        title,
        cause,
        [
            *first_step,
            f"Lower the learning rate by half{lr_text} and rewind to the checkpoint before step {rewind}.",
            "Clip gradients at max_norm=0.5 (after scaler.unscale_ with fp16) for the next 1,000 steps.",
        ],
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
            [
                CLEAR_GRAD_ADVICE,
                f"Restart from the checkpoint before step {since}: no step was applied since.",
            ],
        )
    if "non_finite" in by_rule and by_rule["non_finite"]["evidence"].get("applied"):
        return (
            "non_finite_applied",
            f"non-finite gradients reached the weights at step {by_rule['non_finite']['step']}",
            (
                f"A non-finite gradient{where} was applied by the optimizer at step "
                f"{by_rule['non_finite']['step']}: no GradScaler skipped it, so the weights are probably NaN "
                "from here on."
            ),
            [
                (
                    f"Restart from the checkpoint before step {by_rule['non_finite']['step']} with half the "
                    "learning rate."
                ),
                "Train in bf16, or use torch.amp.GradScaler with fp16 so overflowing steps are skipped.",
            ],
        )
    overflowed = bool({"skip_storm", "scale_drop", "non_finite"} & set(by_rule))
    if (
        "scaler_calibration" in by_rule
        and not overflowed
        and not by_rule["scaler_calibration"]["evidence"].get("skipped")
        and ((by_rule["scaler_calibration"]["evidence"].get("values") or [None])[-1] or 1.0) < 1.0
    ):
        scale = by_rule["scaler_calibration"]["evidence"]["values"][-1]
        settings = scaler_settings(context.safe_scale, prefer="high")
        return (
            "scale_set_below_one",
            f"the loss scale is {_power(scale)} without any overflow: init_scale below 1",
            f"The loss scale is {_power(scale)}, below 1, although nothing overflowed: the GradScaler was "
            "created (or restored) with init_scale below 1, so small gradients underflow to zero in fp16"
            + (f" ({_named(_layers(findings, 'underflow'))})" if "underflow" in by_rule else "")
            + ".",
            [
                (settings + ".")
                if settings
                else "Use the default GradScaler(init_scale=2**16); it backs off by "
                "itself if that overflows.",
                "Or train in bf16 (no GradScaler needed).",
            ],
        )
    if "scaler_calibration" in by_rule or "scale_floor" in by_rule:
        evidence = (by_rule.get("scaler_calibration") or by_rule["scale_floor"])["evidence"]
        values = evidence.get("values") or [None]
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
                [
                    CLEAR_GRAD_ADVICE,
                    "If the loop does clear .grad: keep "
                    + (_named(layers) if layers else "the overflowing layers")
                    + " in fp32 or train in bf16.",
                    f"Restart from the checkpoint before step {step}: no step was applied since.",
                ],
            )
        cause = (
            f"Gradients overflow fp16 on (nearly) every step{where}: the GradScaler keeps halving the loss "
            f"scale (now {_power(values[-1])}) and never finds one that works, so no optimizer step is "
            "applied."
        )
        title = "the loss scale never settles: gradients overflow at any scale" + where
    else:
        evidence = (by_rule.get("skip_storm") or by_rule.get("scale_drop") or by_rule[present[0]])["evidence"]
        count = evidence.get("count")
        cause = (
            f"Gradients overflow fp16 again and again from step {step}{where}"
            + (
                f" ({count} skipped steps"
                + (f", scale now {_power(evidence['scales'][-1])})" if evidence.get("scales") else ")")
                if count
                else ""
            )
            + ": after calibration this is not the scaler's sawtooth but values growing past fp16's range."
        )
        title = f"fp16 overflow storm from step {step}" + where
    steps = []
    if settings:
        steps.append(settings + ".")
    else:
        steps.append(
            "No fp16 loss scale fits these gradients: train in bf16 (torch.autocast(dtype=torch.bfloat16), "
            "no GradScaler)."
        )
    steps.append(
        "Keep " + (_named(layers) if layers else "the overflowing layers") + " in fp32, or train in bf16."
    )
    steps.append(
        f"If the overflows began mid-run, lower the learning rate by half and rewind to the checkpoint "
        f"before step {step}."
    )
    return ("scale_collapse" if "scaler_calibration" in by_rule else "overflow", title, cause, steps)


CLEAR_GRAD_ADVICE = (
    "Call optimizer.zero_grad(set_to_none=True) once per optimizer step (after step(), or before the first "
    "backward of the next step)."
)
STALE_STREAK = 10  # overflows in a row with a finite loss: the scale fell 1024x and it still overflows


def _stale_streak(by_rule: ByRule) -> tuple[int, int] | None:
    """(steps in a row, first step) of an overflow streak that no real overflow of scaled gradients
    makes: STALE_STREAK or more skipped steps with a finite loss (each halving the scale), none
    applied; None otherwise."""
    finding = by_rule.get("non_finite")
    if finding is None or "loss_non_finite" in by_rule:
        return None
    evidence = finding["evidence"]
    count, since = evidence.get("count"), evidence.get("first_step")
    if evidence.get("applied") or not isinstance(count, int) or not isinstance(since, int):
        return None
    return (count, since) if count >= STALE_STREAK else None


def _underflow(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("underflow")
    if finding is None:
        return None
    layers = _layers(findings, "underflow")
    values = finding["evidence"].get("values") or []
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
        (
            [settings + "."]
            if settings
            else [
                (
                    "Raise the GradScaler's init_scale (and lower growth_interval to 100 so "
                    "it climbs) until the zero fraction falls."
                )
            ]
        )
        + [
            (
                "Or train in bf16 (fp32's exponent range: nothing underflows), or keep the adapters' "
                "matmuls in fp32."
            )
        ],
    )


def _clipping(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("clip_saturation")
    if finding is None:
        return None
    evidence = finding["evidence"]
    median, max_norm = evidence.get("median_ratio", 0.0), evidence.get("max_norm", 0.0)
    micro = evidence.get("micro_batches") or context.micro_batches or 1
    if micro and micro > 1:
        k = f"{micro:g}"
        return (
            "clip_saturation_accumulation",
            f"clipping fires on every step: the loss is summed over {k} micro-batches",
            (
                f"Clipping cuts the gradient on {evidence.get('fraction_clipped', 1):.0%} of steps, the "
                f"pre-clip norm {median:.3g}x max_norm={max_norm:g}, with {k} micro-batches per optimizer "
                f"step: the loss is probably not divided by {k}, so gradients are {k}x too large and the "
                "clip, not the lr, sets every step."
            ),
            [
                (
                    f"Divide the loss by the accumulation steps before backward: (loss / {k}).backward() "
                    f"(scaler.scale(loss / {k}) with fp16)."
                ),
                f"Then keep max_norm={max_norm:g}.",
            ],
        )
    return (
        "clip_saturation",
        "clipping fires on nearly every step",
        (
            f"Clipping cuts the gradient on {evidence.get('fraction_clipped', 1):.0%} of steps (pre-clip "
            f"norm {median:.3g}x max_norm={max_norm:g}): the clip, not the learning rate, sets the step "
            "size; with gradient accumulation an undivided loss does this."
        ),
        [
            (
                "If you accumulate gradients, divide the loss by the number of micro-batches; otherwise "
                f"raise max_norm to about {median * max_norm:.2g} (the median pre-clip norm) or lower the "
                "learning rate."
            )
        ],
    )


def _dead(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("dead_layers")
    if finding is None:
        return None
    evidence = finding["evidence"]
    layers = [str(n) for n in evidence.get("layers") or []]
    count = evidence.get("count") if isinstance(evidence.get("count"), int) else len(layers)
    none = evidence.get("grad_none") or []
    if none:
        cause = (
            f"{count} trainable layers get no gradient at all (grad is None): a .detach(), "
            f"torch.no_grad() or an unused branch cuts {_named(layers, total=count)} off the loss, so they "
            "never train."
        )
    else:
        cause = (
            f"{count} trainable layers get a gradient of exactly zero on every step "
            f"({_named(layers, total=count)}): a multiplication by zero, dead ReLUs or a zero-initialised "
            "layer after them" + (", or gradients underflowing in fp16" if context.fp16_scaler else "") + "."
        )
    return (
        "dead_layers",
        f"no gradient reaches {_named(layers, total=count)}",
        cause,
        [
            (
                "Find the .detach() / .data / torch.no_grad() between "
                f"{layers[0] if layers else 'those layers'} and the loss (print the grad_fn of the "
                "activations along the forward)."
            ),
            (
                "If they are frozen on purpose, call requires_grad_(False) on them and leave them out of the "
                "optimizer."
            ),
        ],
    )


def _stalled(by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int) -> Result:
    finding = by_rule.get("not_learning")
    if finding is None:
        return None
    layers = _layers(findings, "not_learning")
    lr = _lr_at(context, finding["step"])
    if lr == 0:
        return (
            "lr_zero",
            "the learning rate is 0: no weight changes",
            (
                f"The learning rate is 0 at step {finding['step']}, so the optimizer changes no weight (a "
                "scheduler that decays to 0 or starts there for too long)."
            ),
            [
                (
                    "Check the scheduler: its value at this step should not be 0 (e.g. eta_min, warm-up "
                    "start_factor)."
                )
            ],
        )
    values = finding["evidence"].get("values") or []
    share = f"{values[0]:.0%} of " if values and isinstance(values[0], (int, float)) else ""
    return (
        "rounded_away",
        f"weights of {_named(layers)} stop changing: updates round away",
        f"Weights of {_named(layers)} stop changing: {share}their updates are rounded away, as happens when "
        "weights are stored in bf16/fp16 and an update is below half an ulp of the weight"
        + (f" (lr {lr:.3g})" if lr else "")
        + ".",
        [
            "Keep fp32 master weights: model.float() and torch.autocast(dtype=torch.bfloat16) for the speed.",
            (
                "Or use an optimizer with stochastic rounding / Kahan summation for bf16 weights; a higher "
                "learning rate only hides it."
            ),
        ],
    )


def _params_not_in_optimizer(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    """Layers with a gradient that no param group holds (the agent's params_not_in_optimizer): the
    cause when the incident holds nothing it does not explain (their layers are not watched, so no
    other rule sees them)."""
    finding = by_rule.get("misuse")
    details = ((finding or {}).get("evidence") or {}).get("details") or {}
    unheld = details.get("params_not_in_optimizer") if isinstance(details, dict) else None
    if not isinstance(unheld, dict) or set(by_rule) - {"misuse", "update_ratio_outlier", "update_ratio"}:
        return None
    layers = [str(name) for name in unheld.get("layers") or []]
    count = unheld.get("count") if isinstance(unheld.get("count"), int) else len(layers)
    fraction = unheld.get("fraction")
    weights = (
        f" ({share(fraction)} of the weights that get a gradient)"
        if isinstance(fraction, (int, float))
        else ""
    )
    return (
        "params_not_in_optimizer",
        unheld_parameters_title(unheld),
        (
            f"{count} layers{weights} get a gradient on every step but are in no param group of the "
            f"optimizer ({_named(layers)}), so they never change: the optimizer was built from part of the "
            "parameters (the head only, or before the backbone was unfrozen)."
        ),
        [
            (
                "Build the optimizer after unfreezing, from model.parameters() (or every parameter "
                "with requires_grad), or add the missing ones with optimizer.add_param_group("
                "{'params': [...]}); the steps so far trained only the layers it holds."
            ),
            (
                "If they are frozen on purpose, call requires_grad_(False) on them: they then get no "
                "gradient and cost no backward pass."
            ),
        ],
        layers,
    )


def _update_ratio_outlier(
    by_rule: ByRule, findings: Findings, context: RunContext, misuse: Misuse, step: int
) -> Result:
    """One layer's update ratio far above every other layer's: most likely its param group's lr."""
    finding = by_rule.get("update_ratio_outlier")
    if finding is None:
        return None
    evidence = finding["evidence"]
    layers = [str(name) for name in evidence.get("layers") or []]
    factors, values = evidence.get("factors") or [None], evidence.get("values") or [None]
    median, at = evidence.get("median"), finding["step"]
    if not layers or not isinstance(values[0], (int, float)) or not isinstance(median, (int, float)):
        return None
    layer, factor = layers[0], _x(factors[0])
    count = evidence.get("count") if isinstance(evidence.get("count"), int) else len(layers)
    more = f" (and {count - 1} more layer{'s' if count > 2 else ''})" if count > 1 else ""
    follows = [
        what
        for rule, what in (("grad_norm_spike", "gradient norm"), ("loss_spike", "loss"))
        if rule in by_rule
    ]
    return (
        "update_ratio_outlier",
        f"the update ratio of {layer} is {factor}x the median layer's: its learning rate is likely {factor}x "
        "the others'" + more,
        (
            f"At step {at} one optimizer step changed {layer} by {values[0]:.3g} of its norm, the median "
            f"layer by {median:.3g} ({factor}x less){more}. Most likely the param group holding {layer} has "
            f"a learning rate ~{factor}x the others' (a typo in its lr, a multiplier applied twice); less "
            "likely "
            f"its weights were initialised ~{factor}x smaller than the others'. Its ratio evens out within a "
            "few dozen steps as its weights grow, while its learning rate stays wrong"
            + (f"; the {' and '.join(follows)} spikes here follow from it." if follows else ".")
        ),
        [
            (
                f"Check the learning rate of the param group holding {layer} (the run records each "
                f"group's as lr, lr/1, lr/2…): if it is ~{factor}x the others', fix it and restart from "
                f"the checkpoint before step {at}."
            ),
            (
                "If the larger learning rate is deliberate, lower it until the layer's update ratio is "
                "within ~10x of the other layers' (a healthy update ratio is near 1e-3 per step)."
            ),
        ],
        layers,
    )


_CAUSES = (
    _clip_before_unscale,
    _fp16_range,
    _params_not_in_optimizer,
    _transient,
    _ramp,
    _forward_overflow,
    _bad_loss,
    _update_ratio_outlier,
    _divergence,
    _scaler,
    _underflow,
    _clipping,
    _dead,
    _stalled,
)
