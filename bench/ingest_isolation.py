"""Ingest isolation: another tenant's latency while one token does its worst, per-tenant limits on and off.

    .venv/bin/python bench/ingest_isolation.py [--databases sqlite,postgresql] [--baseline-s 5]
        [--attack-s 15] [--swarm 8] [--no-batches] [--firing] [--postgres-admin-url URL]
        [--attacks batches,events,layers,rules,reads,websockets,preauth,preauth_reads,halfopen,
        slow_webhooks] [--proxy nginx]

For each database and each configuration, a fresh database (a SQLite file in a temp folder; a
PostgreSQL database created through --postgres-admin-url and dropped after) and a real server child
process on 127.0.0.1 (uvicorn with create_app(Settings(...)) and the connection guards of
server/listener.py and server/connections.py, the API only; `gradwatch server` adds the dashboard)
with two ingest tokens, for projects "victim" and "hostile":

- limits on:  the server's defaults (server.settings: per token 2 batch requests in flight, 20,000
  points/s in bursts of 100,000; per batch 100,000 points and 1,000,000 numbers).
- limits off: ingest_concurrency=0, ingest_points_per_s=0 (no concurrency or rate limit); the
  per-batch caps stay, so the hostile sends the same batches in both.

The scenario is tests/support/ingest_attack.py's (run_scenario, as the hostile-tenant test runs it):
the victim posts a 1-point batch 4 times a second through the agent's own HttpTransport, for
--baseline-s alone and then for --attack-s while the hostile token, ignoring every Retry-After,
posts batches at the caps back to back (scalars of the keys the alert rules read, and one thread of
per-layer vectors of zeros at the numbers cap), oversized ones (past the points cap; a gzip body
inflating past the byte limit), --swarm threads of concurrent 2,000-point batches, and asks for a
grad_norm_spike rule with the largest window (an ingest token is refused that: 403). Its values are
a healthy run's (the rules read them, none fires); with --firing its rank-0 batches skip every step,
so that rules fire on each step. All request bodies are built before the clock starts; the hostile
runs in a process of its own. Reported per configuration: the victim's latency (p50, p95, worst),
its errors (any non-200 answer or failure) and samples, the hostile's accepted points per second and
answers, and the server's peak RSS (VmHWM).

--attacks runs other attacks too, each on a fresh server with the limits on (tests/support/
ingest_attack.py, OtherAttack; the hostile token may then also read and administer its own project):
events (batches of 90,000 events), layers (40,000 layer names of 400 characters), rules (as many
alert rules with the largest windows as its project may hold, then the batches above), reads (8
threads reading 100,000 points of a 400,000-point series), websockets (2,000 live streams held
open), preauth (gzip bombs and 30 MB JSON without a token), preauth_reads (gzip bombs on GET /healthz,
reads with a made-up token per request), halfopen (up to 15,000 connections
that send half a request head) and slow_webhooks (the victim's webhook delivery latency, asked for ->
received, while the hostile's 8 webhooks point at receivers that drip their answers a byte every 4 s).
A last table gives the victim's p50/p95 alone and under each.
--proxy nginx puts server/deploy/nginx.conf in front of the server (its per-address limits on
connections and stream opens included), as a team deployment runs it: victim and hostile go through it.

First (skip with --no-batches), the server's peak RSS for single batches, each sent gzip-compressed to
a fresh server with the default limits (SQLite): one at the points cap and one at the numbers cap
(accepted), one ten times over the points cap and one just under the byte limit (32 MB of JSON, 8x
the numbers cap), both refused with 413 after parsing, before validation.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gradwatch.server.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "support")]

import ingest_attack as scenario  # noqa: E402 - tests/support is put on the path just above
import webhook_attack  # noqa: E402

CONFIGS = {"off": {"ingest_concurrency": 0, "ingest_points_per_s": 0}, "on": {}}
SERVE = """
import json, sys
import uvicorn
from gradwatch.server import connections, listener
from gradwatch.server.app import create_app
from gradwatch.server.settings import Settings
settings = Settings(**json.loads(sys.argv[1]))
config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
                        **connections.uvicorn_options())
listener.GuardedServer(config, settings.connections_per_address).run()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def database(kind: str, folder: Path, admin_url: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / f'isolation-{uuid.uuid4().hex[:8]}.db'}"
        return
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(admin_url)
    name = f"gradwatch_isolation_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(
        admin.set(drivername="postgresql").render_as_string(hide_password=False), autocommit=True
    ) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
        try:
            yield admin.set(database=name).render_as_string(hide_password=False)
        finally:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def server(
    database_url: str, overrides: dict[str, Any], log_path: Path
) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    settings = {"database_url": database_url, **overrides}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, json.dumps(settings), str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/healthz", timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 60 s")
            time.sleep(0.1)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def nginx_in_front(server_url: str, folder: Path) -> Iterator[str]:
    """server/deploy/nginx.conf in front of the one server (its per-address connection and stream-open
    limits included), as a team deployment runs it; yields the proxy's URL."""
    import shutil

    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx is None:
        raise SystemExit("--proxy nginx: nginx is not installed (apt-get install nginx-light)")
    site = (ROOT / "server" / "deploy" / "nginx.conf").read_text()
    upstream = server_url.removeprefix("http://")
    site = site.replace("server gradwatch-1:8765", f"server {upstream}")
    site = "\n".join(line for line in site.splitlines() if "gradwatch-2:8765" not in line)
    port = free_port()
    site = site.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    home = folder / f"nginx-{port}"
    home.mkdir()
    (home / "site.conf").write_text(site)
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp_paths = "".join(
        f"{kind}_temp_path {home / kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (home / "nginx.conf").write_text(
        f"{user}daemon off;\nworker_processes 1;\nworker_rlimit_nofile 40000;\npid {home / 'nginx.pid'};\n"
        f"error_log {home / 'error.log'} crit;\n"
        "events { worker_connections 20000; }\n"
        f"http {{\naccess_log off;\n{temp_paths}include {home / 'site.conf'};\n}}\n"
    )
    process = subprocess.Popen([nginx, "-p", str(home), "-c", str(home / "nginx.conf")])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"nginx exited: {(home / 'error.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/healthz", timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("nginx did not answer within 30 s")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def one_batch_rss(folder: Path) -> None:
    """Peak RSS of a fresh server (limits on, SQLite) for one batch at each cap, and one past each."""
    defaults = Settings(database_url="sqlite://")
    points, values = defaults.max_batch_points, defaults.max_batch_values
    rows = (defaults.max_body_bytes - 100_000) // 20_001  # rows of 10,000 zeros ("0," each) within the limit
    cases = [
        (
            f"{points:,} scalar points (the points cap)",
            scenario.scalar_body(0, 0, points, scenario.RULE_KEYS),
        ),
        (
            f"{10 * points:,} scalar points (10x the cap)",
            scenario.scalar_body(0, 0, 10 * points, scenario.RULE_KEYS),
        ),
        (f"{values:,} vector zeros (the numbers cap)", scenario.vector_body(0, 0, values // 1000, 1000)),
        (f"{rows * 10_000:,} vector zeros (at the byte limit)", scenario.vector_body(0, 0, rows, 10_000)),
    ]
    for label, (before, after) in cases:
        body = before + b"1" + after
        with (
            database("sqlite", folder, "") as url,
            server(url, {}, folder / "server-batch.log") as (server_url, process),
        ):
            status, _, _ = scenario.post(
                server_url, "/api/v1/runs", json.dumps({"id": "r", "project": "p"}).encode()
            )
            assert status == 201
            idle = peak_rss_mb(process.pid)
            started = time.monotonic()
            status, _, _ = scenario.post(
                server_url, "/api/v1/runs/r/batches", gzip.compress(body, 1), gzipped=True
            )
            took = time.monotonic() - started
            peak = peak_rss_mb(process.pid)
        print(
            f"one batch, {label}: {len(body) / 1e6:.1f} MB of JSON -> HTTP {status} in {took:.2f} s; "
            f"server peak RSS {idle:.0f} -> {peak:.0f} MB (+{peak - idle:.0f} MB)",
            flush=True,
        )


def run_slow_webhooks(kind: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The victim's webhook delivery latency alone and while the hostile's receivers drip (limits on)."""
    with database(kind, folder, args.postgres_admin_url) as url:
        victim_token, hostile_token = scenario.make_tokens(url, "ingest,read,admin", "ingest,read,admin")
        overrides = {**CONFIGS["on"], "webhook_allow_private": True}  # the receivers are on 127.0.0.1
        with server(url, overrides, folder / f"server-{kind}-slow_webhooks.log") as (server_url, process):
            result = webhook_attack.slow_webhook_scenario(
                server_url, victim_token, hostile_token, args.baseline_s, args.attack_s
            )
            rss = peak_rss_mb(process.pid)
    b, a = result.baseline, result.attack
    print(
        f"{kind:10} slow_webhooks limits on: victim delivery alone p50 {b.p50 * 1000:.0f} ms p95 "
        f"{b.p95 * 1000:.0f} ms ({b.samples} samples, {b.errors} errors); under attack p50 "
        f"{a.p50 * 1000:.0f} ms p95 {a.p95 * 1000:.0f} ms worst {a.worst * 1000:.0f} ms ({a.samples} "
        f"samples, {a.errors} errors); hostile answers {dict(result.hostile_statuses)}",
        flush=True,
    )
    return {
        "database": kind,
        "limits": "on",
        "scenario": "slow_webhooks",
        "baseline": b,
        "attack": a,
        "hostile_points_per_s": 0.0,
        "hostile_statuses": dict(sorted(result.hostile_statuses.items())),
        "hostile_limits": {},
        "rule_status": None,
        "peak_rss_mb": rss,
    }


def run_one(
    kind: str, config: str, args: argparse.Namespace, folder: Path, attack: str = "batches"
) -> dict[str, Any]:
    if attack == "slow_webhooks":
        return run_slow_webhooks(kind, args, folder)
    defaults = Settings(database_url="sqlite://")
    with database(kind, folder, args.postgres_admin_url) as url:
        # The first attack's hostile is an ingest token (as a training job holds); the others also read
        # and administer their own project.
        victim_token, hostile_token = scenario.make_tokens(
            url, "ingest" if attack == "batches" else "ingest,read,admin"
        )
        log = folder / f"server-{kind}-{config}-{attack}.log"
        with contextlib.ExitStack() as stack:
            server_url, process = stack.enter_context(server(url, CONFIGS[config], log))
            if args.proxy == "nginx":
                server_url = stack.enter_context(nginx_in_front(server_url, folder))
            result = scenario.run_scenario(
                server_url,
                victim_token,
                hostile_token,
                args.baseline_s,
                args.attack_s,
                swarm=args.swarm,
                firing=args.firing,
                max_batch_points=defaults.max_batch_points,
                max_batch_values=defaults.max_batch_values,
                max_body_bytes=defaults.max_body_bytes,
                attack=attack,
            )
            rss = peak_rss_mb(process.pid)
    hostile = result.hostile
    row = {
        "database": kind,
        "limits": config,
        "scenario": attack,
        "baseline": result.baseline,
        "attack": result.attack,
        "hostile_points_per_s": hostile.accepted_points / result.attack_seconds,
        "hostile_statuses": dict(sorted(hostile.statuses.items())),
        "hostile_limits": dict(hostile.limits_named),
        "rule_status": hostile.rule_status,
        "peak_rss_mb": rss,
    }
    a, b = result.attack, result.baseline
    failures = sorted(
        {s.error or f"HTTP {s.status}" for s in result.victim.samples if s.error or s.status != 200}
    )
    if failures:
        print(f"  victim failures: {failures[:5]}", flush=True)
    print(
        f"{kind:10} {attack:10} limits {config:3}{' via nginx' if args.proxy == 'nginx' else ''}: "
        f"victim baseline p50 {b.p50 * 1000:.0f} ms p95 {b.p95 * 1000:.0f} ms "
        f"({b.samples} samples, {b.errors} errors); "
        f"under attack p50 {a.p50 * 1000:.0f} ms p95 {a.p95 * 1000:.0f} ms "
        f"worst {a.worst * 1000:.0f} ms ({a.samples} samples, {a.errors} errors, {a.server_errors} 5xx); "
        f"hostile {row['hostile_points_per_s']:,.0f} points/s accepted, answers {row['hostile_statuses']}, "
        f"limits {row['hostile_limits']}, rule {hostile.rule_status}; server peak RSS {rss:.0f} MB",
        flush=True,
    )
    return row


FIGURES = (  # (name, figure of a result row, unit, format)
    ("victim p50, baseline", lambda r: r["baseline"].p50 * 1000, " ms", "{:,.0f}"),
    ("victim p50, under attack", lambda r: r["attack"].p50 * 1000, " ms", "{:,.0f}"),
    ("victim p95, under attack", lambda r: r["attack"].p95 * 1000, " ms", "{:,.0f}"),
    ("victim worst, under attack", lambda r: r["attack"].worst * 1000, " ms", "{:,.0f}"),
    ("victim requests answered in the attack", lambda r: r["attack"].samples, "", "{:,.0f}"),
    (
        "victim error rate, under attack",
        lambda r: 100 * r["attack"].errors / max(r["attack"].samples, 1),
        " %",
        "{:.1f}",
    ),
    ("hostile accepted points/s", lambda r: r["hostile_points_per_s"], "", "{:,.0f}"),
    ("server peak RSS", lambda r: r["peak_rss_mb"], " MB", "{:,.0f}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| database | figure | limits off | limits on | on / off |", "|---|---|---|---|---|"]
    by = {(r["database"], r["limits"]): r for r in rows if r["scenario"] == "batches"}
    for kind in dict.fromkeys(r["database"] for r in rows):
        off, on = by.get((kind, "off")), by.get((kind, "on"))
        if off is None or on is None:
            continue
        for name, figure, unit, fmt in FIGURES:
            low, high = figure(off), figure(on)
            ratio = f"{high / low:.2f}x" if low else "—"
            lines.append(
                f"| {kind} | {name} | {fmt.format(low)}{unit} | {fmt.format(high)}{unit} | {ratio} |"
            )
    return "\n".join(lines)


def attack_table(rows: list[dict[str, Any]]) -> str:
    """The victim alone and under each attack, limits on: p50, p95, p95 / p95 alone, errors."""
    lines = [
        (
            "| database | attack | victim p50 / p95 alone | under attack p50 / p95 (worst) | p95 / alone"
            " | victim errors | hostile answers |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["limits"] != "on":
            continue
        b, a = r["baseline"], r["attack"]
        lines.append(
            f"| {r['database']} | {r['scenario']} | {b.p50 * 1000:.0f} / {b.p95 * 1000:.0f} ms"
            f" | {a.p50 * 1000:.0f} / {a.p95 * 1000:.0f} ms ({a.worst * 1000:,.0f}) | {a.p95 / b.p95:.2f}x"
            f" | {a.errors} of {a.samples} | {r['hostile_statuses']} {r['hostile_limits'] or ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--baseline-s", type=float, default=5.0)
    parser.add_argument("--attack-s", type=float, default=15.0)
    parser.add_argument("--swarm", type=int, default=8)
    parser.add_argument("--no-batches", action="store_true", help="skip the one-batch peak RSS figures")
    parser.add_argument(
        "--proxy",
        choices=("none", "nginx"),
        default="none",
        help="nginx: victim and hostile reach the server through server/deploy/nginx.conf, as a team "
        "deployment does",
    )
    parser.add_argument(
        "--attacks",
        default=",".join(scenario.ATTACKS),
        help=f"which attacks, comma-separated, of {', '.join(scenario.ATTACKS)}; 'batches' runs with the"
        " limits off too",
    )
    parser.add_argument(
        "--firing",
        action="store_true",
        help="the hostile's rank-0 batches skip every step, so that alert rules fire on each",
    )
    parser.add_argument(
        "--postgres-admin-url",
        default=os.environ.get(
            "GRADWATCH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    args = parser.parse_args()
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        capability = "torch not installed"
    print(
        f"Python {platform.python_version()}; {os.cpu_count()} CPUs; torch CPU capability: {capability}; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gradwatch-isolation-") as folder:
        if not args.no_batches:
            one_batch_rss(Path(folder))
        for kind in args.databases.split(","):
            for attack in args.attacks.split(","):
                for config in CONFIGS if attack == "batches" else ("on",):
                    rows.append(run_one(kind, config, args, Path(folder), attack))
    print(f"\n{time.monotonic() - started:.0f} s in all; load average {os.getloadavg()[0]:.1f} at the end\n")
    print(table(rows))
    print()
    print(attack_table(rows))
    return 0 if all(r["attack"].server_errors == 0 for r in rows if r["limits"] == "on") else 1


if __name__ == "__main__":
    sys.exit(main())
