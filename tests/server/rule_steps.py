"""Step sequences for the alert rule tests (test_alerts_rules_*.py): rules are pure functions of
steps, fed here as the engine feeds them, with no database, no server and no torch.

`Scaler` replays what a torch GradScaler does and what the agent reports of it (a skip halves the
scale, and the scale after update is reported at the same step as amp/skipped=1; growth_interval clean
steps in a row double it).
"""

import itertools
import json
import math

from gradwatch.server.alerts.rules import Finding, StepData

LAYERS = ("embed.weight", "hidden.weight", "head.weight")


def feed(rule, steps, layers=LAYERS, round_trip=False):
    """(step, verdict) for each step the rule reads, as the engine feeds it; round_trip: the state goes
    through json.dumps/json.loads after every step (as if the server restarted between steps)."""
    state = rule.initial_state()
    verdicts = []
    for data in steps:
        if rule.reads(data):
            verdicts.append((data.step, rule.observe(state, data, list(layers))))
            if round_trip:
                state = json.loads(json.dumps(state))
    return verdicts, state


def feed_batches(rule, steps, cuts, layers=LAYERS):
    """feed() with the steps cut into batches before each index in `cuts`, the state going through
    json.dumps/json.loads between batches as the engine stores it."""
    state = rule.initial_state()
    verdicts = []
    bounds = [0, *sorted(cuts), len(steps)]
    for lo, hi in itertools.pairwise(bounds):
        for data in steps[lo:hi]:
            if rule.reads(data):
                verdicts.append((data.step, rule.observe(state, data, list(layers))))
        state = json.loads(json.dumps(state))
    return verdicts, state


def batchings(count):
    """Ways to cut `count` steps into batches: whole, at each single boundary, and at every step."""
    yield []
    for cut in range(1, count):
        yield [cut]
    yield list(range(1, count))


def findings_of(verdicts):
    return [(step, v) for step, v in verdicts if isinstance(v, Finding)]


def first_finding(verdicts):
    return next(v for _, v in verdicts if isinstance(v, Finding))


def scalar_steps(key, values, rank=0, start=0):
    return [StepData(start + i, rank, scalars={key: v}) for i, v in enumerate(values)]


class Scaler:
    """A torch GradScaler as the agent reports it, one optimizer step per character of a pattern:
    "." a clean (applied) step, "x" an overflow (skipped: the scale halves). After `growth_interval` clean
    steps in a row the scale doubles (reported at that applied step). Steps continue across calls."""

    def __init__(self, init_scale=2.0**16, growth_interval=2000, loss=2.0, layers=("hidden.weight",)):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.tracker = 0
        self.step = 0
        self.loss = loss
        self.layers = list(layers)

    def run(self, pattern, loss=None, norm=1.0, skipped_norm=math.inf, **scalars):
        steps = []
        for char in pattern:
            overflow = char == "x"
            before = self.scale
            if overflow:
                self.scale /= 2
                self.tracker = 0
            else:
                self.tracker += 1
                if self.tracker >= self.growth_interval:
                    self.scale *= 2
                    self.tracker = 0
            values = {
                "amp/scale": self.scale,
                "amp/skipped": 1.0 if overflow else 0.0,
                "grad/global_norm": skipped_norm if overflow else norm,
                "loss": self.loss if loss is None else loss,
                **scalars,
            }
            events = (
                [("skip", {"scale_before": before, "non_finite_layers": self.layers})] if overflow else []
            )
            steps.append(StepData(self.step, 0, scalars=values, events=events))
            self.step += 1
        return steps

    def restore(self, scale, event=True):
        """load_state_dict: the next step starts from `scale` (a resumed run)."""
        self.scale = scale
        self.tracker = 0
        return [StepData(self.step, 0, events=[("scaler_state_loaded", {"scale": scale})])] if event else []
