"""NaN and Inf: non-finite gradients that reach the weights or keep overflowing (non_finite), and a loss
that is itself NaN/Inf (loss_non_finite)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from ..evidence import LossNonFiniteEvidence, NonFiniteEvidence
from .base import (
    CLEAR,
    LOSS_KEYS,
    MAX_EVIDENCE_LAYERS,
    MAX_EVIDENCE_POINTS,
    MAX_STEPS,
    MAX_WINDOW,
    Finding,
    Param,
    RuleType,
    StepData,
    Verdict,
    _common_layers,
    _loss_of,
    _skip_layers,
)
from .scaler import ScalerPhase
from .states import LossNonFiniteState, NonFiniteState

__all__ = ["LossNonFinite", "NonFinite"]


class NonFinite(RuleType[NonFiniteState]):
    name = "non_finite"
    severity = "critical"
    description = (
        "A non-finite gradient norm reached the weights (a step applied without a GradScaler to skip it), "
        "or, after the scaler's calibration and with a finite loss, `consecutive` steps in a row overflowed."
    )
    params: ClassVar[dict[str, Param]] = {
        "consecutive": Param(3, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps in a row")
    }
    scalar_keys = frozenset({"grad/global_norm", "amp/skipped", "amp/scale", *LOSS_KEYS})
    event_kinds = frozenset({"skip", "scaler_state_loaded"})

    def initial_state(self) -> NonFiniteState:
        # run: the last MAX_EVIDENCE_POINTS steps [step, value, layers] of the current run of non-finite
        # norms; count and since: its true length and first step
        return {"run": [], "count": 0, "since": None, "phase": ScalerPhase.initial(), "scaler": False}

    def observe(self, state: NonFiniteState, data: StepData, layers: list[str]) -> Verdict:
        phase = state.setdefault("phase", ScalerPhase.initial())
        kind = ScalerPhase.observe(phase, data)
        if "amp/skipped" in data.scalars:
            state["scaler"] = True
        norm = data.scalars.get("grad/global_norm")
        if norm is None:
            return None
        if math.isfinite(norm):
            state["run"], state["count"], state["since"] = [], 0, None
            return CLEAR
        loss = _loss_of(data)
        loss_finite = loss is None or math.isfinite(loss[1])
        skipped = data.scalars.get("amp/skipped")
        applied = (skipped is not None and skipped < 0.5) or (skipped is None and not state["scaler"])
        streak = (state["run"] + [[data.step, norm, _skip_layers(data)]])[-MAX_EVIDENCE_POINTS:]
        # .get: a state stored before the counter existed has at most the list's length
        count = state["count"] = state.get("count", len(state["run"])) + 1
        since = state.get("since")
        if since is None:
            since = streak[0][0]
        state["since"] = since
        state["run"] = streak
        if not applied and (kind == "calibrating" or not loss_finite or count < self.consecutive):
            return None  # the scaler's business (calibration), or the loss's (loss_non_finite)
        layer_names = _common_layers([[s, names] for s, _, names in streak])
        if applied:
            title = f"gradient norm is {norm} at step {data.step}, and the optimizer step was applied"
        elif count == 1:
            title = f"gradient norm is {norm} at step {data.step}: it overflowed after calibration"
        else:
            title = (
                f"gradient norm is {norm}: {count} steps in a row overflowed after calibration (steps "
                f"{since}-{data.step})"
            )
        return Finding(
            data.step,
            title + (f" (first non-finite layer: {layer_names[0]})" if layer_names else ""),
            NonFiniteEvidence(
                keys=["grad/global_norm"],
                steps=[s for s, _, _ in streak],
                values=[v for _, v, _ in streak],
                count=count,  # non-finite norms in a row up to this step (steps: the last 50)
                first_step=since,
                applied=applied,
                layers=layer_names,
            ),
            cause="non_finite_applied" if applied else "",
        )


class LossNonFinite(RuleType[LossNonFiniteState]):
    name = "loss_non_finite"
    severity = "critical"
    family = "data"
    description = (
        "The loss itself is NaN/Inf (even once): the forward pass or the data, not an overflow the scaler "
        "can cure. Names the step and, when the run logs batch ids (run.log_batch), the batch. Resolves "
        "after `clear_after` finite losses."
    )
    params: ClassVar[dict[str, Param]] = {
        "clear_after": Param(100, minimum=1, maximum=MAX_STEPS, integer=True, doc="finite steps")
    }
    scalar_keys = frozenset(LOSS_KEYS)
    event_kinds = frozenset({"bad_batch"})
    cooldown_steps = 0

    def initial_state(self) -> LossNonFiniteState:
        return {"bad": [], "count": 0, "finite": 0}  # bad: [step, key, value, ids], the first and the last

    def observe(self, state: LossNonFiniteState, data: StepData, layers: list[str]) -> Verdict:
        loss = _loss_of(data)
        if loss is None:
            return None
        key, value = loss
        if math.isfinite(value):
            state["finite"] += 1
            if state["bad"] and state["finite"] >= self.clear_after:
                state["bad"], state["count"] = [], 0  # the next non-finite loss starts a new story
                return CLEAR
            return None
        state["finite"] = 0
        # .get: a state stored before the counter existed has at most the list's length
        count = state["count"] = state.get("count", len(state["bad"])) + 1
        ids: list[Any] | None = None
        for kind, event in data.events:
            if kind == "bad_batch" and event.get("ids_logged"):
                given = event.get("ids")
                ids = list(given)[:MAX_EVIDENCE_LAYERS] if isinstance(given, list) else []
        spelled = (
            "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
        )  # as the wire spells them
        bad = (state["bad"] + [[data.step, key, spelled, ids]])[-MAX_EVIDENCE_POINTS:]
        if len(state["bad"]) >= MAX_EVIDENCE_POINTS:
            bad = [state["bad"][0], *bad[-MAX_EVIDENCE_POINTS + 1 :]]  # keep the first one: where it started
        state["bad"] = bad
        first = bad[0]
        batch = f" (batch {', '.join(map(str, first[3]))})" if first[3] else ""
        title = f"the loss is {first[2]} at step {first[0]}{batch}"
        if count > 1:
            title += f"; {count} non-finite losses so far, last at step {data.step}"
        return Finding(
            data.step,
            title,
            LossNonFiniteEvidence(
                key=key,
                steps=[b[0] for b in bad],
                values=[b[2] for b in bad],
                first_step=first[0],
                count=count,  # non-finite losses since first_step (steps: the first and the last 49)
                batch_ids=first[3],
                batches={str(b[0]): b[3] for b in bad if b[3]},
            ),
        )
