"""Alert rule types: pure, incremental evaluators over a run's steps.

Each rule type reads a few wire keys and keeps a small JSON-serialisable state. The engine feeds it one
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
    "ScalerPhase",
    "StepData",
    "make_rule",
]

MAX_EVIDENCE_POINTS = 50
# Bounds of the step-count parameters: what a rule keeps per run and does per point stays small whatever a
# project configures (a rule's state lives in the ingest transaction).
MAX_WINDOW = 10_000
MAX_STEPS = 1_000_000
MAX_EVIDENCE_LAYERS = 20


@dataclass
class StepData:
    """What one rank reported at one step: scalar values, per-layer vectors, events (kind, data)."""

    step: int
    rank: int
    scalars: dict[str, float] = field(default_factory=dict)
    vectors: dict[str, list[float]] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def signature(self) -> frozenset[str]:
        """The scalar and vector keys and event kinds this step holds."""
        return frozenset(self.scalars).union(self.vectors, (kind for kind, _ in self.events))


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
    # Findings of one family in one run group into one incident (see incidents.py): "precision" (the
    # loss scale, overflow, underflow), "divergence", "data", "stalled" (no learning), "liveness".
    family: ClassVar[str] = "precision"

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
        self.__dict__.update(self.values)  # parameters as plain attributes: read on every point
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
        return self.reads_signature(data.rank, data.signature())

    def reads_signature(self, rank: int, present: frozenset[str]) -> bool:
        """reads() from a step's rank and the keys and event kinds it holds (StepData.signature): the
        engine asks once per distinct signature of a batch, not once per step."""
        if not self.all_ranks and rank != 0:
            return False
        return not present.isdisjoint(self.scalar_keys | self.vector_keys | self.event_kinds)

    def initial_state(self) -> dict[str, Any]:
        return {}

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        raise NotImplementedError


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _names(value: Any) -> list[str]:
    """A list of names from event data (a free-form document: anything else reads as no names)."""
    return [str(name) for name in value] if isinstance(value, list) else []


def _skip_layers(data: StepData) -> list[str]:
    layers: list[str] = []
    for kind, event in data.events:
        if kind == "skip":
            layers.extend(_names(event.get("non_finite_layers")))
    return layers


def _common_layers(entries: list[list[Any]]) -> list[str]:
    """Layers named by skip events, most frequent first."""
    counts = Counter(name for _, names in entries for name in names)
    return [name for name, _ in counts.most_common(MAX_EVIDENCE_LAYERS)]


# -- the GradScaler's life: calibration, sawtooth, skips ------------------------------------------

CALIBRATION_CLEAN_STEPS = 10  # consecutive applied steps that end a calibration
SCALE_RESET_JUMP = 4.0  # the scale grew this much in one step: a restored or reset scaler state
MISUSE_EVENTS = ("clip_before_unscale", "bf16_model_in_fp16", "weights_exceed_fp16", "scale_below_one")


class ScalerPhase:
    """Where a run's GradScaler is, from amp/skipped, amp/scale and scaler_state_loaded events.

    Calibration starts at the run's first step, at a `scaler_state_loaded` event (a resume), when the
    scale jumps up by SCALE_RESET_JUMP or more in one step (growth is x2 at a time; a larger jump is a
    state restored or reset by hand) and when it is lower after an applied step (the scaler lowers it
    only when it skips). It ends at the first stretch of CALIBRATION_CLEAN_STEPS
    consecutive applied steps. After it, a skip right after a growth of the scale is the sawtooth's
    probe (the scaler tried twice the scale and backed off: healthy); any other skip counts.

    observe() classifies a step as "calibrating", "probe", "skip", "applied", or None (no scaler data).
    The state is a small JSON-ready dict, kept inside each rule's own state.
    """

    @staticmethod
    def initial() -> dict[str, Any]:
        return {
            "calibrating": True, "start": None, "first_applied": None, "clean": 0, "skips": 0,
            "start_scale": None, "scale": None, "grown": False, "ended": None, "floor_skips": 0,
        }

    @staticmethod
    def observe(phase: dict[str, Any], data: StepData) -> str | None:
        scale = data.scalars.get("amp/scale")
        skipped = data.scalars.get("amp/skipped")
        previous = phase["scale"]
        restored = any(kind == "scaler_state_loaded" for kind, _ in data.events)
        jumped = _finite(scale) and _finite(previous) and previous > 0 and scale >= SCALE_RESET_JUMP * previous
        # The scaler lowers its scale only when it skips: a lower scale on an applied step was set from outside.
        lowered = skipped is not None and skipped < 0.5 and _finite(scale) and _finite(previous) and scale < previous
        if phase["start"] is None or restored or jumped or lowered:
            before = next((e.get("scale_before") for k, e in data.events if k == "skip"), None)
            phase.update(ScalerPhase.initial())
            phase["start"] = data.step
            phase["start_scale"] = before if isinstance(before, (int, float)) else scale
            previous = None
        if _finite(scale):
            phase["scale"] = scale
        if skipped is None:
            return None
        if skipped >= 0.5:
            phase["floor_skips"] = phase["floor_skips"] + 1 if previous is not None and scale == previous else 0
        else:
            phase["floor_skips"] = 0
        if phase["calibrating"]:
            if skipped >= 0.5:
                phase["skips"] += 1
                phase["clean"] = 0
            else:
                if phase["first_applied"] is None:
                    phase["first_applied"] = data.step
                phase["clean"] += 1
                if phase["clean"] >= CALIBRATION_CLEAN_STEPS:
                    phase["calibrating"] = False
                    phase["ended"] = data.step
            return "calibrating"
        if skipped >= 0.5:
            kind = "probe" if phase["grown"] else "skip"
            phase["grown"] = False
            return kind
        if _finite(scale) and _finite(previous) and scale > previous:
            phase["grown"] = True
        return "applied"


def _times(ratio: float) -> str:
    """A ratio for a title: 3.2x, 47x, 3,234x."""
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


def _power_of_two(value: float) -> str:
    if value > 0 and math.isfinite(value):
        exponent = math.log2(value)
        if exponent == int(exponent):
            return f"2^{int(exponent)}"
    return f"{value:.3g}"


class ScalerCalibration(RuleType):
    name = "scaler_calibration"
    severity = "critical"
    description = (
        "The GradScaler's calibration does not end: the scale fell below `floor` while calibrating, "
        "no stretch of clean steps came within `settle_steps` of the first applied step, or the scaler "
        "keeps skipping at a scale it no longer lowers (a floor)."
    )
    params: ClassVar[dict[str, Param]] = {
        "floor": Param(1.0, minimum=0.0, exclusive_minimum=True, doc="a calibration below this scale failed"),
        "settle_steps": Param(25, minimum=CALIBRATION_CLEAN_STEPS, maximum=MAX_WINDOW, integer=True, doc="steps after the first applied one"),
        "floor_skips": Param(5, minimum=2, maximum=MAX_WINDOW, integer=True, doc="skips in a row at an unchanged scale"),
    }
    scalar_keys = frozenset({"amp/scale", "amp/skipped"})
    event_kinds = frozenset({"scaler_state_loaded", "skip"})
    cooldown_steps = 0

    def initial_state(self) -> dict[str, Any]:
        return {"phase": ScalerPhase.initial(), "layers": []}

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        phase = state["phase"]
        was_calibrating = phase["calibrating"]
        kind = ScalerPhase.observe(phase, data)
        skip_layers = _skip_layers(data)
        if skip_layers:
            state["layers"] = _common_layers([[0, state["layers"]], [0, skip_layers]])
        if kind is None:
            return None
        scale = phase["scale"]
        below = _finite(scale) and scale < self.floor
        if not phase["calibrating"] and not below:
            return CLEAR if was_calibrating or kind == "applied" else None
        steps = data.step - phase["start"] + 1
        reason = ""
        if below and not phase["calibrating"]:
            reason = f"calibration ended with the scale at {_power_of_two(scale)}, below {self.floor:g}"
        elif below and not phase["skips"]:
            reason = f"the scale is {_power_of_two(scale)}, below {self.floor:g}, without any overflow"
        elif below:
            reason = f"the scale fell to {_power_of_two(scale)}, below {self.floor:g}, while calibrating"
        elif phase["floor_skips"] >= self.floor_skips:
            reason = f"{phase['floor_skips']} skips in a row at {_power_of_two(scale)}: the scaler is at a floor"
        elif phase["first_applied"] is not None and data.step - phase["first_applied"] >= self.settle_steps:
            reason = (
                f"no {CALIBRATION_CLEAN_STEPS} clean steps in a row within {self.settle_steps} steps of the first "
                "applied one"
            )
        if not reason:
            return None
        start_scale = phase["start_scale"]
        return Finding(
            data.step,
            f"the loss scale is not usable: {phase['skips']} of {steps} steps skipped since step {phase['start']}"
            + (f", scale {_power_of_two(start_scale)} -> {_power_of_two(scale)}" if _finite(start_scale) and _finite(scale) else "")
            + f" ({reason})",
            {
                "key": "amp/scale",
                "steps": [phase["start"], data.step],
                "values": [start_scale, scale],
                "skipped": phase["skips"],
                "calibrating": phase["calibrating"],
                "calibration_steps": steps,
                "reason": reason,
                "layers": state["layers"],
            },
        )


class ScaleDrop(RuleType):
    name = "scale_drop"
    severity = "critical"
    description = (
        "After the scaler's calibration, the loss scale fell by at least `factor`x within `window` steps "
        "(the sawtooth's single back-offs after a growth are not counted as drops)."
    )
    params: ClassVar[dict[str, Param]] = {
        "factor": Param(8.0, minimum=1.0, exclusive_minimum=True, doc="drop ratio (max in window / now)"),
        "window": Param(100, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps"),
    }
    scalar_keys = frozenset({"amp/scale", "amp/skipped"})
    event_kinds = frozenset({"skip", "scaler_state_loaded"})

    def initial_state(self) -> dict[str, Any]:
        return {"maxima": [], "skips": [], "phase": ScalerPhase.initial()}  # maxima: [step, scale], decreasing

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        phase = state.setdefault("phase", ScalerPhase.initial())
        kind = ScalerPhase.observe(phase, data)
        step = data.step
        oldest = step - self.window
        skips = [s for s in state["skips"] if s[0] > oldest]
        if kind == "skip":
            skips.append([step, _skip_layers(data)])
        state["skips"] = skips[-MAX_EVIDENCE_POINTS:]
        scale = data.scalars.get("amp/scale")
        if not _finite(scale) or phase["calibrating"]:
            state["maxima"] = []
            return None
        maxima = [m for m in state["maxima"] if m[0] > oldest]
        if kind == "probe":  # the scale returns to where it was before the growth: that peak was a trial
            maxima = [m for m in maxima if m[1] <= scale]
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
            f"loss scale fell {ratio:.3g}x in {step - peak_step} steps ({_power_of_two(peak)} -> {_power_of_two(scale)})",
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
    description = (
        "After the scaler's calibration, at least `count` skipped optimizer steps within `window` steps "
        "(a single back-off right after the scale grew is the healthy sawtooth and does not count)."
    )
    params: ClassVar[dict[str, Param]] = {
        "count": Param(4, minimum=1, maximum=MAX_WINDOW, integer=True, doc="skips"),
        "window": Param(50, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps"),
        "ignore_first": Param(0, minimum=0, maximum=MAX_STEPS, integer=True, doc="steps not judged at the start (besides calibration)"),
    }
    scalar_keys = frozenset({"amp/skipped", "amp/scale"})
    event_kinds = frozenset({"skip", "scaler_state_loaded"})

    def validate(self) -> None:
        if self.count > self.window:
            raise ValueError(f"skip_storm: count ({self.count}) cannot exceed window ({self.window})")

    def initial_state(self) -> dict[str, Any]:
        return {"skips": [], "phase": ScalerPhase.initial(), "first": None}  # skips: [step, layers, scale]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        phase = state.setdefault("phase", ScalerPhase.initial())
        kind = ScalerPhase.observe(phase, data)
        if kind is None:
            return None
        if state.get("first") is None:
            state["first"] = data.step
        if data.step < state["first"] + self.ignore_first or kind == "calibrating":
            return None
        skips = [s for s in state["skips"] if s[0] > data.step - self.window]
        if kind == "skip":
            skips.append([data.step, _skip_layers(data), data.scalars.get("amp/scale")])
        state["skips"] = skips[-max(self.count, MAX_EVIDENCE_POINTS):]
        if len(skips) < self.count:
            return CLEAR
        scales = [s[2] for s in skips if _finite(s[2])]
        return Finding(
            data.step,
            f"{len(skips)} skipped steps in the last {self.window} steps (steps {skips[0][0]}-{skips[-1][0]}"
            + (f", scale now {_power_of_two(scales[-1])}" if scales else "") + ")",
            {
                "key": "amp/skipped",
                "steps": [s[0] for s in skips][-MAX_EVIDENCE_POINTS:],
                "values": [1.0] * min(len(skips), MAX_EVIDENCE_POINTS),
                "count": len(skips),
                "scales": scales[-MAX_EVIDENCE_POINTS:],
                "layers": _common_layers([[s[0], s[1]] for s in skips]),
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
            f"loss scale {_power_of_two(scale)} is below the floor {self.floor:g}{below_one}",
            {"key": "amp/scale", "steps": [data.step], "values": [scale], "floor": self.floor,
             "layers": _skip_layers(data)},
        )


def _loss_of(data: StepData) -> tuple[str, float] | None:
    """The step's loss: what the user logged as "loss", else what the agent took from scaler.scale()."""
    for key in LOSS_KEYS:
        if key in data.scalars:
            return key, data.scalars[key]
    return None


LOSS_KEYS = ("loss", "amp/loss")


class NonFinite(RuleType):
    name = "non_finite"
    severity = "critical"
    description = (
        "A non-finite gradient norm reached the weights (a step applied without a GradScaler to skip it), "
        "or, after the scaler's calibration and with a finite loss, `consecutive` steps in a row overflowed."
    )
    params: ClassVar[dict[str, Param]] = {"consecutive": Param(3, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps in a row")}
    scalar_keys = frozenset({"grad/global_norm", "amp/skipped", "amp/scale", *LOSS_KEYS})
    event_kinds = frozenset({"skip", "scaler_state_loaded"})

    def initial_state(self) -> dict[str, Any]:
        return {"run": [], "phase": ScalerPhase.initial(), "scaler": False}  # run: [step, value, layers]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        phase = state.setdefault("phase", ScalerPhase.initial())
        kind = ScalerPhase.observe(phase, data)
        if "amp/skipped" in data.scalars:
            state["scaler"] = True
        norm = data.scalars.get("grad/global_norm")
        if norm is None:
            return None
        if math.isfinite(norm):
            state["run"] = []
            return CLEAR
        loss = _loss_of(data)
        loss_finite = loss is None or math.isfinite(loss[1])
        skipped = data.scalars.get("amp/skipped")
        applied = (skipped is not None and skipped < 0.5) or (skipped is None and not state["scaler"])
        streak = (state["run"] + [[data.step, norm, _skip_layers(data)]])[-MAX_EVIDENCE_POINTS:]
        state["run"] = streak
        if not applied and (kind == "calibrating" or not loss_finite or len(streak) < self.consecutive):
            return None  # the scaler's business (calibration), or the loss's (loss_non_finite)
        layer_names = _common_layers([[s, names] for s, _, names in streak])
        if applied:
            title = f"gradient norm is {norm} at step {data.step}, and the optimizer step was applied"
        else:
            title = f"gradient norm is {norm}: {len(streak)} steps in a row overflowed after calibration"
        return Finding(
            data.step,
            title + (f" (first non-finite layer: {layer_names[0]})" if layer_names else ""),
            {
                "keys": ["grad/global_norm"],
                "steps": [s for s, _, _ in streak],
                "values": [v for _, v, _ in streak],
                "applied": applied,
                "layers": layer_names,
            },
            cause="non_finite_applied" if applied else "",
        )


class LossNonFinite(RuleType):
    name = "loss_non_finite"
    severity = "critical"
    family = "data"
    description = (
        "The loss itself is NaN/Inf (even once): the forward pass or the data, not an overflow the scaler "
        "can cure. Names the step and, when the run logs batch ids (run.log_batch), the batch. Resolves "
        "after `clear_after` finite losses."
    )
    params: ClassVar[dict[str, Param]] = {"clear_after": Param(100, minimum=1, maximum=MAX_STEPS, integer=True, doc="finite steps")}
    scalar_keys = frozenset(LOSS_KEYS)
    event_kinds = frozenset({"bad_batch"})
    cooldown_steps = 0

    def initial_state(self) -> dict[str, Any]:
        return {"bad": [], "finite": 0}  # bad: [step, key, value, ids]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        loss = _loss_of(data)
        if loss is None:
            return None
        key, value = loss
        if math.isfinite(value):
            state["finite"] += 1
            if state["bad"] and state["finite"] >= self.clear_after:
                state["bad"] = []  # the next non-finite loss starts a new story
                return CLEAR
            return None
        state["finite"] = 0
        ids: list[Any] | None = None
        for kind, event in data.events:
            if kind == "bad_batch" and event.get("ids_logged"):
                given = event.get("ids")
                ids = list(given)[:MAX_EVIDENCE_LAYERS] if isinstance(given, list) else []
        spelled = "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"  # as the wire spells them
        bad = (state["bad"] + [[data.step, key, spelled, ids]])[-MAX_EVIDENCE_POINTS:]
        if len(state["bad"]) >= MAX_EVIDENCE_POINTS:
            bad = [state["bad"][0]] + bad[-MAX_EVIDENCE_POINTS + 1:]  # keep the first one: where it started
        state["bad"] = bad
        first = bad[0]
        batch = f" (batch {', '.join(map(str, first[3]))})" if first[3] else ""
        title = f"the loss is {first[2]} at step {first[0]}{batch}"
        if len(bad) > 1:
            title += f"; {len(bad)} non-finite losses so far, last at step {data.step}"
        return Finding(
            data.step,
            title,
            {
                "key": key,
                "steps": [b[0] for b in bad],
                "values": [b[2] for b in bad],
                "first_step": first[0],
                "batch_ids": first[3],
                "batches": {str(b[0]): b[3] for b in bad if b[3]},
            },
        )


class Misuse(RuleType):
    name = "misuse"
    severity = "critical"
    description = (
        "A setup mistake the agent detected: clip_grad_norm_ before scaler.unscale_, a bf16 model trained in "
        "fp16, weights beyond fp16's range, a loss scale below one. Once per run and kind, with the fix."
    )
    event_kinds = frozenset(MISUSE_EVENTS)
    cooldown_steps = 0

    def initial_state(self) -> dict[str, Any]:
        return {"seen": []}  # [step, kind, hint]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        new = False
        for kind, event in data.events:
            if kind in MISUSE_EVENTS and kind not in {k for _, k, _ in state["seen"]}:
                hint = event.get("hint")
                state["seen"].append([data.step, kind, hint if isinstance(hint, str) else ""])
                new = True
        if not new:
            return None
        seen = state["seen"]
        names = ", ".join(kind.replace("_", " ") for _, kind, _ in seen)
        return Finding(
            data.step,
            f"setup mistake: {names} (first at step {seen[0][0]})",
            {"kinds": [kind for _, kind, _ in seen], "steps": [s for s, _, _ in seen],
             "hints": [hint for _, _, hint in seen]},
            cause=seen[0][1],
        )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


RECENT = 5  # the sustained rules look at this many latest observations
BASELINE_REFRESH = 10  # steps between recomputations of a baseline's median and spread (sorting is O(window))


def _append_bounded(items: list[Any], item: Any, most: int) -> None:
    """Append, then keep the last `most` items, in place: no copy of the window per point."""
    items.append(item)
    if len(items) > most:
        del items[: len(items) - most]


def _baseline_stats(state: dict[str, Any], step: int, baseline: list[list[float]]) -> tuple[float, float]:
    """(median, MAD-based spread) of the baseline's values but its latest RECENT ones, cached in
    state["stats"] for BASELINE_REFRESH steps: the baseline moves slowly, and ingest must stay cheap
    per point however large the window."""
    cached = state.get("stats")
    if cached is None or step - cached[0] >= BASELINE_REFRESH or step < cached[0]:
        values = [v for _, v in baseline[:-RECENT] or baseline]
        median = _median(values)
        cached = state["stats"] = [step, median, 1.4826 * _median([abs(v - median) for v in values])]
    return cached[1], cached[2]


class GradNormSpike(RuleType):
    name = "grad_norm_spike"
    family = "divergence"
    description = (
        "The global gradient norm jumped and stays up: on at least `sustain` of the last 5 applied steps the "
        "robust z-score of log10(norm) against the median/MAD of the `window` steps before was at least `z` "
        "and the norm at least `min_ratio`x that median (a single odd batch is not a divergence)."
    )
    params: ClassVar[dict[str, Param]] = {
        "window": Param(100, minimum=5, maximum=MAX_WINDOW, integer=True, doc="baseline steps"),
        "warmup": Param(20, minimum=5, maximum=MAX_WINDOW, integer=True, doc="baseline steps needed before judging"),
        "z": Param(6.0, minimum=0.0, exclusive_minimum=True),
        "min_ratio": Param(10.0, minimum=1.0),
        "sustain": Param(3, minimum=1, maximum=RECENT, integer=True, doc=f"of the last {RECENT} steps"),
    }
    scalar_keys = frozenset({"grad/global_norm"})
    MIN_SPREAD = 0.01  # log10 units (~2%): a perfectly flat baseline must not make every wiggle a spike

    def validate(self) -> None:
        if self.warmup > self.window:
            raise ValueError(f"grad_norm_spike: warmup ({self.warmup}) cannot exceed window ({self.window})")

    def initial_state(self) -> dict[str, Any]:
        return {"baseline": [], "recent": []}  # baseline: [step, log10 norm]; recent: [step, hit, norm]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        norm = data.scalars.get("grad/global_norm")
        if not _finite(norm) or norm <= 0 or data.scalars.get("amp/skipped", 0.0) >= 0.5:
            return None
        x = math.log10(norm)
        baseline = state["baseline"]
        recent = state.setdefault("recent", [])
        verdict: Verdict = None
        if len(baseline) >= self.warmup:
            # The baseline excludes the latest RECENT steps, so a sustained rise does not hide itself.
            median, spread = _baseline_stats(state, data.step, baseline)
            spread = max(spread, self.MIN_SPREAD)
            z = (x - median) / spread
            ratio = 10 ** (x - median)
            hit = z >= self.z and ratio >= self.min_ratio
            recent = (recent + [[data.step, hit, norm]])[-RECENT:]
            hits = [r for r in recent if r[1]]
            if hit and len(hits) >= self.sustain:
                verdict = Finding(
                    data.step,
                    f"gradient norm {norm:.3g} is {_times(ratio)} its running median {10 ** median:.3g} "
                    f"(z={z:.1f}; {len(hits)} of the last {len(recent)} steps)",
                    {
                        "key": "grad/global_norm",
                        "steps": [r[0] for r in hits],
                        "values": [r[2] for r in hits],
                        "onset_step": hits[0][0],
                        "baseline_median": 10**median,
                        "baseline_steps": [baseline[0][0], baseline[-1][0]],
                        "ratio": ratio,
                        "z": z,
                    },
                )
            elif not hits:
                verdict = CLEAR
        state["recent"] = recent
        _append_bounded(baseline, [data.step, x], self.window)
        return verdict


class LossSpike(RuleType):
    name = "loss_spike"
    family = "divergence"
    description = (
        "The loss rose and stays up: on at least `sustain` of the last 5 steps it was at least `min_ratio`x the "
        "median of the `window` steps before and `z` robust deviations above it. Warm-up (a falling loss) is "
        "never a spike; within `restart_grace` steps of the lr rising back to a level the run used before (a "
        "scheduled restart) only a loss above the run's starting loss counts."
    )
    params: ClassVar[dict[str, Param]] = {
        "window": Param(100, minimum=10, maximum=MAX_WINDOW, integer=True, doc="baseline steps"),
        "warmup": Param(20, minimum=5, maximum=MAX_WINDOW, integer=True, doc="baseline steps needed before judging"),
        "z": Param(8.0, minimum=0.0, exclusive_minimum=True),
        "min_ratio": Param(2.0, minimum=1.0, doc="loss / baseline median (for a positive loss)"),
        "sustain": Param(3, minimum=1, maximum=RECENT, integer=True, doc=f"of the last {RECENT} steps"),
        "restart_grace": Param(200, minimum=0, maximum=MAX_STEPS, integer=True, doc="steps after a scheduled lr restart"),
    }
    scalar_keys = frozenset({*LOSS_KEYS, "lr"})

    def validate(self) -> None:
        if self.warmup > self.window:
            raise ValueError(f"loss_spike: warmup ({self.warmup}) cannot exceed window ({self.window})")

    def initial_state(self) -> dict[str, Any]:
        return {"baseline": [], "recent": [], "start_loss": None, "lr": None, "lr_max": None, "grace_until": -1}

    def _track_lr(self, state: dict[str, Any], data: StepData) -> None:
        lr = data.scalars.get("lr")
        if not _finite(lr):
            return
        previous, peak = state["lr"], state["lr_max"]
        if _finite(previous) and previous > 0 and lr > 2 * previous and _finite(peak) and lr <= 1.5 * peak:
            state["grace_until"] = data.step + self.restart_grace  # back to a level used before: a restart
        state["lr"] = lr
        state["lr_max"] = lr if peak is None else max(peak, lr)

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        self._track_lr(state, data)
        loss = _loss_of(data)
        if loss is None or not math.isfinite(loss[1]):
            return None  # non-finite losses are loss_non_finite's
        key, value = loss
        baseline = state["baseline"]
        if len(baseline) < self.warmup:
            state["start_loss"] = value if state["start_loss"] is None else max(state["start_loss"], value)
        verdict: Verdict = None
        if len(baseline) >= self.warmup:
            median, spread = _baseline_stats(state, data.step, baseline)
            spread = max(spread, 0.01 * abs(median), 1e-8)
            z = (value - median) / spread
            ratio_ok = value >= self.min_ratio * median if median > 0 else z >= 2 * self.z
            hit = z >= self.z and ratio_ok
            if hit and data.step <= state["grace_until"]:
                hit = state["start_loss"] is not None and value > state["start_loss"]
            recent = (state["recent"] + [[data.step, hit, value]])[-RECENT:]
            state["recent"] = recent
            hits = [r for r in recent if r[1]]
            if hit and len(hits) >= self.sustain:
                ratio = value / median if median > 0 else None
                size = f"{_times(ratio)} its running median" if ratio is not None else f"{z:.3g} deviations above its median"
                verdict = Finding(
                    data.step,
                    f"{key} {value:.4g} is {size} {median:.4g} ({len(hits)} of the last {len(recent)} steps)",
                    {
                        "key": key,
                        "steps": [r[0] for r in hits],
                        "values": [r[2] for r in hits],
                        "onset_step": hits[0][0],
                        "baseline_median": median,
                        "baseline_steps": [baseline[0][0], baseline[-1][0]],
                        "ratio": ratio,
                        "z": z,
                    },
                )
            elif not hits:
                verdict = CLEAR
        _append_bounded(baseline, [data.step, value], self.window)
        return verdict


class LrJump(RuleType):
    name = "lr_jump"
    family = "divergence"
    description = (
        "The learning rate jumped at least `factor`x in one step to at least twice the highest value the run "
        "had used (a scheduler or config bug; warm-up and restarts to an earlier level do not count). Judged "
        "after `warmup` steps of lr history; resolves when the lr is back within twice the earlier peak."
    )
    params: ClassVar[dict[str, Param]] = {
        "factor": Param(30.0, minimum=1.0, exclusive_minimum=True, doc="lr(step) / lr(step - 1)"),
        "warmup": Param(10, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps of lr history needed"),
    }
    scalar_keys = frozenset({"lr"})
    cooldown_steps = 0

    def initial_state(self) -> dict[str, Any]:
        return {"count": 0, "lr": None, "peak": None, "jump": None}  # jump: [step, from, to, peak before]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        lr = data.scalars.get("lr")
        if not _finite(lr):
            return None
        previous, peak = state["lr"], state["peak"]
        state["lr"] = lr
        state["count"] += 1
        state["peak"] = lr if peak is None else max(peak, lr)
        jump = state["jump"]
        if jump is not None:
            if lr <= 2 * jump[3]:
                state["jump"] = None
                return CLEAR
            return None
        if state["count"] <= self.warmup or not (_finite(previous) and previous > 0 and peak):
            return None
        if lr < self.factor * previous or lr < 2 * peak:
            return None
        state["jump"] = [data.step, previous, lr, peak]
        return Finding(
            data.step,
            f"the learning rate jumped {_times(lr / previous)} at step {data.step} ({previous:.3g} -> {lr:.3g}; "
            f"the run's highest before was {peak:.3g})",
            {"key": "lr", "steps": [data.step - 1, data.step], "values": [previous, lr], "ratio": lr / previous,
             "previous_peak": peak},
        )


class ClipSaturation(RuleType):
    name = "clip_saturation"
    family = "stalled"
    description = (
        "clip_grad_norm_ cuts the gradient on nearly every step. With gradient accumulation (several backward "
        "passes per optimizer step): of the last `window` applied steps at least `fraction` clipped, with a "
        "median norm/max_norm of at least `min_ratio_accumulating` (an undivided loss). Without it, over "
        "`plain_window` steps and a median of at least `min_ratio` (early training often clips for a while)."
    )
    params: ClassVar[dict[str, Param]] = {
        "window": Param(20, minimum=5, maximum=MAX_WINDOW, integer=True, doc="applied steps, accumulating"),
        "plain_window": Param(200, minimum=5, maximum=MAX_WINDOW, integer=True, doc="applied steps, otherwise"),
        "fraction": Param(0.9, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        "min_ratio": Param(3.0, minimum=1.0),
        "min_ratio_accumulating": Param(1.25, minimum=1.0),
    }
    scalar_keys = frozenset({"grad/global_norm", "grad/clip_max_norm", "amp/micro_batches"})

    def initial_state(self) -> dict[str, Any]:
        return {"recent": [], "micro_batches": 1}  # recent: [step, norm / max_norm]

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        micro = data.scalars.get("amp/micro_batches")
        if _finite(micro):
            state["micro_batches"] = micro
        norm, max_norm = data.scalars.get("grad/global_norm"), data.scalars.get("grad/clip_max_norm")
        if not (_finite(norm) and _finite(max_norm) and max_norm > 0) or data.scalars.get("amp/skipped", 0) >= 0.5:
            return None
        accumulating = state["micro_batches"] > 1
        window = self.window if accumulating else self.plain_window
        recent = state["recent"]
        recent.append([data.step, norm / max_norm])
        if len(recent) > max(self.window, self.plain_window):
            del recent[0]
        if len(recent) < window:
            return None
        recent = recent[-window:]
        share = sum(1 for r in recent if r[1] > 1.0) / len(recent)
        median = _median([r[1] for r in recent])
        threshold = self.min_ratio_accumulating if accumulating else self.min_ratio
        if share < self.fraction or median < threshold:
            return CLEAR if share < self.fraction / 2 else None
        return Finding(
            data.step,
            f"clipping cut the gradient on {share:.0%} of the last {len(recent)} steps: the pre-clip norm is "
            f"{median:.3g}x max_norm={max_norm:g} (median)"
            + (f", with {state['micro_batches']:g} micro-batches per step" if accumulating else ""),
            {
                "key": "grad/global_norm",
                "steps": [recent[0][0], data.step],
                "fraction_clipped": share,
                "median_ratio": median,
                "max_norm": max_norm,
                "micro_batches": state["micro_batches"],
            },
            cause="clip_saturation_accumulation" if accumulating else "",
        )


class NoScaleGrowth(RuleType):
    name = "no_scale_growth"
    description = "The loss scale has not grown for `intervals` growth intervals (recurring overflows)."
    params: ClassVar[dict[str, Param]] = {
        "growth_interval": Param(2000, minimum=1, maximum=MAX_STEPS, integer=True, doc="the GradScaler's growth_interval"),
        "intervals": Param(5, minimum=1, maximum=MAX_STEPS, integer=True),
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


class UpdateRatioBand(RuleType):
    name = "update_ratio"
    family = "divergence"
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

    def reads_signature(self, rank: int, present: frozenset[str]) -> bool:
        return rank == 0 and self.key in present

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        row = data.vectors.get(self.key)
        if row is None:
            return None
        bad = [(i, v) for i, v in enumerate(row) if not math.isfinite(v) or v > self.high or 0 < v < self.low]
        if not bad:
            return CLEAR
        bad.sort(key=lambda item: -abs(item[1]) if math.isfinite(item[1]) else -math.inf)  # non-finite first
        bad = bad[:MAX_EVIDENCE_LAYERS]
        names = [_layer(layers, i) for i, _ in bad]
        values = [v for _, v in bad]
        high = any(not math.isfinite(v) or v > self.high for v in values)
        return Finding(
            data.step,
            f"update ratio of {names[0]} is {values[0]:.3g}, outside [{self.low:g}, {self.high:g}]"
            + (f" (and {len(names) - 1} more layers)" if len(names) > 1 else ""),
            {"key": self.key, "steps": [data.step], "values": values, "layers": names},
            cause="update_ratio_high" if high else "update_ratio_low",
        )


def _layer(layers: list[str], index: int) -> str:
    return layers[index] if index < len(layers) else f"layer{index}"


class _PersistentLayers(RuleType):
    """Per-layer conditions that must hold on `observations` consecutive observations of a layer
    (one odd step is not a stalled layer), on steps after the run's first applied optimizer step (before
    it, a zero-initialised LoRA B makes A's gradient exactly zero, healthily)."""

    family = "stalled"

    def initial_state(self) -> dict[str, Any]:
        return {"streaks": {}, "applied": 0, "scaler": False}  # streaks: layer index -> observations in a row

    @staticmethod
    def skipped(data: StepData) -> bool:
        """A skipped step's gradients overflowed: what they show about a layer means nothing."""
        return data.scalars.get("amp/skipped", 0.0) >= 0.5

    def count_applied(self, state: dict[str, Any], data: StepData) -> int:
        """Applied optimizer steps before this one (every step, without a GradScaler)."""
        before = state["applied"]
        skipped = data.scalars.get("amp/skipped")
        if skipped is not None:
            state["scaler"] = True
        if skipped is None and not state["scaler"]:
            state.setdefault("first", data.step)
            before = data.step - state["first"]
        elif skipped is not None and skipped < 0.5:
            state["applied"] = before + 1
        return before

    def streaks(self, state: dict[str, Any], bad: set[int], width: int) -> list[int]:
        """Layers whose condition held on enough consecutive observations, worst (longest) first."""
        streaks: dict[str, int] = state["streaks"]
        updated = {str(i): streaks.get(str(i), 0) + 1 for i in bad if i < width}
        state["streaks"] = updated
        held = [int(i) for i, n in updated.items() if n >= self.observations]
        return sorted(held, key=lambda i: (-updated[str(i)], i))


class UnderflowFraction(_PersistentLayers):
    name = "underflow"
    family = "precision"
    description = (
        "A layer's gradients underflow in fp16: most of its elements are exactly zero while the survivors sit "
        "in fp16's subnormal range (zero fraction >= `zero_fraction` and precision-loss fraction >= "
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

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
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
            elif math.isfinite(z) and z >= self.zero_fraction and math.isfinite(p) and p >= self.precision_loss:
                bad[i] = z
            elif self.all_zero and math.isnan(u) and (math.isnan(z) or z >= 1.0):
                bad[i] = 1.0
        held = self.streaks(state, set(bad), width)
        if not held:
            return CLEAR if not bad else None
        held = held[:MAX_EVIDENCE_LAYERS]
        names = [_layer(layers, i) for i in held]
        return Finding(
            data.step,
            f"{bad[held[0]]:.0%} of {names[0]}'s gradients underflow to zero in fp16"
            + (f" (and {len(names) - 1} more layers)" if len(names) > 1 else ""),
            {"key": "grad/zero_frac" if zeros is not None else self.key, "steps": [data.step],
             "values": [bad[i] for i in held], "layers": names},
        )


class DeadLayers(_PersistentLayers):
    name = "dead_layers"
    description = (
        "Trainable layers get no gradient (grad None or exactly zero: a stray .detach(), torch.no_grad(), an "
        "unused module) on `observations` gradient-norm samples in a row after the first applied step."
    )
    params: ClassVar[dict[str, Param]] = {"observations": Param(2, minimum=1, maximum=MAX_WINDOW, integer=True)}
    scalar_keys = frozenset({"amp/skipped"})
    vector_keys = frozenset({"grad/norm"})
    event_kinds = frozenset({"no_gradient"})

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
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
            {"key": "grad/norm", "steps": [data.step], "layers": names[:MAX_EVIDENCE_LAYERS], "count": len(names),
             "grad_none": without[:MAX_EVIDENCE_LAYERS]},
            cause="dead_layers_none" if without else "dead_layers_zero",
        )


class NotLearning(_PersistentLayers):
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
    vector_keys = frozenset({"update/ratio", "update/rounded_away_frac"})

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
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
        held = held[:MAX_EVIDENCE_LAYERS]
        names = [_layer(layers, i) for i in held]
        ratio_values = [ratios[i] if ratios is not None and i < len(ratios) else None for i in held]
        return Finding(
            data.step,
            f"weights of {len(held)} of {width} layers stopped changing: {bad[held[0]]:.0%} of {names[0]}'s "
            "updates were rounded away (or the learning rate is 0)",
            {"key": "update/rounded_away_frac" if rounded is not None else "update/ratio", "steps": [data.step],
             "values": [bad[i] for i in held], "update_ratios": ratio_values, "layers": names},
        )


class Heartbeat(RuleType):
    name = "heartbeat"
    severity = "critical"
    description = "A running run sent nothing for `timeout_s` seconds (checked by the server's clock)."
    params: ClassVar[dict[str, Param]] = {"timeout_s": Param(900.0, minimum=1.0, doc="seconds")}
    periodic = True
    cooldown_steps = 0
    family = "liveness"

    def reads_signature(self, rank: int, present: frozenset[str]) -> bool:
        return rank == 0

    def observe(self, state: dict[str, Any], data: StepData, layers: list[str]) -> Verdict:
        return CLEAR  # data arrived: the run is alive


class RankDisagreement(RuleType):
    name = "rank_disagreement"
    severity = "critical"
    description = "Some ranks skipped a step that others applied (their found-inf checks disagree)."
    params: ClassVar[dict[str, Param]] = {"window": Param(200, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps remembered")}
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
        ClipSaturation,
        NoScaleGrowth,
        UpdateRatioBand,
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
    "clip_saturation",
    "underflow",
    "dead_layers",
    "not_learning",
    "rank_disagreement",
    "heartbeat",
)


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
