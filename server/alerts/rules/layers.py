"""Per-layer rules over the per-layer vectors: update ratios out of band (update_ratio) or far above the
other layers' (update_ratio_outlier), and layers that underflow, get no gradient or stop learning
(underflow, dead_layers, not_learning)."""

from __future__ import annotations

import math
from typing import ClassVar, TypeVar, cast

from ..evidence import (
    DeadLayersEvidence,
    NotLearningEvidence,
    UnderflowEvidence,
    UpdateRatioBandEvidence,
    UpdateRatioOutlierEvidence,
)
from .base import (
    CLEAR,
    MAX_EVIDENCE_LAYERS,
    MAX_WINDOW,
    Finding,
    Param,
    RuleType,
    StepData,
    Verdict,
    _names,
    _times,
)
from .states import LayerStreaksState, UpdateRatioBandState, UpdateRatioOutlierState

__all__ = ["DeadLayers", "NotLearning", "UnderflowFraction", "UpdateRatioBand", "UpdateRatioOutlier"]


class UpdateRatioBand(RuleType[UpdateRatioBandState]):
    name = "update_ratio"
    family = "divergence"
    description = (
        "A layer's update ratio ||dW||/||W|| is outside [low, high] (zero ratios, and +inf ones: weights "
        "that were zero before the step, are ignored; NaN counts as outside)."
    )
    params: ClassVar[dict[str, Param]] = {
        "low": Param(1e-6, minimum=0.0),
        "high": Param(1e-2, minimum=0.0, exclusive_minimum=True),
        "key": Param("update/ratio"),
    }
    vector_keys = frozenset({"update/ratio"})

    def validate(self) -> None:
        if self.low >= self.high:
            raise ValueError(f"update_ratio: low ({self.low:g}) must be below high ({self.high:g})")

    def reads_signature(self, rank: int, present: frozenset[str]) -> bool:
        return rank == 0 and self.key in present

    def observe(self, state: UpdateRatioBandState, data: StepData, layers: list[str]) -> Verdict:
        row = data.vectors.get(self.key)
        if row is None:
            return None
        # +inf: the layer's weights were zero before the step (a LoRA B, a zero-initialised head), so
        # its ratio is undefined, not high; NaN: its weights or update were not finite (the agent's
        # update_ratios gives each one meaning).
        bad = [
            (i, v)
            for i, v in enumerate(row)
            if v != math.inf and (not math.isfinite(v) or v > self.high or 0 < v < self.low)
        ]
        if not bad:
            return CLEAR
        bad.sort(key=lambda item: -abs(item[1]) if math.isfinite(item[1]) else -math.inf)  # non-finite first
        count = len(bad)
        bad = bad[:MAX_EVIDENCE_LAYERS]
        names = [_layer(layers, i) for i, _ in bad]
        values = [v for _, v in bad]
        high = any(not math.isfinite(v) or v > self.high for v in values)
        return Finding(
            data.step,
            f"update ratio of {names[0]} is {values[0]:.3g}, outside [{self.low:g}, {self.high:g}]"
            + _more_layers(count),
            UpdateRatioBandEvidence(
                key=self.key, steps=[data.step], values=values, layers=names, count=count
            ),
            cause="update_ratio_high" if high else "update_ratio_low",
        )


def _layer(layers: list[str], index: int) -> str:
    return layers[index] if index < len(layers) else f"layer{index}"


def _more_layers(count: int) -> str:
    """ " (and N more layers)" after the first of `count` layers (all of them, not only those the evidence
    lists)."""
    if count <= 1:
        return ""
    return f" (and {count - 1} more layer{'s' if count > 2 else ''})"


LayerState = TypeVar("LayerState", bound=LayerStreaksState)


class _PersistentLayers(RuleType[LayerState]):
    """Per-layer conditions that must hold on `observations` consecutive observations of a layer
    (one odd step is not a stalled layer), on steps after the run's first applied optimizer step (before
    it, a zero-initialised LoRA B makes A's gradient exactly zero, healthily)."""

    family = "stalled"

    def initial_state(self) -> LayerState:
        # streaks: layer index -> observations in a row
        return cast(LayerState, {"streaks": {}, "applied": 0, "scaler": False})

    @staticmethod
    def skipped(data: StepData) -> bool:
        """A skipped step's gradients overflowed: what they show about a layer means nothing."""
        return data.scalars.get("amp/skipped", 0.0) >= 0.5

    def count_applied(self, state: LayerStreaksState, data: StepData) -> int:
        """Applied optimizer steps before this one (every step, without a GradScaler)."""
        before: int = state["applied"]
        skipped = data.scalars.get("amp/skipped")
        if skipped is not None:
            state["scaler"] = True
        if skipped is None and not state["scaler"]:
            state.setdefault("first", data.step)
            before = data.step - state["first"]
        elif skipped is not None and skipped < 0.5:
            state["applied"] = before + 1
        return before

    def streaks(self, state: LayerStreaksState, bad: set[int], width: int) -> list[int]:
        """Layers whose condition held on enough consecutive observations, worst (longest) first."""
        streaks: dict[str, int] = state["streaks"]
        updated = {str(i): streaks.get(str(i), 0) + 1 for i in bad if i < width}
        state["streaks"] = updated
        held = [int(i) for i, n in updated.items() if n >= self.observations]
        return sorted(held, key=lambda i: (-updated[str(i)], i))


class UnderflowFraction(_PersistentLayers[LayerStreaksState]):
    name = "underflow"
    family = "precision"
    description = (
        "A layer's gradients underflow in fp16: most of its elements are exactly zero while the survivors "
        "sit in fp16's subnormal range (zero fraction >= `zero_fraction` and precision-loss fraction >= "
        "`precision_loss`), or more than `threshold` of its non-zero gradients are below 2^-24 once scaled; "
        "on `observations` histogram steps in a row."
    )
    params: ClassVar[dict[str, Param]] = {
        "threshold": Param(0.1, minimum=0.0, maximum=1.0),
        "zero_fraction": Param(0.3, minimum=0.0, maximum=1.0),
        "precision_loss": Param(0.5, minimum=0.0, maximum=1.0),
        "observations": Param(2, minimum=1, maximum=MAX_WINDOW, integer=True),
        "all_zero": Param(False, doc="a layer whose gradients are all zero counts as underflowing"),
        "key": Param("grad/underflow_frac"),
    }
    scalar_keys = frozenset({"amp/skipped"})
    vector_keys = frozenset({"grad/underflow_frac", "grad/zero_frac", "grad/precision_loss_frac"})

    def observe(self, state: LayerStreaksState, data: StepData, layers: list[str]) -> Verdict:
        self.count_applied(state, data)
        under = data.vectors.get(self.key)
        zeros = data.vectors.get("grad/zero_frac")
        subnormal = data.vectors.get("grad/precision_loss_frac")
        if (under is None and zeros is None) or self.skipped(data):
            return None
        width = max(len(under or ()), len(zeros or ()))
        bad: dict[int, float] = {}
        for i in range(width):
            u = under[i] if under is not None and i < len(under) else math.nan
            z = zeros[i] if zeros is not None and i < len(zeros) else math.nan
            p = subnormal[i] if subnormal is not None and i < len(subnormal) else math.nan
            if math.isfinite(u) and u > self.threshold:
                bad[i] = u
            elif (
                math.isfinite(z) and z >= self.zero_fraction and math.isfinite(p) and p >= self.precision_loss
            ):
                bad[i] = z
            elif self.all_zero and math.isnan(u) and (math.isnan(z) or z >= 1.0):
                bad[i] = 1.0
        held = self.streaks(state, set(bad), width)
        if not held:
            return CLEAR if not bad else None
        count = len(held)
        held = held[:MAX_EVIDENCE_LAYERS]
        names = [_layer(layers, i) for i in held]
        return Finding(
            data.step,
            f"{bad[held[0]]:.0%} of {names[0]}'s gradients underflow to zero in fp16" + _more_layers(count),
            UnderflowEvidence(
                key="grad/zero_frac" if zeros is not None else self.key,
                steps=[data.step],
                values=[bad[i] for i in held],
                layers=names,
                count=count,
            ),
        )


class DeadLayers(_PersistentLayers[LayerStreaksState]):
    name = "dead_layers"
    description = (
        "Trainable layers get no gradient (grad None or exactly zero: a stray .detach(), torch.no_grad(), an "
        "unused module) on `observations` gradient-norm samples in a row after the first applied step."
    )
    params: ClassVar[dict[str, Param]] = {
        "observations": Param(2, minimum=1, maximum=MAX_WINDOW, integer=True)
    }
    scalar_keys = frozenset({"amp/skipped"})
    vector_keys = frozenset({"grad/norm"})
    event_kinds = frozenset({"no_gradient"})

    def observe(self, state: LayerStreaksState, data: StepData, layers: list[str]) -> Verdict:
        for kind, event in data.events:
            if kind == "no_gradient":
                state["none"] = _names(event.get("layers"))
        applied_before = self.count_applied(state, data)
        row = data.vectors.get("grad/norm")
        if row is None or applied_before < 1 or self.skipped(data):
            return None
        held = self.streaks(state, {i for i, v in enumerate(row) if v == 0.0}, len(row))
        if not held:
            return CLEAR
        names = [_layer(layers, i) for i in held]
        missing = set(state.get("none") or ())
        without = [name for name in names if name in missing]
        what = "no gradient (grad is None)" if without else "a gradient of exactly zero"
        return Finding(
            data.step,
            f"{len(names)} of {len(row)} trainable layers get {what}: {', '.join(names[:3])}"
            + ("…" if len(names) > 3 else ""),
            DeadLayersEvidence(
                key="grad/norm",
                steps=[data.step],
                layers=names[:MAX_EVIDENCE_LAYERS],
                count=len(names),
                grad_none=without[:MAX_EVIDENCE_LAYERS],
            ),
            cause="dead_layers_none" if without else "dead_layers_zero",
        )


class NotLearning(_PersistentLayers[LayerStreaksState]):
    name = "not_learning"
    description = (
        "Weights stop changing: at least `rounded_away` of a layer's elements with a non-zero gradient were "
        "left unchanged by the optimizer step (updates rounded away in bf16/fp16 storage, or a zero learning "
        "rate) on `observations` sampled steps in a row; without that signal, an update ratio of exactly 0."
    )
    params: ClassVar[dict[str, Param]] = {
        "rounded_away": Param(0.5, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        "observations": Param(2, minimum=1, maximum=MAX_WINDOW, integer=True),
    }
    scalar_keys = frozenset({"amp/skipped"})
    vector_keys = frozenset({"update/ratio", "update/rounded_away_frac", "grad/norm"})

    def observe(self, state: LayerStreaksState, data: StepData, layers: list[str]) -> Verdict:
        self.count_applied(state, data)
        ratios = data.vectors.get("update/ratio")
        rounded = data.vectors.get("update/rounded_away_frac")
        if ratios is None and rounded is None:
            return None
        width = max(len(ratios or ()), len(rounded or ()))
        bad: dict[int, float] = {}
        for i in range(width):
            r = ratios[i] if ratios is not None and i < len(ratios) else math.nan
            f = rounded[i] if rounded is not None and i < len(rounded) else math.nan
            if rounded is not None:
                if math.isfinite(f) and f >= self.rounded_away:
                    bad[i] = f
            elif r == 0.0:
                bad[i] = 1.0
        held = self.streaks(state, set(bad), width)
        if not held:
            return CLEAR if not bad else None
        count = len(held)
        held = held[:MAX_EVIDENCE_LAYERS]
        names = [_layer(layers, i) for i in held]
        ratio_values = [ratios[i] if ratios is not None and i < len(ratios) else None for i in held]
        shares, top = _grad_norm_shares(data.vectors.get("grad/norm"), held)
        return Finding(
            data.step,
            f"weights of {count} of {width} layers stopped changing: {bad[held[0]]:.0%} of {names[0]}'s "
            "updates were rounded away (or the learning rate is 0)",
            NotLearningEvidence(
                key="update/rounded_away_frac" if rounded is not None else "update/ratio",
                steps=[data.step],
                values=[bad[i] for i in held],
                update_ratios=ratio_values,
                layers=names,
                count=count,
                grad_norm_shares=shares,
                top_grad_layer=_layer(layers, top) if top is not None else None,
            ),
        )


def _grad_norm_shares(norms: list[float] | None, held: list[int]) -> tuple[list[float | None], int | None]:
    """Each held layer's gradient norm as a share of the largest layer's at this step, and that layer's
    index: a stalled layer whose gradient is ~1e-12 of the top layer's stalls because the gradient
    vanished on its way down the stack, not because its update rounds away in a low-precision weight."""
    finite = [(v, i) for i, v in enumerate(norms or ()) if math.isfinite(v)]
    if not finite or max(finite)[0] <= 0:
        return [None] * len(held), None
    largest, top = max(finite)
    return [
        norms[i] / largest if norms is not None and i < len(norms) and math.isfinite(norms[i]) else None
        for i in held
    ], top


class UpdateRatioOutlier(_PersistentLayers[UpdateRatioOutlierState]):
    """One layer (or a few) whose update ratio ||dW||/||W|| is far above every other layer's: a param
    group whose learning rate is 100x the others' (a typo in the embedding's lr) shows as that layer's
    ratio ~100x the median layer's.

    Like is compared with like: a layer whose ratio was ever +inf had all-zero weights when it was
    measured (a zero-initialised bias or LayerNorm shift, a LoRA B); its ratio is large while it grows
    from zero, by design, so it is left out for the rest of the run. A NaN ratio (weights or update not
    finite) leaves the layer out of that observation only. Layers with a ratio of 0 (no update)
    are left out too. The outliers must be few (at most `max_outlier_fraction` of the compared layers,
    at least one) and stand apart: every other layer's ratio at most 1/`gap` of the smallest outlier's, so
    a class of layers spread over a range (small-init adapters, biases) is not taken for one layer set
    apart. The signal is strongest on a run's first observations (Adam moves every element by ~lr, so
    the layer's weights soon grow and its ratio comes back towards the others'): the default needs one
    observation, and a fired finding stays until the run ends (the learning rate is still wrong when
    the ratios have evened out).
    """

    name = "update_ratio_outlier"
    family = "divergence"
    description = (
        "A layer's update ratio ||dW||/||W|| is at least `factor` x the median of the other layers' on "
        "`observations` samples in a row, with every other layer at most 1/`gap` of it (layers whose "
        "weights were all zero and layers without an update are not compared): a param group's learning "
        "rate far above the others' (a config typo)."
    )
    params: ClassVar[dict[str, Param]] = {
        "factor": Param(30.0, minimum=1.0, exclusive_minimum=True),
        "gap": Param(5.0, minimum=1.0),
        "observations": Param(1, minimum=1, maximum=MAX_WINDOW, integer=True),
        "min_layers": Param(4, minimum=2, maximum=MAX_WINDOW, integer=True),
        "max_outlier_fraction": Param(0.1, minimum=0.0, maximum=0.5),
    }
    vector_keys = frozenset({"update/ratio"})

    def initial_state(self) -> UpdateRatioOutlierState:
        return {"streaks": {}, "applied": 0, "scaler": False, "zero_weights": [], "fired": False}

    def observe(self, state: UpdateRatioOutlierState, data: StepData, layers: list[str]) -> Verdict:
        row = data.vectors.get("update/ratio")
        if row is None or state["fired"]:
            return None
        # +inf: weights all zero before the step (left out for the run); NaN: weights or update not
        # finite at this observation only (a run resumed from a checkpoint before it is finite again).
        zero_weights = set(state["zero_weights"]) | {i for i, v in enumerate(row) if v == math.inf}
        state["zero_weights"] = sorted(zero_weights)
        compared = [(i, v) for i, v in enumerate(row) if i not in zero_weights and math.isfinite(v) and v > 0]
        outliers: dict[int, float] = {}
        median = 0.0
        if len(compared) >= self.min_layers:
            values = sorted(v for _, v in compared)
            median = values[(len(values) - 1) // 2]
            high = {i: v for i, v in compared if v >= self.factor * median}
            rest = max((v for i, v in compared if i not in high), default=0.0)
            few = max(1, int(self.max_outlier_fraction * len(compared)))
            if high and len(high) <= few and rest * self.gap <= min(high.values()):
                outliers = high
        held = self.streaks(state, set(outliers), len(row))
        if not held:
            return CLEAR if not outliers else None
        state["fired"] = True
        held.sort(key=lambda i: -outliers[i])
        names = [_layer(layers, i) for i in held][:MAX_EVIDENCE_LAYERS]
        ratios = [outliers[i] for i in held][:MAX_EVIDENCE_LAYERS]
        return Finding(
            data.step,
            f"update ratio of {names[0]} is {_times(ratios[0] / median)} the median layer's "
            f"({ratios[0]:.3g} vs {median:.3g} over {len(compared)} layers)" + _more_layers(len(held)),
            UpdateRatioOutlierEvidence(
                key="update/ratio",
                steps=[data.step],
                layers=names,
                count=len(held),
                values=ratios,
                median=median,
                factors=[v / median for v in ratios],
                compared_layers=len(compared),
                other_layers_max=max((v for i, v in compared if i not in outliers), default=None),
            ),
            cause="update_ratio_outlier",
        )
