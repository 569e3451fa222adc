"""The live run page: how soon a stored point is drawn, and what an open page costs while its run is
idle, with the doorbell (the page refreshes when the server's stream rings) against polling every 2 s
(the same page with its WebSocket blocked, as behind a proxy that does not pass WebSockets), side by
side on one real `gradwatch server` subprocess (SQLite) in headless Chromium.

    .venv/bin/python bench/live_page.py [--points 20] [--idle-s 60]

For each mode, a fresh running run and its page; then `--points` times, after a random pause of 0.5 to
3.5 s (so that a poll's phase is uniform), the bench logs one loss point through the agent, flushes,
and waits until the page's loss chart has it (checked every 10 ms in the page): the latency is from
the flush's return to the point on screen. Then `--idle-s` seconds with nothing logged while the run
is still running: the page's callback requests (`_dash-update-component`) and the server process's
CPU seconds in that time. Reported: latency p50 / p95 / max, and idle requests and server CPU per
minute, per mode and as ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    CHROMIUM,
    CHROMIUM_ARGS,
    Server,
    cpu_name,
    free_port,
    percentile,
    server_command,
    server_env,
)

import gradwatch

HAS_STEP = (
    "(step) => { const g = document.querySelector('#loss-graph .js-plotly-plot');"
    " return !!(g && g.data && g.data.some(t => t.x && t.x.includes(step))); }"
)


def measure(page: Any, server: Server, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    run = gradwatch.init(project="live-page", name=mode, server=server.url, flush_interval=0.05)
    step = 0
    for step in range(5):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run._flush(None)
    requests: list[float] = []
    page.on(
        "request", lambda r: requests.append(time.monotonic()) if "_dash-update-component" in r.url else None
    )
    if mode == "polling":
        page.route_web_socket("**/dashboard/live/**", lambda socket: socket.close(code=1006))
    page.goto(f"{server.url}/dashboard/runs/{run.id}")
    page.wait_for_function(HAS_STEP, arg=4, timeout=60_000)
    expected = "streamed by the server" if mode == "doorbell" else "polling every 2 s"
    page.get_by_text(expected, exact=False).wait_for(timeout=30_000)
    page.wait_for_timeout(3_000)  # the first load's callbacks settle
    latencies = []
    for step in range(5, 5 + args.points):
        page.wait_for_timeout(random.uniform(500, 3_500))
        run.log({"loss": 1.0 / (step + 1)}, step=step)
        run._flush(None)
        flushed = time.monotonic()
        page.wait_for_function(HAS_STEP, arg=step, timeout=60_000, polling=10)
        latencies.append((time.monotonic() - flushed) * 1000)
    page.wait_for_timeout(3_000)
    idle_from, cpu_from = time.monotonic(), server.cpu()
    page.wait_for_timeout(args.idle_s * 1000)  # (Playwright reports the page's requests while it waits)
    idle_s, idle_cpu = time.monotonic() - idle_from, server.cpu() - cpu_from
    idle_requests = len([at for at in requests if at >= idle_from])
    run.finish()
    page.unroute_all()
    return {
        "p50": percentile(latencies, 0.5),
        "p95": percentile(latencies, 0.95),
        "max": max(latencies),
        "requests_per_min": idle_requests * 60 / idle_s,
        "cpu_ms_per_min": idle_cpu * 1000 * 60 / idle_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    from playwright.sync_api import sync_playwright

    print(
        f"Python {platform.python_version()}; {os.cpu_count()} CPUs ({cpu_name()}); torch CPU capability: "
        f"{torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()[0]:.1f}"
    )
    folder = Path(tempfile.mkdtemp(prefix="gradwatch-live-page-"))
    port = free_port()
    server = Server(
        "gradwatch",
        server_command(port, f"sqlite:///{folder / 'gradwatch.db'}"),
        port,
        "/healthz",
        folder / "server.log",
        server_env(folder / "home"),
    )
    results = {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            for mode in ("doorbell", "polling"):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                results[mode] = measure(page, server, mode, args)
                page.close()
                row = results[mode]
                print(
                    f"{mode:9s} update latency p50 {row['p50']:.0f} ms, p95 {row['p95']:.0f} ms, max "
                    f"{row['max']:.0f} ms ({args.points} points); idle: {row['requests_per_min']:.1f} "
                    f"callback requests/min, server CPU {row['cpu_ms_per_min']:.0f} ms/min"
                )
            browser.close()
    finally:
        server.stop()
    door, poll = results["doorbell"], results["polling"]
    print(
        f"doorbell / polling: latency p50 {door['p50'] / poll['p50']:.2f}x, "
        f"p95 {door['p95'] / poll['p95']:.2f}x; "
        f"idle requests {door['requests_per_min']:.1f} vs {poll['requests_per_min']:.1f} a minute, "
        f"idle server CPU {door['cpu_ms_per_min'] / max(poll['cpu_ms_per_min'], 1e-9):.2f}x"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
