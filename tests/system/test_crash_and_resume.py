"""Crash paths and resuming from a checkpoint, end to end on a real uvicorn server (SQLite file and
PostgreSQL): a training process SIGKILLed mid-run becomes "crashed" once no rank has reported for the
(shortened) bound, a second process resumes it from its checkpoint with resume="must", and the run is
one continuous run again, with the resume marked and no alert; an exception in the loop ends a run
"crashed" with its type. The API-level tests drive the same server paths with hand-made batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port
from sqlalchemy.orm import Session
from webhook_receiver import WebhookReceiver

from gradwatch.server.database import make_engine, prepare_schema
from gradwatch.server.schemas import BatchIn, RunIn
from gradwatch.server.serve import BackgroundServer
from gradwatch.server.settings import Settings
from gradwatch.server.storage import RunFilter, Store
from gradwatch.server.storage.liveness import NO_HEARTBEAT, mark_silent_runs

CRASHED_AFTER_S = 3.0  # seconds of silence: long enough that a loaded machine's slow GET sees running
TRAINING_SCRIPT = Path(__file__).resolve().parent.parent / "support" / "checkpointed_training.py"
NAMESPACE_A = 1_000 << 20  # seqs of a first process (a sender's start time in ms << 20)
NAMESPACE_B = 2_000 << 20  # a later process of the same run


@pytest.fixture
def server(database_url) -> Iterator[BackgroundServer]:
    """The API with a short liveness bound, fast periodic checks and a fast outbox."""
    settings = Settings(
        database_url=database_url,
        crashed_after_s=CRASHED_AFTER_S,
        heartbeat_check_interval_s=0.2,
        incident_check_interval_s=0.2,
        incident_group_wait_s=0.5,
        outbox_poll_interval_s=0.1,
    )
    background = BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False).start()
    yield background
    background.stop()


@pytest.fixture
def api(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _wait(condition: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _run(api: httpx.Client, run_id: str) -> dict[str, Any]:
    response = api.get(f"/api/v1/runs/{run_id}")
    assert response.status_code == 200, response.text
    return response.json()


def _series(api: httpx.Client, run_id: str, key: str, **params: Any) -> dict[str, list[Any]]:
    response = api.get(f"/api/v1/runs/{run_id}/series", params={"key": key, "max_points": 100_000, **params})
    assert response.status_code == 200, response.text
    return response.json()


def _events(api: httpx.Client, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
    params = {"kind": kind} if kind else {}
    return api.get(f"/api/v1/runs/{run_id}/events", params=params).json()["data"]


def _send(api: httpx.Client, run_id: str, seq: int, **batch: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{run_id}/batches", json={"seq": seq, **batch})
    assert response.status_code == 200, response.text
    return response.json()


def _scalars(steps: range | list[int], offset: float, key: str = "loss") -> list[dict[str, Any]]:
    steps = list(steps)
    return [{"key": key, "steps": steps, "values": [offset + s for s in steps]}]


# -- the server's part, with hand-made batches ---------------------------------------------------------


def test_create_with_resume_checks_the_id_and_sets_an_existing_run_running(api):
    missing = api.post("/api/v1/runs", json={"id": "nope", "project": "r", "resume": "must"})
    assert missing.status_code == 404 and "resume='must'" in missing.json()["detail"]
    assert api.get("/api/v1/runs/nope").status_code == 404  # nothing was created

    created = api.post("/api/v1/runs", json={"id": "r1", "project": "r", "resume": "allow"})
    assert created.status_code == 201 and created.json()["resumed"] is False
    _send(api, "r1", 1, scalars=_scalars(range(5), 0.0), status="crashed")
    assert _run(api, "r1")["status"] == "crashed"

    taken = api.post("/api/v1/runs", json={"id": "r1", "project": "r", "resume": "never"})
    assert taken.status_code == 409 and "resume='never'" in taken.json()["detail"]
    resumed = api.post("/api/v1/runs", json={"id": "r1", "project": "r", "resume": "must"}).json()
    assert resumed["resumed"] is True and resumed["status"] == "running" and resumed["last_step"] == 4
    assert resumed["previous_status"] == "crashed" and resumed["previous_status_reason"] is None
    plain = api.post("/api/v1/runs", json={"id": "r1", "project": "r"}).json()
    assert plain["resumed"] is None and plain["status"] == "running"
    # Another project's id: resume="never" gets a run of its own, as any create does.
    other = api.post("/api/v1/runs", json={"id": "r1", "project": "elsewhere", "resume": "never"}).json()
    assert other["id"] != "r1" and other["resumed"] is False


def test_a_resume_supersedes_the_abandoned_attempt_from_its_step_on(api):
    run_id = api.post("/api/v1/runs", json={"id": "rw", "project": "rewind"}).json()["id"]
    layers = ["a.weight", "b.weight"]
    _send(
        api,
        run_id,
        NAMESPACE_A,
        scalars=_scalars(range(100), 1000.0) + _scalars(range(100), 2.0**16, key="amp/scale"),
        vectors=[{"key": "grad/norm", "steps": [0, 40, 80], "values": [[1, 1], [2, 2], [3, 3]]}],
        histograms=[
            {
                "key": "grad/hist",
                "step": step,
                "exponent_min": -1,
                "exponent_max": 0,
                "counts": [[1, 2, 0, 0]] * 2,
            }
            for step in (0, 80)
        ],
        layers=layers,
        events=[
            {"step": 50, "kind": "skip", "data": {"scale_before": 65536.0}},
            {"step": 70, "kind": "skip", "data": {"scale_before": 65536.0}},
        ],
    )
    # The second process resumes from the checkpoint at step 60 and trains on to 129.
    ack = _send(
        api,
        run_id,
        NAMESPACE_B,
        scalars=_scalars(range(60, 130), 5000.0) + _scalars(range(60, 130), 2.0**15, key="amp/scale"),
        vectors=[{"key": "grad/norm", "steps": [60, 100], "values": [[7, 7], [8, 8]]}],
        events=[{"step": 60, "kind": "resume", "data": {"mode": "must", "step_from": "run.step"}}],
    )
    assert ack["duplicate"] is False

    loss = _series(api, run_id, "loss")
    assert loss["steps"] == list(range(130))
    assert loss["values"] == [1000.0 + s for s in range(60)] + [5000.0 + s for s in range(60, 130)]
    # The rollups forgot the abandoned attempt: a downsampled view holds only the kept points.
    coarse = _series(api, run_id, "loss", max_points=8)
    assert coarse["downsampled"] is True
    kept = set(loss["values"])
    assert set(coarse["values"]) <= kept
    assert (min(coarse["values"]), max(coarse["values"])) == (1000.0, 5129.0)
    vectors = api.get(f"/api/v1/runs/{run_id}/vectors", params={"key": "grad/norm"}).json()
    assert vectors["steps"] == [0, 40, 60, 100]
    hist = api.get(
        f"/api/v1/runs/{run_id}/histograms", params={"key": "grad/hist", "layer": "a.weight"}
    ).json()
    assert hist["steps"] == [0]
    assert [e["step"] for e in _events(api, run_id, "skip")] == [50]  # the one at 70 was superseded
    [resume] = _events(api, run_id, "resume")
    assert resume["step"] == 60
    assert resume["data"] == {
        "mode": "must",
        "step_from": "run.step",
        "previous_last_step": 99,
        "previous_status": "running",
        "previous_status_reason": None,
    }
    assert _run(api, run_id)["last_step"] == 129

    # A batch of the first process arriving late (its spool replayed, `gradwatch sync`) is cut at the
    # resume: its points before step 60 are stored, the rest and its status are not.
    _send(
        api,
        run_id,
        NAMESPACE_A + 1,
        scalars=_scalars([55, 100, 101], -1.0, key="late") + _scalars([100, 101], -1.0),
        status="crashed",
    )
    assert _series(api, run_id, "late")["steps"] == [55]
    assert _series(api, run_id, "loss", start=100, end=102)["values"] == [5100.0, 5101.0]
    assert _run(api, run_id)["status"] == "running"
    # Batches of the resumed process go on as usual, and it ends the run.
    _send(api, run_id, NAMESPACE_B + 1, scalars=_scalars([130], 5000.0), status="finished")
    finished = _run(api, run_id)
    assert finished["status"] == "finished" and finished["last_step"] == 130
    # A process between the two, which had resumed at step 20 and whose batch comes only now: its resume
    # deletes nothing (the later one superseded it), and its steps from 60 on are cut.
    _send(
        api,
        run_id,
        (NAMESPACE_A + NAMESPACE_B) // 2,
        scalars=_scalars([20, 70], 9000.0),
        events=[{"step": 20, "kind": "resume", "data": {"mode": "allow", "step_from": "run.step"}}],
    )
    loss = _series(api, run_id, "loss")
    assert loss["steps"] == list(range(131)) and loss["values"][20] == 9020.0 and loss["values"][70] == 5070.0
    assert [e["step"] for e in _events(api, run_id, "resume")] == [60]


def test_a_resume_after_the_last_step_replaces_nothing(api):
    run_id = api.post("/api/v1/runs", json={"id": "cont", "project": "rewind"}).json()["id"]
    _send(api, run_id, NAMESPACE_A, scalars=_scalars(range(10), 0.0), status="finished")
    _send(
        api,
        run_id,
        NAMESPACE_B,
        scalars=_scalars(range(10, 20), 0.0),
        events=[{"step": 10, "kind": "resume", "data": {"mode": "allow", "step_from": "server"}}],
    )
    assert _series(api, run_id, "loss")["steps"] == list(range(20))
    [resume] = _events(api, run_id, "resume")
    assert resume["data"]["previous_last_step"] == 9 and resume["data"]["previous_status"] == "finished"
    assert _run(api, run_id)["status"] == "running"


def test_a_silent_run_is_crashed_until_data_arrives_and_an_ended_one_never_is(api):
    quiet = api.post("/api/v1/runs", json={"id": "quiet", "project": "live"}).json()["id"]
    done = api.post("/api/v1/runs", json={"id": "done", "project": "live"}).json()["id"]
    _send(api, quiet, 1, scalars=_scalars(range(3), 0.0))
    _send(api, done, 1, scalars=_scalars(range(3), 0.0), status="finished")

    _wait(lambda: _run(api, quiet)["status"] == "crashed", "the silent run to be marked crashed")
    assert _run(api, quiet)["status_reason"] == NO_HEARTBEAT
    time.sleep(0.5)
    assert _run(api, done)["status"] == "finished" and _run(api, done)["status_reason"] is None

    _send(api, quiet, 2, scalars=_scalars([3], 0.0))  # it was only slow: running again
    assert _run(api, quiet)["status"] == "running" and _run(api, quiet)["status_reason"] is None
    _wait(lambda: _run(api, quiet)["status"] == "crashed", "the run to be marked crashed again")
    _send(api, quiet, 3, scalars=_scalars([4], 0.0), status="finished")  # and it did finish
    assert _run(api, quiet)["status"] == "finished" and _run(api, quiet)["status_reason"] is None


def test_the_heartbeat_alert_still_fires_for_a_run_marked_crashed_for_silence(api):
    run_id = api.post("/api/v1/runs", json={"id": "hb", "project": "hb"}).json()["id"]
    _send(api, run_id, 1, scalars=_scalars(range(3), 0.0))  # installs the project's default rules
    rule = {"project": "hb", "type": "heartbeat", "run_id": run_id, "params": {"timeout_s": 3}}
    assert api.post("/api/v1/alert-rules", json=rule).status_code == 201
    _wait(lambda: _run(api, run_id)["status"] == "crashed", "the silent run to be marked crashed")

    def heartbeat_alert() -> list[dict[str, Any]]:
        alerts = api.get("/api/v1/alerts", params={"run_id": run_id}).json()["data"]
        return [a for a in alerts if a["type"] == "heartbeat" and a["status"] == "firing"]

    assert _wait(heartbeat_alert, "the heartbeat alert")[0]["step"] == 2
    _send(api, run_id, 2, scalars=_scalars([3], 0.0))  # it reports again: running, the alert resolves
    assert _run(api, run_id)["status"] == "running" and not heartbeat_alert()


def test_a_reported_crash_keeps_its_reason_when_other_ranks_finish(api):
    run_id = api.post("/api/v1/runs", json={"id": "ranks", "project": "crash"}).json()["id"]
    crash = {"exception": "RuntimeError", "message": "CUDA error: an illegal memory access"}
    _send(
        api,
        run_id,
        1,
        rank=1,
        scalars=_scalars([5], 0.0),
        events=[{"step": 5, "kind": "crash", "data": crash}],
        status="crashed",
    )
    sigterm = [{"step": 5, "kind": "crash", "data": {"signal": "SIGTERM"}}]
    _send(api, run_id, 1, rank=2, events=sigterm, status="crashed")
    _send(api, run_id, 1, rank=0, scalars=_scalars([5], 0.0), status="finished")
    stored = _run(api, run_id)
    assert stored["status"] == "crashed"
    assert stored["status_reason"] == "rank 1: RuntimeError: CUDA error: an illegal memory access"


def test_the_silence_sweep_changes_each_run_once_across_replicas(database_url):
    """Four replicas sweeping at the same moment: every silent run is marked once, none twice."""
    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    store = Store(engine)
    for index in range(20):
        store.create_run(RunIn(id=f"s{index}", project="sweep"))
    store.ingest("s0", BatchIn(seq=1, status="finished"))  # said it finished: never marked
    replicas = [make_engine(database_url) for _ in range(4)]
    counts: list[int] = []
    start = threading.Barrier(len(replicas))

    def sweep(replica: Any) -> None:
        start.wait()
        with Session(replica) as session, session.begin():
            counts.append(mark_silent_runs(session, time.time() + 3600, silent_s=60))

    try:
        threads = [threading.Thread(target=sweep, args=(replica,)) for replica in replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(counts) == len(replicas) and sum(counts) == 19, counts  # shared out, none twice
        records, _ = store.list_runs(RunFilter(project="sweep"), limit=100, offset=0)
        assert {(r.status, r.status_reason) for r in records if r.id != "s0"} == {("crashed", NO_HEARTBEAT)}
        assert store.get_run("s0").status == "finished"
    finally:
        for replica in [*replicas, engine]:
            replica.dispose()


# -- real training processes --------------------------------------------------------------------------


class Training:
    """A training process (checkpointed_training.py) and the file its output goes to."""

    def __init__(self, server: BackgroundServer, tmp_path: Path, *args: str) -> None:
        self.log = tmp_path / f"training-{time.monotonic_ns()}.log"
        with open(self.log, "w") as log:
            self.process = _start(server, tmp_path, log, *args)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def output(self) -> str:
        return self.log.read_text()


def _start(server: BackgroundServer, tmp_path: Path, log: Any, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(TRAINING_SCRIPT),
            "--server",
            server.url,
            "--checkpoint",
            str(tmp_path / "checkpoint.pt"),
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"GRADWATCH_HOME": str(tmp_path / "home")},
    )


def _records(path: Path) -> dict[int, dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return {record["step"]: record for record in map(json.loads, lines)}


def test_killed_mid_run_then_resumed_from_its_checkpoint_is_one_continuous_run(server, api, tmp_path):
    with WebhookReceiver() as receiver:
        hook = api.post("/api/v1/webhooks", json={"url": receiver.url, "project": "resume"})
        assert hook.status_code == 201, hook.text
        first_record, second_record = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
        first = Training(
            server,
            tmp_path,
            *("--project", "resume", "--record", str(first_record)),
            *("--steps", "100000", "--checkpoint-at", "30", "--step-delay", "0.01"),
        )
        try:

            def past_the_checkpoint() -> dict[str, Any] | None:
                runs = api.get("/api/v1/runs", params={"project": "resume"}).json()["data"]
                return runs[0] if runs and (runs[0]["last_step"] or 0) >= 45 else None

            run = _wait(past_the_checkpoint, "the first attempt to report past its checkpoint", timeout=120)
            assert first.process.poll() is None, first.output()
            assert (tmp_path / "checkpoint.pt").exists()
        finally:
            first.process.send_signal(signal.SIGKILL)  # no atexit, no SIGTERM handler: the agent says nothing
            first.wait(30)
        run_id = run["id"]
        reached = _run(api, run_id)["last_step"]
        _wait(lambda: _run(api, run_id)["status"] == "crashed", "the killed run to be marked crashed")
        assert _run(api, run_id)["status_reason"] == NO_HEARTBEAT

        second = Training(
            server,
            tmp_path,
            "--project",
            "resume",
            "--record",
            str(second_record),
            "--steps",
            "80",
            "--resume",
        )
        assert second.wait(180) == 0, second.output()

        runs = api.get("/api/v1/runs", params={"project": "resume"}).json()["data"]
        assert [r["id"] for r in runs] == [run_id]  # one run, not a new one
        stored = runs[0]
        assert stored["status"] == "finished" and stored["status_reason"] is None
        assert stored["last_step"] == 79

        before, after = _records(first_record), _records(second_record)
        assert sorted(after) == list(range(30, 80))
        loss = _series(api, run_id, "loss")
        assert loss["steps"] == list(range(80))  # continuous: every step once, the rewind gone
        expected = [before[s]["loss"] for s in range(30)] + [after[s]["loss"] for s in range(30, 80)]
        assert loss["values"] == pytest.approx(expected, rel=1e-6)
        # The abandoned attempt had gone on at the full learning rate: its losses after the checkpoint
        # differ from the resumed ones, and none of them is left.
        # (SIGKILL may land between the agent's flush of a step and the script's record of it.)
        recorded = [s for s in range(31, min(reached, 79) + 1) if s in before]
        overwritten = [s for s in recorded if before[s]["loss"] != after[s]["loss"]]
        assert overwritten
        scale = _series(api, run_id, "amp/scale")
        assert scale["steps"] == list(range(80))
        assert scale["values"][:30] == [before[s]["scale"] for s in range(30)]
        assert scale["values"][30:] == [after[s]["scale"] for s in range(30, 80)]

        [resume] = _events(api, run_id, "resume")
        assert resume["step"] == 30
        assert resume["data"]["previous_last_step"] >= reached >= 45
        assert resume["data"]["mode"] == "must" and resume["data"]["step_from"] == "run.step"
        # How the abandoned attempt ended, as init(resume="must") found it (before setting it running).
        assert resume["data"]["previous_status"] == "crashed"
        assert resume["data"]["previous_status_reason"] == NO_HEARTBEAT
        [loaded] = _events(api, run_id, "scaler_state_loaded")
        assert loaded["step"] == 30 and loaded["data"]["scale"] == before[29]["scale"]
        # Events too: the skips (the grow/back-off sawtooth) of the first attempt before the checkpoint,
        # of the resumed one after it, and nothing else.
        skips = [e["step"] for e in _events(api, run_id, "skip")]
        assert skips == [s for s in range(30) if before[s]["skipped"]] + [
            s for s in range(30, 80) if after[s]["skipped"]
        ]
        assert {e["kind"] for e in _events(api, run_id)} <= {"resume", "scaler_state_loaded", "skip"}

        time.sleep(1.5)  # longer than the incident group wait: anything found would be notified by now
        alerts = api.get("/api/v1/alerts", params={"run_id": run_id}).json()["data"]
        assert alerts == [], [a["title"] for a in alerts]
        assert receiver.received == []


def test_an_exception_in_the_loop_ends_the_run_crashed_with_its_type(server, api, tmp_path):
    record = tmp_path / "record.jsonl"
    child = Training(server, tmp_path, "--project", "boom", "--record", str(record), "--raise-at", "12")
    assert child.wait(120) != 0
    assert "ValueError: loss exploded at step 12" in child.output()
    [run] = api.get("/api/v1/runs", params={"project": "boom"}).json()["data"]
    assert run["status"] == "crashed"
    assert run["status_reason"] == "ValueError: loss exploded at step 12"
    [crash] = _events(api, run["id"], "crash")
    assert crash["step"] == 12
    assert crash["data"]["exception"] == "ValueError"
    assert crash["data"]["at"].startswith("checkpointed_training.py:")
    assert _series(api, run["id"], "loss")["steps"] == list(range(13))
    time.sleep(CRASHED_AFTER_S + 0.5)
    # Silent ever since, but it said how it ended: not "no heartbeat".
    assert _run(api, run["id"])["status_reason"] == "ValueError: loss exploded at step 12"
