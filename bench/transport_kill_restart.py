"""Kill and restart at a high point rate: does every point arrive exactly once?

A real `gradwatch server` process (SQLite file) on 127.0.0.1; a loop logs --keys scalars per step with
run.log() at about --rate points per second. A third of the way in the server is killed with
SIGKILL; at half way it is started again on the same port and database, while the loop goes on. After
run.finish() the SQLite file is read directly and compared with what the loop produced, value for
value. Points are unique per (key, step) in storage, so the duplicate check also counts one event per
step (events have no such key): a batch stored twice would store its events twice.

    python bench/transport_kill_restart.py [--steps 5000] [--keys 200] [--rate 50000]

prints details, then "produced N, stored N, duplicates 0".
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _common import server_command

import gradwatch
from gradwatch.server.storage.chunked_points import decode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`gradwatch server` as a child process, killable with SIGKILL and restartable."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database = folder / "bench.db"
        self.log = folder / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                server_command(self.port, f"sqlite:///{self.database}", host=None),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not start; see {self.log}")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def value(step: int, key: int) -> float:
    """The point the loop logs for key number `key` at `step` (exact in binary: checked by equality)."""
    return step + key / 256


class NullTransport:
    """The baseline: a transport that takes everything at once (no network, no server)."""

    def create_run(self, run: dict) -> None:
        pass

    def send_batch(self, run_id: str, batch: dict) -> None:
        pass


def run_delay_seconds(fd: int | None) -> float:
    """Time this thread was ready to run but the CPU was given to another process (Linux schedstat)."""
    return int(os.pread(fd, 100, 0).split()[1]) / 1e9 if fd is not None else 0.0


def training_loop(
    run: gradwatch.Run, steps: int, keys: int, rate: float, actions: dict
) -> tuple[float, float, float]:
    """Log `keys` scalars per step at about `rate` points/s; returns (seconds, slowest run.log wall
    time, slowest run.log time less the time other processes held the CPU)."""
    try:
        schedstat: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        schedstat = None
    names = [f"k{j}" for j in range(keys)]
    slowest = slowest_busy = 0.0
    started = time.perf_counter()
    for step in range(steps):
        if step in actions:
            actions[step]()
        points = {name: value(step, j) for j, name in enumerate(names)}
        delay, t = run_delay_seconds(schedstat), time.perf_counter()
        run.log(points, step=step)
        run.buffer.add_event(step, "bench", {})  # the duplicate canary (see the docstring)
        wall = time.perf_counter() - t
        slowest = max(slowest, wall)
        slowest_busy = max(slowest_busy, wall - (run_delay_seconds(schedstat) - delay))
        lag = started + (step + 1) * keys / rate - time.perf_counter()
        if lag > 0:
            time.sleep(lag)
    if schedstat is not None:
        os.close(schedstat)
    return time.perf_counter() - started, slowest, slowest_busy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=200, help="scalars logged per step")
    parser.add_argument("--rate", type=float, default=50_000, help="target points per second")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    produced = args.steps * args.keys

    baseline = gradwatch.init(project="bench", transport=NullTransport())
    base_seconds, base_slowest, base_busy = training_loop(baseline, args.steps, args.keys, args.rate, {})
    baseline.finish()
    print(
        f"baseline (no server, nothing can fail): {produced / base_seconds:,.0f} points/s; slowest run.log "
        f"{base_slowest * 1e3:.2f} ms ({base_busy * 1e3:.2f} ms less CPU taken by other processes)",
        flush=True,
    )

    folder = Path(tempfile.mkdtemp(prefix="gradwatch-bench-"))
    server = Server(folder)
    server.start()
    restart = threading.Thread(target=server.start)

    def kill() -> None:
        server.kill()
        print("server killed (SIGKILL)", flush=True)

    def start_again() -> None:
        restart.start()
        print("server restarting on the same port and database", flush=True)

    try:
        started = time.perf_counter()
        run = gradwatch.init(
            project="bench",
            name="kill-restart",
            server=server.url,
            spool_dir=folder / "spool",
            max_backoff=1.0,
        )
        loop_seconds, slowest, slowest_busy = training_loop(
            run,
            args.steps,
            args.keys,
            args.rate,
            {args.steps // 3: kill, args.steps // 2: start_again},
        )
        run.finish(timeout=600)
        total_seconds = time.perf_counter() - started
        restart.join()
    finally:
        server.stop()

    with sqlite3.connect(server.database) as db:
        rows = [
            (key, step, stored_value)
            for key, first_step, step_data, value_data in db.execute(
                "SELECT s.key, c.first_step, c.step_data, c.value_data FROM point_chunks c"
                " JOIN series s ON s.id = c.series_id WHERE s.run_id = ? AND s.key LIKE 'k%'",
                (run.id,),
            ).fetchall()
            for points in [decode(first_step, step_data, value_data)]
            for step, stored_value in zip(points.steps.tolist(), points.values.tolist(), strict=True)
        ]
        events, distinct_events = db.execute(
            "SELECT count(*), count(DISTINCT step) FROM events WHERE run_id = ? AND kind = 'bench'",
            (run.id,),
        ).fetchone()
        batches = db.execute("SELECT count(*) FROM agent_batches WHERE run_id = ?", (run.id,)).fetchone()[0]
    stored = len(rows)
    wrong = sum(1 for key, step, stored_value in rows if stored_value != value(step, int(key[1:])))
    duplicates = (stored - len({(key, step) for key, step, _ in rows})) + (events - distinct_events)
    print(
        f"kill and restart: {produced / loop_seconds:,.0f} points/s; slowest run.log {slowest * 1e3:.2f} ms "
        f"({slowest_busy * 1e3:.2f} ms less CPU taken by other processes)"
    )
    print(f"everything stored {total_seconds:.1f} s after the start ({batches} batches); agent {run.stats}")
    print(f"wrong values {wrong}; bench events {events} for {args.steps} steps")
    print(f"produced {produced}, stored {stored}, duplicates {duplicates}")
    return 0 if stored == produced and duplicates == 0 and wrong == 0 and events == args.steps else 1


if __name__ == "__main__":
    os.environ.setdefault("GRADWATCH_HOME", tempfile.mkdtemp(prefix="gradwatch-home-"))
    sys.exit(main())
