"""Query latency on big runs: a 10-million-point series downsampled to 2,000 points, and a
200-layer x 100k-step heatmap, on SQLite and PostgreSQL, through the HTTP API of a real server.

    .venv/bin/python bench/server_query.py [--points 10000000] [--layers 200] [--steps 100000]
                                           [--repeats 30] [--databases sqlite,postgres]

For each database: a fresh SQLite file / a fresh PostgreSQL database (GRADWATCH_BENCH_POSTGRES_URL,
default the local server) gets, through the store's real ingest path (Store.ingest: the same code
POST /batches runs, rollups maintained as data arrives, minus HTTP and JSON parsing), one run with
- "loss": `--points` points, one per step (a noisy decay with a 1e6 spike every 1,000,003 steps and a
  NaN every 2,000,003), in batches of 100,000;
- "grad/norm": `--layers` values at every one of `--steps` steps (the heatmap's data).
Then a real `gradwatch server` subprocess on 127.0.0.1 answers, `--repeats` times each:
- GET /series?key=loss&max_points=2000 over the whole run, and over random zoom windows;
- GET /vectors?key=grad/norm&max_steps=500 (what the run page asks for) over the whole run.
Side by side in the same run, the baseline is the query without rollups (what gradwatch did before
them): every point read (decoded from its chunk, migration 0011) and min/max-downsampled per bucket
with numpy (before 0011 this was one SQL pass over a row per point) and, for the heatmap, reading
every row and merging them with numpy; both timed in this process against the same database. Every
rollup answer is checked against the baseline's points.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from _common import percentile, server_command

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_ADMIN = os.environ.get(
    "GRADWATCH_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill(database_url: str, points: int, layers: int, steps: int) -> tuple[str, float, float]:
    """Create the run through Store.ingest; (run id, series seconds, vectors seconds)."""
    from gradwatch.server.database import make_engine, prepare_schema
    from gradwatch.server.schemas import BatchIn, RunIn
    from gradwatch.server.storage import Store

    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    store = Store(engine)
    run = store.create_run(RunIn(project="bench", name=f"{points:,} points"))
    rng = random.Random(0)
    seq = 0
    started = time.perf_counter()
    for first in range(0, points, 100_000):
        chunk = range(first, min(points, first + 100_000))
        values = [1.0 / math.log(s + 3) + rng.random() * 0.05 for s in chunk]
        for index, step in enumerate(chunk):
            if step % 1_000_003 == 500_000:
                values[index] = 1e6
            elif step % 2_000_003 == 1_000_000:
                values[index] = math.nan
        store.ingest(
            run.id,
            BatchIn.model_construct(
                seq=seq,
                rank=0,
                layers=None,
                status=None,
                events=[],
                vectors=[],
                histograms=[],
                scalars=[_scalars("loss", list(chunk), values)],
            ),
        )
        seq += 1
    series_seconds = time.perf_counter() - started
    names = [f"model.layers.{i // 8}.part{i % 8}.weight" for i in range(layers)]
    started = time.perf_counter()
    for first in range(0, steps, 1_000):
        chunk = list(range(first, min(steps, first + 1_000)))
        rows = np.abs(np.random.default_rng(first).normal(0.05, 0.02, (len(chunk), layers)))
        if first % 20_000 == 0:
            rows[0, : layers // 10] = np.nan  # a skipped step's non-finite layers
        store.ingest(
            run.id,
            BatchIn.model_construct(
                seq=seq,
                rank=0,
                layers=names if first == 0 else None,
                status=None,
                events=[],
                scalars=[],
                histograms=[],
                vectors=[_vectors("grad/norm", chunk, rows.tolist())],
            ),
        )
        seq += 1
    vector_seconds = time.perf_counter() - started
    engine.dispose()
    return run.id, series_seconds, vector_seconds


def _scalars(key: str, steps: list[int], values: list[float]):
    from gradwatch.server.schemas import ScalarSeriesIn

    return ScalarSeriesIn.model_construct(key=key, steps=steps, values=values)


def _vectors(key: str, steps: list[int], values: list[list[float]]):
    from gradwatch.server.schemas import VectorSeriesIn

    return VectorSeriesIn.model_construct(key=key, steps=steps, values=values)


def baseline_series(database_url: str, run_id: str, max_points: int) -> tuple[float, list[int]]:
    """The query without rollups: every stored point read (decoded from its chunk) and min/max
    downsampled per bucket with numpy."""
    import numpy as np
    from sqlalchemy import text

    from gradwatch.server.database import make_engine
    from gradwatch.server.storage import chunked_points

    engine = make_engine(database_url)
    with engine.connect() as connection:
        series_id = connection.execute(
            text("SELECT id FROM series WHERE run_id = :r AND key = 'loss'"), {"r": run_id}
        ).scalar()
        started = time.perf_counter()
        points = chunked_points.read(connection, series_id, [0])[0]
        first, last = int(points.steps[0]), int(points.steps[-1])
        width = (last - first) // (max_points // 2) + 1
        buckets = (points.steps - first) // width
        starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
        finite = np.isfinite(points.values)
        steps: set[int] = set()
        for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(buckets)], strict=True):
            part, ok = points.values[lo:hi], finite[lo:hi]
            if not ok.all():
                steps.add(int(points.steps[lo + int(np.flatnonzero(~ok)[0])]))
            if ok.any():
                masked = np.where(ok, part, np.nan)
                steps.add(int(points.steps[lo + int(np.nanargmin(masked))]))
                steps.add(int(points.steps[lo + int(np.nanargmax(masked))]))
        seconds = time.perf_counter() - started
    engine.dispose()
    return seconds, sorted(steps)


def baseline_vectors(database_url: str, run_id: str, max_steps: int) -> float:
    """The pre-rollup heatmap: read every row, merge into max_steps buckets (numpy, not Python)."""
    from sqlalchemy import text

    from gradwatch.server.database import make_engine
    from gradwatch.server.storage.rollups import to_array, worst_per_bucket

    engine = make_engine(database_url)
    with engine.connect() as connection:
        started = time.perf_counter()
        rows = connection.execute(
            text(
                "SELECT v.step, v.data FROM vector_points v JOIN series s ON s.id = v.series_id"
                " WHERE s.run_id = :r AND s.key = 'grad/norm' AND v.rank = 0 ORDER BY v.step"
            ),
            {"r": run_id},
        ).all()
        matrix = np.vstack([to_array(bytes(row[1])) for row in rows])
        starts = np.arange(max_steps) * len(rows) // max_steps
        worst_per_bucket(matrix, np.unique(starts))
        seconds = time.perf_counter() - started
    engine.dispose()
    return seconds


def timed(client: httpx.Client, path: str, params: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    response = client.get(path, params=params)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return seconds, response.json()


def measure(database_url: str, args: argparse.Namespace) -> dict:
    run_id, series_seconds, vector_seconds = fill(database_url, args.points, args.layers, args.steps)
    print(
        f"  ingested {args.points:,} points in {series_seconds:.1f} s "
        f"({args.points / series_seconds:,.0f}/s) and "
        f"{args.steps:,} x {args.layers} vector rows in {vector_seconds:.1f} s",
        flush=True,
    )
    port = free_port()
    server = subprocess.Popen(
        server_command(port, database_url, launcher=[str(ROOT / ".venv/bin/gradwatch")]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    result: dict = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"server did not start: {server.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
            base = f"/api/v1/runs/{run_id}"
            first, answer = timed(client, f"{base}/series", {"key": "loss", "max_points": 2000})
            full = [
                timed(client, f"{base}/series", {"key": "loss", "max_points": 2000})[0]
                for _ in range(args.repeats)
            ]
            rng = random.Random(1)
            zoom = []
            for _ in range(args.repeats):
                start = rng.randrange(0, args.points - 10_000)
                end = rng.randrange(start + 10_000, args.points + 1)
                zoom.append(
                    timed(
                        client,
                        f"{base}/series",
                        {"key": "loss", "max_points": 2000, "start": start, "end": end},
                    )[0]
                )
            heat = [
                timed(client, f"{base}/vectors", {"key": "grad/norm", "max_steps": 500})[0]
                for _ in range(args.repeats)
            ]
            _, matrix = timed(client, f"{base}/vectors", {"key": "grad/norm", "max_steps": 500})
        base_series = [baseline_series(database_url, run_id, 2000) for _ in range(3)]
        base_heat = [baseline_vectors(database_url, run_id, 500) for _ in range(3)]
    finally:
        server.terminate()
        server.wait(30)
    kept = set(answer["steps"])
    spikes = {s for s in range(args.points) if s % 1_000_003 == 500_000 or s % 2_000_003 == 1_000_000}
    assert spikes <= kept, f"a spike or NaN was lost: {sorted(spikes - kept)[:5]}"
    assert len(answer["steps"]) <= 2000 and answer["downsampled"]
    assert len(matrix["steps"]) <= 500 and len(matrix["values"][0]) == args.layers
    result.update(
        first=first,
        full=full,
        zoom=zoom,
        heat=heat,
        answer_points=len(answer["steps"]),
        heat_cells=len(matrix["steps"]) * args.layers,
        base_series=statistics.median(s for s, _ in base_series),
        base_steps=len(base_series[0][1]),
        base_heat=statistics.median(base_heat),
    )
    return result


def postgres_database() -> tuple[str, callable]:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(POSTGRES_ADMIN)
    name = f"gradwatch_bench_{uuid.uuid4().hex[:10]}"
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(conninfo, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return admin.set(database=name).render_as_string(hide_password=False), drop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=10_000_000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--databases", default="sqlite,postgres")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start", flush=True)
    rows = []
    for kind in args.databases.split(","):
        print(f"{kind}:", flush=True)
        with tempfile.TemporaryDirectory() as home:
            drop = None
            if kind == "sqlite":
                url = f"sqlite:///{home}/gradwatch.db"
            else:
                url, drop = postgres_database()
            try:
                r = measure(url, args)
            finally:
                if drop is not None:
                    drop()

        def ms(seconds: float) -> float:
            return seconds * 1000

        print(
            f"  first query (cold caches): {ms(r['first']):.0f} ms; baseline (no rollups) kept "
            f"{r['base_steps']} points, rollups {r['answer_points']}",
            flush=True,
        )
        for name, values, baseline in (
            (f"series {args.points:,} -> 2,000 points", r["full"], r["base_series"]),
            ("series, random zoom windows", r["zoom"], None),
            (f"heatmap {args.layers} x {args.steps:,} -> 500 steps", r["heat"], r["base_heat"]),
        ):
            p50, p95 = ms(statistics.median(values)), ms(percentile(values, 0.95))
            against = "" if baseline is None else f"{ms(baseline):.0f} ms ({ms(baseline) / p50:.0f}x)"
            rows.append((kind, name, p50, p95, against))
    print()
    print(
        f"{'database':<9} {'query':<40} {'p50 ms':>8} {'p95 ms':>8}  "
        "baseline without rollups, median (ratio to p50)"
    )
    for kind, name, p50, p95, against in rows:
        print(f"{kind:<9} {name:<40} {p50:>8.1f} {p95:>8.1f}  {against}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
