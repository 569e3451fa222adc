"""Alert rule types: pure, incremental evaluators over a run's steps.

Each rule type reads a few wire keys and keeps a small JSON-serialisable state. The engine feeds it one
StepData per (rank, step) in step order and persists the state per (rule, run), so a restarted server
continues where it stopped, and evaluation costs O(new points) however long the run is. observe()
answers, for that step, whether the rule's condition holds (a Finding with its evidence), does not
hold (CLEAR), or says nothing (None); the engine turns that into firing / resolved alerts.

No database, no clock, no I/O here: every rule is tested with plain lists of steps.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "CLEAR",
    "DEFAULT_RULES",
    "RULE_TYPES",
    "Finding",
    "RuleType",
    "StepData",
    "make_rule",
]

MAX_EVIDENCE_POINTS = 50
MAX_EVIDENCE_LAYERS = 20


@dataclass
class StepData:
    """What one rank reported at one step: scalar values, per-layer vectors, events (kind, data)."""

    step: int
    rank: int
    scalars: dict[str, float] = field(default_factory=dict)
    vectors: dict[str, list[float]] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


@dataclass(frozen=True)
class Finding:
    """The rule's condition holds at `step`; evidence is JSON-ready (steps, values, layers…)."""

    step: int
    title: str
    evidence: dict[str, Any]
    cause: str = ""  # a key of HINTS (engine) naming the likeliest cause, "" for the rule's default


class _Clear:
    def __repr__(self) -> str:
        return "CLEAR"


CLEAR = _Clear()
Verdict = Finding | _Clear | None


@dataclass(frozen=True)
class Param:
    default: float | int | str | bool
    minimum: float | None = None
    maximum: float | None = None
    integer: bool = False
    exclusive_minimum: bool = False
    doc: str = ""

    def check(self, rule: str, name: str, value: Any) -> float | int | str | bool:
        if isinstance(self.default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{rule}: {name} must be true or false, got {value!r}")
            return value
        if isinstance(self.default, str):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{rule}: {name} must be a non-empty string, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{rule}: {name} must be a number, got {value!r}")
        if self.integer and value != int(value):
            raise ValueError(f"{rule}: {name} must be a whole number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{rule}: {name} must be finite, got {value!r}")
        if self.minimum is not None:
            if self.exclusive_minimum and value <= self.minimum:
                raise ValueError(f"{rule}: {name} must be greater than {self.minimum:g}, got {value!r}")
            if value < self.minimum:
                raise ValueError(f"{rule}: {name} must be at least {self.minimum:g}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{rule}: {name} must be at most {self.maximum:g}, got {value!r}")
        return int(value) if self.integer else float(value)


class RuleType:
    """Base of the rule types. Subclasses set name, params, the keys they read, and observe()."""

    name: ClassVar[str]
    description: ClassVar[str]
    severity: ClassVar[str] = "warning"
    params: ClassVar[dict[str, Param]] = {}
    scalar_keys: ClassVar[frozenset[str]] = frozenset()
    vector_keys: ClassVar[frozenset[str]] = frozenset()
    event_kinds: ClassVar[frozenset[str]] = frozenset()
    all_ranks: ClassVar[bool] = False  # False: only rank 0's data is evaluated
    cooldown_steps: ClassVar[int] = 100  # default: a re-trigger this soon after firing reopens silently
    periodic: ClassVar[bool] = False  # evaluated by the server's clock, not by steps

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        given = dict(params or {})
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise ValueError(f"{self.name}: unknown parameter {unknown[0]!r} (parameters: {known})")
        self.values: dict[str, Any] = {
            name: spec.check(self.name, name, given[name]) if name in given else spec.default
            for name, spec in self.params.items()
        }
        self.validate()

    def validate(self) -> None:
        """Cross-parameter checks; raise ValueError naming the bad values."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def reads(self, data: StepData) -> bool:
        """Whether a step holds anything this rule reads (others are not fed to it)."""
        if not self.all_ranks and data.rank != 0:
            return False
        return (
            any(k in data.scalars for k in self.scalar_keys)
            or any(k in data.vectors for k in self.vector_keys)
            or any(kind in self.event_kinds for kind, _ in data.events)
        )

    def initial_state(self) -> dict[str, Any]:
        return {}

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        raise NotImplementedError


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _skip_layers(data: StepData) -> list[str]:
    layers: list[str] = []
    for kind, event in data.events:
        if kind == "skip":
            layers.extend(str(name) for name in event.get("non_finite_layers") or [])
    return layers


def _common_layers(entries: list[list[Any]]) -> list[str]:
    """Layers named by skip events, most frequent first."""
    counts = Counter(name for _, names in entries for name in names)
    return [name for name, _ in counts.most_common(MAX_EVIDENCE_LAYERS)]


class ScaleDrop(RuleType):
    name = "scale_drop"
    severity = "critical"
    description = "The loss scale fell by at least `factor`x within `window` steps."
    params: ClassVar[dict[str, Param]] = {
        "factor": Param(8.0, minimum=1.0, exclusive_minimum=True, doc="drop ratio (max in window / now)"),
        "window": Param(100, minimum=1, integer=True, doc="steps"),
    }
    scalar_keys = frozenset({"amp/scale"})
    event_kinds = frozenset({"skip"})

    def initial_state(self) -> dict[str, Any]:
        return {"maxima": [], "skips": []}  # maxima: [step, scale] with decreasing scales

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        step = data.step
        oldest = step - self.window
        skips = [s for s in state["skips"] if s[0] > oldest]
        layers_here = _skip_layers(data)
        if any(kind == "skip" for kind, _ in data.events):
            skips.append([step, layers_here])
        state["skips"] = skips[-MAX_EVIDENCE_POINTS:]
        scale = data.scalars.get("amp/scale")
        if not _finite(scale):
            return None
        maxima = [m for m in state["maxima"] if m[0] > oldest]
        while maxima and maxima[-1][1] <= scale:
            maxima.pop()
        maxima.append([step, scale])
        state["maxima"] = maxima
        peak_step, peak = maxima[0]
        if scale > 0 and peak / scale < self.factor:
            return CLEAR
        ratio = peak / scale if scale > 0 else math.inf
        return Finding(
            step,
            f"loss scale fell {ratio:.3g}x in {step - peak_step} steps ({peak:g} -> {scale:g})",
            {
                "key": "amp/scale",
                "steps": [peak_step, step],
                "values": [peak, scale],
                "ratio": ratio,
                "skip_steps": [s for s, _ in state["skips"]],
                "layers": _common_layers(state["skips"]),
            },
        )


class SkipStorm(RuleType):
    name = "skip_storm"
    severity = "critical"
    description = "At least `count` skipped optimizer steps within `window` steps, after `ignore_first` steps."
    params: ClassVar[dict[str, Param]] = {
        "count": Param(10, minimum=1, integer=True, doc="skips"),
        "window": Param(100, minimum=1, integer=True, doc="steps"),
        "ignore_first": Param(50, minimum=0, integer=True, doc="calibration steps not counted"),
    }
    scalar_keys = frozenset({"amp/skipped"})
    event_kinds = frozenset({"skip"})

    def validate(self) -> None:
        if self.count > self.window:
            raise ValueError(f"skip_storm: count ({self.count}) cannot exceed window ({self.window})")

    def initial_state(self) -> dict[str, Any]:
        return {"skips": []}  # [step, non-finite layers]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        skipped = data.scalars.get("amp/skipped")
        if skipped is None or data.step < self.ignore_first:
            return None
        skips = [s for s in state["skips"] if s[0] > data.step - self.window]
        if skipped >= 0.5:
            skips.append([data.step, _skip_layers(data)])
        state["skips"] = skips
        if len(skips) < self.count:
            return CLEAR
        return Finding(
            data.step,
            f"{len(skips)} skipped steps in the last {self.window} steps",
            {
                "key": "amp/skipped",
                "steps": [s for s, _ in skips][-MAX_EVIDENCE_POINTS:],
                "values": [1.0] * min(len(skips), MAX_EVIDENCE_POINTS),
                "count": len(skips),
                "layers": _common_layers(skips),
            },
        )


class ScaleFloor(RuleType):
    name = "scale_floor"
    severity = "critical"
    description = "The loss scale is below `floor` (below 1, gradients overflow even unscaled)."
    params: ClassVar[dict[str, Param]] = {"floor": Param(1.0, minimum=0.0, exclusive_minimum=True)}
    scalar_keys = frozenset({"amp/scale"})

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        scale = data.scalars.get("amp/scale")
        if scale is None or math.isnan(scale):
            return None
        if scale >= self.floor:
            return CLEAR
        below_one = " (below 1: gradients overflow even unscaled)" if scale < 1.0 else ""
        return Finding(
            data.step,
            f"loss scale {scale:g} is below the floor {self.floor:g}{below_one}",
            {"key": "amp/scale", "steps": [data.step], "values": [scale], "floor": self.floor},
        )


class NonFinite(RuleType):
    name = "non_finite"
    severity = "critical"
    description = (
        "NaN/Inf in the loss or the gradient norm on a step the optimizer applied, or on `consecutive` "
        "steps in a row (the scaler skipping them all)."
    )
    params: ClassVar[dict[str, Param]] = {"consecutive": Param(3, minimum=1, integer=True, doc="steps in a row")}
    scalar_keys = frozenset({"loss", "grad/global_norm"})
    event_kinds = frozenset({"skip"})
    _KEYS = ("loss", "grad/global_norm")

    def initial_state(self) -> dict[str, Any]:
        return {"run": []}  # the current streak: [step, {key: value}, layers]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        seen = {k: data.scalars[k] for k in self._KEYS if k in data.scalars}
        if not seen:
            return None
        bad = {k: v for k, v in seen.items() if not math.isfinite(v)}
        if not bad:
            state["run"] = []
            return CLEAR
        streak = (state["run"] + [[data.step, bad, _skip_layers(data)]])[-MAX_EVIDENCE_POINTS:]
        state["run"] = streak
        applied = "amp/skipped" in data.scalars and data.scalars["amp/skipped"] < 0.5
        if not applied and len(streak) < self.consecutive:
            return None
        what = " and ".join(f"{'gradient norm' if k == 'grad/global_norm' else k} is {v}" for k, v in bad.items())
        if applied:
            title = f"{what} at step {data.step}, and the optimizer step was applied"
        else:
            title = f"{what}: {len(streak)} steps in a row with non-finite values"
        layer_names = _common_layers([[s, names] for s, _, names in streak])
        return Finding(
            data.step,
            title + (f" (first non-finite layer: {layer_names[0]})" if layer_names else ""),
            {
                "keys": sorted({k for _, b, _ in streak for k in b}),
                "steps": [s for s, _, _ in streak],
                "values": [b for _, b, _ in streak],
                "applied": applied,
                "layers": layer_names,
            },
            cause="non_finite_applied" if applied else "",
        )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class GradNormSpike(RuleType):
    name = "grad_norm_spike"
    description = (
        "The global gradient norm jumped: robust z-score of log10(norm) against the median/MAD of the "
        "last `window` applied steps at least `z`, and at least `min_ratio`x the median."
    )
    params: ClassVar[dict[str, Param]] = {
        "window": Param(100, minimum=5, integer=True, doc="baseline steps"),
        "warmup": Param(20, minimum=5, integer=True, doc="baseline steps needed before judging"),
        "z": Param(6.0, minimum=0.0, exclusive_minimum=True),
        "min_ratio": Param(10.0, minimum=1.0),
    }
    scalar_keys = frozenset({"grad/global_norm"})
    MIN_SPREAD = 0.01  # log10 units (~2%): a perfectly flat baseline must not make every wiggle a spike

    def validate(self) -> None:
        if self.warmup > self.window:
            raise ValueError(f"grad_norm_spike: warmup ({self.warmup}) cannot exceed window ({self.window})")

    def initial_state(self) -> dict[str, Any]:
        return {"baseline": []}  # [step, log10 norm]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        norm = data.scalars.get("grad/global_norm")
        if not _finite(norm) or norm <= 0 or data.scalars.get("amp/skipped", 0.0) >= 0.5:
            return None
        x = math.log10(norm)
        baseline = state["baseline"]
        verdict: Verdict = None
        if len(baseline) >= self.warmup:
            logs = [v for _, v in baseline]
            median = _median(logs)
            spread = max(1.4826 * _median([abs(v - median) for v in logs]), self.MIN_SPREAD)
            z = (x - median) / spread
            ratio = 10 ** (x - median)
            if z >= self.z and ratio >= self.min_ratio:
                verdict = Finding(
                    data.step,
                    f"gradient norm {norm:.3g} is {ratio:.3g}x its running median {10 ** median:.3g} (z={z:.1f})",
                    {
                        "key": "grad/global_norm",
                        "steps": [data.step],
                        "values": [norm],
                        "baseline_median": 10**median,
                        "baseline_steps": [baseline[0][0], baseline[-1][0]],
                        "ratio": ratio,
                        "z": z,
                    },
                )
            else:
                verdict = CLEAR
        baseline.append([data.step, x])
        state["baseline"] = baseline[-self.window :]
        return verdict


class NoScaleGrowth(RuleType):
    name = "no_scale_growth"
    description = "The loss scale has not grown for `intervals` growth intervals (recurring overflows)."
    params: ClassVar[dict[str, Param]] = {
        "growth_interval": Param(2000, minimum=1, integer=True, doc="the GradScaler's growth_interval"),
        "intervals": Param(5, minimum=1, integer=True),
    }
    scalar_keys = frozenset({"amp/scale"})

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        scale = data.scalars.get("amp/scale")
        if not _finite(scale):
            return None
        if "since" not in state or scale > state["scale"]:
            state["since"] = data.step
            state["scale"] = scale
            return CLEAR
        state["scale"] = scale
        steps = data.step - state["since"]
        if steps < self.intervals * self.growth_interval:
            return CLEAR
        return Finding(
            data.step,
            f"the loss scale has not grown for {steps} steps ({steps / self.growth_interval:.3g} growth intervals)",
            {"key": "amp/scale", "steps": [state["since"], data.step], "values": [scale], "since_step": state["since"]},
        )


class _LayerBand(RuleType):
    """Shared by the per-layer rules: a vector's entries outside [low, high]."""

    key_param = "key"

    def outside(self, value: float) -> bool:
        raise NotImplementedError

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        row = data.vectors.get(self.key)
        if row is None:
            return None
        bad = [(i, v) for i, v in enumerate(row) if self.outside(v)]
        if not bad:
            return CLEAR
        bad.sort(key=lambda item: -abs(item[1]) if math.isfinite(item[1]) else -math.inf)  # non-finite first
        bad = bad[:MAX_EVIDENCE_LAYERS]
        names = [layers[i] if i < len(layers) else f"layer{i}" for i, _ in bad]
        return Finding(
            data.step,
            self.describe(names, [v for _, v in bad], len(row)),
            {"key": self.key, "steps": [data.step], "values": [v for _, v in bad], "layers": names},
            cause=self.cause([v for _, v in bad]),
        )

    def describe(self, names: list[str], values: list[float], width: int) -> str:
        raise NotImplementedError

    def cause(self, values: list[float]) -> str:
        return ""


class UpdateRatioBand(_LayerBand):
    name = "update_ratio"
    description = "A layer's update ratio ||dW||/||W|| is outside [low, high] (zero ratios are ignored)."
    params: ClassVar[dict[str, Param]] = {
        "low": Param(1e-6, minimum=0.0),
        "high": Param(1e-2, minimum=0.0, exclusive_minimum=True),
        "key": Param("update/ratio"),
    }
    vector_keys = frozenset({"update/ratio"})

    def validate(self) -> None:
        if self.low >= self.high:
            raise ValueError(f"update_ratio: low ({self.low:g}) must be below high ({self.high:g})")

    def reads(self, data: StepData) -> bool:
        return data.rank == 0 and self.key in data.vectors

    def outside(self, value: float) -> bool:
        return not math.isfinite(value) or value > self.high or 0 < value < self.low

    def describe(self, names: list[str], values: list[float], width: int) -> str:
        return f"update ratio of {names[0]} is {values[0]:.3g}, outside [{self.low:g}, {self.high:g}]" + (
            f" (and {len(names) - 1} more layers)" if len(names) > 1 else ""
        )

    def cause(self, values: list[float]) -> str:
        return "update_ratio_high" if any(not math.isfinite(v) or v > self.high for v in values) else "update_ratio_low"


class UnderflowFraction(_LayerBand):
    name = "underflow"
    description = "A layer's fraction of fp16 gradients that underflow (|g*S| < 2^-24) is above `threshold`."
    params: ClassVar[dict[str, Param]] = {
        "threshold": Param(0.1, minimum=0.0, maximum=1.0),
        "all_zero": Param(True, doc="a layer whose gradients are all zero (fraction undefined) counts as 100%"),
        "key": Param("grad/underflow_frac"),
    }
    vector_keys = frozenset({"grad/underflow_frac"})

    def reads(self, data: StepData) -> bool:
        return data.rank == 0 and self.key in data.vectors

    def outside(self, value: float) -> bool:
        if math.isnan(value):  # no non-zero gradient at all: everything underflowed (or never arrived)
            return bool(self.all_zero)
        return value > self.threshold

    def describe(self, names: list[str], values: list[float], width: int) -> str:
        if math.isnan(values[0]):
            lead = f"every gradient of {names[0]} is zero (underflowed in fp16)"
        else:
            lead = f"{values[0]:.1%} of {names[0]}'s gradients underflow in fp16"
        return lead + (
            f" (and {len(names) - 1} more layers above {self.threshold:.0%})" if len(names) > 1 else ""
        )


class Heartbeat(RuleType):
    name = "heartbeat"
    severity = "critical"
    description = "A running run sent nothing for `timeout_s` seconds (checked by the server's clock)."
    params: ClassVar[dict[str, Param]] = {"timeout_s": Param(900.0, minimum=1.0, doc="seconds")}
    periodic = True
    cooldown_steps = 0

    def reads(self, data: StepData) -> bool:
        return data.rank == 0

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        return CLEAR  # data arrived: the run is alive


class RankDisagreement(RuleType):
    name = "rank_disagreement"
    severity = "critical"
    description = "Some ranks skipped a step that others applied (their found-inf checks disagree)."
    params: ClassVar[dict[str, Param]] = {"window": Param(200, minimum=1, integer=True, doc="steps remembered")}
    scalar_keys = frozenset({"amp/skipped"})
    all_ranks = True

    def initial_state(self) -> dict[str, Any]:
        return {"steps": {}}  # "step" -> {"rank": 0|1}

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        skipped = data.scalars.get("amp/skipped")
        if skipped is None:
            return None
        steps: dict[str, dict[str, int]] = state["steps"]
        entry = steps.setdefault(str(data.step), {})
        entry[str(data.rank)] = int(skipped >= 0.5)
        if len(steps) > self.window + self.window // 2:  # prune in bulk: amortised O(1) per point
            newest = max(int(s) for s in steps)
            for s in [s for s in steps if int(s) <= newest - self.window]:
                del steps[s]
        if len(entry) < 2:
            return None
        if len(set(entry.values())) == 1:
            return CLEAR
        skipped_ranks = sorted(int(r) for r, v in entry.items() if v)
        applied_ranks = sorted(int(r) for r, v in entry.items() if not v)
        return Finding(
            data.step,
            f"step {data.step} was skipped on rank(s) {skipped_ranks} but applied on rank(s) {applied_ranks}",
            {
                "key": "amp/skipped",
                "steps": [data.step],
                "skipped_ranks": skipped_ranks,
                "applied_ranks": applied_ranks,
                "layers": _skip_layers(data),
            },
        )


RULE_TYPES: dict[str, type[RuleType]] = {
    rule.name: rule
    for rule in (
        ScaleDrop,
        SkipStorm,
        ScaleFloor,
        NonFinite,
        GradNormSpike,
        NoScaleGrowth,
        UpdateRatioBand,
        UnderflowFraction,
        Heartbeat,
        RankDisagreement,
    )
}

# Installed for every new project (each can be edited or deleted through the API).
DEFAULT_RULES: tuple[str, ...] = ("scale_drop", "skip_storm", "non_finite", "scale_floor", "rank_disagreement", "heartbeat")


def make_rule(rule_type: str, params: dict[str, Any] | None = None) -> RuleType:
    """A rule type with validated parameters. ValueError names an unknown type or a value out of range,
    TypeError a value of the wrong type."""
    try:
        cls = RULE_TYPES[rule_type]
    except KeyError:
        raise ValueError(f"unknown rule type {rule_type!r}; known types: {', '.join(RULE_TYPES)}") from None
    if not isinstance(params, (dict, type(None))):
        raise TypeError(f"{rule_type}: params must be an object, got {type(params).__name__}")
    return cls(params)
