"""Fault injection: a real `gradwatch server` process on 127.0.0.1, a real fp16 training loop, and the
faults a long run meets -- server not up yet, SIGKILLed and restarted, answering 503, answering after
2 s, spool folder not writable, and a `gradwatch sync` killed half way.

Every test keeps a ground truth of what the loop logged (plus the Reference of train()) and compares
counts and values through the HTTP API once the fault is over. Points are unique per (key, step) in
storage, so a batch stored twice would not show up in the points; the "skip" events, which have no
such key, would: their exact count is the duplicate check.

In-loop time: AgentClock measures the time the training thread spends inside gradwatch, per call of
the loop into it (run.log, and GradScaler.unscale_/step/update and clip_grad_norm_ as gradwatch wraps
them, its optimizer hooks included, the user's own work inside them excluded). The transport's part is
a deque append; with the step observations the median call is ~50-90 µs here. The assertion is on that
time less the time the kernel gave the CPU to other processes while our thread was ready to run
(run_delay in /proc/thread-self/schedstat): this machine has 2 cores shared with other jobs (load
average 4-8 while the suite runs), and wall time alone showed one-off 70-220 ms spikes even in a
baseline with no server at all. Waiting on a socket, a file, a lock or the GIL still counts in full.
The session's objects from before the loop are frozen (gc.freeze), so a full garbage collection of
pytest's and other tests' objects (200-300 ms here) cannot land in a measured call.
The bound, 500 ms, is generous on purpose: the sender threads can hold the GIL for a switch interval
(5 ms) each, several times within one call, and a sender thread that the kernel preempts while it
holds the GIL is not in our run_delay; measured maxima are 2-26 ms on a quiet machine. A call that
blocked on the network or the disk -- what these tests exist to catch -- would take the fault's
duration: 2 s with the slow server, seconds during an outage. Each test prints both figures.
"""

from __future__ import annotations

import gc
import http.client
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from training import Reference, train

import gradwatch
from gradwatch._wire import wire_float

MAX_IN_LOOP_SECONDS = 0.5
STEPS = 300
OVERFLOW_STEPS = (30, 31, 150)  # fp16 overflows: skipped steps and "skip" events to count


# -- a real server process ---------------------------------------------------------------------------


class ServerProcess:
    """`python -m gradwatch.cli server` on a fixed loopback port and SQLite file; start/kill/restart."""

    def __init__(self, tmp: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = f"sqlite:///{tmp / 'server.db'}"
        self.log_path = tmp / "server.log"
        self.env = os.environ | {"GRADWATCH_HOME": str(tmp / "server-home")}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> ServerProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gradwatch.cli",
                    "server",
                    "--port",
                    str(self.port),
                    "--database-url",
                    self.database_url,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.log_path.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"server not ready within {timeout} s:\n{self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush; the process is gone mid-request."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


# -- a real HTTP proxy that injects faults -----------------------------------------------------------


class _QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the handlers: no stray threads

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away mid-answer (the killed sync) is part of the test


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of the server: passes requests on, or answers 503
    (`failing`), or holds each request `delay` seconds first."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.failing = False
        self.delay = 0.0
        self.answered_503 = 0
        self.delayed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy._relay(self)

            def do_POST(self) -> None:
                proxy._relay(self)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = _QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()

    def _relay(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if self.failing:
            self.answered_503 += 1
            self._answer(handler, 503, b'{"detail": "injected: service unavailable"}', "application/json")
            return
        if self.delay:
            self.delayed += 1
            time.sleep(self.delay)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")}
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            upstream.request(handler.command, handler.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            self._answer(
                handler, response.status, data, response.getheader("Content-Type") or "application/json"
            )
        except OSError as exc:
            self._answer(
                handler, 502, json.dumps({"detail": f"upstream: {exc}"}).encode(), "application/json"
            )
        finally:
            upstream.close()

    @staticmethod
    def _answer(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=30)


# -- timing the agent inside the loop ----------------------------------------------------------------


class AgentClock:
    """Time the training thread spends inside gradwatch, per call of the loop into it.

    For each call two figures: `calls`, the wall time; `busy`, the wall time less the time the thread
    was ready to run but the kernel gave the CPU to another process (run_delay in
    /proc/thread-self/schedstat). Waiting on a socket, a file, a lock or the GIL is not "ready to run",
    so a blocking call counts in full in both; only this shared machine's load is taken out of `busy`.
    """

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.busy: list[float] = []
        self._user = (0.0, 0.0)  # (wall, run delay) of user work inside the current call: excluded
        self._hooks = (0.0, 0.0)  # gradwatch's optimizer hooks inside the user work: included
        self._hook_started = (0.0, 0.0)
        try:
            self._schedstat: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._schedstat = None  # not Linux: busy == wall

    def close(self) -> None:
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def _mark(self) -> tuple[float, float]:
        run_delay = 0.0
        if self._schedstat is not None:
            run_delay = int(os.pread(self._schedstat, 100, 0).split()[1]) / 1e9
        return time.perf_counter(), run_delay

    @staticmethod
    def _since(start: tuple[float, float], end: tuple[float, float]) -> tuple[float, float]:
        return end[0] - start[0], end[1] - start[1]

    def _record(self, wall: float, delay: float) -> None:
        self.calls.append(wall)
        self.busy.append(wall - min(delay, wall))

    def pure(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn is gradwatch's alone (run.log)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self._record(*self._since(started, self._mark()))

        return timed

    def user(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn is the user's own work, called by gradwatch's wrapper: its time is subtracted."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, delay = self._since(started, self._mark())
                self._user = (self._user[0] + wall, self._user[1] + delay)

        return timed

    def around(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn is gradwatch's wrapper around user work: the call's time minus the user's, plus hooks."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._user = self._hooks = (0.0, 0.0)
            started = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, delay = self._since(started, self._mark())
                self._record(wall - self._user[0] + self._hooks[0], delay - self._user[1] + self._hooks[1])

        return timed

    def hook_start(self, *_: Any) -> None:
        self._hook_started = self._mark()

    def hook_end(self, *_: Any) -> None:
        wall, delay = self._since(self._hook_started, self._mark())
        self._hooks = (self._hooks[0] + wall, self._hooks[1] + delay)

    def summary(self) -> str:
        return (
            f"max {max(self.calls) * 1e3:.2f} ms wall, {max(self.busy) * 1e3:.2f} ms less CPU taken by "
            f"other processes; median {statistics.median(self.calls) * 1e6:.0f} µs over "
            f"{len(self.calls)} calls"
        )


class InstrumentedRun:
    """What train() sees as its run: forwards to a real Run, times every entry into gradwatch, keeps
    the ground truth of what was logged, and runs `actions[step]` (fault injection) untimed."""

    def __init__(self, run: gradwatch.Run, actions: dict[int, Callable[[], None]] | None = None) -> None:
        self.run = run
        self.clock = AgentClock()
        self.truth: dict[str, dict[int, Any]] = {}
        self.actions = actions or {}
        self._log = self.clock.pure(run.log)
        self._restore: list[Callable[[], None]] = []

    def watch(self, model: Any, optimizer: Any, scaler: Any = None) -> InstrumentedRun:
        import torch.nn.utils

        clock = self.clock
        # Inner timers first, so gradwatch's wrappers call them as "the original"; outer ones after.
        for name in ("unscale_", "step", "update"):
            scaler.__dict__[name] = clock.user(getattr(scaler, name))
        original_clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clock.user(original_clip)
        first = [
            optimizer.register_step_pre_hook(clock.hook_start),
            optimizer.register_step_post_hook(clock.hook_start),
        ]
        self.run.watch(model, optimizer, scaler=scaler)
        last = [
            optimizer.register_step_pre_hook(clock.hook_end),
            optimizer.register_step_post_hook(clock.hook_end),
        ]
        for name in ("unscale_", "step", "update"):
            scaler.__dict__[name] = clock.around(scaler.__dict__[name])
        watched_clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clock.around(watched_clip)

        def restore() -> None:
            torch.nn.utils.clip_grad_norm_ = watched_clip
            for handle in first + last:
                handle.remove()

        self._restore.append(restore)
        return self

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        at = self.run.step if step is None else step
        action = self.actions.pop(at, None)
        if action is not None:
            action()
        data = {**data, "probe/step_half": at / 2, "probe/neg": -float(at) - 0.25}
        for key, value in data.items():
            self.truth.setdefault(key, {})[at] = value
        self._log(data, step)

    def finish(self, timeout: float) -> None:
        self.clock.close()
        for restore in self._restore:
            restore()
        self.run.finish(timeout=timeout)

    def expected(self) -> dict[str, dict[int, float]]:
        """The ground truth as floats (tensors read now, after training, outside the timing)."""
        return {
            key: {s: float(v.item() if hasattr(v, "item") else v) for s, v in points.items()}
            for key, points in self.truth.items()
        }


# -- checks --------------------------------------------------------------------------------------


def _get(base: str, path: str, **params: Any) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{base}{path}?{query}", timeout=30) as response:
        return json.loads(response.read())


def assert_stored_exactly_once(base: str, instrumented: InstrumentedRun, reference: Reference) -> None:
    run_id = instrumented.run.id
    for key, points in instrumented.expected().items():
        series = _get(base, f"/api/v1/runs/{run_id}/series", key=key, max_points=100_000)
        assert series["steps"] == sorted(points), f"{key}: stored steps differ from the logged ones"
        expected = [wire_float(points[s]) for s in sorted(points)]  # NaN/Inf come back as strings
        assert series["values"] == expected, f"{key}: stored values differ"
    scale = _get(base, f"/api/v1/runs/{run_id}/series", key="amp/scale", max_points=100_000)
    assert scale["steps"] == list(range(STEPS))
    assert scale["values"] == reference.scales_after
    skipped_steps = [i for i, skipped in enumerate(reference.skipped) if skipped]
    events = _get(base, f"/api/v1/runs/{run_id}/events", kind="skip")
    assert [e["step"] for e in events["data"]] == skipped_steps, "a skip event is missing or stored twice"
    assert set(OVERFLOW_STEPS) <= set(skipped_steps)
    stats = instrumented.run.stats
    assert (stats.queued, stats.spooled, stats.dropped) == (0, 0, 0), stats
    assert _get(base, f"/api/v1/runs/{run_id}")["status"] == "finished"


def run_faulty_training(
    server_url: str,
    tmp: Path,
    actions: dict[int, Callable[[], None]],
    finish_timeout: float = 60.0,
    spool_dir: Path | None = None,
) -> tuple[InstrumentedRun, Reference]:
    # Objects of the test session so far (pytest, other tests' FastAPI/SQLAlchemy...) are frozen: a
    # full collection of them (200-300 ms here) must not land in a measured call. Collections of
    # what the loop and gradwatch allocate still happen, and still count.
    gc.collect()
    gc.freeze()
    try:
        run = gradwatch.init(
            project="faults",
            name="fp16",
            server=server_url,
            spool_dir=spool_dir or tmp / "spool",
            flush_interval=0.05,
            flush_every_steps=10,
            max_backoff=0.5,
        )
        instrumented = InstrumentedRun(run, actions)
        reference = Reference()
        train(STEPS, run=instrumented, overflow_steps=OVERFLOW_STEPS, reference=reference)
        instrumented.finish(timeout=finish_timeout)
    finally:
        gc.unfreeze()
    print(f"\nin-loop gradwatch time: {instrumented.clock.summary()}; stats {run.stats}")
    assert max(instrumented.clock.busy) < MAX_IN_LOOP_SECONDS, instrumented.clock.summary()
    return instrumented, reference


class InBackground:
    """An action that starts fn on a thread (a server start takes seconds: the loop goes on)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._thread = threading.Thread(target=fn)

    def __call__(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join(timeout=120)


@pytest.fixture
def server_tmp(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("shared-server")).start()
    yield server
    server.stop()


@pytest.fixture
def proxy(shared_server: ServerProcess) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(shared_server.port)
    yield fault_proxy
    fault_proxy.close()


# -- the faults ------------------------------------------------------------------------------------


def test_server_not_started_yet_when_training_begins(server_tmp: ServerProcess, tmp_path: Path) -> None:
    start = InBackground(server_tmp.start)
    instrumented, reference = run_faulty_training(server_tmp.url, tmp_path, {40: start})
    start.join()
    assert "Connection refused" in (instrumented.run.stats.last_error or "")
    assert_stored_exactly_once(server_tmp.url, instrumented, reference)


def test_server_killed_with_sigkill_mid_run_and_restarted(server_tmp: ServerProcess, tmp_path: Path) -> None:
    server_tmp.start()
    restart = InBackground(server_tmp.start)
    instrumented, reference = run_faulty_training(
        server_tmp.url,
        tmp_path,
        {60: server_tmp.kill, 120: restart},
    )
    restart.join()
    assert instrumented.run.stats.last_error is not None  # the outage was seen
    assert_stored_exactly_once(server_tmp.url, instrumented, reference)


def test_server_answering_503_for_a_while(
    proxy: FaultProxy, shared_server: ServerProcess, tmp_path: Path
) -> None:
    def fail() -> None:
        proxy.failing = True

    def recover() -> None:
        proxy.failing = False

    instrumented, reference = run_faulty_training(proxy.url, tmp_path, {50: fail, 200: recover})
    assert proxy.answered_503 > 0
    assert "HTTP 503" in (instrumented.run.stats.last_error or "")
    assert_stored_exactly_once(shared_server.url, instrumented, reference)


def test_server_responding_after_2_s_delays(
    proxy: FaultProxy, shared_server: ServerProcess, tmp_path: Path
) -> None:
    proxy.delay = 2.0
    instrumented, reference = run_faulty_training(proxy.url, tmp_path, {})
    assert proxy.delayed >= 2
    # The sender merges what arrives while a request is in flight: far fewer batches than flushes.
    assert instrumented.run.stats.sent_batches < STEPS / 10
    assert instrumented.run.stats.last_error is None
    assert_stored_exactly_once(shared_server.url, instrumented, reference)


def test_spool_folder_not_writable(
    proxy: FaultProxy,
    shared_server: ServerProcess,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A path under a regular file: no one can create it, root included (chmod does not stop root).
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")

    def fail() -> None:
        proxy.failing = True

    def recover() -> None:
        proxy.failing = False

    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        # The server is up, with a 503 spell in the middle: that data can only wait in memory.
        instrumented, reference = run_faulty_training(
            proxy.url,
            tmp_path,
            {50: fail, 150: recover},
            spool_dir=blocker / "spool",
        )
    spool_warnings = [r.getMessage() for r in caplog.records if "spool file" in r.getMessage()]
    assert len(spool_warnings) == 1, spool_warnings
    assert "cannot write the spool file" in spool_warnings[0] and "kept in memory" in spool_warnings[0]
    assert proxy.answered_503 > 0
    assert_stored_exactly_once(shared_server.url, instrumented, reference)


def test_sync_killed_half_way_and_run_again_stores_everything_once(
    proxy: FaultProxy,
    shared_server: ServerProcess,
    tmp_path: Path,
) -> None:
    # An offline run resumed 12 times (same id): one spool file, 12 batches with 12 seq namespaces.
    run_id = f"offline-{os.getpid()}-{time.monotonic_ns()}"
    truth: dict[str, dict[int, float]] = {"a": {}, "b": {}}
    for session in range(12):
        run = gradwatch.init(project="faults", run_id=run_id, mode="offline", spool_dir=tmp_path)
        for step in range(session * 50, (session + 1) * 50):
            truth["a"][step], truth["b"][step] = step * 0.5, -step - 0.125
            run.log({"a": truth["a"][step], "b": truth["b"][step]}, step=step)
        run.finish()
    spool = tmp_path / f"{run_id}-rank0.jsonl"
    assert spool.exists()

    def stored() -> int:
        try:
            return len(
                _get(shared_server.url, f"/api/v1/runs/{run_id}/series", key="a", max_points=100_000)["steps"]
            )
        except urllib.error.HTTPError:
            return 0

    command = [sys.executable, "-m", "gradwatch.cli", "sync", str(spool), "--server", proxy.url]
    proxy.delay = 0.3
    interrupted = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while stored() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        interrupted.send_signal(signal.SIGKILL)  # half way: some batches stored, the rest not
    finally:
        interrupted.wait(timeout=30)
    assert 0 < stored() < 600, "the sync was not interrupted half way"

    proxy.delay = 0.0
    again = subprocess.run([*command, "--keep"], check=False, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "skipped as uploaded before" in again.stdout and spool.exists()
    for key, points in truth.items():
        series = _get(shared_server.url, f"/api/v1/runs/{run_id}/series", key=key, max_points=100_000)
        assert series["steps"] == sorted(points)
        assert series["values"] == [points[s] for s in sorted(points)]

    # A third run, with the .sent list gone, sends everything again: the server stores none of it twice.
    (tmp_path / f"{run_id}-rank0.jsonl.sent").unlink()
    third = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr
    counts = re.search(r"in (\d+) batches \((\d+) already on the server", third.stdout)
    assert counts is not None and int(counts[1]) == int(counts[2]) >= 12, third.stdout
    assert f"{spool}: removed" in third.stdout and not spool.exists()  # without --keep: all stored, gone
    assert (
        len(_get(shared_server.url, f"/api/v1/runs/{run_id}/series", key="a", max_points=100_000)["steps"])
        == 600
    )
