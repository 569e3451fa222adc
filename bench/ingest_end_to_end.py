"""Ingest end to end: the agent logging as fast as it can into `gradwatch server`, beside the storage
engine's own per-row insert of the same points, in one run.

    .venv/bin/python bench/ingest_end_to_end.py [--keys 100] [--steps 10000] [--databases sqlite,postgresql]
        [--postgres-admin-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres] [--repeats 3]

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
The ratio printed is gradwatch's points/s over the bare insert's rows/s. The CPU the run used is
printed first (the machine may be shared: the load average too).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import server_command, server_env

ROWS_PER_TRANSACTION = 50_000


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError) as exc:  # torch is optional for this bench
        return f"unknown ({type(exc).__name__})"


def value(step: int, key: int) -> float:
    """A healthy run's kind of value: smooth, distinct per key, never the same twice."""
    return 1.0 / (1.0 + 0.001 * step) + key * 1e-3 + math.sin(step * 0.37 + key) * 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def database(kind: str, admin_url: str, folder: Path) -> Iterator[str]:
    """A fresh database URL of `kind`, removed afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{folder / f'gw-{uuid.uuid4().hex[:8]}.db'}"
        return
    from sqlalchemy import create_engine, text

    name = f"gw_e2e_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


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
            urllib.request.urlopen(f"{url}/healthz", timeout=1).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"server did not start: {process.stderr.read().decode()[-2000:]}"
                ) from None
            time.sleep(0.1)
    try:
        yield url, process
    finally:
        process.terminate()
        process.wait(30)


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_gradwatch(database_url: str, keys: int, steps: int, folder: Path) -> tuple[float, float, str]:
    """(points/s, server CPU s per million points, how the check went)."""
    import gradwatch

    names = [f"k{i}" for i in range(keys)]
    rows = [{name: value(step, i) for i, name in enumerate(names)} for step in range(steps)]
    with server(database_url, folder) as (url, process):
        os.environ["GRADWATCH_HOME"] = str(folder / "agent-home")
        run = gradwatch.init(
            project="e2e", server=url, spool_dir=str(folder / f"spool-{uuid.uuid4().hex[:6]}")
        )
        cpu_before = process_cpu(process.pid)
        started = time.perf_counter()
        for step, row in enumerate(rows):
            run.log(row, step=step)
        run.finish()
        seconds = time.perf_counter() - started
        server_cpu = process_cpu(process.pid) - cpu_before
        stats = run.stats
        api = gradwatch.Api(url)
        wrong = 0
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
        if wrong or stats.sent != keys * steps:
            raise SystemExit(f"gradwatch stored something else than it was given: {check}")
    return keys * steps / seconds, server_cpu / (keys * steps) * 1e6, check


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


def bare_postgres(database_url: str, keys: int, steps: int) -> float:
    import psycopg

    with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://")) as connection:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--postgres-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_name()} (torch capability {cpu_capability()}), {os.cpu_count()} cores")
    print(
        f"{args.keys} keys x {args.steps:,} steps = {args.keys * args.steps:,} points per run;"
        f" repeats {args.repeats}"
    )
    folder = Path(tempfile.mkdtemp(prefix="gw-e2e-"))
    try:
        table = []
        for kind in args.databases.split(","):
            gw, bare, cpu = [], [], []
            for repeat in range(args.repeats):
                with database(kind, args.postgres_admin_url, folder) as url:
                    rate, server_cpu, check = run_gradwatch(url, args.keys, args.steps, folder)
                    gw.append(rate)
                    cpu.append(server_cpu)
                    if kind == "sqlite":
                        bare.append(bare_sqlite(args.keys, args.steps, folder))
                    else:
                        bare.append(bare_postgres(url, args.keys, args.steps))
                print(
                    f"  {kind} #{repeat + 1}: gradwatch {rate:,.0f} points/s ({check}); bare per-row"
                    f" {bare[-1]:,.0f} rows/s; server CPU {server_cpu:.2f} s per million points;"
                    f" load average {os.getloadavg()[0]:.1f}"
                )
            table.append((kind, statistics.median(gw), statistics.median(bare), statistics.median(cpu)))
        print()
        print(
            "| database | gradwatch end to end, points/s (median) | bare per-row insert, rows/s (median)"
            " | ratio | server CPU s / 1M points |"
        )
        print("|---|---|---|---|---|")
        for kind, rate, bare_rate, server_cpu in table:
            print(f"| {kind} | {rate:,.0f} | {bare_rate:,.0f} | {rate / bare_rate:.2f}x | {server_cpu:.2f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
