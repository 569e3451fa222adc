"""No ingest request destroys data (issue 39, item 1): a resume takes the steps it supersedes out of the
run's default view but keeps them as an attempt, readable and restorable by an admin; a process still
writing long after another resumed its rank is a second writer (kept, an event, its agent told); a
replayed spool of a dead process is not. A real uvicorn server on SQLite and PostgreSQL, tokens in use."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import free_port

PROJECT = "alpha"


def _seq_floor(seconds_ago: float) -> int:
    """The seq floor of a sender that started `seconds_ago` (the agent's layout: start ms << 20)."""
    return int((time.time() - seconds_ago) * 1000) << 20


def _batch(seq: int, first: int, count: int, **extra: object) -> dict:
    steps = list(range(first, first + count))
    values: list[float | str] = [1.0 / (1 + s) for s in steps]
    if first == 0:
        values[1] = "NaN"  # a NaN point must come back as one
    return {
        "seq": seq,
        "layers": ["l0", "l1"],
        "scalars": [{"key": "loss", "steps": steps, "values": values}],
        "vectors": [{"key": "grad/norm", "steps": steps[:3], "values": [[s, 2.0 * s] for s in steps[:3]]}],
        "histograms": [
            {
                "key": "grad/hist",
                "step": first,
                "exponent_min": -1,
                "exponent_max": 0,
                "counts": [[1, 2, 0, 0]] * 2,
            }
        ],
        **extra,
    }


def _loss_steps(client: httpx.Client, run_id: str) -> list[int]:
    answer = client.get(f"/api/v1/runs/{run_id}/series", params={"key": "loss", "max_points": 100_000})
    assert answer.status_code == 200, answer.text
    return answer.json()["steps"]


@pytest.fixture
def clients(api_server, tokens) -> Iterator[dict[str, httpx.Client]]:
    made = {}
    for name, scope in (("ingest", "ingest"), ("admin", "*")):
        made[name] = httpx.Client(
            base_url=api_server.url,
            headers={"Authorization": f"Bearer {tokens.create(PROJECT, scope, name)[1]}"},
            timeout=30,
        )
    yield made
    for client in made.values():
        client.close()


def test_a_forged_resume_of_a_running_run_loses_nothing_and_an_admin_restores_it(clients):
    job, admin = clients["ingest"], clients["admin"]
    run_id = job.post("/api/v1/runs", json={"project": PROJECT, "name": "live"}).json()["id"]
    live = _seq_floor(120)  # the live training process, started two minutes ago
    for k in range(3):
        assert (
            job.post(f"/api/v1/runs/{run_id}/batches", json=_batch(live + k, 100 * k, 100)).status_code == 200
        )
    assert len(_loss_steps(admin, run_id)) == 300

    # A leaked ingest token forges a resume at step 0 with a present-time seq.
    forged = {"seq": _seq_floor(0), "events": [{"step": 0, "kind": "resume"}]}
    assert job.post(f"/api/v1/runs/{run_id}/batches", json=forged).status_code == 200
    assert _loss_steps(admin, run_id) == []  # out of the default view...
    [kept] = admin.get(f"/api/v1/runs/{run_id}/attempts").json()["data"]
    assert kept["from_step"] == 0 and kept["points"] == 300 + 3 * 3 + 3 and kept["last_step"] == 299
    assert kept["reason"] == "resume" and not kept["second_writer"] and kept["restored_at"] is None

    # The live process goes on: its batch is kept with the attempt, and it is told.
    ack = job.post(f"/api/v1/runs/{run_id}/batches", json=_batch(live + 3, 300, 100)).json()
    assert ack["superseded_from"] == 0 and "second_writer" not in ack  # one late batch: maybe a replay
    data = admin.get(f"/api/v1/runs/{run_id}/attempts/{kept['id']}").json()
    assert data["late_batches"] == 1 and data["last_step"] == 399
    losses = {
        step: value
        for batch in data["batches"]
        for series in batch.get("scalars", [])
        for step, value in zip(series["steps"], series["values"], strict=True)
    }
    assert sorted(losses) == list(range(400)) and losses[1] == "NaN" and losses[7] == 1 / 8

    # Restoring is an admin's: the job's token cannot.
    refused = job.post(f"/api/v1/runs/{run_id}/attempts/{kept['id']}/restore")
    assert refused.status_code == 403 and "admin" in refused.json()["detail"]
    restored = admin.post(f"/api/v1/runs/{run_id}/attempts/{kept['id']}/restore")
    assert restored.status_code == 200, restored.text
    assert restored.json()["restored_at"] is not None
    assert _loss_steps(admin, run_id) == list(range(400))
    vectors = admin.get(f"/api/v1/runs/{run_id}/vectors", params={"key": "grad/norm"}).json()
    assert vectors["steps"] == [s for k in range(4) for s in range(100 * k, 100 * k + 3)]
    assert vectors["values"][-1] == [302.0, 604.0]
    histograms = admin.get(f"/api/v1/runs/{run_id}/histograms", params={"layer": "l1"}).json()
    assert histograms["steps"] == [0, 100, 200, 300]
    # What the forged resume had stored (its event) is kept in turn; the run is whole again.
    attempts = admin.get(f"/api/v1/runs/{run_id}/attempts").json()["data"]
    assert [a["reason"] for a in attempts] == ["resume", "restore"] and attempts[1]["events"] == 1
    assert admin.get(f"/api/v1/runs/{run_id}").json()["last_step"] == 399
    # The live process is no longer cut, and a second restore is refused.
    ack = job.post(f"/api/v1/runs/{run_id}/batches", json=_batch(live + 4, 400, 100)).json()
    assert "superseded_from" not in ack
    assert _loss_steps(admin, run_id) == list(range(500))
    again = admin.post(f"/api/v1/runs/{run_id}/attempts/{kept['id']}/restore")
    assert again.status_code == 409 and "restored already" in again.json()["detail"]
    missing = admin.get(f"/api/v1/runs/{run_id}/attempts/999999")
    assert missing.status_code == 404 and "no attempt 999999" in missing.json()["detail"]


def test_a_replayed_spool_of_a_dead_process_is_kept_and_not_taken_for_a_second_writer(clients):
    job, admin = clients["ingest"], clients["admin"]
    run_id = job.post("/api/v1/runs", json={"project": PROJECT, "name": "crashed"}).json()["id"]
    dead = _seq_floor(600)
    assert job.post(f"/api/v1/runs/{run_id}/batches", json=_batch(dead, 0, 100)).status_code == 200
    resumed = {"seq": _seq_floor(0), "events": [{"step": 50, "kind": "resume"}], **_batch(0, 50, 10)}
    resumed["seq"] = _seq_floor(0)
    assert job.post(f"/api/v1/runs/{run_id}/batches", json=resumed).status_code == 200
    # The resumed run replays the dead process's unsent spool: three late batches in a burst.
    for k in range(1, 4):
        ack = job.post(f"/api/v1/runs/{run_id}/batches", json=_batch(dead + k, 100 * k, 100)).json()
        assert ack["superseded_from"] == 50 and "second_writer" not in ack
    [kept] = admin.get(f"/api/v1/runs/{run_id}/attempts").json()["data"]
    assert kept["from_step"] == 50 and kept["late_batches"] == 3 and not kept["second_writer"]
    assert kept["last_step"] == 399
    events = admin.get(f"/api/v1/runs/{run_id}/events").json()["data"]
    assert "second_writer" not in {e["kind"] for e in events}
    assert _loss_steps(admin, run_id) == list(range(60))


@pytest.fixture
def quick_server(database_url) -> Iterator:
    """A server that calls a superseded process still sending after 1 s a second writer."""
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    server = BackgroundServer(
        Settings(database_url=database_url, second_writer_after_s=1.0),
        "127.0.0.1",
        free_port(),
        with_dashboard=False,
    )
    server.start()
    yield server
    server.stop()


def test_two_processes_writing_one_rank_are_told_apart_from_a_restart(quick_server):
    with httpx.Client(base_url=quick_server.url, timeout=30) as client:
        run_id = client.post("/api/v1/runs", json={"project": PROJECT, "name": "twice"}).json()["id"]
        first = _seq_floor(60)
        assert client.post(f"/api/v1/runs/{run_id}/batches", json=_batch(first, 0, 100)).status_code == 200
        # A second job started on the same run id, resuming from step 80 while the first one still runs.
        second = {"seq": _seq_floor(0), "events": [{"step": 80, "kind": "resume"}], **_batch(0, 80, 20)}
        second["seq"] = _seq_floor(0)
        assert client.post(f"/api/v1/runs/{run_id}/batches", json=second).status_code == 200
        sent_first_late = time.monotonic()
        ack = client.post(f"/api/v1/runs/{run_id}/batches", json=_batch(first + 1, 100, 100)).json()
        assert ack["superseded_from"] == 80 and "second_writer" not in ack
        time.sleep(max(0.0, 1.2 - (time.monotonic() - sent_first_late)))  # past second_writer_after_s
        ack = client.post(f"/api/v1/runs/{run_id}/batches", json=_batch(first + 2, 200, 100)).json()
        assert ack["superseded_from"] == 80 and ack["second_writer"] is True
        events = client.get(f"/api/v1/runs/{run_id}/events", params={"kind": "second_writer"}).json()["data"]
        [event] = [e for e in events if e["kind"] == "second_writer"]
        assert event["step"] == 80 and "two jobs share this run id" in event["data"]["message"]
        [kept] = client.get(f"/api/v1/runs/{run_id}/attempts").json()["data"]
        assert kept["second_writer"] and kept["late_batches"] == 2 and kept["last_step"] == 299
        # Both writers' data is there: the second in the run, the first's from step 80 on in the attempt.
        assert _loss_steps(client, run_id) == list(range(100))
        ack = client.post(f"/api/v1/runs/{run_id}/batches", json=_batch(first + 3, 300, 100)).json()
        assert ack["second_writer"] is True  # told on every later batch
        events = client.get(f"/api/v1/runs/{run_id}/events").json()["data"]
        assert [e["kind"] for e in events].count("second_writer") == 1


def test_the_agent_of_a_superseded_process_is_told_and_warns_its_user_once_each(quick_server, caplog):
    import gradwatch

    run = gradwatch.init(project=PROJECT, server=quick_server.url, flush_every_steps=5, flush_interval=0.05)
    step, deadline = 0, time.monotonic() + 60
    while run.stats.sent < 20:  # 20 points stored before the forged resume (log() flushes on time)
        assert time.monotonic() < deadline, run.stats
        run.log({"loss": 1.0 / (1 + step)}, step=step)
        step += 1
        time.sleep(0.02)
    with httpx.Client(base_url=quick_server.url, timeout=30) as client:
        forged = {"seq": _seq_floor(0), "events": [{"step": 10, "kind": "resume"}]}
        assert client.post(f"/api/v1/runs/{run.id}/batches", json=forged).status_code == 200
        deadline = time.monotonic() + 60
        while not any("written by two processes" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            run.log({"loss": 0.5}, step=step)
            step += 1
            time.sleep(0.05)  # flush_interval: each step goes out in a batch of its own
        run.finish()
        told = [r.getMessage() for r in caplog.records if "gradwatch: run" in r.getMessage()]
        assert sum("was resumed by another process at step 10" in m for m in told) == 1
        assert sum("written by two processes" in m for m in told) == 1
        [kept] = client.get(f"/api/v1/runs/{run.id}/attempts").json()["data"]
        assert kept["second_writer"] and kept["from_step"] == 10 and kept["last_step"] >= step - 1
