"""The evidence of a finding, one type per rule type: what the rules write and diagnosis.py reads.

Evidence is stored as JSON (an alert's evidence_json, with the "link" the engine adds) and returned by
the API as it is stored, so these are TypedDicts: a rule builds a plain dict whose keys the type
checker knows, the JSON keeps its key order, and a reader sees which keys a rule writes. Readers
still read with .get() and check what they get: evidence stored by an older server may lack a key
added since (NonFiniteEvidence's count) or hold a value of another shape.

    rule type                              evidence
    scaler_calibration                     ScalerCalibrationEvidence
    scale_drop                             ScaleDropEvidence
    skip_storm                             SkipStormEvidence
    scale_floor                            ScaleFloorEvidence
    no_scale_growth                        NoScaleGrowthEvidence
    non_finite                             NonFiniteEvidence
    loss_non_finite                        LossNonFiniteEvidence
    misuse                                 MisuseEvidence (details and layers when an event had numbers)
    grad_norm_spike, loss_spike            SpikeEvidence
    lr_jump                                LrJumpEvidence
    loss_divergence, divergence_warning    LossDivergenceEvidence
    clip_saturation                        ClipSaturationEvidence
    update_ratio                           UpdateRatioBandEvidence
    update_ratio_outlier                   UpdateRatioOutlierEvidence
    underflow                              UnderflowEvidence
    dead_layers                            DeadLayersEvidence
    not_learning                           NotLearningEvidence
    rank_disagreement                      RankDisagreementEvidence
    heartbeat                              HeartbeatEvidence
"""

from __future__ import annotations

import sys
from typing import Any, TypedDict

if sys.version_info >= (3, 11):  # read at run time too (typing.get_type_hints: the API's schemas)
    from typing import NotRequired
else:
    from typing_extensions import NotRequired

__all__ = [
    "EVIDENCE_TYPES",
    "ClipSaturationEvidence",
    "DeadLayersEvidence",
    "Evidence",
    "HeartbeatEvidence",
    "LossNonFiniteEvidence",
    "LrJumpEvidence",
    "MisuseEvidence",
    "NoScaleGrowthEvidence",
    "NonFiniteEvidence",
    "NotLearningEvidence",
    "RankDisagreementEvidence",
    "ScaleDropEvidence",
    "ScaleFloorEvidence",
    "ScalerCalibrationEvidence",
    "SkipStormEvidence",
    "SpikeEvidence",
    "UnderflowEvidence",
    "UnheldParameters",
    "UpdateRatioBandEvidence",
    "UpdateRatioOutlierEvidence",
]


# -- the loss scale -------------------------------------------------------------------------------


class ScalerCalibrationEvidence(TypedDict):
    key: str  # "amp/scale"
    steps: list[int]  # [where the calibration began, this step]
    values: list[float | None]  # the loss scale there and now
    skipped: int  # every skipped step since steps[0] (amp/skipped's count)
    calibrating: bool
    calibration_steps: int  # steps with amp/skipped since steps[0]
    reason: str
    layers: list[str]


class ScaleDropEvidence(TypedDict):
    key: str  # "amp/scale"
    steps: list[int]  # [the peak's step, this step]
    values: list[float]  # [the peak, the scale now]
    ratio: float  # peak / low
    low_step: int
    skip_steps: list[int]
    layers: list[str]


class SkipStormEvidence(TypedDict):
    key: str  # "amp/skipped"
    steps: list[int]  # the last 50 judged skips
    values: list[float]
    count: int  # the judged skips in the window
    scales: list[float]
    layers: list[str]


class ScaleFloorEvidence(TypedDict):
    key: str  # "amp/scale"
    steps: list[int]
    values: list[float]
    floor: float
    overflowed: int  # of the last recent_steps steps
    recent_steps: int
    layers: list[str]


class NoScaleGrowthEvidence(TypedDict):
    key: str  # "amp/scale"
    steps: list[int]  # [since, this step]
    values: list[float]
    since_step: int


# -- non-finite values ----------------------------------------------------------------------------


class NonFiniteEvidence(TypedDict):
    keys: list[str]  # ["grad/global_norm"]
    steps: list[int]  # the last 50 of the streak
    values: list[float]
    count: int  # non-finite norms in a row up to this step
    first_step: int  # the streak's first step
    applied: bool  # the optimizer applied the step (no GradScaler skipped it)
    layers: list[str]


class LossNonFiniteEvidence(TypedDict):
    key: str  # "loss" or "amp/loss"
    steps: list[int]  # the first and the last 49
    values: list[str]  # "NaN", "Infinity", "-Infinity" (as the wire spells them)
    first_step: int
    count: int  # non-finite losses since first_step
    batch_ids: list[Any] | None  # the first bad step's batch, when the run logs ids
    batches: dict[str, list[Any]]  # step -> batch ids


# -- setup mistakes -------------------------------------------------------------------------------


class UnheldParameters(TypedDict):
    """The numbers of a params_not_in_optimizer event (bounded)."""

    layers: list[str]
    count: int
    fraction: float | None
    elements: int | None


class _MisuseEvidence(TypedDict):
    kinds: list[str]  # in the order the run reported them
    steps: list[int]
    hints: list[str]


class MisuseEvidence(_MisuseEvidence, total=False):
    details: dict[str, UnheldParameters]  # kind -> the numbers of an event that has them
    layers: list[str]


# -- jumps and spikes -----------------------------------------------------------------------------


class SpikeEvidence(TypedDict):
    """grad_norm_spike and loss_spike."""

    key: str
    steps: list[int]  # the steps of the spike among the last few
    values: list[float]
    onset_step: int
    baseline_median: float
    baseline_steps: list[int]  # [first, last] of the baseline
    ratio: float  # value / baseline median
    z: float


class LrJumpEvidence(TypedDict):
    key: str  # "lr"
    steps: list[int]  # [step - 1, step]
    values: list[float]  # [lr before, lr after]
    ratio: float
    previous_peak: float


class LossDivergenceEvidence(TypedDict):
    key: str  # "loss" or "amp/loss"
    steps: list[int]  # [the best step, now]
    values: list[float]  # [the best level, the level now] (medians of `smooth` steps)
    ratio: float  # now / best
    start_level: float  # the highest level of the first `warmup` steps
    onset_step: int  # the first step out of range (of the streak that fired)
    rising_step: int | None  # the first step since the best one half way out of the range
    grad_norm: list[float | None]  # the median gradient norm [at the best step, now]
    lr: list[float | None]  # [at the best step, now]
    clipped_share: list[float | None]  # share of the last 20 steps the clip cut [then, now]
    precursors: list[str]  # what moved with the loss, as worded in the title


class ClipSaturationEvidence(TypedDict):
    key: str  # "grad/global_norm"
    steps: list[int]  # [first, last] of the window
    fraction_clipped: float
    median_ratio: float  # median pre-clip norm / max_norm
    max_norm: float
    micro_batches: float | None
    # The ratio is high enough for the micro-batch count to name an undivided (summed) loss
    # (rules.spikes.undivided_loss_ratio); absent in evidence stored before it existed: not named.
    undivided_loss: NotRequired[bool]


# -- layers ---------------------------------------------------------------------------------------


class UpdateRatioBandEvidence(TypedDict):
    key: str
    steps: list[int]
    values: list[float]
    layers: list[str]
    count: int


class UnderflowEvidence(TypedDict):
    key: str
    steps: list[int]
    values: list[float]  # the zero fraction of each layer named
    layers: list[str]
    count: int


class DeadLayersEvidence(TypedDict):
    key: str  # "grad/norm"
    steps: list[int]
    layers: list[str]
    count: int
    grad_none: list[str]  # of them, the layers whose .grad is None


class NotLearningEvidence(TypedDict):
    key: str
    steps: list[int]
    values: list[float]  # the rounded-away fraction (or update ratio) of each layer named
    update_ratios: list[float | None]  # each layer's update ratio, where the step reported one
    layers: list[str]
    count: int
    # each layer's gradient norm / the largest layer's at the step (None: not sampled), and that layer
    grad_norm_shares: NotRequired[list[float | None]]
    top_grad_layer: NotRequired[str | None]


class UpdateRatioOutlierEvidence(TypedDict):
    key: str  # "update/ratio"
    steps: list[int]
    layers: list[str]
    count: int
    values: list[float]  # the outliers' update ratios
    median: float  # the median layer's
    factors: list[float]  # values / median
    compared_layers: int
    other_layers_max: float | None


# -- liveness -------------------------------------------------------------------------------------


class RankDisagreementEvidence(TypedDict):
    key: str  # "amp/skipped"
    steps: list[int]
    skipped_ranks: list[int]
    applied_ranks: list[int]
    layers: list[str]


class HeartbeatEvidence(TypedDict):
    steps: list[int | None]  # [the run's last step]
    last_seen: str | None  # ISO time
    silent_s: float


Evidence = (
    ScalerCalibrationEvidence
    | ScaleDropEvidence
    | SkipStormEvidence
    | ScaleFloorEvidence
    | NoScaleGrowthEvidence
    | NonFiniteEvidence
    | LossNonFiniteEvidence
    | MisuseEvidence
    | SpikeEvidence
    | LrJumpEvidence
    | ClipSaturationEvidence
    | LossDivergenceEvidence
    | UpdateRatioBandEvidence
    | UnderflowEvidence
    | DeadLayersEvidence
    | NotLearningEvidence
    | UpdateRatioOutlierEvidence
    | RankDisagreementEvidence
    | HeartbeatEvidence
)

# The evidence type of each rule type's findings (by RuleType.name).
EVIDENCE_TYPES: dict[str, type[Any]] = {
    "scaler_calibration": ScalerCalibrationEvidence,
    "scale_drop": ScaleDropEvidence,
    "skip_storm": SkipStormEvidence,
    "scale_floor": ScaleFloorEvidence,
    "no_scale_growth": NoScaleGrowthEvidence,
    "non_finite": NonFiniteEvidence,
    "loss_non_finite": LossNonFiniteEvidence,
    "misuse": MisuseEvidence,
    "grad_norm_spike": SpikeEvidence,
    "loss_spike": SpikeEvidence,
    "lr_jump": LrJumpEvidence,
    "clip_saturation": ClipSaturationEvidence,
    "loss_divergence": LossDivergenceEvidence,
    "divergence_warning": LossDivergenceEvidence,
    "update_ratio": UpdateRatioBandEvidence,
    "update_ratio_outlier": UpdateRatioOutlierEvidence,
    "underflow": UnderflowEvidence,
    "dead_layers": DeadLayersEvidence,
    "not_learning": NotLearningEvidence,
    "rank_disagreement": RankDisagreementEvidence,
    "heartbeat": HeartbeatEvidence,
}
