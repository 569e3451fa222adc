"""Early warning: how many steps before a divergence does gradwatch warn, and does it ever warn on a
healthy run? Side by side with llm-foundry's KillLossSpike rule, fed the very same losses.

    .venv/bin/python bench/early_warning.py [--markdown]

Every scenario of tests/support/pathologies/ trains once, without gradwatch (its ground truth is
measured by plain torch): per optimizer step its loss, pre-clip gradient norm and learning rate.

- gradwatch: the default `divergence_warning` and `loss_divergence` rules (server/alerts/rules/divergence.py)
  fed those values step by step exactly as the alert engine feeds them (the rules are pure functions of
  the steps; the end-to-end path, agent to server to webhook, is what tests/system/test_pathologies.py
  and bench/diagnosis.py run).
- KillLossSpike: llm-foundry's rule re-implemented from its documented parameters (window_size 100,
  outlier_multiplier 2, patience 4, loss_cap 10): after a full window, a loss at least 2x the window's
  mean is an outlier; more than `patience` outliers in a row stop the run; so does half the window above
  the cap after 2 windows. Loss only.

The divergence step of a run: the first step (after 20) whose median of 5 losses is more than 3x the
lowest such median before it, or whose loss is not finite. Lead = divergence step - first warning (or
stop) step; a healthy control's warning or stop is a false one.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import pathologies
import torch
from _common import cpu_name

from gradwatch.server.alerts.rules import Finding, StepData, make_rule

# The pathologies whose mechanism is a divergence (an lr too high for where the run is).
DIVERGENCES = ("lr_jump", "lr_too_high_fp32", "lr_restart_100x", "lr_warmup_too_high")


def divergence_step(losses: list[float]) -> int | None:
    best = math.inf
    for i in range(len(losses)):
        window = losses[max(0, i - 4) : i + 1]
        if i > 20 and not all(math.isfinite(v) for v in window):
            return i
        if not all(math.isfinite(v) for v in window):
            continue
        level = statistics.median(window)
        if i >= 20 and level > 3 * best:
            return i
        best = min(best, level)
    return None


class KillLossSpike:
    """llm-foundry's rule, from its documented parameters (see the module's docstring)."""

    def __init__(self, patience: int = 4, multiplier: float = 2.0, window: int = 100, cap: float = 10.0):
        self.patience, self.multiplier, self.window_size, self.cap = patience, multiplier, window, cap
        self.window: deque[float] = deque(maxlen=window)
        self.outliers = 0

    def stops(self, step: int, loss: float) -> bool:
        stop = False
        if len(self.window) == self.window_size:
            mean = sum(self.window) / len(self.window)
            if loss >= mean * self.multiplier or not math.isfinite(loss):
                self.outliers += 1
                stop = self.outliers > self.patience
            else:
                self.outliers = 0
                stop = (
                    step >= 2 * self.window_size
                    and sum(v > self.cap for v in self.window) >= self.window_size / 2
                )
        self.window.append(loss)
        return stop


def first_finding(rule_type: str, scenario: pathologies.Scenario) -> int | None:
    rule = make_rule(rule_type)
    state = rule.initial_state()
    for step, (loss, norm, lr) in enumerate(
        zip(scenario.losses, scenario.grad_norms, scenario.lrs, strict=True)
    ):
        scalars = {"loss": loss, "lr": lr}
        if math.isfinite(norm):
            scalars["grad/global_norm"] = norm
        if isinstance(rule.observe(state, StepData(step, 0, scalars=scalars), ["model"]), Finding):
            return step
    return None


def first_stop(scenario: pathologies.Scenario) -> int | None:
    rule = KillLossSpike()
    return next((step for step, loss in enumerate(scenario.losses) if rule.stops(step, loss)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.parse_args()
    print(
        f"{cpu_name()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
        f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}"
    )
    rows, healthy_false = [], {"gradwatch": 0, "KillLossSpike": 0}
    for name, make in pathologies.SCENARIOS.items():
        scenario = make(None)
        warned = first_finding("divergence_warning", scenario)
        left = first_finding("loss_divergence", scenario)
        stopped = first_stop(scenario)
        if scenario.healthy:
            healthy_false["gradwatch"] += warned is not None or left is not None
            healthy_false["KillLossSpike"] += stopped is not None
            rows.append((name, "healthy", None, warned, left, stopped))
        elif name in DIVERGENCES:
            rows.append((name, "divergence", divergence_step(scenario.losses), warned, left, stopped))
        print(f"  {name}: warn {warned}, loss_divergence {left}, KillLossSpike {stopped}", file=sys.stderr)

    def lead(diverged: int | None, at: int | None) -> str:
        return "-" if diverged is None or at is None else str(diverged - at)

    print(
        "| run | kind | diverged at | gw warning | gw lead | gw loss_divergence | KillLossSpike stop "
        "| KLS lead |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, kind, diverged, warned, left, stopped in rows:
        show = [name, kind, diverged, warned, lead(diverged, warned), left, stopped, lead(diverged, stopped)]
        print("| " + " | ".join("-" if v is None else str(v) for v in show) + " |")
    controls = sum(1 for r in rows if r[1] == "healthy")
    print(
        f"\nfalse warnings on {controls} healthy controls: gradwatch {healthy_false['gradwatch']}, "
        f"KillLossSpike {healthy_false['KillLossSpike']}"
    )


if __name__ == "__main__":
    main()
