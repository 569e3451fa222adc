"""The GradScaler's life: calibration, the grow/back-off sawtooth, skips (ScalerPhase), and the rules
that read the loss scale: scaler_calibration, scale_drop, skip_storm, scale_floor, no_scale_growth."""

from __future__ import annotations

import math
from typing import ClassVar

from ...._text import scale_change
from ..evidence import (
    NoScaleGrowthEvidence,
    ScaleDropEvidence,
    ScaleFloorEvidence,
    ScalerCalibrationEvidence,
    SkipStormEvidence,
)
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
    _overflowed,
    _power_of_two,
    _recent_overflows,
    _skip_layers,
)
from .states import (
    NoScaleGrowthState,
    ScaleDropState,
    ScaleFloorState,
    ScalerCalibrationState,
    ScalerPhaseState,
    SkipStormState,
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
    def initial() -> ScalerPhaseState:
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
            "observed": 0,  # steps with amp/skipped since `start`, calibrating or not
            "skipped": 0,  # of which skipped (probes included): what the stored series counts
        }

    @staticmethod
    def observe(phase: ScalerPhaseState, data: StepData) -> str | None:
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
        # .get: a state stored before these counters existed counts from here on
        phase["observed"] = phase.get("observed", 0) + 1
        if skipped >= 0.5:
            phase["skipped"] = phase.get("skipped", 0) + 1
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


class ScalerCalibration(RuleType[ScalerCalibrationState]):
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

    def initial_state(self) -> ScalerCalibrationState:
        return {"phase": ScalerPhase.initial(), "layers": [], "recent": ""}

    def observe(self, state: ScalerCalibrationState, data: StepData, layers: list[str]) -> Verdict:
        phase = state["phase"]
        was_calibrating = phase["calibrating"]
        kind = ScalerPhase.observe(phase, data)
        _recent_overflows(state, data)
        skip_layers = _skip_layers(data)
        if skip_layers:
            state["layers"] = _common_layers([[0, state["layers"]], [0, skip_layers]])
        if kind is None:
            return None
        scale = phase["scale"]
        below = _finite(scale) and scale < self.floor
        if not phase["calibrating"] and not below:
            return CLEAR if was_calibrating or kind == "applied" else None
        skipped, steps = phase.get("skipped", phase["skips"]), phase.get("observed", 0)
        reason = ""
        if below and not skipped:
            reason = f"the scale is {_power_of_two(scale)}, below {self.floor:g}, without any overflow"
        elif below and not phase["calibrating"]:
            reason = (
                f"the scale fell to {_power_of_two(scale)}, below {self.floor:g}, after calibration ended at "
                f"step {phase['ended']}: {_overflowed(state)}"
            )
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
            f"the loss scale is not usable: {skipped} of {steps} steps skipped since step {phase['start']}"
            + (
                f", scale {_power_of_two(start_scale)} -> {_power_of_two(scale)}"
                if _finite(start_scale) and _finite(scale)
                else ""
            )
            + f" ({reason})",
            ScalerCalibrationEvidence(
                key="amp/scale",
                steps=[data.step if phase["start"] is None else phase["start"], data.step],
                values=[start_scale, scale],
                skipped=skipped,  # every skipped step since `start` (amp/skipped's count)
                calibrating=phase["calibrating"],
                calibration_steps=steps,  # steps with amp/skipped since `start`
                reason=reason,
                layers=state["layers"],
            ),
        )


class ScaleDrop(RuleType[ScaleDropState]):
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

    def initial_state(self) -> ScaleDropState:
        # maxima: [step, scale], decreasing, the sawtooth's trial peaks left out (what is judged);
        # peaks: the same with them (what is reported: the true peak in the window, at its last step);
        # low: [step, scale] where the scale took its current value.
        return {"maxima": [], "peaks": [], "low": None, "skips": [], "phase": ScalerPhase.initial()}

    def observe(self, state: ScaleDropState, data: StepData, layers: list[str]) -> Verdict:
        phase = state.setdefault("phase", ScalerPhase.initial())
        kind = ScalerPhase.observe(phase, data)
        step = data.step
        oldest = step - self.window
        skips = [s for s in state["skips"] if s[0] > oldest]
        if kind in ("skip", "probe"):  # a probe that starts a fall is one of its skipped steps
            skips.append([step, _skip_layers(data)])
        state["skips"] = skips[-MAX_EVIDENCE_POINTS:]
        scale = data.scalars.get("amp/scale")
        if not _finite(scale) or phase["calibrating"]:
            state["maxima"], state["peaks"], state["low"] = [], [], None
            return None
        low = state.get("low")
        if low is None or low[1] != scale:
            low = state["low"] = [step, scale]
        # A probe returns the scale to where it was before the growth: that peak was a trial, not judged.
        maxima = state["maxima"] = (
            [[step, scale]]
            if kind == "probe"
            else _decreasing([m for m in state["maxima"] if m[0] > oldest], step, scale)
        )
        peaks = state["peaks"] = _decreasing(
            [m for m in state.get("peaks", maxima) if m[0] > oldest], step, scale
        )
        if scale > 0 and maxima[0][1] / scale < self.factor:
            return CLEAR
        peak_step, peak = peaks[0]
        ratio = peak / scale if scale > 0 else math.inf
        fall = [s for s in state["skips"] if s[0] > peak_step]  # the skipped steps since the peak
        first = fall[0][0] if fall else peak_step + 1
        steps = f"step {low[0]}" if first >= low[0] else f"steps {first}-{low[0]}"
        return Finding(
            step,
            f"loss scale fell {scale_change(peak, scale)} at {steps} ({len(fall)} skipped)",
            ScaleDropEvidence(
                key="amp/scale",
                steps=[int(peak_step), step],  # peaks hold [step, scale]: the step is an int
                values=[peak, scale],
                ratio=ratio,
                low_step=low[0],
                skip_steps=[s for s, _ in fall],
                layers=_common_layers(fall),
            ),
        )


def _decreasing(maxima: list[list[float]], step: int, scale: float) -> list[list[float]]:
    """A window's running maxima ([step, scale], decreasing, each at the last step it held) with the
    scale at `step` added: maxima[0] is the window's peak."""
    while maxima and maxima[-1][1] <= scale:
        maxima.pop()
    maxima.append([step, scale])
    return maxima


class SkipStorm(RuleType[SkipStormState]):
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

    def initial_state(self) -> SkipStormState:
        # skips: [step, layers, scale] of the last judged skips (no probe, no calibration); judged, skipped,
        # seen: as [first, last] spans of steps in the window, the judged skips, every skipped step and
        # every step with amp/skipped (what the counts in the title count)
        return {
            "skips": [],
            "phase": ScalerPhase.initial(),
            "first": None,
            "judged": [],
            "skipped": [],
            "seen": [],
        }

    def observe(self, state: SkipStormState, data: StepData, layers: list[str]) -> Verdict:
        phase = state.setdefault("phase", ScalerPhase.initial())
        kind = ScalerPhase.observe(phase, data)
        if kind is None:
            return None
        oldest = data.step - self.window
        if "judged" not in state:  # a state stored before the spans: its skips list, counting from here on
            state["judged"] = []
            for skip in state["skips"]:
                _spans_add(state["judged"], skip[0])
        spans = {
            "judged": _spans_after(state.get("judged", []), oldest),
            "skipped": _spans_after(state.get("skipped", []), oldest),
            "seen": _spans_after(state.get("seen", []), oldest),
        }
        _spans_add(spans["seen"], data.step)
        if data.scalars["amp/skipped"] >= 0.5:
            _spans_add(spans["skipped"], data.step)
        state["judged"], state["skipped"], state["seen"] = spans["judged"], spans["skipped"], spans["seen"]
        if state.get("first") is None:
            state["first"] = data.step
        if data.step < state["first"] + self.ignore_first or kind == "calibrating":
            return None
        skips = [s for s in state["skips"] if s[0] > oldest]
        if kind == "skip":
            skips.append([data.step, _skip_layers(data), data.scalars.get("amp/scale")])
            _spans_add(spans["judged"], data.step)
        state["skips"] = skips[-MAX_EVIDENCE_POINTS:]
        count = _spans_count(spans["judged"])
        if count < self.count:
            return CLEAR
        scales = [s[2] for s in skips if _finite(s[2])]
        others = _spans_count(spans["skipped"]) - count
        steps = _spans_last(spans["judged"], MAX_EVIDENCE_POINTS)
        return Finding(
            data.step,
            f"{count} skipped steps in the last {_spans_count(spans['seen'])} steps"
            + (f", besides {others} while calibrating or right after a growth" if others > 0 else "")
            + f" (steps {spans['judged'][0][0]}-{spans['judged'][-1][1]}"
            + (f", scale now {_power_of_two(scales[-1])}" if scales else "")
            + ")",
            SkipStormEvidence(
                key="amp/skipped",
                steps=steps,
                values=[1.0] * len(steps),
                count=count,  # the judged skips in the window (steps: the last 50 of them)
                scales=scales,
                layers=_common_layers([[s[0], s[1]] for s in skips]),
            ),
        )


def _spans_add(spans: list[list[int]], step: int) -> None:
    """Add `step` to increasing [first, last] spans of steps (a step at or before the last is there)."""
    if spans and spans[-1][1] == step - 1:
        spans[-1][1] = step
    elif not spans or spans[-1][1] < step:
        spans.append([step, step])


def _spans_after(spans: list[list[int]], oldest: int) -> list[list[int]]:
    """The spans' steps after `oldest`."""
    return [[max(first, oldest + 1), last] for first, last in spans if last > oldest]


def _spans_count(spans: list[list[int]]) -> int:
    return sum(last - first + 1 for first, last in spans)


def _spans_last(spans: list[list[int]], most: int) -> list[int]:
    """The last `most` steps of the spans, in order."""
    steps: list[int] = []
    for first, last in reversed(spans):
        steps[:0] = range(max(first, last - (most - len(steps)) + 1), last + 1)
        if len(steps) >= most:
            break
    return steps


class ScaleFloor(RuleType[ScaleFloorState]):
    name = "scale_floor"
    severity = "critical"
    description = "The loss scale is below `floor` (below 1, gradients overflow even unscaled)."
    params: ClassVar[dict[str, Param]] = {"floor": Param(1.0, minimum=0.0, exclusive_minimum=True)}
    scalar_keys = frozenset({"amp/scale", "amp/skipped"})

    def observe(self, state: ScaleFloorState, data: StepData, layers: list[str]) -> Verdict:
        _recent_overflows(state, data)
        scale = data.scalars.get("amp/scale")
        if scale is None or math.isnan(scale):
            return None
        if scale >= self.floor:
            return CLEAR
        below_one = " (below 1: gradients overflow even unscaled)" if scale < 1.0 else ""
        overflowed = _overflowed(state)
        return Finding(
            data.step,
            f"loss scale {_power_of_two(scale)} is below the floor {self.floor:g}{below_one}"
            + (f": {overflowed}" if overflowed else ""),
            ScaleFloorEvidence(
                key="amp/scale",
                steps=[data.step],
                values=[scale],
                floor=self.floor,
                overflowed=state.get("recent", "").count("x"),  # of the last `recent_steps` steps
                recent_steps=len(state.get("recent", "")),
                layers=_skip_layers(data),
            ),
        )


class NoScaleGrowth(RuleType[NoScaleGrowthState]):
    name = "no_scale_growth"
    description = "The loss scale has not grown for `intervals` growth intervals (recurring overflows)."
    params: ClassVar[dict[str, Param]] = {
        "growth_interval": Param(
            2000, minimum=1, maximum=MAX_STEPS, integer=True, doc="the GradScaler's growth_interval"
        ),
        "intervals": Param(5, minimum=1, maximum=MAX_STEPS, integer=True),
    }
    scalar_keys = frozenset({"amp/scale"})

    def observe(self, state: NoScaleGrowthState, data: StepData, layers: list[str]) -> Verdict:
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
            NoScaleGrowthEvidence(
                key="amp/scale",
                steps=[state["since"], data.step],
                values=[scale],
                since_step=state["since"],
            ),
        )
