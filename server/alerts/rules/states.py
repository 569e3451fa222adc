"""Each rule type's state: what it keeps per (rule, run) between steps, declared here key by key.

A state is a JSON document (the engine stores it in alert_rule_states and gives it back on the next
batch), so each is a TypedDict: a plain dict at run time, its keys and their types checked by mypy
wherever a rule reads or writes them. Keys marked NotRequired were added after states of that rule
had been stored; the rule reads them with .get or setdefault, so a run in flight across an upgrade
goes on. Lists hold JSON arrays ([step, value, ...] rows: see each rule's initial_state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # the annotations are strings at run time (PEP 563): no import needed there
    from typing_extensions import NotRequired

__all__ = [
    "ClipSaturationState",
    "LayerStreaksState",
    "LossDivergenceState",
    "LossNonFiniteState",
    "LossSpikeState",
    "LrJumpState",
    "MisuseState",
    "NoScaleGrowthState",
    "NoState",
    "NonFiniteState",
    "OverflowHistory",
    "RankDisagreementState",
    "ScaleDropState",
    "ScaleFloorState",
    "ScalerCalibrationState",
    "ScalerPhaseState",
    "SkipStormState",
    "SpikeState",
    "UpdateRatioBandState",
    "UpdateRatioOutlierState",
]


class NoState(TypedDict):
    """A rule that keeps nothing between steps."""


class ScalerPhaseState(TypedDict):
    """Where the run's GradScaler is (scaler.ScalerPhase), kept inside each scaler rule's state."""

    calibrating: bool
    start: int | None  # the step calibration (re)started at
    first_applied: int | None
    clean: int  # applied steps in a row while calibrating
    skips: int  # skips while calibrating
    start_scale: float | None
    scale: float | None  # the latest finite amp/scale
    grown: bool  # the scale grew at the latest applied step (a skip now is the sawtooth's probe)
    ended: int | None  # the step calibration ended at
    floor_skips: int  # skips in a row at an unchanged scale
    observed: NotRequired[int]  # steps with amp/skipped since `start`
    skipped: NotRequired[int]  # of which skipped


class OverflowHistory(TypedDict):
    """base._recent_overflows: "x" (skipped) or "." (applied) per step with amp/skipped, the latest
    RECENT_STEPS."""

    recent: NotRequired[str]


class ScalerCalibrationState(TypedDict):
    phase: ScalerPhaseState
    layers: list[str]  # the layers skip events named most
    recent: NotRequired[str]


class ScaleDropState(TypedDict):
    maxima: list[list[float]]  # [step, scale], decreasing, the sawtooth's trial peaks left out
    peaks: NotRequired[list[list[float]]]  # the same with them
    low: NotRequired[list[Any] | None]  # [step, scale] where the scale took its current value
    skips: list[list[Any]]  # [step, layers] of the window's skips
    phase: NotRequired[ScalerPhaseState]


class SkipStormState(TypedDict):
    skips: list[list[Any]]  # [step, layers, scale] of the last judged skips
    phase: NotRequired[ScalerPhaseState]
    first: NotRequired[int | None]  # the first step seen
    # [first, last] spans of steps in the window: judged skips, every skipped step, every step seen
    judged: NotRequired[list[list[int]]]
    skipped: NotRequired[list[list[int]]]
    seen: NotRequired[list[list[int]]]


class ScaleFloorState(TypedDict):
    recent: NotRequired[str]


class NoScaleGrowthState(TypedDict):
    since: NotRequired[int]  # the step the scale last grew (or was first seen)
    scale: NotRequired[float]


class NonFiniteState(TypedDict):
    run: list[list[Any]]  # [step, value, layers] of the latest steps of the current non-finite run
    count: int  # its true length
    since: int | None  # its first step
    phase: NotRequired[ScalerPhaseState]
    scaler: NotRequired[bool]  # the run has a GradScaler (amp/skipped seen)


class LossNonFiniteState(TypedDict):
    bad: list[list[Any]]  # [step, key, value as spelled, ids] of non-finite losses (first kept)
    finite: int  # finite losses in a row since the last non-finite one
    count: NotRequired[int]  # non-finite losses in the current story


class MisuseState(TypedDict):
    seen: list[list[Any]]  # [step, kind, data] of each misuse event kind, first time only
    details: NotRequired[dict[str, Any]]  # params_not_in_optimizer's numbers, by kind
    scale: NotRequired[float | None]  # the latest finite amp/scale


class SpikeState(TypedDict):
    """_SustainedSpike's: grad_norm_spike's whole state, loss_spike's first keys."""

    baseline: list[list[Any]]  # [step, judged value] of the window's steps
    recent: list[list[Any]]  # [step, hit, value] of the latest RECENT observations
    stats: NotRequired[list[float]]  # the baseline's cached [step, median, spread, tail]


class LossSpikeState(SpikeState):
    start_loss: float | None  # the largest loss of the warm-up
    lr: float | None
    lr_max: float | None
    grace_until: int  # a scheduled lr restart's grace ends after this step


class LossDivergenceState(TypedDict):
    recent: list[float]  # the latest max(smooth, 3 x baseline) finite losses
    count: int  # finite losses seen
    start: float | None  # the highest level (median) of the first `warmup` losses
    # [step, median of `baseline`, grad norm, lr, clip share, the third-highest of the last 3 x baseline
    # losses] where the median was lowest
    best: list[Any] | None
    norms: list[float]  # the latest `smooth` finite gradient norms
    clipped: list[int]  # 1 where the clip cut, of the latest 20 steps with a known max_norm
    lr: float | None
    lr_max: float | None
    grace_until: int  # a scheduled lr restart's grace ends after this step
    open: bool  # a finding is open (the next level back in range clears it)
    key: NotRequired[str | None]  # the loss series judged: "loss" once the user logs it, else "amp/loss"
    rising: NotRequired[int | None]  # the first step since the best one at half way out of the range
    streak: NotRequired[int]  # consecutive steps out of range
    out_since: NotRequired[int | None]  # the first step of the latest streak out of range
    # divergence_warning: steps since the lr last rose, and the peak it settled on (and where)
    lr_flat: NotRequired[int]
    lr_settled: NotRequired[float | None]
    lr_settled_step: NotRequired[int | None]
    first_precursor: NotRequired[list[Any] | None]  # [step, words] of the open warning's first precursor
    # divergence_warning's norm climb: [norm, lr] of the latest lr_settle + smooth steps with both finite,
    # whether a climb finding is open and whether the norm is still half way up
    norm_history: NotRequired[list[list[float]]]
    climb_open: NotRequired[bool]
    climbing: NotRequired[bool]


class LrJumpState(TypedDict):
    count: int  # lr values seen
    lr: float | None
    peak: float | None
    jump: list[float] | None  # [step, from, to, peak before] of an open jump


class ClipSaturationState(TypedDict):
    recent: list[list[Any]]  # [step, norm / max_norm] of the longer window, oldest first
    ordered: NotRequired[list[float]]  # the latest plain_window ratios, sorted
    short: NotRequired[list[float]]  # the latest window ratios, sorted
    micro_batches: float


class LayerStreaksState(TypedDict):
    """_PersistentLayers': underflow, dead_layers, not_learning."""

    streaks: dict[str, int]  # layer index -> observations in a row
    applied: int  # applied optimizer steps (with a GradScaler)
    scaler: bool  # the run has a GradScaler
    first: NotRequired[int]  # the first step (without a GradScaler, every step is applied)
    none: NotRequired[list[str]]  # the layers the latest no_gradient event named


class UpdateRatioOutlierState(LayerStreaksState):
    zero_weights: list[int]  # layers whose ratio was ever non-finite (weights that were zero)
    fired: bool


class UpdateRatioBandState(TypedDict):
    first: NotRequired[int]


class RankDisagreementState(TypedDict):
    steps: dict[str, dict[str, int]]
