"""One tenant doing its worst through the API while another sends small batches like an agent.

The scenario of tests/server/test_ingest_limits.py's hostile-tenant test and of
bench/ingest_isolation.py (which runs it with the ingest limits on and off side by side): the victim
(Victim) posts a 1-point batch 4 times a second through the agent's own HttpTransport; the hostile
(Hostile, in a process of its own) posts batches at the server's caps back to back, oversized ones, a
swarm of concurrent medium ones and asks for an alert rule with the largest window, ignoring every
Retry-After. run_scenario measures the victim alone, then under attack.
"""

from __future__ import annotations

import gzip
import http.client
import json
import math
import multiprocessing
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gradwatch._transport import HttpTransport, TransportError

__all__ = [
    "RULE_KEYS",
    "Hostile",
    "HostileReport",
    "ScenarioResult",
    "Summary",
    "Victim",
    "firing",
    "get_json",
    "healthy",
    "make_tokens",
    "post",
    "run_scenario",
    "scalar_body",
    "vector_body",
]


def post(
    url: str,
    path: str,
    body: bytes,
    token: str | None = None,
    gzipped: bool = False,
    timeout: float = 60.0,
    method: str = "POST",
) -> tuple[int, dict[str, str], bytes]:
    """One request (a POST unless `method` says otherwise) with `body` on a new connection: (status,
    headers, body); (0, {}, error text) when it failed."""
    host, port = url.removeprefix("http://").split(":")
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    except OSError as exc:
        return 0, {}, f"{type(exc).__name__}: {exc}".encode()
    finally:
        connection.close()


def get_json(url: str, path: str, token: str | None = None) -> Any:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


# -- the scenario: a victim tenant and a hostile one -------------------------------------------------

RULE_KEYS = ["loss", "lr", "amp/scale", "amp/skipped", "grad/global_norm"]  # what the default rules read


@dataclass
class Sample:
    at: float  # seconds since the scenario started
    latency: float
    status: int | None
    error: str | None = None


class Victim(threading.Thread):
    """Another project's agent: one small batch (`points` points) every `interval` seconds through
    the agent's own HttpTransport, each answer's latency and status recorded."""

    def __init__(
        self, url: str, token: str | None, run_id: str, interval: float = 0.25, points: int = 1
    ) -> None:
        super().__init__(name="victim", daemon=True)
        self.transport = HttpTransport(url, token)
        self.run_id = run_id
        self.interval = interval
        self.points = points
        self.samples: list[Sample] = []
        self.started_at = time.monotonic()
        self.stop = threading.Event()

    def run(self) -> None:
        step = 0
        next_send = time.monotonic()
        while not self.stop.is_set():
            batch = {
                "rank": 0,
                "seq": step,
                "scalars": [
                    {
                        "key": "loss",
                        "steps": [step + i for i in range(self.points)],
                        "values": [1.0 / (step + 1)] * self.points,
                    }
                ],
            }
            began = time.monotonic()
            status: int | None = 200
            error = None
            try:
                self.transport.send_batch(self.run_id, batch)
            except TransportError as exc:
                status, error = exc.status, str(exc)[:200]
            self.samples.append(Sample(began - self.started_at, time.monotonic() - began, status, error))
            step += self.points
            next_send = max(next_send + self.interval, time.monotonic())
            self.stop.wait(next_send - time.monotonic())
        self.transport.close()  # its kept-alive connection

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.at < end]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


@dataclass
class Summary:
    samples: int
    p50: float
    p95: float
    worst: float
    errors: int
    server_errors: int

    @classmethod
    def of(cls, samples: list[Sample]) -> Summary:
        latencies = [s.latency for s in samples]
        return cls(
            len(samples),
            percentile(latencies, 0.5),
            percentile(latencies, 0.95),
            max(latencies, default=math.nan),
            sum(1 for s in samples if s.error is not None or s.status != 200),
            sum(1 for s in samples if s.status is not None and s.status >= 500),
        )


def _json_array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def healthy(key: str, step: int) -> float:
    """`key` at `step` in a healthy fp16 run (no alert rule fires on it), as bench/server_ingest.py has it."""
    wiggle = 0.05 * math.sin(0.1 * step + len(key))
    return {
        "loss": 2.0 + 8.0 / (1.0 + step / 500) + wiggle,
        "lr": 3e-4,
        "amp/scale": 65536.0 * 2.0 ** (step // 2000),
        "amp/skipped": 0.0,
    }.get(key, 0.8 * (1.0 + wiggle))


def firing(key: str, step: int) -> float:
    """`key` at `step` in a run whose every optimizer step is skipped: rules fire on each of them."""
    return 1.0 if key == "amp/skipped" else 0.8 * (1.0 + 0.05 * math.sin(0.1 * step + len(key)))


def scalar_body(
    rank: int, first_step: int, points: int, keys: list[str], value: Any = healthy
) -> tuple[bytes, bytes]:
    """A batch of `points` scalar points over `keys` as JSON text around its seq: (before, after)."""
    steps = points // len(keys)
    step_text = _json_array([str(s) for s in range(first_step, first_step + steps)])
    series = []
    for key in keys:
        values = [repr(value(key, s)) for s in range(first_step, first_step + steps)]
        series.append(f'{{"key":{json.dumps(key)},"steps":{step_text},"values":{_json_array(values)}}}')
    return f'{{"rank":{rank},"seq":'.encode(), f',"scalars":{_json_array(series)}}}'.encode()


def vector_body(rank: int, first_step: int, rows: int, width: int) -> tuple[bytes, bytes]:
    """A batch of per-layer vectors of zeros: `rows` points, rows x width numbers (the cheapest JSON
    per number, the dearest to validate)."""
    row = _json_array(["0"] * width)
    steps = _json_array([str(s) for s in range(first_step, first_step + rows)])
    return (
        f'{{"rank":{rank},"seq":'.encode(),
        f',"vectors":[{{"key":"grad/norm","steps":{steps},"values":{_json_array([row] * rows)}}}]}}'.encode(),
    )


@dataclass
class Hostile:
    """A tenant doing its worst through the API for `seconds`: `max_workers` threads posting batches
    at the server's caps back to back (scalars of the keys the alert rules read, on rank 0 and others;
    one thread per-layer vectors at the numbers cap), one posting oversized batches (over the points
    cap, and a gzip body inflating past the byte limit), `swarm` threads of concurrent medium batches,
    and an alert rule with the largest windows. It ignores Retry-After. Its values are a healthy run's
    unless `firing`: then rank 0 skips every step and the alert rules fire on each (the alert engine
    writes per firing step inside the batch's transaction: see bench/ingest_isolation.py --firing)."""

    url: str
    token: str | None
    run_id: str
    max_batch_points: int = 100_000
    max_batch_values: int = 1_000_000
    max_body_bytes: int = 32 * 1024 * 1024
    max_workers: int = 3
    swarm: int = 8
    firing: bool = False  # rank 0's batches skip every step, so that alert rules fire on each one
    statuses: Counter[int] = field(default_factory=Counter)
    retry_after: list[str] = field(default_factory=list)
    limits_named: Counter[str] = field(default_factory=Counter)
    accepted_points: int = 0
    rule_status: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def prepare(self) -> None:
        """Build every body before the clock starts (the client must not compete for the CPU)."""
        steps_per_body = self.max_batch_points // len(RULE_KEYS)
        self.bodies: dict[str, list[tuple[bytes, bytes, int]]] = {}
        for worker in range(self.max_workers):
            rank = worker  # rank 0 is the one the alert rules judge
            if worker == self.max_workers - 1 and self.max_batch_values:
                width = 1000
                rows = self.max_batch_values // width
                self.bodies[f"max{worker}"] = [
                    (*vector_body(rank, i * rows, rows, width), rows) for i in range(2)
                ]
            else:
                value = firing if self.firing and rank == 0 else healthy
                self.bodies[f"max{worker}"] = [
                    (
                        *scalar_body(rank, i * steps_per_body, self.max_batch_points, RULE_KEYS, value),
                        self.max_batch_points,
                    )
                    for i in range(3)
                ]
        over = self.max_batch_points + self.max_batch_points // 2
        self.bodies["oversize"] = [(*scalar_body(90, 0, over, ["loss"]), over)]
        self.bomb = gzip.compress(
            b'{"rank":0,"seq":1,"scalars":[{"key":"x","steps":['
            + b"0," * (self.max_body_bytes // 2)
            + b"0]}]}",
            6,
        )
        self.bodies["swarm"] = [
            (*scalar_body(91 + i, 0, 2000, ["loss", "lr"]), 2000) for i in range(self.swarm)
        ]

    def _send(self, body: bytes, points: int, gzipped: bool = False) -> None:
        status, headers, answer = post(
            self.url, f"/api/v1/runs/{self.run_id}/batches", body, self.token, gzipped
        )
        with self._lock:
            self.statuses[status] += 1
            if status == 200:
                self.accepted_points += points
            elif status in (413, 429):
                if "retry-after" in headers:
                    self.retry_after.append(headers["retry-after"])
                try:
                    self.limits_named[json.loads(answer).get("limit", "?")] += 1
                except ValueError:
                    self.limits_named["?"] += 1

    def report(self) -> HostileReport:
        return HostileReport(
            dict(self.statuses),
            list(self.retry_after),
            dict(self.limits_named),
            self.accepted_points,
            self.rule_status,
        )

    def run(self, seconds: float) -> None:
        seqs = iter(range(10**9))
        seq_lock = threading.Lock()
        deadline = time.monotonic() + seconds

        def next_seq() -> bytes:
            with seq_lock:
                return str(next(seqs)).encode()

        def loop(name: str, index: int = 0) -> None:
            bodies = self.bodies[name]
            turn = 0
            while time.monotonic() < deadline:
                if name == "oversize" and turn % 2:
                    self._send(self.bomb, 0, gzipped=True)
                else:
                    before, after, points = bodies[(index + turn) % len(bodies)]
                    self._send(before + next_seq() + after, points)
                turn += 1

        self.rule_status = post(
            self.url,
            "/api/v1/alert-rules",
            json.dumps(
                {
                    "project": "hostile",
                    "type": "grad_norm_spike",
                    "params": {"window": 10_000, "warmup": 10_000},
                }
            ).encode(),
            self.token,
        )[0]
        threads = [
            threading.Thread(target=loop, args=(name,), daemon=True)
            for name in self.bodies
            if name.startswith("max")
        ]
        threads.append(threading.Thread(target=loop, args=("oversize",), daemon=True))
        threads += [threading.Thread(target=loop, args=("swarm", i), daemon=True) for i in range(self.swarm)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0) + 120)


@dataclass
class HostileReport:
    statuses: dict[int, int]
    retry_after: list[str]
    limits_named: dict[str, int]
    accepted_points: int
    rule_status: int | None


def _hostile_process(
    connection: Any, url: str, token: str | None, run_id: str, options: dict[str, Any]
) -> None:
    """The hostile tenant in a process of its own, so that its threads never hold the victim's GIL:
    builds its bodies, says "ready", attacks for the seconds it is sent, sends its HostileReport."""
    attack = options.pop("attack", "batches")
    admin_token = options.pop("admin_token", None)
    hostile = Hostile(url, token, run_id, **options)
    if attack == "batches":
        hostile.prepare()
        connection.send("ready")
        hostile.run(connection.recv())
    else:
        other = OtherAttack(attack, hostile, admin_token or token)
        other.prepare()
        connection.send("ready")
        other.run(connection.recv())
    connection.send(hostile.report())


# -- the attacks beyond ingest batches (issue 28, round two) ------------------------------------------

ATTACKS = (
    "batches",
    "events",
    "layers",
    "rules",
    "reads",
    "websockets",
    "preauth",
    "preauth_reads",
    "halfopen",
    "slow_webhooks",
)


class OtherAttack:
    """One of ATTACKS other than "batches", by a hostile tenant whose `admin_token` may also read and
    create alert rules in its project:
      events      3 threads of batches of 90,000 skip events (the alert rules read each)
      layers      3 threads of batches of 40,000 layer names of 400 characters (16 MB, no number)
      rules       as many alert rules with the largest windows as the project may hold, then "batches"
      reads       8 threads of the dearest reads: 100,000 points of a 400,000-point series, whole
      websockets  2,000 live streams held open from 127.0.0.2 (reopened as soon as they close)
      preauth     6 threads of 32 KB gzip bodies inflating to 32 MB and 2 of 30 MB JSON, without a token
      preauth_reads  4 threads of those gzip bodies sent with GET /healthz, and 6 of GET /api/v1/runs
                  with a made-up token per request (its lookup is a query; it was the read cap's key)
      halfopen    up to 15,000 connections from 127.0.0.2 that send half a request head and wait
    Statuses go to the Hostile's report (for websockets, the client's failures by exception type in
    its "limits")."""

    def __init__(self, kind: str, hostile: Hostile, admin_token: str | None) -> None:
        self.kind, self.hostile, self.admin = kind, hostile, admin_token
        self.url, self.run_id = hostile.url, hostile.run_id

    def _count(self, status: int, answer: bytes = b"") -> None:
        with self.hostile._lock:
            self.hostile.statuses[status] += 1
            if status in (413, 429):
                try:
                    self.hostile.limits_named[json.loads(answer).get("limit", "?")] += 1
                except ValueError:
                    self.hostile.limits_named["?"] += 1

    def prepare(self) -> None:
        kind = self.kind
        if kind == "events":
            events = ",".join(f'{{"step":{s},"kind":"skip","data":{{}}}}' for s in range(90_000))
            self.body = f'"events":[{events}]}}'.encode()
        elif kind == "layers":
            names = ",".join(f'"{i:08d}{"x" * 392}"' for i in range(40_000))
            self.body = f'"layers":[{names}]}}'.encode()
        elif kind == "rules":
            made = 0
            rule = {
                "project": "hostile",
                "type": "grad_norm_spike",
                "params": {"window": 10_000, "warmup": 20},
            }
            while made < 200:
                status, _, _ = post(self.url, "/api/v1/alert-rules", json.dumps(rule).encode(), self.admin)
                if status != 201:
                    break
                made += 1
            self.hostile.rule_status = made  # how many the project was let hold
            self.hostile.prepare()
        elif kind == "reads":
            # A long run to read, stored before the clock starts, in batches its alert rules can evaluate.
            for first in range(0, 400_000, 5_000):
                before, after = scalar_body(0, first, 5_000, ["loss"])
                while True:
                    body = before + str(first).encode() + after
                    status, headers, answer = post(
                        self.url, f"/api/v1/runs/{self.run_id}/batches", body, self.admin
                    )
                    if status == 200:
                        break
                    assert status == 429, answer
                    time.sleep(float(headers.get("retry-after", "1")))
        elif kind in ("preauth", "preauth_reads"):
            self.bomb = gzip.compress(
                b'{"seq":1,"scalars":[{"key":"x","steps":[' + b"0," * (16 * 1024 * 1024) + b"0]}]}", 9
            )
            self.json_body = b'{"project":"x","params":{"a":"' + b"y" * (30 * 1024 * 1024) + b'"}}'

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        if self.kind == "rules":
            self.hostile.run(seconds)
            return
        if self.kind == "websockets":
            import asyncio

            asyncio.run(self._websockets(deadline))
            return
        if self.kind == "halfopen":
            self._halfopen(deadline)
            return
        loops = {
            "events": [self._batches] * 3,
            "layers": [self._batches] * 3,
            "reads": [self._reads] * 8,
            "preauth": [self._bombs] * 6 + [self._big_json] * 2,
            "preauth_reads": [self._healthz_bombs] * 4 + [self._made_up_token_reads] * 6,
        }[self.kind]
        threads = [threading.Thread(target=loop, args=(deadline,), daemon=True) for loop in loops]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 120)

    def _batches(self, deadline: float) -> None:
        seq = threading.get_ident() % 1000 * 10**6
        while time.monotonic() < deadline:
            seq += 1
            body = b'{"seq":' + str(seq).encode() + b"," + self.body
            status, _, answer = post(
                self.url, f"/api/v1/runs/{self.run_id}/batches", body, self.hostile.token
            )
            self._count(status, answer)

    def _reads(self, deadline: float) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        path = f"/api/v1/runs/{self.run_id}/series?key=loss&max_points=100000"
        while time.monotonic() < deadline:
            connection = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                connection.request("GET", path, headers={"Authorization": f"Bearer {self.admin}"})
                response = connection.getresponse()
                answer = response.read()
                self._count(response.status, answer)
            except OSError:
                self._count(0)
            finally:
                connection.close()

    def _bombs(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            status, _, answer = post(
                self.url, f"/api/v1/runs/{self.run_id}/batches", self.bomb, None, gzipped=True
            )
            self._count(status, answer)

    def _healthz_bombs(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            status, _, answer = post(self.url, "/healthz", self.bomb, None, gzipped=True, method="GET")
            self._count(status, answer)

    def _made_up_token_reads(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            token = "gw_" + os.urandom(16).hex()
            status, _, answer = post(self.url, "/api/v1/runs", b"", token, method="GET")
            self._count(status, answer)

    def _big_json(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            status, _, answer = post(self.url, "/api/v1/alert-rules", self.json_body, None)
            self._count(status, answer)

    async def _websockets(self, deadline: float) -> None:
        import asyncio

        from websockets.asyncio.client import connect

        address = f"ws://{self.url.removeprefix('http://')}/api/v1/runs/{self.run_id}/live?token={self.admin}"

        async def hold() -> None:
            while time.monotonic() < deadline:
                try:
                    # From 127.0.0.2, another machine than the victim's (as with halfopen).
                    async with connect(
                        address, proxy=None, open_timeout=30, local_addr=("127.0.0.2", 0)
                    ) as ws:
                        self._count(101)
                        while time.monotonic() < deadline:
                            await asyncio.wait_for(ws.recv(), max(deadline - time.monotonic(), 0.01))
                except Exception as exc:  # noqa: BLE001 - closed (1013), refused, timed out: open another
                    self._count(0)
                    with self.hostile._lock:
                        self.hostile.limits_named[type(exc).__name__] += 1
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(hold() for _ in range(2000)))

    def _halfopen(self, deadline: float) -> None:
        import resource
        import socket

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        host, port = self.url.removeprefix("http://").split(":")
        held: list[socket.socket] = []
        while time.monotonic() < deadline:
            if len(held) < min(15_000, hard - 200):
                try:
                    # From 127.0.0.2: another machine than the victim's, as an attacker is (loopback still).
                    sock = socket.create_connection(
                        (host, int(port)), timeout=2, source_address=("127.0.0.2", 0)
                    )
                    sock.sendall(b"POST /api/v1/runs HTTP/1.1\r\nHost: x\r\n")
                    held.append(sock)
                    self._count(1)
                except OSError:
                    self._count(0)
                    time.sleep(0.01)
            else:
                time.sleep(0.1)
                alive = []
                for sock in held:  # the server closes some: open others in their place
                    try:
                        sock.setblocking(False)
                        if sock.recv(1, socket.MSG_PEEK) == b"":
                            sock.close()
                            continue
                    except BlockingIOError:
                        pass
                    except OSError:
                        sock.close()
                        continue
                    alive.append(sock)
                held = alive
        for sock in held:
            sock.close()


@dataclass
class ScenarioResult:
    baseline: Summary
    attack: Summary
    hostile: HostileReport
    attack_seconds: float
    victim: Victim
    attack_start: float


def run_scenario(
    url: str,
    victim_token: str | None,
    hostile_token: str | None,
    baseline_s: float,
    attack_s: float,
    **hostile_options: Any,
) -> ScenarioResult:
    """Create the two runs, measure the victim alone for baseline_s, then under attack for attack_s."""
    for token, project, run_id in (
        (victim_token, "victim", "victim-run"),
        (hostile_token, "hostile", "hostile-run"),
    ):
        status, _, body = post(
            url, "/api/v1/runs", json.dumps({"id": run_id, "project": project}).encode(), token
        )
        assert status == 201, body
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_hostile_process,
        args=(theirs, url, hostile_token, "hostile-run", hostile_options),
        name="hostile",
        daemon=True,
    )
    process.start()
    try:
        assert ours.poll(180) and ours.recv() == "ready", "the hostile process did not start"
        victim = Victim(url, victim_token, "victim-run")
        victim.start()
        time.sleep(baseline_s)
        attack_start = time.monotonic() - victim.started_at
        ours.send(attack_s)
        assert ours.poll(attack_s + 180), "the hostile process did not finish"
        hostile: HostileReport = ours.recv()
        attack_end = time.monotonic() - victim.started_at
        victim.stop.set()
        victim.join(30)
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
        ours.close()
        theirs.close()
    return ScenarioResult(
        Summary.of(victim.between(0.5, attack_start)),  # the first requests warm up
        Summary.of(victim.between(attack_start, attack_end)),
        hostile,
        attack_end - attack_start,
        victim,
        attack_start,
    )


def make_tokens(
    database_url: str, hostile_scope: str = "ingest", victim_scope: str = "ingest"
) -> tuple[str, str]:
    """(victim, hostile) tokens, the victim's with an agent's scope unless told, created before the
    server starts."""
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine, prepare_schema

    engine = make_engine(database_url)
    try:
        prepare_schema(engine, database_url)
        tokens = Tokens(engine)
        return tokens.create("victim", victim_scope)[1], tokens.create("hostile", hostile_scope)[1]
    finally:
        engine.dispose()
