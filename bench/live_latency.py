"""How soon a stored point reaches a viewer: the live WebSocket against polling the JSON API, side by side
on one real `gradwatch server` subprocess, on SQLite and PostgreSQL.

    .venv/bin/python bench/live_latency.py [--seconds 30] [--rate 10] [--keys 50]
                                           [--poll-interval 1.0] [--databases sqlite,postgres]
                                           [--postgres-admin-url URL]

A writer posts one step a batch (`--keys` scalar keys, "loss" among them) `--rate` times a second for
`--seconds`, as an agent flushing every 100 ms does, and notes when each POST returned. At the same time
- a WebSocket viewer (/api/v1/runs/{id}/live?key=loss) notes when each step's point arrived;
- a poller, the baseline (what a dashboard without a stream does: TensorBoard reloads every 30 s, a
  typical hand-written page every second or two), asks GET /series?key=loss&start=<next step> every
  `--poll-interval` seconds and notes when each step first appeared.
The latency of a step is its arrival minus its POST's return (it can be a little negative: the stream
is woken when the batch commits, before the response is written). Every step must arrive on both,
exactly once and in order; the script fails otherwise. Reported: p50 / p95 / p99 / max in
milliseconds and the share of steps within a second (the README's promise), with the load averages and
the CPU, since the server shares this machine's cores with the writer and both viewers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from _common import Database, Server, cpu_name, free_port, percentile, server_command, server_env
from websockets.sync.client import connect

PROMISE_S = 1.0


class StreamViewer(threading.Thread):
    """Arrival time of every step of `loss` on the live WebSocket."""

    def __init__(self, url: str, run_id: str) -> None:
        super().__init__(daemon=True)
        self.ws_url = f"ws://{url.removeprefix('http://')}/api/v1/runs/{run_id}/live?key=loss&since=-1"
        self.arrived: dict[int, float] = {}
        self.order: list[int] = []
        self.subscribed = threading.Event()  # the first status message arrived: the stream is live
        self.done = threading.Event()

    def run(self) -> None:
        with connect(self.ws_url, proxy=None, open_timeout=10, close_timeout=2) as ws:  # loopback only
            first = json.loads(ws.recv(timeout=10))
            assert first["type"] == "status", first
            self.subscribed.set()
            while not self.done.is_set():
                try:
                    message = ws.recv(timeout=0.2)
                except TimeoutError:
                    continue
                now = time.monotonic()
                document = json.loads(message)
                if document["type"] == "points":
                    for step in document["steps"]:
                        self.order.append(step)
                        self.arrived.setdefault(step, now)


class Poller(threading.Thread):
    """Arrival time of every step of `loss`, asking GET /series for what is after the last step seen."""

    def __init__(self, url: str, run_id: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.run_id, self.interval = url, run_id, interval
        self.arrived: dict[int, float] = {}
        self.order: list[int] = []
        self.requests = 0
        self.stop = threading.Event()

    def run(self) -> None:
        next_step = 0
        with httpx.Client(base_url=self.url, timeout=30, trust_env=False) as client:
            while not self.stop.wait(self.interval):
                answer = client.get(
                    f"/api/v1/runs/{self.run_id}/series",
                    params={"key": "loss", "start": next_step, "max_points": 100_000},
                )
                now = time.monotonic()
                self.requests += 1
                answer.raise_for_status()
                for step in answer.json()["steps"]:
                    self.order.append(step)
                    self.arrived.setdefault(step, now)
                    next_step = step + 1


def write(url: str, run_id: str, seconds: float, rate: float, keys: list[str]) -> dict[int, float]:
    """Post one step a batch at `rate` per second; the time each POST returned, by step."""
    posted: dict[int, float] = {}
    seq_base = int(time.time() * 1000) << 20
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        step = 0
        while (due := started + step / rate) < started + seconds:
            time.sleep(max(0.0, due - time.monotonic()))
            batch = {
                "seq": seq_base + step,
                "scalars": [
                    {"key": key, "steps": [step], "values": [i + 1.0 / (step + 1)]}
                    for i, key in enumerate(keys)
                ],
            }
            answer = client.post(f"/api/v1/runs/{run_id}/batches", json=batch)
            posted[step] = time.monotonic()
            answer.raise_for_status()
            step += 1
    return posted


def measure(database: Database, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    command = server_command(port, database.url("postgresql+psycopg"))
    server = Server(
        "gradwatch",
        command,
        port,
        "/healthz",
        folder / f"gradwatch-{database.kind}.log",
        server_env(folder / "gradwatch-home"),
    )
    try:
        run_id = uuid.uuid4().hex
        created = httpx.post(
            f"{server.url}/api/v1/runs",
            json={"id": run_id, "project": "live-latency"},
            timeout=30,
            trust_env=False,
        )
        created.raise_for_status()
        keys = ["loss"] + [f"key{i:03d}" for i in range(args.keys - 1)]
        stream, poller = StreamViewer(server.url, run_id), Poller(server.url, run_id, args.poll_interval)
        stream.start()
        if not stream.subscribed.wait(30):
            raise SystemExit(f"{database.kind}: the live stream did not open within 30 s")
        poller.start()
        load_before = os.getloadavg()
        posted = write(server.url, run_id, args.seconds, args.rate, keys)
        deadline = time.monotonic() + max(10.0, 3 * args.poll_interval)
        while (len(stream.arrived) < len(posted) or len(poller.arrived) < len(posted)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        poller.stop.set()
        poller.join()
        stream.done.set()
        stream.join(timeout=10)
        load_after = os.getloadavg()
    finally:
        server.stop()
    steps = sorted(posted)
    result: dict[str, Any] = {"steps": len(steps), "load": (load_before[0], load_after[0])}
    for name, viewer in (("stream", stream), ("poll", poller)):
        if viewer.order != steps:
            missing = sorted(set(steps) - set(viewer.arrived))[:10]
            raise SystemExit(
                f"{database.kind} {name}: {len(viewer.order)} points for {len(steps)} steps "
                f"(missing e.g. {missing}; in order: {viewer.order == sorted(viewer.order)})"
            )
        latencies = [viewer.arrived[step] - posted[step] for step in steps]
        result[name] = {
            "p50": percentile(latencies, 0.5),
            "p95": percentile(latencies, 0.95),
            "p99": percentile(latencies, 0.99),
            "max": max(latencies),
            "within": sum(latency <= PROMISE_S for latency in latencies) / len(latencies),
        }
    result["poll_requests"] = poller.requests
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=10.0, help="batches (steps) a second")
    parser.add_argument("--keys", type=int, default=50, help="scalar keys a step, loss included")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--databases", default="sqlite,postgres")
    parser.add_argument(
        "--postgres-admin-url",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="a database to connect to for CREATE/DROP DATABASE",
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} CPUs; load averages {os.getloadavg()}")
    print(
        f"{args.rate:g} batches/s of {args.keys} keys for {args.seconds:g} s; "
        f"the poller asks every {args.poll_interval:g} s"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="gw-live-latency-") as tmp:
        for kind in args.databases.split(","):
            database = Database(
                "sqlite" if kind == "sqlite" else "postgresql", Path(tmp), "live", args.postgres_admin_url
            )
            try:
                rows.append((kind, measure(database, Path(tmp), args)))
            finally:
                database.drop()
    print()
    print(
        "| database | viewer | steps | p50 ms | p95 ms | p99 ms | max ms | within 1 s "
        "| load (1 min) before → after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, result in rows:
        for name, label in (("stream", "WebSocket stream"), ("poll", f"poll every {args.poll_interval:g} s")):
            figures = result[name]
            print(
                f"| {kind} | {label} | {result['steps']} | {figures['p50'] * 1000:.1f} | "
                f"{figures['p95'] * 1000:.1f} | {figures['p99'] * 1000:.1f} | {figures['max'] * 1000:.1f} | "
                f"{figures['within'] * 100:.1f} % | {result['load'][0]:.2f} → {result['load'][1]:.2f} |"
            )
    for kind, result in rows:
        ratio = result["poll"]["p50"] / max(
            result["stream"]["p50"], 1e-3
        )  # a median under 1 ms counts as 1 ms
        print(
            f"{kind}: the stream's median latency is 1/{ratio:.0f} of polling's "
            f"({result['poll_requests']} polls)"
        )


if __name__ == "__main__":
    main()
