"""What the bench scripts share: the servers they start as child processes and the databases those use.

    server_command    the argv of `gradwatch server` on a port, with a database URL
    server_env        the child's environment: ours, with its own GRADWATCH_HOME and, to run another
                      checkout of gradwatch, a PYTHONPATH entry ahead of ours
    Database          a fresh database for one server: a SQLite file, or a PostgreSQL database created
                      and dropped by the bench
    BackendCpu        CPU seconds of the PostgreSQL backends serving one database, over a window
    Server            a server child process in its own process group, up once healthy; stop()
    start_mlflow      `mlflow server` from its own venv (MLflow 3.17.2 in .venv-mlflow), on a Database
    mlflow_missing    why an MLflow venv cannot be used (with the command that creates it), or None
    mlflow_version    the MLflow version a venv holds
    free_port, process_tree_cpu, LOOPBACK (a urllib opener that ignores *_proxy settings)
    cpu_name          the CPU's model name, for the header every script prints
    percentile        the q-quantile of a list (nearest rank)

The scripts run as `python bench/NAME.py`, which puts bench/ first on sys.path: `from _common import ...`.
Nothing here imports gradwatch or a database driver at module level (ingest_end_to_end.py runs part of
itself in MLflow's venv).
"""

from __future__ import annotations

import math
import os
import platform
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

__all__ = [
    "CHROMIUM",
    "CHROMIUM_ARGS",
    "CLI_MODULE",
    "LOOPBACK",
    "MLFLOW_VERSION",
    "BackendCpu",
    "Database",
    "Server",
    "cpu_name",
    "free_port",
    "loopback_env",
    "mlflow_missing",
    "mlflow_version",
    "percentile",
    "process_tree_cpu",
    "server_command",
    "server_env",
    "start_mlflow",
]

# `gradwatch` run as a module of this interpreter: the installed (or PYTHONPATH's) gradwatch.cli
CLI_MODULE = (sys.executable, "-m", "gradwatch.cli")
# Debian's Chromium for the browser benchmarks: tests/support/headless_chromium.py (shared with the tests).
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from headless_chromium import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

MLFLOW_VERSION = "3.17.2"  # the MLflow the BENCHMARKS.md figures were measured with
# Requests made with urllib go straight to 127.0.0.1, whatever the *_proxy environment says.
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_command(
    port: int,
    database_url: str,
    *extra: str,
    launcher: Sequence[str] = CLI_MODULE,
    host: str | None = "127.0.0.1",
) -> list[str]:
    """`launcher server [--host HOST] --port PORT --database-url URL EXTRA...`; host None leaves
    --host out (the CLI's default, 127.0.0.1)."""
    command = [*launcher, "server"]
    if host is not None:
        command += ["--host", host]
    return [*command, "--port", str(port), "--database-url", database_url, *extra]


def server_env(home: Path, pythonpath: Path | None = None) -> dict[str, str]:
    """This process's environment with GRADWATCH_HOME=home; with `pythonpath`, that entry first on
    PYTHONPATH (ahead of any already set), so it imports ahead of the installed gradwatch."""
    env = dict(os.environ, GRADWATCH_HOME=str(home))
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return env


def loopback_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that must talk to 127.0.0.1 only: no proxy for it, and
    MLflow's telemetry (which would send usage events out) off."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        MLFLOW_DISABLE_TELEMETRY="true",
        DO_NOT_TRACK="true",
    )
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and its descendants, the living ones
    and those already reaped (counted in their parent's cutime/cstime)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is the state, stat(5)'s third field
            total += sum(int(f) for f in fields[11:15]) / ticks  # utime, stime, cutime, cstime
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


class Database:
    """A fresh database for one server: a SQLite file, or a PostgreSQL database created and dropped here."""

    def __init__(self, kind: str, folder: Path, label: str, admin_url: str) -> None:
        self.kind = kind
        self.admin_url = admin_url
        self._postmaster: int | None = None
        if kind == "sqlite":
            self.path = folder / f"{label}.db"
            self.name = ""
        else:
            self.name = f"gwbench_{label}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            base = admin_url.rsplit("/", 1)[0]
            self.psycopg_url = f"{base}/{self.name}"
            import psycopg

            with psycopg.connect(admin_url, autocommit=True) as admin:
                admin.execute(f'CREATE DATABASE "{self.name}"')

    def url(self, dialect: str) -> str:
        """The database's SQLAlchemy URL with `dialect` (e.g. "postgresql+psycopg", "postgresql")."""
        if self.kind == "sqlite":
            return f"sqlite:///{self.path}"
        return self.psycopg_url.replace("postgresql://", f"{dialect}://", 1)

    def query(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Rows of a read-only query (placeholders written as `?`); a missing table raises
        sqlite3.OperationalError or RuntimeError naming it."""
        if self.kind == "sqlite":
            with sqlite3.connect(self.path) as db:
                return list(db.execute(sql, params).fetchall())
        import psycopg

        with psycopg.connect(self.psycopg_url) as db:
            try:
                return list(db.execute(sql.replace("?", "%s"), params).fetchall())
            except psycopg.errors.UndefinedTable as exc:
                raise RuntimeError(str(exc)) from exc

    def query_by_key(self, sql: str, params: tuple[Any, ...]) -> dict[str, tuple[Any, ...]]:
        """Rows of a read-only query (placeholders written as `?`) by their first column."""
        return {row[0]: tuple(row[1:]) for row in self.query(sql, params)}

    def postmaster(self) -> int:
        """The PostgreSQL server's main process (the parent of every backend)."""
        if self._postmaster is None:
            import psycopg

            with psycopg.connect(
                self.admin_url
            ) as admin:  # this connection's backend: a child of the postmaster
                backend = admin.execute("SELECT pg_backend_pid()").fetchone()
                assert backend is not None
                stat = Path(f"/proc/{backend[0]}/stat").read_text()
            self._postmaster = int(stat[stat.rindex(")") + 2 :].split()[1])
        return self._postmaster

    def drop(self) -> None:
        """Drop the PostgreSQL database (a SQLite file goes with the bench's temp folder)."""
        if self.kind == "sqlite":
            return
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


class BackendCpu(threading.Thread):
    """CPU seconds used by the PostgreSQL backends serving one database while it runs (a context manager).

    The cluster is shared with other sessions, so its backends are told apart by their process title
    ("postgres: ... USER DATABASE HOST(PORT) state"), sampled every `interval` seconds: a backend that
    exits (a pooled connection above the pool size closes when returned) loses at most its last
    `interval` of CPU. For SQLite, `seconds` stays NaN.
    """

    def __init__(self, database: Database, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.database = database
        self.interval = interval
        self.seconds = math.nan
        self._stop_sampling = threading.Event()
        self._titles: dict[int, str] = {}
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}

    def __enter__(self) -> Self:
        if self.database.kind == "postgresql":
            self._postmaster = self.database.postmaster()
            self._sample(initial=True)
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.database.kind == "postgresql":
            self._stop_sampling.set()
            self.join()
            self._sample(initial=False)
            self.seconds = sum(cpu - self._first.get(pid, 0.0) for pid, cpu in self._last.items())

    def run(self) -> None:
        while not self._stop_sampling.wait(self.interval):
            self._sample(initial=False)

    def _sample(self, initial: bool) -> None:
        marker = f" {self.database.name} "
        try:
            children = Path(f"/proc/{self._postmaster}/task/{self._postmaster}/children").read_text().split()
        except OSError:
            return
        for pid in map(int, children):
            try:
                if pid not in self._titles:
                    self._titles[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                if marker not in self._titles[pid]:
                    continue
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            if initial:
                self._first[pid] = cpu
            self._last[pid] = cpu


class Server:
    """A server as a child process in its own process group (MLflow starts several processes)."""

    def __init__(
        self, system: str, command: list[str], port: int, health_path: str, log: Path, env: dict[str, str]
    ) -> None:
        self.system = system
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log.parent
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()  # what it started may still run
                raise RuntimeError(f"{system} server exited with {self.process.returncode}; see {log}")
            try:
                with LOOPBACK.open(self.url + health_path, timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{system} server not healthy after 300 s; see {log}")

    def cpu(self) -> float:
        return process_tree_cpu(self.process.pid)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; then SIGKILL to whatever of its process group is left."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:  # workers that outlive their parent are still in its process group
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_mlflow(
    database: Database, folder: Path, venv: Path, workers: int = 1, max_overflow: int = 45
) -> Server:
    """`mlflow server --workers WORKERS` of `venv` on 127.0.0.1 with `database` as its backend store,
    its log in `folder` (mlflow-KIND.log); returns once /health answers."""
    port = free_port()
    artifacts = folder / f"mlflow-artifacts-{database.kind}"
    # The job runner (huey consumers for MLflow's GenAI jobs) has nothing to do with tracking: off.
    # log-batch holds one pooled connection while _log_metrics takes a second; with the default pool
    # (5 + 10 overflow) and more concurrent requests than that, every request waits for a second
    # connection that never frees up until the 30 s pool timeout (HTTP 400 "QueuePool limit ...
    # reached"). Up to 40 requests run at once (the WSGI bridge's thread limit), so 5 + 45 suffices.
    # psycopg2 named explicitly: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3.
    env = loopback_env(
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW=str(max_overflow),
    )
    command = [
        str(venv / "bin" / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--backend-store-uri",
        database.url("postgresql+psycopg2"),
        "--default-artifact-root",
        str(artifacts),
    ]
    return Server("mlflow", command, port, "/health", folder / f"mlflow-{database.kind}.log", env)


def mlflow_missing(venv: Path) -> str | None:
    """None when `venv` has an `mlflow` command; else what is wrong and the command that creates it
    (outside the project venv: MLflow's dependencies conflict with gradwatch's)."""
    if (venv / "bin" / "mlflow").exists():
        return None
    return (
        f"no MLflow in {venv}; create it (outside the project venv: dependency conflicts):\n"
        f"    python3 -m venv {venv} && {venv}/bin/pip install mlflow=={MLFLOW_VERSION} psycopg2-binary"
    )


def mlflow_version(venv: Path) -> str:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import mlflow; print(mlflow.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
