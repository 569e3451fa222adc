"""Server ingest rate: points per second stored by gradwatch and by an MLflow tracking server, same run.

    .venv/bin/python bench/server_ingest.py [--points 200000] [--agents 1,8,64]
        [--databases sqlite,postgresql] [--systems gradwatch,mlflow] [--gradwatch-rev REV]
        [--mlflow-venv .venv-mlflow] [--compress auto|always|never] [--profile DIR]

For each database kind, two real servers run as child processes on 127.0.0.1, each on a fresh
database: `gradwatch server` (one process: uvicorn, FastAPI; the working tree, or --gradwatch-rev
exported with `git archive`) and `mlflow server` (uvicorn with --mlflow-workers worker processes,
default 1; MLflow's own default is 4). SQLite: a file in a temp folder per server; PostgreSQL: a
database per server, created through --postgres-admin-url and dropped at the end. For each agent
count the two systems are fed the same points one after the other: every agent is one run (created
before the clock starts) and one client thread with its own keep-alive HTTP connection; `--points`
points in all (rounded to whole requests per agent), --keys scalar keys per step (loss, lr,
amp/scale, ..., grad/norm/layerN, with a healthy run's values: see value()), --batch-points points
per request:

- gradwatch: POST /api/v1/runs/{id}/batches with the agent's wire batch (agent/_wire.py: one
  {"key", "steps", "values"} series per key, rank, seq, and the four agent/ health scalars the
  sender adds to every batch, which the agent does not count as points), encoded as the agent
  encodes it: values as base64 float64 (`values_f64`, agent/_wire.py's `pack_values`) when the server
  announces that encoding in its answer to POST /runs, the agent's own `dumps`, and gzip-compressed
  when the agent's HttpTransport would compress (`--compress auto`: not to a server on loopback, as
  here; `always` to measure the gzip path).
- MLflow: POST /api/2.0/mlflow/runs/log-batch with {"run_id", "metrics": [{key, value, timestamp,
  step}]} (plain JSON, as MLflow's client sends it); at most 1000 metrics per request (MLflow's limit).

Every request body is built before the clock starts. A request answered 429/5xx or cut off is sent
again after a backoff, as both systems' clients do (counted as "retried requests"). Rate = points
sent / wall time from the first send to the last acknowledgement. Afterwards the servers' databases
are read directly: per key, every (run, step) stored exactly once and the values' sum as sent, or
the configuration is reported as failed (exit status 1). Also printed per configuration: CPU
seconds, over the timed window, of the server's processes, of the PostgreSQL backends serving its
database (BackendCpu) and of this client process, and the load average (the machine may be shared).
With --profile, py-spy samples the gradwatch server (slower: take rates from a run without).
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import io
import json
import math
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    LOOPBACK,
    BackendCpu,
    Database,
    Server,
    free_port,
    mlflow_missing,
    mlflow_version,
    server_command,
    server_env,
    start_mlflow,
)

from gradwatch._transport import COMPRESS_ABOVE, COMPRESS_LEVEL, HttpTransport
from gradwatch._wire import HEALTH_PREFIX, VALUES_F64, dumps, pack_values

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("gradwatch", "mlflow")
DATABASES = ("sqlite", "postgresql")
MLFLOW_MAX_METRICS = 1000  # MLflow's MAX_METRICS_PER_BATCH for log-batch
NAMED_KEYS = (
    "loss",
    "lr",
    "amp/scale",
    "amp/skipped",
    "amp/growth_tracker",
    "grad/global_norm",
    "grad/global_norm_post_clip",
    "perf/step_time",
    "perf/samples_per_sec",
    "memory/max_allocated",
)
TIMESTAMP_BASE_MS = 1_700_000_000_000
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_ATTEMPTS = 8
# pyproject.toml's package-dir mapping, parents first (for --gradwatch-rev).
PACKAGE_DIRS = {
    "gradwatch": "agent",
    "gradwatch.server": "server",
    "gradwatch.dashboard": "dashboard",
    "gradwatch.migrations": "migrations",
}


def metric_keys(count: int) -> list[str]:
    """`count` scalar keys: the agent's usual scalars, then per-layer grad/norm keys."""
    named = list(NAMED_KEYS[:count])
    return named + [f"grad/norm/layer{index}" for index in range(count - len(named))]


def value(key: str, step: int) -> float:
    """`key` at `step` in a healthy fp16 run: the loss falls, the scale grows every 2000 steps, no step
    is skipped, norms wiggle by a few percent. None of the server's alert rules fires on it, as in
    most training; values that make rules fire on every step cost gradwatch's ingest more."""
    wiggle = 0.05 * math.sin(0.1 * step + len(key))
    if key == "loss":
        return 2.0 + 8.0 / (1.0 + step / 500) + 0.1 * wiggle
    if key == "lr":
        return 3e-4 * min(1.0, (step + 1) / 100)
    if key == "amp/scale":
        return 65536.0 * 2.0 ** (step // 2000)
    if key == "amp/skipped":
        return 0.0
    if key == "amp/growth_tracker":
        return float(step % 2000)
    if key in ("grad/global_norm", "grad/global_norm_post_clip"):  # below max_norm 1.0: clipping is a no-op
        return 0.8 * (1.0 + 0.05 * math.sin(0.1 * step))
    if key == "perf/step_time":
        return 0.2 * (1.0 + wiggle)
    if key == "perf/samples_per_sec":
        return 640.0 * (1.0 - wiggle)
    if key == "memory/max_allocated":
        return 8.5e9
    layer = int(key.rsplit("layer", 1)[1])  # grad/norm/layerN
    return 0.01 * (1 + layer % 7) * (1.0 + wiggle)


# -- servers (Database, BackendCpu, Server and start_mlflow are _common's) ---------------------------


def export_revision(revision: str, folder: Path) -> tuple[Path, str]:
    """Lay out gradwatch at a git revision as an importable package under `folder`.

    Returns (a PYTHONPATH entry that imports that gradwatch ahead of the editable install, the
    commit's short hash). Read-only for the repository: `git archive`, no checkout.
    """
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, *PACKAGE_DIRS.values()], check=True, capture_output=True
    ).stdout
    source = folder / "source"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    root = folder / "pythonpath"
    for package, directory in PACKAGE_DIRS.items():  # pyproject's package-dir mapping
        shutil.move(source / directory, root.joinpath(*package.split(".")))
    return root, commit[:7]


def start_gradwatch(database: Database, folder: Path, pythonpath: Path | None) -> Server:
    port = free_port()
    env = server_env(folder / "gradwatch-home", pythonpath)
    command = server_command(port, database.url("postgresql+psycopg"))
    return Server("gradwatch", command, port, "/healthz", folder / f"gradwatch-{database.kind}.log", env)


# -- requests -------------------------------------------------------------------------------------


def post_json(url: str, document: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(document).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with LOOPBACK.open(request, timeout=60) as response:
        return json.loads(response.read() or b"{}")


@dataclass
class Plan:
    """What every agent sends in one configuration: steps × keys points, in requests of steps_per_request
    steps."""

    agents: int
    keys: list[str]
    steps: int
    steps_per_request: int

    @property
    def points(self) -> int:
        return self.agents * self.steps * len(self.keys)

    def request_ranges(self) -> list[range]:
        return [
            range(first, min(first + self.steps_per_request, self.steps))
            for first in range(0, self.steps, self.steps_per_request)
        ]

    def value_sum(self, key: str) -> float:
        """The sum of the values of `key` that all agents send."""
        return self.agents * math.fsum(value(key, step) for step in range(self.steps))


@dataclass
class Request:
    path: str
    body: bytes
    headers: dict[str, str]
    points: int | None = None  # for gradwatch: the points its acknowledgement must count


def gradwatch_requests(plan: Plan, url: str, project: str, compress: str = "auto") -> list[list[Request]]:
    """Create one gradwatch run per agent; return each agent's batch requests, encoded as the agent's
    sender and HttpTransport encode them for this server (see the module docstring)."""
    agents = []
    seq_base = int(time.time() * 1000) << 20  # the agent's seq: (start millisecond << 20) + counter
    gzipped = HttpTransport(url).compress if compress == "auto" else compress == "always"
    for agent in range(plan.agents):
        run_id = uuid.uuid4().hex
        created = post_json(
            f"{url}/api/v1/runs",
            {
                "id": run_id,
                "project": project,
                "name": f"agent-{agent}",
                "config": {},
                "metadata": {"hostname": platform.node(), "python": platform.python_version(), "rank": 0},
            },
        )
        packed = VALUES_F64 in (created.get("wire_features") or [])
        requests = []
        for counter, steps in enumerate(plan.request_ranges()):
            scalars = [
                {"key": key, "steps": list(steps), "values": [value(key, step) for step in steps]}
                for key in plan.keys
            ]
            scalars += [
                {"key": f"{HEALTH_PREFIX}{name}", "steps": [steps[-1]], "values": [0.0]}
                for name in ("queued", "sent", "spooled", "dropped")
            ]
            acknowledged = sum(len(series["steps"]) for series in scalars)  # health scalars included
            batch = {"rank": 0, "seq": seq_base + counter, "scalars": scalars, "events": []}
            body = dumps(pack_values(batch) if packed else batch).encode()
            headers = {"Content-Type": "application/json"}
            if gzipped and len(body) > COMPRESS_ABOVE:
                body = gzip.compress(body, compresslevel=COMPRESS_LEVEL)
                headers["Content-Encoding"] = "gzip"
            requests.append(Request(f"/api/v1/runs/{run_id}/batches", body, headers, acknowledged))
        agents.append(requests)
    return agents


def mlflow_requests(plan: Plan, url: str, experiment_name: str) -> list[list[Request]]:
    """Create an experiment and one MLflow run per agent; return each agent's log-batch requests."""
    experiment_id = post_json(f"{url}/api/2.0/mlflow/experiments/create", {"name": experiment_name})[
        "experiment_id"
    ]
    agents = []
    for agent in range(plan.agents):
        run = post_json(
            f"{url}/api/2.0/mlflow/runs/create",
            {
                "experiment_id": experiment_id,
                "run_name": f"agent-{agent}",
                "start_time": int(time.time() * 1000),
            },
        )
        run_id = run["run"]["info"]["run_id"]
        requests = []
        for steps in plan.request_ranges():
            metrics = [
                {"key": key, "value": value(key, step), "timestamp": TIMESTAMP_BASE_MS + step, "step": step}
                for step in steps
                for key in plan.keys
            ]
            body = json.dumps({"run_id": run_id, "metrics": metrics}).encode()
            requests.append(
                Request("/api/2.0/mlflow/runs/log-batch", body, {"Content-Type": "application/json"})
            )
        agents.append(requests)
    return agents


@dataclass
class AgentResult:
    started: float = math.inf
    finished: float = -math.inf
    requests: int = 0
    retries: int = 0
    error: str | None = None


def send(port: int, requests: list[Request], start: threading.Barrier, result: AgentResult) -> None:
    """One agent: its requests in order on one keep-alive connection.

    A request that fails in a way the server may recover from (429, 5xx, a dropped connection) is
    sent again after a backoff, up to RETRY_ATTEMPTS times, as both systems' clients do; the waits
    count in the wall time. Any other failure stops the agent."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        start.wait()
        result.started = time.perf_counter()
        for request in requests:
            for attempt in range(RETRY_ATTEMPTS):
                if attempt:
                    result.retries += 1
                    time.sleep(min(0.25 * 2 ** (attempt - 1), 4.0))
                try:
                    connection.request("POST", request.path, request.body, request.headers)
                    response = connection.getresponse()
                    answer = response.read()
                except (OSError, http.client.HTTPException) as exc:
                    connection.close()  # the next request opens a new connection
                    failure = f"{type(exc).__name__}: {exc}"
                    continue
                if response.status == 200:
                    break
                failure = f"HTTP {response.status}: {answer[:300]!r}"
                if response.status not in RETRY_STATUSES:
                    result.error = failure
                    return
            else:
                result.error = f"gave up after {RETRY_ATTEMPTS} attempts: {failure}"
                return
            if request.points is not None:  # a gradwatch BatchAck
                ack = json.loads(answer)
                if ack["duplicate"] and not attempt:
                    result.error = "a batch sent once was acknowledged as a duplicate"
                    return
                if not ack["duplicate"] and ack["points"] != request.points:
                    result.error = f"a batch of {request.points} points was acknowledged with {ack['points']}"
                    return
            result.requests += 1
        result.finished = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - reported with the configuration
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()


@dataclass
class Measurement:
    system: str
    database: str
    agents: int
    points: int
    seconds: float = math.nan
    server_cpu: float = math.nan
    database_cpu: float = math.nan
    client_cpu: float = math.nan
    retries: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    problems: list[str] = field(default_factory=list)

    @property
    def cpu_per_point(self) -> float:
        """CPU seconds per point: the server's processes plus its PostgreSQL backends, if any."""
        return (self.server_cpu + (0.0 if math.isnan(self.database_cpu) else self.database_cpu)) / self.points

    @property
    def rate(self) -> float:
        return self.points / self.seconds if not self.problems else math.nan


def measure(
    server: Server,
    database: Database,
    plan: Plan,
    agent_requests: list[list[Request]],
    profile: Path | None = None,
) -> Measurement:
    """Send everything with one thread per agent; wall time from the first send to the last ack.

    With `profile`, py-spy samples the server meanwhile and writes collapsed stacks there."""
    result = Measurement(server.system, database.kind, plan.agents, plan.points)
    profiler = None
    if profile is not None:
        py_spy = Path(sys.executable).parent / "py-spy"
        profiler = subprocess.Popen(
            [
                str(py_spy),
                "record",
                "--pid",
                str(server.process.pid),
                "--rate",
                "200",
                "--format",
                "raw",
                "--output",
                str(profile),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # py-spy attaches
    results = [AgentResult() for _ in agent_requests]
    start = threading.Barrier(len(agent_requests) + 1)
    threads = [
        threading.Thread(target=send, args=(server.port, requests, start, r), daemon=True)
        for requests, r in zip(agent_requests, results, strict=True)
    ]
    for thread in threads:
        thread.start()
    with BackendCpu(database) as backends:
        server_before, client_before = server.cpu(), time.process_time()
        start.wait()
        for thread in threads:
            thread.join()
        client_after, server_after = time.process_time(), server.cpu()
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        profiler.wait(timeout=60)
    result.load = os.getloadavg()
    result.seconds = max(r.finished for r in results) - min(r.started for r in results)
    result.server_cpu = server_after - server_before
    result.client_cpu = client_after - client_before
    result.retries = sum(r.retries for r in results)
    result.database_cpu = backends.seconds
    errors = [r.error for r in results if r.error]
    if errors:
        result.problems.append(f"{len(errors)} of {len(results)} agents failed, first: {errors[0]}")
    return result


# -- verification ---------------------------------------------------------------------------------


Stored = dict[str, tuple[int, int, float]]


def stored_gradwatch(database: Database, project: str) -> Stored:
    """Per key: (points, distinct (run, step), sum of values) stored for the project's runs (health keys
    excluded)."""
    try:
        chunks = database.query(
            "SELECT s.key, s.run_id, c.first_step, c.step_data, c.value_data FROM point_chunks c"
            " JOIN series s ON s.id = c.series_id JOIN runs r ON r.id = s.run_id"
            " WHERE r.project = ? AND s.key NOT LIKE ?",
            (project, f"{HEALTH_PREFIX}%"),
        )
    except (sqlite3.OperationalError, ImportError, RuntimeError) as exc:  # --gradwatch-rev before 0011
        if "point_chunks" not in str(exc):
            raise
        return database.query_by_key(
            "SELECT s.key, count(*), count(DISTINCT s.run_id || ':' || p.step), sum(p.value) "
            "FROM points p JOIN series s ON s.id = p.series_id JOIN runs r ON r.id = s.run_id "
            "WHERE r.project = ? AND s.key NOT LIKE ? GROUP BY s.key",
            (project, f"{HEALTH_PREFIX}%"),
        )
    from gradwatch.server.storage.chunked_points import decode

    counts: dict[str, list[Any]] = {}
    for key, run_id, first_step, step_data, value_data in chunks:
        points = decode(first_step, step_data, value_data)
        entry = counts.setdefault(key, [0, set(), 0.0])
        entry[0] += len(points)
        entry[1].update((run_id, step) for step in points.steps.tolist())
        entry[2] += float(points.values.sum())
    return {key: (n, len(distinct), total) for key, (n, distinct, total) in counts.items()}


def stored_mlflow(database: Database, experiment_name: str) -> Stored:
    """Per key: (metric rows, distinct (run, step), sum of values) stored for the experiment's runs."""
    return database.query_by_key(
        "SELECT m.key, count(*), count(DISTINCT m.run_uuid || ':' || m.step), sum(m.value) "
        "FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
        "JOIN experiments e ON e.experiment_id = r.experiment_id WHERE e.name = ? GROUP BY m.key",
        (experiment_name,),
    )


def verify(result: Measurement, stored: Stored, plan: Plan) -> None:
    """Every key has every (run, step) once, and its values sum to what was sent."""
    per_key = plan.agents * plan.steps
    for key in plan.keys:
        count, distinct, total = stored.get(key, (0, 0, 0.0))
        expected = plan.value_sum(key)
        if count != per_key or distinct != per_key:
            result.problems.append(f"{key}: sent {per_key} points, stored {count} ({distinct} distinct)")
        elif not math.isclose(total, expected, rel_tol=1e-9, abs_tol=1e-9):
            result.problems.append(f"{key}: stored values sum to {total!r}, sent {expected!r}")
    if set(stored) - set(plan.keys):
        result.problems.append(f"keys stored that were not sent: {sorted(set(stored) - set(plan.keys))}")


# -- main -----------------------------------------------------------------------------------------


def parse_list(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if allowed is not None:
        for item in items:
            if item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed)}")
    return items


def cell(m: Measurement, number: float) -> str:
    return "failed" if m.problems else f"{number:,.0f}"


def describe(m: Measurement) -> str:
    database_cpu = "" if math.isnan(m.database_cpu) else f", its PostgreSQL backends {m.database_cpu:.1f}"
    status = f"{m.rate:,.0f} points/s" if not m.problems else "FAILED: " + "; ".join(m.problems)
    return (
        f"{m.database:10} {m.agents:3} agents {m.system:9}: {m.points:,} points in {m.seconds:.1f} s "
        f"= {status} "
        f"(CPU s: server {m.server_cpu:.1f}{database_cpu}, client {m.client_cpu:.1f}; "
        f"{m.retries} retried requests; load {m.load[0]:.1f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=200_000, help="points per configuration (all agents)")
    parser.add_argument(
        "--agents",
        type=lambda t: [int(a) for a in parse_list(t)],
        default=[1, 8, 64],
        help="concurrent agent counts, comma-separated",
    )
    parser.add_argument("--systems", type=lambda t: parse_list(t, SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--databases", type=lambda t: parse_list(t, DATABASES), default=list(DATABASES))
    parser.add_argument("--keys", type=int, default=50, help="scalar keys per step")
    parser.add_argument(
        "--compress",
        choices=("auto", "always", "never"),
        default="auto",
        help="gzip gradwatch's request bodies: auto = as the agent's HttpTransport would (not on loopback)",
    )
    parser.add_argument(
        "--batch-points",
        type=int,
        default=1000,
        help=f"points per request, both systems (MLflow allows at most {MLFLOW_MAX_METRICS})",
    )
    parser.add_argument(
        "--gradwatch-batch-points",
        type=int,
        default=None,
        help="points per gradwatch request when it should differ from MLflow's (default: "
        "--batch-points); e.g. 5000 = 100 steps x 50 keys, what the agent sends with its "
        "default flush_every_steps=100 when steps come faster than its 1 s flush interval",
    )
    parser.add_argument(
        "--gradwatch-rev",
        default=None,
        help="serve gradwatch as of this git revision (exported with git archive) instead of "
        "the working tree; the client's wire encoding is always the working tree's",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="folder for py-spy profiles (collapsed stacks) of the gradwatch server, one per "
        "configuration; py-spy must be in this venv; sampling slows the server: take rates from "
        "a run without it",
    )
    parser.add_argument("--mlflow-venv", type=Path, default=ROOT / ".venv-mlflow")
    parser.add_argument(
        "--mlflow-workers",
        type=int,
        default=1,
        help="mlflow server --workers (MLflow's default is 4; gradwatch runs one process)",
    )
    parser.add_argument(
        "--mlflow-max-overflow",
        type=int,
        default=45,
        help="MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW (MLflow's default 10 deadlocks log-batch at "
        "15+ concurrent requests until its pool timeout; see start_mlflow)",
    )
    parser.add_argument(
        "--postgres-admin-url",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="a database to connect to for CREATE/DROP DATABASE",
    )
    args = parser.parse_args()
    if args.keys < 1 or args.batch_points < args.keys or args.points < 1:
        parser.error("need --keys >= 1, --batch-points >= --keys and --points >= 1")
    if "mlflow" in args.systems and args.batch_points > MLFLOW_MAX_METRICS:
        parser.error(f"MLflow's log-batch takes at most {MLFLOW_MAX_METRICS} metrics: lower --batch-points")

    versions = [f"Python {platform.python_version()}", f"{os.cpu_count()} CPUs"]
    if "mlflow" in args.systems:
        missing = mlflow_missing(args.mlflow_venv)
        if missing:
            print(missing, file=sys.stderr)
            return 2
        versions.insert(
            0,
            f"MLflow {mlflow_version(args.mlflow_venv)} (uvicorn, --workers {args.mlflow_workers}, "
            f"job execution off, SQLAlchemy pool 5 + {args.mlflow_max_overflow} overflow)",
        )
    folder = Path(tempfile.mkdtemp(prefix="gradwatch-ingest-"))
    pythonpath = None
    if args.gradwatch_rev:
        pythonpath, commit = export_revision(args.gradwatch_rev, folder / "gradwatch-rev")
        check = subprocess.run(
            [sys.executable, "-c", "import gradwatch.server; print(gradwatch.server.__file__)"],
            check=True,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(pythonpath)),
        )
        if not check.stdout.startswith(str(pythonpath)):
            print(
                f"the exported revision does not shadow the installed gradwatch: {check.stdout}",
                file=sys.stderr,
            )
            return 2
        source = f"{commit} (--gradwatch-rev {args.gradwatch_rev})"
    else:
        source = (
            subprocess.run(
                ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                check=False,
                capture_output=True,
                text=True,
            ).stdout.strip()
            + " (working tree)"
        )
    versions.insert(0, f"gradwatch server {source}, one process, bodies gzip {args.compress}")
    if args.profile is not None:
        if not (Path(sys.executable).parent / "py-spy").exists():
            print(f"--profile needs py-spy: {sys.executable} -m pip install py-spy", file=sys.stderr)
            return 2
        args.profile.mkdir(parents=True, exist_ok=True)
    keys = metric_keys(args.keys)
    steps_per_request = args.batch_points // args.keys
    gradwatch_steps_per_request = (args.gradwatch_batch_points or args.batch_points) // args.keys
    print("; ".join(versions))
    print(
        f"{args.keys} keys per step, {steps_per_request * args.keys} points per request"
        + (
            f" ({gradwatch_steps_per_request * args.keys} for gradwatch)"
            if args.gradwatch_batch_points
            else ""
        )
        + f", load average {os.getloadavg()[0]:.1f} at the start",
        flush=True,
    )

    results: list[Measurement] = []
    started = time.monotonic()
    for database_kind in args.databases:
        databases: dict[str, Database] = {}
        servers: dict[str, Server] = {}
        try:
            for system in args.systems:
                databases[system] = Database(database_kind, folder, system, args.postgres_admin_url)
                if system == "gradwatch":
                    servers[system] = start_gradwatch(databases[system], folder, pythonpath)
                else:
                    servers[system] = start_mlflow(
                        databases[system],
                        folder,
                        args.mlflow_venv,
                        args.mlflow_workers,
                        args.mlflow_max_overflow,
                    )
            for agents in args.agents:
                requests_per_agent = max(1, round(args.points / agents / (steps_per_request * args.keys)))
                steps = requests_per_agent * steps_per_request  # the same points for both systems
                for system in args.systems:
                    plan = Plan(
                        agents,
                        keys,
                        steps,
                        gradwatch_steps_per_request if system == "gradwatch" else steps_per_request,
                    )
                    label = f"ingest-{database_kind}-{agents}-{uuid.uuid4().hex[:8]}"
                    server, database = servers[system], databases[system]
                    if system == "gradwatch":
                        agent_requests = gradwatch_requests(plan, server.url, label, args.compress)
                        profile = (
                            None
                            if args.profile is None
                            else args.profile / f"gradwatch-{database_kind}-{agents}.txt"
                        )
                        result = measure(server, database, plan, agent_requests, profile)
                        verify(result, stored_gradwatch(database, label), plan)
                    else:
                        agent_requests = mlflow_requests(plan, server.url, label)
                        result = measure(server, database, plan, agent_requests)
                        verify(result, stored_mlflow(database, label), plan)
                    del agent_requests
                    results.append(result)
                    print(describe(result), flush=True)
        finally:
            for server in servers.values():
                server.stop()
            for database in databases.values():
                database.drop()
    for leftover in folder.iterdir():  # keep the server logs only
        if leftover.is_dir():
            shutil.rmtree(leftover)
        elif leftover.suffix != ".log":
            leftover.unlink()

    print(
        f"\n{time.monotonic() - started:.0f} s in all; load average {os.getloadavg()[0]:.1f} at the end; "
        f"server logs in {folder}\n"
    )
    by_key = {(m.database, m.agents, m.system): m for m in results}
    print(
        "| database | agents | points | gradwatch points/s | MLflow points/s | ratio "
        "| gradwatch CPU µs/point | MLflow CPU µs/point | CPU ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for database_kind in args.databases:
        for agents in args.agents:
            gw, ml = (
                by_key.get((database_kind, agents, "gradwatch")),
                by_key.get((database_kind, agents, "mlflow")),
            )
            pair = (gw, ml)
            points = next((m.points for m in pair if m), 0)
            rates = [cell(m, m.rate) if m else "—" for m in pair]
            costs = [cell(m, m.cpu_per_point * 1e6) if m else "—" for m in pair]
            both = gw and ml and not gw.problems and not ml.problems
            ratio = f"{gw.rate / ml.rate:.1f}x" if both else "—"
            cpu_ratio = f"{ml.cpu_per_point / gw.cpu_per_point:.1f}x" if both else "—"
            print(
                f"| {database_kind} | {agents} | {points:,} | {rates[0]} | {rates[1]} | {ratio} "
                f"| {costs[0]} | {costs[1]} | {cpu_ratio} |"
            )
    print(
        "\nCPU µs/point: the server's processes plus the PostgreSQL backends serving its database, per "
        "point stored; CPU ratio = MLflow's / gradwatch's (less sensitive to other load on the machine than "
        "the rates)."
    )
    return 1 if any(m.problems for m in results) else 0


if __name__ == "__main__":
    sys.exit(main())
