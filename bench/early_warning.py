"""Early warning and the guard: how many steps before a divergence does gradwatch warn, does it ever warn
on a healthy run, and how many steps does a guarded loop train after the first critical incident?
Side by side with llm-foundry's KillLossSpike rule, fed the very same losses.

    .venv/bin/python bench/early_warning.py [--markdown] [--no-guard]

Every scenario of tests/support/pathologies/ (and its bench-only runs) trains once, without gradwatch
(its ground truth is measured by plain torch): per optimizer step its loss, pre-clip gradient norm and lr.

- gradwatch, rule level: the default `divergence_warning` and `loss_divergence` rules
  (server/alerts/rules/divergence.py) fed those values step by step exactly as the alert engine feeds
  them.
- gradwatch, end to end with the guard (unless --no-guard): each divergence run trains again, as a user
  runs it, into a real `gradwatch server` child process (fresh SQLite, loopback) with
  `watch(..., guard=Guard(raise_on_stop=True))` at the agent's default flush (1 s or 100 steps). Its first
  alert of any severity, its first critical alert, and the step the guard stopped the loop at
  (TrainingHalted from run.log()); wasted steps = optimizer steps applied after the first critical alert's
  step until the loop stopped. A watched run trains bit-identically to the plain one, so the plain run's
  divergence step holds for it.
- KillLossSpike: llm-foundry's rule re-implemented from its documented parameters (window_size 100,
  outlier_multiplier 2, patience 4, loss_cap 10): after a full window, a loss at least 2x the window's
  mean is an outlier; more than `patience` outliers in a row stop the run; so does half the window above
  the cap after 2 windows. Loss only.

The divergence step of a run (pathologies.divergence_step): its first non-finite loss, or the first step
(after 20) whose median of 5 losses is more than 3x the lowest such median before it. Lead = divergence
step - first warning (or stop) step; a healthy control's warning or stop is a false one.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import httpx
import pathologies
import torch
from _common import cpu_name

from gradwatch.server.alerts.rules import Finding, StepData, make_rule

# The runs whose mechanism is a divergence (an lr too high for where the run is).
DIVERGENCES = (
    "lr_jump",
    "lr_too_high_fp32",
    "lr_warmup_too_high",
    "lr_restart_100x",
    "post_ln_no_warmup",
    "warmup_too_fast",
)


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


@dataclass
class Guarded:
    first_alert: int | None  # the first alert of any severity (step)
    first_alert_rule: str | None
    first_critical: int | None
    stopped_at: int | None  # run.step when the guard stopped the loop (the step that ended + 1)
    steps: int  # optimizer steps the run took (it may end before the guard stops it)

    @property
    def wasted(self) -> str | None:
        """Optimizer steps applied after the first critical alert's step until the loop stopped (or the
        run ended first, on its own)."""
        if self.first_critical is None:
            return None
        if self.stopped_at is None:
            return f"{self.steps - 1 - self.first_critical} (the run ended first)"
        return str(self.stopped_at - 1 - self.first_critical)


def guarded(name: str, url: str) -> Guarded:
    """Train `name` again into the server at `url`, with a guard that raises TrainingHalted."""
    import gradwatch

    runs: list[gradwatch.Run] = []

    def new_run(**options: object) -> gradwatch.Run:
        run = gradwatch.init(project=f"guard-{name}", server=url, **options)  # default flush
        runs.append(run)
        return run

    new_run.make_guard = lambda: gradwatch.Guard(raise_on_stop=True)  # type: ignore[attr-defined]
    stopped_at = None
    try:
        SCENARIOS[name](new_run)
    except gradwatch.TrainingHalted as halted:
        stopped_at = halted.incident.get("stopped_at_step")
    alerts = httpx.get(
        f"{url}/api/v1/alerts", params={"run_id": runs[-1].id, "limit": 500}, timeout=30
    ).json()["data"]
    alerts.sort(key=lambda a: (a["step"], a["id"]))
    critical = [a["step"] for a in alerts if a["severity"] == "critical"]
    return Guarded(
        alerts[0]["step"] if alerts else None,
        alerts[0]["type"] if alerts else None,
        min(critical) if critical else None,
        stopped_at,
        runs[-1].step,
    )


SCENARIOS = {**pathologies.SCENARIOS, **pathologies.BENCH_ONLY}


def fast_ramps() -> str:
    """warmup_too_fast over peaks, ramp lengths and seeds: where a fast warm-up leaves its range moves
    with all three, and so does how much warning its precursors give (one seed proves little)."""
    lines = [
        "\n| fast warm-up (peak, ramp, seed) | diverged at | gw warning | gw lead | gw left | KLS stop |",
        "|---|---|---|---|---|---|",
    ]
    leads = []
    for peak in (2e-2, 3e-2):
        for ramp in (60, 100):
            for seed in (0, 1, 2):
                run = pathologies.warmup_too_fast(None, seed=seed, steps=ramp + 60, peak=peak, ramp=ramp)
                diverged = pathologies.divergence_step(run.losses)
                warned = first_finding("divergence_warning", run)
                left, stopped = first_finding("loss_divergence", run), first_stop(run)
                lead = None if diverged is None or warned is None else diverged - warned
                leads.append(lead)
                show = [f"{peak:g}, {ramp}, {seed}", diverged, warned, lead, left, stopped]
                lines.append("| " + " | ".join("-" if v is None else str(v) for v in show) + " |")
    known = sorted(v for v in leads if v is not None)
    lines.append(
        f"\nfast warm-ups: warned on {len(known)} of {len(leads)}, lead >= 5 on "
        f"{sum(v >= 5 for v in known)}, median lead {known[len(known) // 2] if known else '-'}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--no-guard", action="store_true", help="skip the end-to-end runs with a guard")
    args = parser.parse_args()
    print(
        f"{cpu_name()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
        f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}"
    )
    rows, healthy_false = [], {"gradwatch": 0, "KillLossSpike": 0}
    seconds: dict[str, float] = {}
    for name, make in SCENARIOS.items():
        if name not in DIVERGENCES and make not in pathologies.HEALTHY:
            continue
        scenario = make(None)
        seconds[name] = scenario.seconds / max(scenario.steps, 1)
        warned = first_finding("divergence_warning", scenario)
        left = first_finding("loss_divergence", scenario)
        stopped = first_stop(scenario)
        if scenario.healthy:
            healthy_false["gradwatch"] += warned is not None or left is not None
            healthy_false["KillLossSpike"] += stopped is not None
            rows.append((name, "healthy", None, warned, left, stopped))
        else:
            diverged = pathologies.divergence_step(scenario.losses)
            rows.append((name, "divergence", diverged, warned, left, stopped))
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
    print(fast_ramps())
    if args.no_guard:
        return
    from diagnosis import gradwatch_server

    print(
        "\n| run | diverged at | first alert (rule) | lead | first critical | guard stopped at "
        "| wasted steps | ms a step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp, gradwatch_server(Path(tmp)) as url:
        for name, kind, diverged, *_ in rows:
            if kind != "divergence":
                continue
            g = guarded(name, url)
            print(f"  {name} guarded: {g}", file=sys.stderr)
            first = None if g.first_alert is None else f"{g.first_alert} ({g.first_alert_rule})"
            show = [
                name,
                diverged,
                first,
                lead(diverged, g.first_alert),
                g.first_critical,
                g.stopped_at,
                g.wasted,
                f"{1000 * seconds[name]:.1f}",
            ]
            print("| " + " | ".join("-" if v is None else str(v) for v in show) + " |")


if __name__ == "__main__":
    main()
