"""Diagnosis quality: do gradwatch's notifications name what went wrong, when, and once? Side by side
with trainpulse 0.4.0 fed the very same per-step values.

    .venv/bin/python bench/diagnosis.py [--markdown] [--scenarios lr_jump,resumed,...]

Every scenario of tests/support/pathologies/ (realistic CPU training runs that go wrong through a scheduler,
a data pipeline, a loop-order or dtype mistake, plus healthy controls; each with ground truth
measured by plain torch, not by gradwatch) trains once:

- gradwatch: as a user runs it. A real `gradwatch server` child process on 127.0.0.1 (a fresh SQLite
  file, the default alert rules) and a real webhook receiver subscribed per scenario project in the
  generic "json" format; the scenario's loop calls gradwatch.init / run.watch / run.log / finish.
  Counted: the firing notifications the receiver got (incident.firing) once the
  server's outbox has nothing left to deliver.
- trainpulse: a Monitor() with its default MonitorConfig fed, per optimizer step, the scenario's
  measured loss, pre-clip unscaled global gradient norm and learning rate as "loss", "grad_norm" and
  "learning_rate" (as its README's full training loop does; step time is left out, it is noise here).
  Counted: monitor.alerts, each with its step (trainpulse names no layers).

Judged against the ground truth (pathologies.judge): detected = a notification at a step within
DETECTION_WINDOW (30) steps after the onset; latency = that step - onset; layer named = a detecting
notification names an affected parameter (or its module); cause named = where the scenario pins the
cause a right diagnosis names (Scenario.cause), the first detecting notification's incident names it
(its cause_key; trainpulse names detectors, never a cause). Totals: detection rate over pathologies,
cause named where pinned, false notifications on healthy controls, median latency, notifications per
notified pathology run (the ideal is one: one incident per cause).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from _common import CLI_MODULE, server_command, server_env

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "support")]

import pathologies  # noqa: E402 - tests/ is put on the path just above
from webhook_receiver import WebhookReceiver  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gradwatch_server(workdir: Path) -> Iterator[str]:
    """`gradwatch server` on a free loopback port with a fresh SQLite file; yields its URL."""
    port = free_port()
    executable = Path(sys.executable).with_name("gradwatch")
    command = server_command(
        port,
        f"sqlite:///{workdir / 'gradwatch.db'}",
        "--webhook-allow-private",  # the receiver is on 127.0.0.1, refused by default
        launcher=[str(executable)] if executable.exists() else CLI_MODULE,
        host=None,
    )
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=server_env(workdir))
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"gradwatch server exited: {log_path.read_text()}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("gradwatch server did not start within 60 s")
                time.sleep(0.1)
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@dataclass
class Row:
    scenario: pathologies.Scenario
    gradwatch: pathologies.Verdict
    trainpulse: pathologies.Verdict
    gradwatch_kinds: list[str]
    trainpulse_kinds: list[str]
    gradwatch_cause: bool | None = None  # the first detecting notification names Scenario.cause


def trainpulse_alerts(scenario: pathologies.Scenario) -> list[tuple[int, str]]:
    """(step, detector) of every alert a default trainpulse Monitor raises on the scenario's values."""
    from trainpulse import Monitor

    monitor = Monitor()
    for step, (loss, grad_norm, lr) in enumerate(
        zip(scenario.losses, scenario.grad_norms, scenario.lrs, strict=True)
    ):
        monitor.log("loss", step, loss)
        monitor.log("grad_norm", step, grad_norm)
        monitor.log("learning_rate", step, lr)
    return [(alert.step, alert.detector) for alert in monitor.alerts]


def run_one(name: str, url: str, api: httpx.Client, receiver: WebhookReceiver) -> Row:
    import gradwatch

    project = f"diagnosis-{name}"
    hook = api.post(
        "/api/v1/webhooks", json={"url": f"{receiver.url}/{name}", "format": "json", "project": project}
    )
    if hook.status_code != 201:
        raise RuntimeError(f"could not subscribe the loopback receiver: {hook.status_code} {hook.text}")
    new_run = functools.partial(gradwatch.init, project=project, server=url, flush_interval=0.05)
    scenario = pathologies.SCENARIOS[name](new_run)

    def bodies() -> list[object]:
        return [r.json for r in list(receiver.received) if r.path == f"/hook/{name}"]

    notified = pathologies.settled_notifications(
        api, project, bodies, settle=2.0, webhook_id=hook.json()["id"]
    )
    tp = trainpulse_alerts(scenario)
    return Row(
        scenario,
        pathologies.judge(scenario, [(n.step, n.layers) for n in notified]),
        pathologies.judge(scenario, [(step, ()) for step, _ in tp]),
        [n.kind for n in notified],
        sorted({detector for _, detector in tp}),
        cause_named(scenario, notified),
    )


def cause_named(scenario: pathologies.Scenario, notified: list[pathologies.Notification]) -> bool | None:
    """Whether the first notification within the detection window names the scenario's pinned cause
    (None where the scenario pins none)."""
    if scenario.cause is None or scenario.onset_step is None:
        return None
    onset = scenario.onset_step
    window = [
        n for n in notified if n.step is not None and onset <= n.step <= onset + pathologies.DETECTION_WINDOW
    ]
    return bool(window) and min(window, key=lambda n: n.step or 0).kind == scenario.cause


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def table(rows: list[Row]) -> list[list[str]]:
    """One line per scenario; latency = first notified step - onset, "detected" = within the window."""
    tool_columns = ["notified", "detected", "count", "first step", "latency", "layer"]
    header = ["scenario", "truth", "onset", "s"]
    header += [f"gw {c}" for c in tool_columns] + ["gw cause"] + [f"tp {c}" for c in tool_columns]
    body = [header]
    for row in rows:
        s = row.scenario
        cells: list[object] = [s.name, s.pathology or "healthy", s.onset_step, f"{s.seconds:.1f}"]
        for verdict in (row.gradwatch, row.trainpulse):
            latency = (
                verdict.first_step - s.onset_step
                if verdict.first_step is not None and s.onset_step is not None
                else None
            )
            cells += [
                verdict.notified,
                None if s.healthy else verdict.detected,
                verdict.count,
                verdict.first_step,
                latency,
                verdict.layer_named if s.layers else None,
            ]
            if verdict is row.gradwatch:
                cells.append(row.gradwatch_cause)
        body.append([_cell(c) for c in cells])
    return body


def totals(rows: list[Row], tool: str) -> dict[str, str]:
    verdicts = [(row.scenario, getattr(row, tool)) for row in rows]
    sick = [(s, v) for s, v in verdicts if not s.healthy]
    healthy = [(s, v) for s, v in verdicts if s.healthy]
    latencies = [v.latency for _, v in sick if v.latency is not None]
    notified = [v for _, v in sick if v.notified]
    layered = [v for s, v in sick if s.layers]
    pinned = [row for row in rows if row.scenario.cause is not None]
    named = sum(bool(row.gradwatch_cause) for row in pinned) if tool == "gradwatch" else 0
    return {
        "detection rate (pathologies, within 30 steps)": f"{sum(v.detected for _, v in sick)}/{len(sick)}",
        "cause named (pathologies that pin one)": f"{named}/{len(pinned)}",
        "false notifications on healthy controls": (
            f"{sum(v.count for _, v in healthy)} "
            f"({sum(v.notified for _, v in healthy)}/{len(healthy)} controls)"
        ),
        "median latency of detections (steps)": f"{statistics.median(latencies):g}" if latencies else "-",
        "notifications per notified pathology run": (
            f"{sum(v.count for v in notified) / len(notified):.1f}" if notified else "-"
        ),
        "affected layer named": f"{sum(bool(v.layer_named) for v in layered)}/{len(layered)}",
    }


def render(rows: list[Row], markdown: bool) -> str:
    grid = table(rows)
    lines = []
    if markdown:
        lines.append("| " + " | ".join(grid[0]) + " |")
        lines.append("|" + "|".join("---" for _ in grid[0]) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in grid[1:]]
    else:
        widths = [max(len(r[i]) for r in grid) for i in range(len(grid[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in grid]
    lines.append("")
    summary = {tool: totals(rows, tool) for tool in ("gradwatch", "trainpulse")}
    if markdown:
        lines.append("| total | gradwatch | trainpulse 0.4.0 |")
        lines.append("|---|---|---|")
        lines += [
            f"| {k} | {summary['gradwatch'][k]} | {summary['trainpulse'][k]} |" for k in summary["gradwatch"]
        ]
    else:
        width = max(map(len, summary["gradwatch"]))
        lines.append(f"{'total'.ljust(width)}  {'gradwatch':<24}  trainpulse 0.4.0")
        lines += [
            f"{k.ljust(width)}  {summary['gradwatch'][k]:<24}  {summary['trainpulse'][k]}"
            for k in summary["gradwatch"]
        ]
    lines.append("")
    lines.append("notified kinds (gradwatch: alert type or incident cause; trainpulse: detectors):")
    lines += [
        f"  {row.scenario.name}: gradwatch {row.gradwatch_kinds or '-'}; "
        f"trainpulse {row.trainpulse_kinds or '-'}"
        for row in rows
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the tables as Markdown (BENCHMARKS.md)"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(pathologies.SCENARIOS),
        help="comma-separated scenario names (default: all)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(names) - set(pathologies.SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(pathologies.SCENARIOS)}")
    import trainpulse

    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"python {platform.python_version()}, trainpulse {trainpulse.__version__}, "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="gradwatch-diagnosis-") as tmp,
        gradwatch_server(Path(tmp)) as url,
        WebhookReceiver() as receiver,
        httpx.Client(base_url=url, timeout=30) as api,
    ):
        for name in names:
            rows.append(run_one(name, url, api, receiver))
            print(
                f"  {name}: {rows[-1].scenario.seconds:.1f} s, gradwatch {rows[-1].gradwatch.count} "
                f"notification(s), trainpulse {rows[-1].trainpulse.count} alert(s)",
                file=sys.stderr,
                flush=True,
            )
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
