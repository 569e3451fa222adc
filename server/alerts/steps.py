"""The steps the rules are fed: a batch's points grouped by step (step_data), and whole steps however
the agent cut them into batches (complete_steps, which holds a step's first part in the rule's state
until the rest arrives)."""

from __future__ import annotations

from typing import Any

from ..schemas import BatchIn
from .rules import RuleType, StepData

__all__ = ["complete_steps", "last_step", "step_data"]


def step_data(batch: BatchIn, scalar_keys: set[str], vector_keys: set[str]) -> list[StepData]:
    """The batch's points of the wanted keys (and all its events), grouped by step, in step order."""
    by_step: dict[int, StepData] = {}

    def at(step: int) -> StepData:
        data = by_step.get(step)
        if data is None:
            data = by_step[step] = StepData(step, batch.rank)
        return data

    for series in batch.scalars:
        if series.key in scalar_keys:
            for step, value in zip(series.steps, series.values, strict=True):  # validated to pair up
                at(step).scalars[series.key] = value
    for vector in batch.vectors:
        if vector.key in vector_keys:
            for step, row in zip(vector.steps, vector.values, strict=True):
                at(step).vectors[vector.key] = row
    for item in batch.events:
        at(item.step).events.append((item.kind, item.data))
    return [by_step[step] for step in sorted(by_step)]


def _read_keys(rule: RuleType[Any], data: StepData) -> list[str]:
    """The scalar and vector keys of `data` that `rule` reads."""
    wanted = rule.scalar_keys | rule.vector_keys | {"amp/skipped", str(rule.values.get("key"))}
    return sorted(k for k in (*data.scalars, *data.vectors) if k in wanted)


def complete_steps(
    document: dict[str, Any], rule: RuleType[Any], fed: list[StepData], final: bool
) -> list[StepData]:
    """A rule's steps as whole steps, however the agent cut them into batches.

    The agent may send part of a step in one batch and the rest in the next (a loss logged before the
    step's backward, then a flush: the loss at step N ends one batch, N's gradients and scaler values
    begin the next). A step is evaluated once, so its first part alone would stand for the whole step.
    So the last step of a rank in a batch is held back (in the state, document["held"]) when it holds
    fewer of the keys the rule reads than the step before it, and joined with the rest of that step from
    the next batch; on the run's last batch (`final`) nothing is held. document["keys"] keeps, per rank,
    the keys the rule read at the last step it evaluated."""
    held: dict[str, Any] = document.pop("held", None) or {}
    if not held and not fed:
        return fed
    steps = {(data.rank, data.step): data for data in fed} if held else {}
    for held_rank, part in held.items():
        step, rank = part["step"], int(held_rank)
        rest = steps.get((rank, step))
        steps[(rank, step)] = StepData(
            step,
            rank,
            {**part["scalars"], **(rest.scalars if rest else {})},
            {**part["vectors"], **(rest.vectors if rest else {})},
            [(kind, event) for kind, event in part["events"]] + (rest.events if rest else []),
        )
    ordered = [steps[key] for key in sorted(steps, key=lambda key: (key[1], key[0]))] if held else fed
    keys: dict[str, list[str]] = document.setdefault("keys", {})
    last_of_rank = {data.rank: index for index, data in enumerate(ordered)}
    held_steps = set()
    for last_rank, index in last_of_rank.items():  # only the last two steps of a rank are looked at
        before = next((i for i in range(index - 1, -1, -1) if ordered[i].rank == last_rank), None)
        previous = keys.get(str(last_rank)) if before is None else _read_keys(rule, ordered[before])
        read = _read_keys(rule, ordered[index])
        if not final and previous and set(read) < set(previous):
            data = ordered[index]
            document.setdefault("held", {})[str(last_rank)] = {
                "step": data.step,
                "scalars": data.scalars,
                "vectors": data.vectors,
                "events": [[kind, event] for kind, event in data.events],
            }
            held_steps.add(index)
            read = previous
        keys[str(last_rank)] = read
    return [data for index, data in enumerate(ordered) if index not in held_steps]


def last_step(batch: BatchIn) -> int:
    """The highest step a batch carries (its run has reached at least that)."""
    steps = [max(s.steps) for s in batch.scalars if s.steps] + [
        max(v.steps) for v in batch.vectors if v.steps
    ]
    steps += [e.step for e in batch.events]
    return max(steps, default=-1)
