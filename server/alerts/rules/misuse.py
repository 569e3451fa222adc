"""Setup mistakes the agent detects and reports as events (misuse)."""

from __future__ import annotations

from typing import Any

from .base import Finding, RuleType, StepData, Verdict

__all__ = ["MISUSE_EVENTS", "Misuse"]

MISUSE_EVENTS = ("clip_before_unscale", "bf16_model_in_fp16", "weights_exceed_fp16", "scale_below_one")


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
            {
                "kinds": [kind for _, kind, _ in seen],
                "steps": [s for s, _, _ in seen],
                "hints": [hint for _, _, hint in seen],
            },
            cause=seen[0][1],
        )
