"""Alert rule types: pure, incremental evaluators over a run's steps.

Each rule type reads a few wire keys and keeps a small JSON-serialisable state (a TypedDict of
states.py: RuleType[ItsState]). The engine feeds it one
StepData per (rank, step) in step order and persists the state per (rule, run), so a restarted server
continues where it stopped, and evaluation costs O(new points) however long the run is. observe()
answers, for that step, whether the rule's condition holds (a Finding with its evidence), does not
hold (CLEAR), or says nothing (None); the engine turns that into firing / resolved alerts.

No database, no clock, no I/O here: every rule is tested with plain lists of steps.

The GradScaler's calibration (ScalerPhase) is part of how the scaler-related rules read a run: from a
run's start, a restored scaler state or a scale jump that no growth explains, until the first stretch
of CALIBRATION_CLEAN_STEPS consecutive applied steps, skips and scale drops are the scaler finding its
scale and notify no one; so do the single back-offs that follow a growth (the grow/back-off sawtooth
of dynamic loss scaling). A calibration that does not end is an alert of its own (scaler_calibration).

    base        StepData, Finding/CLEAR, Param, RuleType: what every rule type is made of
    scaler      ScalerPhase and the loss-scale rules
    non_finite  NaN/Inf gradients and losses
    misuse      setup mistakes the agent reports (params not in the optimizer among them)
    spikes      gradient-norm, loss and learning-rate jumps; clip saturation
    divergence  the loss leaving the range it had reached (finite or not yet NaN)
    layers      per-layer rules: update ratio (band, outlier layer), underflow, dead layers, weights that
                stop changing
    liveness    heartbeat and rank disagreement
    states      each rule type's state, key by key
A new rule type is a RuleType subclass in the module of its kind, added to RULE_TYPES below (and to
DEFAULT_RULES if new projects get it).
"""

from __future__ import annotations

from typing import Any

from .base import CLEAR, LOSS_KEYS, Finding, Param, RuleType, StepData, Verdict
from .divergence import DivergenceWarning, LossDivergence
from .layers import DeadLayers, NotLearning, UnderflowFraction, UpdateRatioBand, UpdateRatioOutlier
from .liveness import Heartbeat, RankDisagreement
from .misuse import MISUSE_EVENTS, Misuse
from .non_finite import LossNonFinite, NonFinite
from .scaler import (
    CALIBRATION_CLEAN_STEPS,
    NoScaleGrowth,
    ScaleDrop,
    ScaleFloor,
    ScalerCalibration,
    ScalerPhase,
    SkipStorm,
)
from .spikes import ClipSaturation, GradNormSpike, LossSpike, LrJump

__all__ = [
    "CALIBRATION_CLEAN_STEPS",
    "CLEAR",
    "DEFAULT_RULES",
    "LOSS_KEYS",
    "MISUSE_EVENTS",
    "RULE_TYPES",
    "ClipSaturation",
    "DeadLayers",
    "DivergenceWarning",
    "Finding",
    "GradNormSpike",
    "Heartbeat",
    "LossDivergence",
    "LossNonFinite",
    "LossSpike",
    "LrJump",
    "Misuse",
    "NoScaleGrowth",
    "NonFinite",
    "NotLearning",
    "Param",
    "RankDisagreement",
    "RuleType",
    "ScaleDrop",
    "ScaleFloor",
    "ScalerCalibration",
    "ScalerPhase",
    "SkipStorm",
    "StepData",
    "UnderflowFraction",
    "UpdateRatioBand",
    "UpdateRatioOutlier",
    "Verdict",
    "make_rule",
]

RULE_TYPES: dict[str, type[RuleType[Any]]] = {
    rule.name: rule
    for rule in (
        ScalerCalibration,
        ScaleDrop,
        SkipStorm,
        ScaleFloor,
        NonFinite,
        LossNonFinite,
        Misuse,
        GradNormSpike,
        LossSpike,
        LrJump,
        LossDivergence,
        DivergenceWarning,
        ClipSaturation,
        NoScaleGrowth,
        UpdateRatioBand,
        UpdateRatioOutlier,
        UnderflowFraction,
        DeadLayers,
        NotLearning,
        Heartbeat,
        RankDisagreement,
    )
}

# Installed for every new project (each can be edited or deleted through the API); tuned so that healthy
# runs (a scaler calibrating, the grow/back-off sawtooth, warm-up, restarts, resumes) stay silent.
DEFAULT_RULES: tuple[str, ...] = (
    "scaler_calibration",
    "scale_drop",
    "skip_storm",
    "scale_floor",
    "non_finite",
    "loss_non_finite",
    "misuse",
    "grad_norm_spike",
    "loss_spike",
    "lr_jump",
    "loss_divergence",
    "divergence_warning",
    "clip_saturation",
    "underflow",
    "update_ratio_outlier",
    "dead_layers",
    "not_learning",
    "rank_disagreement",
    "heartbeat",
)


def make_rule(rule_type: str, params: dict[str, Any] | None = None) -> RuleType[Any]:
    """A rule type with validated parameters. ValueError names an unknown type or a value out of range,
    TypeError a value of the wrong type."""
    try:
        cls = RULE_TYPES[rule_type]
    except KeyError:
        raise ValueError(f"unknown rule type {rule_type!r}; known types: {', '.join(RULE_TYPES)}") from None
    if not isinstance(params, (dict, type(None))):
        raise TypeError(f"{rule_type}: params must be an object, got {type(params).__name__}")
    return cls(params)
