"""Ingest end to end: the agent logging as fast as it can into `gradwatch server`, beside the storage
engine's own per-row insert of the same points and MLflow's client logging them into `mlflow server`,
in one run.

    .venv/bin/python bench/ingest_end_to_end.py [--keys 100] [--steps 10000] [--databases sqlite,postgresql]
        [--postgres-admin-url postgresql://postgres@127.0.0.1:5432/test] [--repeats 3]
        [--mlflow-steps 1000] [--mlflow-venv .venv-mlflow]

For each database, per repeat:
- gradwatch: a real `gradwatch server` child process on 127.0.0.1 with a fresh database (SQLite file
  or a new PostgreSQL database); this process runs `gradwatch.init(...)`, then `run.log({k0..kN})` for
  every step as fast as it can, then `run.finish()`. Timed from the first log() to finish()
  returning, which is when the server has acknowledged every point (finish drains). Afterwards every
  point is read back through the read API (gradwatch.Api) and compared value for value.
- bare per-row: the same (series, step, value) rows inserted by the database driver itself into a
  table with a primary key on (series, step), with nothing else (sqlite3.executemany with gradwatch's
  own pragmas: WAL, synchronous=NORMAL; psycopg executemany), one transaction per 50,000 rows (the
  agent's largest request). This is the floor a row-per-point design cannot beat.
- MLflow (with --mlflow-steps > 0; MLflow 3.17.2 in its own venv, see _common.mlflow_missing): a real
  `mlflow server --workers 1` child process on 127.0.0.1 (job execution off; _common.start_mlflow)
  with a fresh SQLite file or PostgreSQL database, fed the same points of the first --mlflow-steps
  steps (MLflow stores ~5k points/s: the full run would take minutes) by MLflow's own client, as a
  user logging as fast as MLflow allows would: `MlflowClient().log_batch(run_id, metrics)` with
  1000 `Metric(key, value, timestamp, step)` per call (10 steps of 100 keys; 1000 is log-batch's
  maximum per request). The client runs in MLflow's venv (this file, with --mlflow-client), in a
  process of its own; it creates its experiment and run first, and is timed from building the first
  Metric to the last log_batch returning (synchronous: the server has stored it). Afterwards MLflow's
  `metrics` table is read directly: every (key, step) exactly once with the value sent.
The ratios printed are gradwatch's points/s over the bare insert's rows/s and over MLflow's points/s.
Also printed: the server's CPU per million points (its processes; on PostgreSQL also the backends
serving its database, sampled by process title), and the load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from _common import (
    LOOPBACK,
    BackendCpu,
    Database,
    cpu_name,
    free_port,
    loopback_env,
    mlflow_missing,
    mlflow_version,
    process_tree_cpu,
    server_command,
    server_env,
    start_mlflow,
)

ROOT = Path(__file__).resolve().parent.parent
ROWS_PER_TRANSACTION = 50_000
MLFLOW_METRICS_PER_CALL = 1000  # log-batch's maximum per request (MAX_METRICS_PER_BATCH)


def cpu_capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError) as exc:  # torch is optional for this bench
        return f"unknown ({type(exc).__name__})"


def value(step: int, key: int) -> float:
    """A healthy run's kind of value: smooth, distinct per key, never the same twice."""
    return 1.0 / (1.0 + 0.001 * step) + key * 1e-3 + math.sin(step * 0.37 + key) * 1e-4


@contextmanager
def server(database_url: str, folder: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    home = folder / f"home-{port}"
    home.mkdir()
    subprocess.run(
        [sys.executable, "-m", "gradwatch.cli", "db", "upgrade", "--database-url", database_url],
        env=server_env(home),
        check=True,
        capture_output=True,
    )
    process = subprocess.Popen(
        server_command(port, database_url),
        env=server_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            LOOPBACK.open(f"{url}/healthz", timeout=1).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                assert process.stderr is not None
                raise RuntimeError(
                    f"server did not start: {process.stderr.read().decode()[-2000:]}"
                ) from None
            time.sleep(0.1)
    try:
        yield url, process
    finally:
        process.terminate()
        process.wait(30)


@dataclass(frozen=True)
class Measured:
    """One system's run: points/s, CPU seconds per million points (the server's processes; its
    PostgreSQL backends apart, NaN on SQLite), and how the check of what it stored went."""

    rate: float
    server_cpu: float
    backend_cpu: float
    check: str
    client_cpu: float = math.nan  # the logging process (agent or MLflow client), CPU s per million points

    @property
    def cpu(self) -> float:
        """Server and backends together, CPU s per million points."""
        return self.server_cpu + (0.0 if math.isnan(self.backend_cpu) else self.backend_cpu)


def run_gradwatch(database: Database, keys: int, steps: int, folder: Path) -> Measured:
    import gradwatch

    names = [f"k{i}" for i in range(keys)]
    rows = [{name: value(step, i) for i, name in enumerate(names)} for step in range(steps)]
    points = keys * steps
    with server(database.url("postgresql+psycopg"), folder) as (url, process):
        os.environ["GRADWATCH_HOME"] = str(folder / "agent-home")
        run = gradwatch.init(
            project="e2e", server=url, spool_dir=str(folder / f"spool-{uuid.uuid4().hex[:6]}")
        )
        with BackendCpu(database) as backends:
            cpu_before, client_before = process_tree_cpu(process.pid), time.process_time()
            started = time.perf_counter()
            for step, row in enumerate(rows):
                run.log(row, step=step)
            run.finish()
            seconds = time.perf_counter() - started
            server_cpu = process_tree_cpu(process.pid) - cpu_before
            client_cpu = time.process_time() - client_before
        stats = run.stats
        api = gradwatch.Api(url)
        rows_back = api.run(run.id).history(names, as_frame=False)
        wrong = sum(1 for step, row in enumerate(rows_back) if row["step"] != step) + abs(
            len(rows_back) - steps
        )
        for step, row in zip(range(steps), rows_back, strict=False):
            wrong += sum(1 for i, name in enumerate(names) if row[name] != value(step, i))
        check = (
            f"sent {stats.sent:,}, dropped {stats.dropped}, spooled {stats.spooled};"
            f" points read back wrong or missing: {wrong}"
        )
        if wrong or stats.sent != points:
            raise SystemExit(f"gradwatch stored something else than it was given: {check}")
    per_million = 1e6 / points
    return Measured(
        points / seconds,
        server_cpu * per_million,
        backends.seconds * per_million,
        check,
        client_cpu * per_million,
    )


def bare_sqlite(keys: int, steps: int, folder: Path) -> float:
    path = folder / f"bare-{uuid.uuid4().hex[:6]}.db"
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.execute(
        "CREATE TABLE points (series_id INTEGER, step INTEGER, value REAL, PRIMARY KEY (series_id, step))"
    )
    rows = [(key, step, value(step, key)) for step in range(steps) for key in range(keys)]
    started = time.perf_counter()
    for lo in range(0, len(rows), ROWS_PER_TRANSACTION):
        connection.execute("BEGIN")
        connection.executemany("INSERT INTO points VALUES (?, ?, ?)", rows[lo : lo + ROWS_PER_TRANSACTION])
        connection.execute("COMMIT")
    seconds = time.perf_counter() - started
    connection.close()
    return len(rows) / seconds


def bare_postgres(database: Database, keys: int, steps: int) -> float:
    import psycopg

    with psycopg.connect(database.psycopg_url) as connection:
        connection.execute(
            "CREATE TABLE bare_points (series_id INTEGER, step BIGINT, value DOUBLE PRECISION,"
            " PRIMARY KEY (series_id, step))"
        )
        connection.commit()
        rows = [(key, step, value(step, key)) for step in range(steps) for key in range(keys)]
        started = time.perf_counter()
        with connection.cursor() as cursor:
            for lo in range(0, len(rows), ROWS_PER_TRANSACTION):
                cursor.executemany(
                    "INSERT INTO bare_points VALUES (%s, %s, %s)", rows[lo : lo + ROWS_PER_TRANSACTION]
                )
                connection.commit()
        return len(rows) / (time.perf_counter() - started)


# -- MLflow -----------------------------------------------------------------------------------------


def mlflow_client(url: str, keys: int, steps: int) -> None:
    """The MLflow side's client (run in MLflow's venv: this file with --mlflow-client URL): create an
    experiment and a run, print {"run_id"} and wait for a line on stdin; then log the points with
    MlflowClient.log_batch, 1000 metrics a call, as fast as it can, and print {"seconds"}."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=url)
    experiment_id = client.create_experiment(f"e2e-{uuid.uuid4().hex[:8]}")
    run_id = client.create_run(experiment_id, run_name="e2e").info.run_id
    names = [f"k{i}" for i in range(keys)]
    rows = [[value(step, i) for i in range(keys)] for step in range(steps)]  # what the loop computed
    print(json.dumps({"run_id": run_id}), flush=True)
    sys.stdin.readline()
    steps_per_call = max(1, MLFLOW_METRICS_PER_CALL // keys)
    cpu_before = time.process_time()
    started = time.perf_counter()
    pending: list[Metric] = []
    for step, row in enumerate(rows):
        timestamp = int(time.time() * 1000)
        pending += [Metric(name, v, timestamp, step) for name, v in zip(names, row, strict=True)]
        if (step + 1) % steps_per_call == 0 or step == steps - 1:
            client.log_batch(run_id, metrics=pending, synchronous=True)
            pending = []
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    client.set_terminated(run_id)
    print(json.dumps({"seconds": seconds, "cpu": cpu}), flush=True)


def json_line(stream: IO[str]) -> dict[str, Any] | None:
    """The next line of `stream` that is a JSON object (skipping anything else MLflow may print)."""
    for line in stream:
        if line.startswith("{"):
            return dict(json.loads(line))
    return None


def run_mlflow(database: Database, keys: int, steps: int, folder: Path, venv: Path) -> Measured:
    """MLflow's client logging `steps` steps of `keys` keys into a fresh `mlflow server`; then the
    points it stored are read from its database and compared with what was sent."""
    points = keys * steps
    mlflow = start_mlflow(database, folder, venv)
    try:
        client = subprocess.Popen(
            [
                *(str(venv / "bin" / "python"), __file__, "--mlflow-client", mlflow.url),
                *("--keys", str(keys), "--steps", str(steps)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=loopback_env(),
            cwd=folder,
        )
        assert client.stdin is not None and client.stdout is not None
        ready = json_line(client.stdout)
        if ready is None:
            raise RuntimeError(f"the MLflow client exited with {client.wait()} before logging")
        run_id = ready["run_id"]
        with BackendCpu(database) as backends:
            cpu_before = mlflow.cpu()
            client.stdin.write("go\n")
            client.stdin.flush()
            done = json_line(client.stdout)
            server_cpu = mlflow.cpu() - cpu_before
        if client.wait(60) != 0 or done is None:
            raise RuntimeError(f"the MLflow client failed (exit status {client.returncode})")
        seconds = done["seconds"]
    finally:
        mlflow.stop()
    stored = database.query("SELECT key, step, value FROM metrics WHERE run_uuid = ?", (run_id,))
    seen: set[tuple[str, int]] = set()
    wrong = 0
    for key, step, stored_value in stored:
        index = int(key[1:])
        if (key, step) in seen or not 0 <= step < steps or stored_value != value(step, index):
            wrong += 1
        seen.add((key, step))
    missing = points - len(seen)
    check = f"stored {len(stored):,} metric rows; wrong or repeated: {wrong}, missing: {missing}"
    if wrong or missing:
        raise SystemExit(f"MLflow stored something else than it was given: {check}")
    per_million = 1e6 / points
    return Measured(
        points / seconds,
        server_cpu * per_million,
        backends.seconds * per_million,
        check,
        done["cpu"] * per_million,
    )


# -- main -------------------------------------------------------------------------------------------


def cpu_text(m: Measured) -> str:
    backends = "" if math.isnan(m.backend_cpu) else f" + its PostgreSQL backends {m.backend_cpu:.2f}"
    return f"server CPU {m.server_cpu:.2f}{backends}, client {m.client_cpu:.2f} s per million points"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--postgres-admin-url",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="a database to connect to for CREATE/DROP DATABASE",
    )
    parser.add_argument(
        "--mlflow-steps",
        type=int,
        default=1000,
        help="steps (of --keys keys) MLflow's client logs per repeat; 0: leave MLflow out",
    )
    parser.add_argument("--mlflow-venv", type=Path, default=ROOT / ".venv-mlflow")
    parser.add_argument("--mlflow-client", metavar="URL", help=argparse.SUPPRESS)  # the MLflow side's child
    args = parser.parse_args()
    if args.mlflow_client:
        mlflow_client(args.mlflow_client, args.keys, args.steps)
        return
    admin_url = args.postgres_admin_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with_mlflow = args.mlflow_steps > 0
    if with_mlflow:
        missing = mlflow_missing(args.mlflow_venv)
        if missing:
            raise SystemExit(missing + "\n(or --mlflow-steps 0 to leave MLflow out)")
    print(f"CPU: {cpu_name()} (torch capability {cpu_capability()}), {os.cpu_count()} cores")
    print(
        f"{args.keys} keys x {args.steps:,} steps = {args.keys * args.steps:,} points per run;"
        f" repeats {args.repeats}"
        + (
            f"; MLflow {mlflow_version(args.mlflow_venv)} (--workers 1): the first {args.mlflow_steps:,}"
            f" steps = {args.keys * args.mlflow_steps:,} points, log_batch of"
            f" {min(MLFLOW_METRICS_PER_CALL // args.keys, args.mlflow_steps) * args.keys} metrics"
            if with_mlflow
            else ""
        )
        + f"; load average {os.getloadavg()[0]:.1f} at the start",
        flush=True,
    )
    folder = Path(tempfile.mkdtemp(prefix="gw-e2e-"))
    try:
        table = []
        for kind in args.databases.split(","):
            gw: list[Measured] = []
            bare: list[float] = []
            ml: list[Measured] = []
            for repeat in range(args.repeats):
                database = Database(kind, folder, f"gw{repeat}", admin_url)
                try:
                    gw.append(run_gradwatch(database, args.keys, args.steps, folder))
                    if kind == "sqlite":
                        bare.append(bare_sqlite(args.keys, args.steps, folder))
                    else:
                        bare.append(bare_postgres(database, args.keys, args.steps))
                finally:
                    database.drop()
                line = (
                    f"  {kind} #{repeat + 1}: gradwatch {gw[-1].rate:,.0f} points/s ({gw[-1].check};"
                    f" {cpu_text(gw[-1])}); bare per-row {bare[-1]:,.0f} rows/s"
                )
                if with_mlflow:
                    database = Database(kind, folder, f"mlflow{repeat}", admin_url)
                    try:
                        ml.append(
                            run_mlflow(database, args.keys, args.mlflow_steps, folder, args.mlflow_venv)
                        )
                    finally:
                        database.drop()
                    line += f"; MLflow {ml[-1].rate:,.0f} points/s ({ml[-1].check}; {cpu_text(ml[-1])})"
                print(line + f"; load average {os.getloadavg()[0]:.1f}", flush=True)
            table.append((kind, gw, statistics.median(bare), ml))
        print()
        print(
            "| database | gradwatch end to end, points/s (median) | bare per-row insert, rows/s (median)"
            " | ratio | gradwatch server CPU s / 1M points"
            + (
                " | MLflow end to end, points/s (median) | gradwatch / MLflow | MLflow server CPU s / 1M"
                " points | CPU ratio |"
                if with_mlflow
                else " |"
            )
        )
        print("|---|---|---|---|---" + ("|---|---|---|---|" if with_mlflow else "|"))
        for kind, gw, bare_rate, ml in table:
            rate, cpu = statistics.median(m.rate for m in gw), statistics.median(m.cpu for m in gw)
            row = f"| {kind} | {rate:,.0f} | {bare_rate:,.0f} | {rate / bare_rate:.2f}x | {cpu:.2f} |"
            if with_mlflow:
                ml_rate, ml_cpu = statistics.median(m.rate for m in ml), statistics.median(m.cpu for m in ml)
                row += f" {ml_rate:,.0f} | {rate / ml_rate:.1f}x | {ml_cpu:.2f} | {ml_cpu / cpu:.1f}x |"
            print(row)
        print(
            "\nServer CPU: the server's processes, on PostgreSQL plus the backends serving its database;"
            " CPU ratio = MLflow's / gradwatch's per point (less sensitive to other load than the rates)."
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
