"""Hostile tenants and hostile bytes, round two: what a leaked token or one bad string may not do to
the history of a team server (real server, SQLite and PostgreSQL)."""

from __future__ import annotations

import time

import httpx

SEQ_SHIFT = 20  # the agent's seq layout: (the sender's start in ms << 20) + a counter


def _seq(started: float, counter: int = 0) -> int:
    return (int(started * 1000) << SEQ_SHIFT) + counter


def _client(server, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def _finished_run(client: httpx.Client, steps: int = 50) -> tuple[str, int]:
    """A run that trained `steps` steps and finished, as the agent sends it; returns its id and the
    agent's next seq."""
    started = time.time() - 60
    run = client.post("/api/v1/runs", json={"project": "alpha", "name": "done"}).json()
    batch = {
        "seq": _seq(started),
        "scalars": [
            {"key": "loss", "steps": list(range(steps)), "values": [1.0 / (s + 1) for s in range(steps)]}
        ],
        "events": [{"step": 3, "kind": "skip", "data": {}}],
    }
    assert client.post(f"/api/v1/runs/{run['id']}/batches", json=batch).status_code == 200
    end = {"seq": _seq(started, 1), "status": "finished"}
    assert client.post(f"/api/v1/runs/{run['id']}/batches", json=end).status_code == 200
    return run["id"], _seq(started, 2)


def _points(client: httpx.Client, run_id: str) -> list[int]:
    return client.get(f"/api/v1/runs/{run_id}/series", params={"key": "loss"}).json()["steps"]


def test_an_ingest_token_cannot_erase_or_silence_a_finished_run(api_server, tokens):
    _, ingest = tokens.create("alpha", "ingest,read")  # a job that also reads its own runs
    _, admin = tokens.create("alpha", "ingest,read,admin")
    with _client(api_server, ingest) as client:
        run_id, next_seq = _finished_run(client)
        url = f"/api/v1/runs/{run_id}/batches"
        # The attack as reported: a resume at step 0 under the largest seq there is.
        attack = client.post(url, json={"seq": 2**63 - 1, "events": [{"step": 0, "kind": "resume"}]})
        assert attack.status_code == 422, attack.text
        assert "seq" in attack.json()["detail"] and "clock" in attack.json()["detail"]
        # The same with a seq of now: it would replace a finished run's history.
        now = client.post(url, json={"seq": _seq(time.time()), "events": [{"step": 0, "kind": "resume"}]})
        assert now.status_code == 409, now.text
        assert "admin" in now.json()["detail"] and "finished at step 49" in now.json()["detail"]
        assert _points(client, run_id) == list(range(50))  # nothing was lost
        # The job's own later batches are still stored, and its status still moves.
        later = {"seq": next_seq, "scalars": [{"key": "loss", "steps": [50], "values": [0.01]}]}
        answer = client.post(url, json=later)
        assert (
            answer.status_code == 200
            and answer.json()["points"] == 1
            and "superseded_from" not in answer.json()
        )
        assert _points(client, run_id) == list(range(51))
        # Continuing a finished run after its last step is no rewrite: allowed with the job's token.
        onward = {"seq": _seq(time.time(), 5), "events": [{"step": 51, "kind": "resume"}]}
        assert client.post(url, json=onward).status_code == 200
        assert _points(client, run_id) == list(range(51))
    with _client(api_server, admin) as client:
        # An admin may rewrite the history (a deliberate restart from an earlier checkpoint).
        rewind = {"seq": _seq(time.time(), 9), "events": [{"step": 40, "kind": "resume"}]}
        assert client.post(f"/api/v1/runs/{run_id}/batches", json=rewind).status_code == 200
        assert _points(client, run_id) == list(range(40))


def test_a_batch_cut_by_a_later_resume_says_so(api_server):
    with _client(api_server, None) as client:
        run = client.post("/api/v1/runs", json={"project": "alpha", "name": "crashed"}).json()
        url = f"/api/v1/runs/{run['id']}/batches"
        first = time.time() - 120
        batch = {
            "seq": _seq(first),
            "scalars": [{"key": "loss", "steps": [0, 1, 2], "values": [3.0, 2.0, 1.0]}],
        }
        assert client.post(url, json=batch).status_code == 200
        resumed = {"seq": _seq(time.time()), "events": [{"step": 2, "kind": "resume"}]}
        assert client.post(url, json=resumed).status_code == 200
        late = {"seq": _seq(first, 1), "scalars": [{"key": "loss", "steps": [3, 4], "values": [0.5, 0.4]}]}
        answer = client.post(url, json=late)
        assert answer.status_code == 200 and answer.json()["superseded_from"] == 2
        assert _points(client, run["id"]) == [0, 1]
