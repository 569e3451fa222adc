"""The GradScaler's life: calibration, the grow/back-off sawtooth, skips (ScalerPhase), and the rules
that read the loss scale: scaler_calibration, scale_drop, skip_storm, scale_floor, no_scale_growth."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from .base import (
    CLEAR,
    MAX_EVIDENCE_POINTS,
    MAX_STEPS,
    MAX_WINDOW,
    Finding,
    Param,
    RuleType,
    StepData,
    Verdict,
    _common_layers,
    _finite,
    _power_of_two,
    _skip_layers,
)

__all__ = [
    "CALIBRATION_CLEAN_STEPS",
    "NoScaleGrowth",
    "ScaleDrop",
    "ScaleFloor",
    "ScalerCalibration",
    "ScalerPhase",
    "SkipStorm",
]

CALIBRATION_CLEAN_STEPS = 10  # consecutive applied steps that end a calibration
SCALE_RESET_JUMP = 4.0  # the scale grew this much in one step: a restored or reset scaler state


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
            "calibrating": True,
            "start": None,
            "first_applied": None,
            "clean": 0,
            "skips": 0,
            "start_scale": None,
            "scale": None,
            "grown": False,
            "ended": None,
            "floor_skips": 0,
        }

    @staticmethod
    def observe(phase: dict[str, Any], data: StepData) -> str | None:
        scale = data.scalars.get("amp/scale")
        skipped = data.scalars.get("amp/skipped")
        previous = phase["scale"]
        restored = any(kind == "scaler_state_loaded" for kind, _ in data.events)
        jumped = (
            _finite(scale) and _finite(previous) and previous > 0 and scale >= SCALE_RESET_JUMP * previous
        )
        # The scaler lowers its scale only when it skips: a lower scale on an applied step was set from
        # outside.
        lowered = (
            skipped is not None
            and skipped < 0.5
            and _finite(scale)
            and _finite(previous)
            and scale < previous
        )
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
            phase["floor_skips"] = (
                phase["floor_skips"] + 1 if previous is not None and scale == previous else 0
            )
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
        "settle_steps": Param(
            25,
            minimum=CALIBRATION_CLEAN_STEPS,
            maximum=MAX_WINDOW,
            integer=True,
            doc="steps after the first applied one",
        ),
        "floor_skips": Param(
            5, minimum=2, maximum=MAX_WINDOW, integer=True, doc="skips in a row at an unchanged scale"
        ),
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
            reason = (
                f"{phase['floor_skips']} skips in a row at {_power_of_two(scale)}: the scaler is at a floor"
            )
        elif phase["first_applied"] is not None and data.step - phase["first_applied"] >= self.settle_steps:
            reason = (
                f"no {CALIBRATION_CLEAN_STEPS} clean steps in a row within {self.settle_steps} steps of the "
                "first applied one"
            )
        if not reason:
            return None
        start_scale = phase["start_scale"]
        return Finding(
            data.step,
            f"the loss scale is not usable: {phase['skips']} of {steps} steps skipped since step "
            f"{phase['start']}"
            + (
                f", scale {_power_of_two(start_scale)} -> {_power_of_two(scale)}"
                if _finite(start_scale) and _finite(scale)
                else ""
            )
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
        return {
            "maxima": [],
            "skips": [],
            "phase": ScalerPhase.initial(),
        }  # maxima: [step, scale], decreasing

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
            f"loss scale fell {ratio:.3g}x in {step - peak_step} steps ({_power_of_two(peak)} -> "
            f"{_power_of_two(scale)})",
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
        "ignore_first": Param(
            0,
            minimum=0,
            maximum=MAX_STEPS,
            integer=True,
            doc="steps not judged at the start (besides calibration)",
        ),
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
        state["skips"] = skips[-max(self.count, MAX_EVIDENCE_POINTS) :]
        if len(skips) < self.count:
            return CLEAR
        scales = [s[2] for s in skips if _finite(s[2])]
        return Finding(
            data.step,
            f"{len(skips)} skipped steps in the last {self.window} steps (steps {skips[0][0]}-{skips[-1][0]}"
            + (f", scale now {_power_of_two(scales[-1])}" if scales else "")
            + ")",
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
            {
                "key": "amp/scale",
                "steps": [data.step],
                "values": [scale],
                "floor": self.floor,
                "layers": _skip_layers(data),
            },
        )


class NoScaleGrowth(RuleType):
    name = "no_scale_growth"
    description = "The loss scale has not grown for `intervals` growth intervals (recurring overflows)."
    params: ClassVar[dict[str, Param]] = {
        "growth_interval": Param(
            2000, minimum=1, maximum=MAX_STEPS, integer=True, doc="the GradScaler's growth_interval"
        ),
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
            f"the loss scale has not grown for {steps} steps ({steps / self.growth_interval:.3g} growth "
            "intervals)",
            {
                "key": "amp/scale",
                "steps": [state["since"], data.step],
                "values": [scale],
                "since_step": state["since"],
            },
        )
