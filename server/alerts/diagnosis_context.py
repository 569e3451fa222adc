"""What the causes read: the run around an incident (RunContext), its findings, the lr and the
safe-scale band interpreted, and numbers and layers worded for a sentence."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..._text import power_of_two
from .evidence import (
    LrJumpEvidence,
    NonFiniteEvidence,
    SpikeEvidence,
)

__all__ = [
    "SEVERITY_ORDER",
    "RunContext",
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


def _power(value: float | None) -> str:
    if value is None or not math.isfinite(value) or value <= 0:
        return str(value)
    return power_of_two(value) or f"{value:.3g}"


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


# (cause_key, title, cause, next steps[, layers named]) or None when the cause does not apply.
Result = tuple[str, str, str, list[str]] | tuple[str, str, str, list[str], list[str]] | None
# What a cause is tried on: the findings (JSON documents) and the first one of each rule, the misuse
# events' data by kind (see diagnose).
Findings = list[dict[str, Any]]
ByRule = dict[str, dict[str, Any]]
Misuse = dict[str, dict[str, Any]]


def _divergence_trigger(by_rule: ByRule, context: RunContext, step: int) -> tuple[int, float, float] | None:
    if "lr_jump" in by_rule:
        evidence: LrJumpEvidence = by_rule["lr_jump"]["evidence"]
        values = evidence.get("values") or []
        if len(values) == 2:
            return by_rule["lr_jump"]["step"], float(values[0]), float(values[1])
    return lr_jump_near(
        context.lr, step, peak_before=context.lr_peak_before, points_before=context.lr_points_before
    )


def _non_finite(finding: dict[str, Any]) -> NonFiniteEvidence:
    """A non_finite finding's evidence."""
    evidence: NonFiniteEvidence = finding["evidence"]
    return evidence


def _onset(by_rule: ByRule, rules: tuple[str, ...]) -> int | None:
    steps = []
    for rule in rules:
        if rule in by_rule:
            evidence: SpikeEvidence = by_rule[rule]["evidence"]
            steps.append(evidence.get("onset_step", by_rule[rule]["step"]))
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
