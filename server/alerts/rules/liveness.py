"""The run as a whole: whether it still reports (heartbeat, on the server's clock) and whether its ranks
agree on which steps they skipped (rank_disagreement)."""

from __future__ import annotations

from typing import ClassVar

from ..evidence import RankDisagreementEvidence
from .base import CLEAR, MAX_WINDOW, Finding, Param, RuleType, StepData, Verdict, _skip_layers
from .states import NoState, RankDisagreementState

__all__ = ["Heartbeat", "RankDisagreement"]


class Heartbeat(RuleType[NoState]):
    name = "heartbeat"
    severity = "critical"
    description = (
        "A running run sent nothing for `timeout_s` seconds (checked by the server's clock; a run the "
        'server marked crashed for that silence, reason "no heartbeat", still counts as running)."'
    )
    params: ClassVar[dict[str, Param]] = {"timeout_s": Param(900.0, minimum=1.0, doc="seconds")}
    periodic = True
    cooldown_steps = 0
    family = "liveness"

    def reads_signature(self, rank: int, present: frozenset[str]) -> bool:
        return rank == 0

    def observe(self, state: NoState, data: StepData, layers: list[str]) -> Verdict:
        return CLEAR  # data arrived: the run is alive


class RankDisagreement(RuleType[RankDisagreementState]):
    name = "rank_disagreement"
    severity = "critical"
    description = "Some ranks skipped a step that others applied (their found-inf checks disagree)."
    params: ClassVar[dict[str, Param]] = {
        "window": Param(200, minimum=1, maximum=MAX_WINDOW, integer=True, doc="steps remembered")
    }
    scalar_keys = frozenset({"amp/skipped"})
    all_ranks = True

    def initial_state(self) -> RankDisagreementState:
        return {"steps": {}}  # "step" -> {"rank": 0|1}

    def observe(self, state: RankDisagreementState, data: StepData, layers: list[str]) -> Verdict:
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
            RankDisagreementEvidence(
                key="amp/skipped",
                steps=[data.step],
                skipped_ranks=skipped_ranks,
                applied_ranks=applied_ranks,
                layers=_skip_layers(data),
            ),
        )
