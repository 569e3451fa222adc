"""Setup mistakes the agent detects and reports as events (misuse)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..advice import MISUSE_HINTS
from ..evidence import MisuseEvidence, UnheldParameters
from .base import MAX_EVIDENCE_LAYERS, Finding, RuleType, StepData, Verdict, _names
from .states import MisuseState

__all__ = ["MISUSE_EVENTS", "Misuse", "unheld_parameters_title"]

MISUSE_EVENTS = (
    "clip_before_unscale",
    "bf16_model_in_fp16",
    "weights_exceed_fp16",
    "scale_below_one",
    "params_not_in_optimizer",
)


def share(fraction: float) -> str:
    """A fraction as a percentage that never rounds to 0% or 100% unless it is exactly that."""
    if fraction <= 0 or fraction >= 1:
        return f"{fraction:.0%}"
    if fraction < 0.01:
        return "<1%"
    if fraction > 0.99:
        return ">99%"
    return f"{fraction:.0%}"


def unheld_parameters_title(details: Mapping[str, object]) -> str:
    """ "N layers (X% of the weights) get gradients but are not in the optimizer: a, b, c…" from a
    `params_not_in_optimizer` event's data."""
    layers = _names(details.get("layers"))
    count = details.get("count")
    count = int(count) if isinstance(count, (int, float)) and math.isfinite(count) else len(layers)
    fraction = details.get("fraction")
    weights = (
        f" ({share(fraction)} of the weights)"
        if isinstance(fraction, (int, float)) and math.isfinite(fraction)
        else ""
    )
    names = ", ".join(layers[:3]) + ("…" if count > 3 else "")
    noun, verb = ("layer", "gets a gradient but is") if count == 1 else ("layers", "get gradients but are")
    return f"{count} {noun}{weights} {verb} not in the optimizer: {names}"


class Misuse(RuleType[MisuseState]):
    name = "misuse"
    severity = "critical"
    description = (
        "A setup mistake the agent detected: clip_grad_norm_ before scaler.unscale_, a bf16 model trained in "
        "fp16, weights beyond fp16's range, a loss scale set below one, layers that get gradients but are in "
        "no param group of the optimizer. Once per run and kind, with the fix. A scale that the GradScaler "
        "itself lowered below one by backing off from overflows is no setup mistake (scale_floor and the "
        "other scaler rules report it)."
    )
    scalar_keys = frozenset({"amp/scale"})
    event_kinds = frozenset(MISUSE_EVENTS)
    cooldown_steps = 0

    def initial_state(self) -> MisuseState:
        # seen: [step, kind, hint]; "details": kind -> the numbers of an event that has them; scale: the
        # last loss scale before this step
        return {"seen": [], "scale": None}

    def observe(self, state: MisuseState, data: StepData, layers: list[str]) -> Verdict:
        new = False
        backed_off = _backed_off_below_one(state, data)
        for kind, event in data.events:
            if kind == "scale_below_one" and backed_off:
                continue
            if kind in MISUSE_EVENTS and kind not in {k for _, k, _ in state["seen"]}:
                hint = event.get("hint")
                state["seen"].append(
                    [data.step, kind, hint if isinstance(hint, str) else MISUSE_HINTS.get(kind, "")]
                )
                if kind == "params_not_in_optimizer":
                    state.setdefault("details", {})[kind] = _unheld_details(event)
                new = True
        if not new:
            return None
        seen = state["seen"]
        details: dict[str, UnheldParameters] = state.get("details") or {}
        names = "; ".join(
            unheld_parameters_title(details[kind]) if kind in details else kind.replace("_", " ")
            for _, kind, _ in seen
        )
        evidence = MisuseEvidence(
            kinds=[kind for _, kind, _ in seen],
            steps=[s for s, _, _ in seen],
            hints=[hint for _, _, hint in seen],
        )
        if details:
            evidence["details"] = details
            evidence["layers"] = [name for d in details.values() for name in d["layers"]][
                :MAX_EVIDENCE_LAYERS
            ]
        return Finding(
            data.step, f"setup mistake: {names} (first at step {seen[0][0]})", evidence, cause=seen[0][1]
        )


def _backed_off_below_one(state: MisuseState, data: StepData) -> bool:
    """Whether the scale went below one at this step by the GradScaler's own back-off: the step skipped
    and the scale before it (the skip event's, else the last one reported) was at least one. Keeps
    state["scale"]."""
    before = state.get("scale")
    for kind, event in data.events:
        if kind == "skip" and isinstance(event.get("scale_before"), (int, float)):
            before = event["scale_before"]
    scale = data.scalars.get("amp/scale")
    if scale is not None and math.isfinite(scale):
        state["scale"] = scale
    skipped = data.scalars.get("amp/skipped")
    return skipped is not None and skipped >= 0.5 and before is not None and before >= 1.0


def _unheld_details(event: dict[str, Any]) -> UnheldParameters:
    """The numbers of a `params_not_in_optimizer` event, bounded (rule state stays small)."""
    count, fraction = event.get("count"), event.get("fraction")
    layers = _names(event.get("layers"))
    return UnheldParameters(
        layers=layers[:MAX_EVIDENCE_LAYERS],
        count=int(count) if isinstance(count, (int, float)) and math.isfinite(count) else len(layers),
        fraction=float(fraction)
        if isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0 <= fraction <= 1
        else None,
        elements=event.get("elements") if isinstance(event.get("elements"), int) else None,
    )
