"""The JSON API against a real uvicorn server, on a SQLite file and on PostgreSQL."""

import json
import math

import httpx


def _create(client, **fields):
    body = {"project": "p", "name": "r"} | fields
    response = client.post("/api/v1/runs", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def _batch(seq, key="loss", steps=(0, 1, 2), values=(1.0, 2.0, 3.0), **extra):
    return {"seq": seq, "scalars": [{"key": key, "steps": list(steps), "values": list(values)}], **extra}


def test_healthz(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_create_run_is_idempotent_for_the_same_id(client):
    first = _create(client, id="job-1", config={"lr": 1e-3})
    again = _create(client, id="job-1")
    assert first["id"] == again["id"] == "job-1"
    assert again["config"] == {"lr": 1e-3}
    assert again["status"] == "running"
    listed = client.get("/api/v1/runs").json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == "job-1"


def test_a_run_uploaded_after_it_ran_keeps_its_start_time_within_plausible_bounds(client):
    """created_at (gradwatch sync of an offline run): stored as given; left out: the server's now; a
    time a little ahead (clock skew): the server's now; far ahead or absurdly old: 422 naming the field."""
    import time
    from datetime import datetime, timedelta, timezone

    started = datetime.now(timezone.utc) - timedelta(hours=3)
    uploaded = _create(client, id="offline-1", created_at=started.isoformat())
    assert datetime.fromisoformat(uploaded["created_at"]) == started
    assert datetime.fromisoformat(client.get("/api/v1/runs/offline-1").json()["created_at"]) == started
    naive = _create(client, id="offline-2", created_at=started.replace(tzinfo=None).isoformat())
    assert datetime.fromisoformat(naive["created_at"]) == started  # a time without a zone is UTC
    before = time.time()
    online = _create(client, id="online-1")
    skewed = _create(
        client, id="skewed-1", created_at=(datetime.now(timezone.utc) + timedelta(minutes=2)).isoformat()
    )
    after = time.time()
    for run in (online, skewed):
        assert before <= datetime.fromisoformat(run["created_at"]).timestamp() <= after
    # The run list sorts and filters by when runs started, uploaded ones included.
    listed = [
        r["id"] for r in client.get("/api/v1/runs", params={"sort": "created", "order": "asc"}).json()["data"]
    ]
    assert listed[:2] == ["offline-1", "offline-2"] and set(listed[2:]) == {"online-1", "skewed-1"}
    cutoff = (started + timedelta(hours=1)).isoformat()
    assert {
        r["id"] for r in client.get("/api/v1/runs", params={"created_before": cutoff}).json()["data"]
    } == {
        "offline-1",
        "offline-2",
    }
    # An existing run keeps its creation time.
    assert (
        _create(client, id="online-1", created_at=started.isoformat())["created_at"] == online["created_at"]
    )
    for implausible, says in (
        (datetime.now(timezone.utc) + timedelta(hours=1), "after the server's clock"),
        (datetime(1970, 1, 1, tzinfo=timezone.utc), "days before the server's clock"),
    ):
        refused = client.post("/api/v1/runs", json={"project": "p", "created_at": implausible.isoformat()})
        assert refused.status_code == 422 and "created_at" in refused.text and says in refused.text
    garbled = client.post("/api/v1/runs", json={"project": "p", "created_at": "yesterday"})
    assert garbled.status_code == 422 and "created_at" in garbled.text
    assert client.get("/api/v1/runs").json()["count"] == 4


def test_same_id_in_another_project_gets_a_run_of_its_own(client):
    """Ids are per project: another project's id is not refused (that would let one project squat
    another's), the run is stored under a fresh id, and the same request finds it again."""
    _create(client, id="job-1")
    response = client.post("/api/v1/runs", json={"id": "job-1", "project": "other"})
    assert response.status_code == 201 and response.json()["project"] == "other"
    stored = response.json()["id"]
    assert stored != "job-1" and "'p'" not in response.text
    assert client.post("/api/v1/runs", json={"id": "job-1", "project": "other"}).json()["id"] == stored
    assert client.post("/api/v1/runs", json={"id": "job-1", "project": "p"}).json()["id"] == "job-1"
    assert client.get("/api/v1/runs").json()["count"] == 2


def test_ingest_then_read_series_and_events(client):
    run = _create(client)
    batch = _batch(0, events=[{"step": 1, "kind": "skip", "data": {"scale_before": 65536.0}}])
    ack = client.post(f"/api/v1/runs/{run['id']}/batches", json=batch).json()
    assert ack == {"duplicate": False, "points": 3, "events": 1}
    series = client.get(f"/api/v1/runs/{run['id']}/series", params={"key": "loss"}).json()
    assert series["steps"] == [0, 1, 2] and series["values"] == [1.0, 2.0, 3.0]
    assert series["downsampled"] is False
    events = client.get(f"/api/v1/runs/{run['id']}/events").json()
    assert events["count"] == 1
    assert events["data"][0] == {"step": 1, "kind": "skip", "rank": 0, "data": {"scale_before": 65536.0}}
    assert client.get(f"/api/v1/runs/{run['id']}").json()["last_step"] == 2


def test_a_repeated_batch_is_acknowledged_and_stored_once(client):
    run = _create(client)
    url = f"/api/v1/runs/{run['id']}/batches"
    assert client.post(url, json=_batch(7)).json()["duplicate"] is False
    assert client.post(url, json=_batch(7, values=(9.0, 9.0, 9.0))).json()["duplicate"] is True
    series = client.get(f"/api/v1/runs/{run['id']}/series", params={"key": "loss"}).json()
    assert series["values"] == [1.0, 2.0, 3.0]
    # The same seq from another rank is a different batch.
    assert client.post(url, json=_batch(7) | {"rank": 1}).json()["duplicate"] is False


def test_non_finite_values_round_trip(client):
    run = _create(client)
    body = json.dumps(_batch(0, values=(math.nan, math.inf, -math.inf)))  # JSON NaN literals
    response = client.post(
        f"/api/v1/runs/{run['id']}/batches", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    client.post(f"/api/v1/runs/{run['id']}/batches", json=_batch(1, steps=(3,), values=("NaN",)))
    series = client.get(f"/api/v1/runs/{run['id']}/series", params={"key": "loss"}).json()
    assert series["values"] == ["NaN", "Infinity", "-Infinity", "NaN"]


def test_series_range_and_downsampling_keep_the_spike(client):
    run = _create(client)
    n = 5_000
    values = [1.0] * n
    values[4_321] = 1e9
    for seq, start in enumerate(range(0, n, 2500)):  # within the rule-evaluation cap per batch
        part = _batch(seq, steps=range(start, start + 2500), values=values[start : start + 2500])
        assert client.post(f"/api/v1/runs/{run['id']}/batches", json=part).status_code == 200
    url = f"/api/v1/runs/{run['id']}/series"
    sampled = client.get(url, params={"key": "loss", "max_points": 100}).json()
    assert sampled["downsampled"] is True and len(sampled["steps"]) <= 100
    assert 4_321 in sampled["steps"] and 1e9 in sampled["values"]
    exact = client.get(url, params={"key": "loss", "start": 10, "end": 60, "max_points": 100}).json()
    assert exact["steps"] == list(range(10, 60)) and exact["downsampled"] is False


def test_bad_input_says_what_is_wrong_and_stores_nothing(client):
    run = _create(client)
    url = f"/api/v1/runs/{run['id']}/batches"
    bad = _batch(0, steps=(0, 1), values=(1.0,))
    response = client.post(url, json=bad)
    assert response.status_code == 422
    assert "2 steps but 1 values" in response.text
    response = client.post(url, json=_batch(1, steps=(-1, 0, 1)))
    assert response.status_code == 422 and "greater than or equal to 0" in response.text
    response = client.post(url, json=_batch(2, values=("high", 1.0, 2.0)))
    assert response.status_code == 422
    assert client.get(f"/api/v1/runs/{run['id']}/keys").json()["data"] == []
    # The rejected seqs were not consumed: a corrected batch with seq 0 is stored.
    assert client.post(url, json=_batch(0)).json()["duplicate"] is False


def test_unknown_run_is_404_with_a_message(client):
    response = client.post("/api/v1/runs/nope/batches", json=_batch(0))
    assert response.status_code == 404
    assert response.json()["detail"] == "run 'nope' does not exist"
    assert client.get("/api/v1/runs/nope/series", params={"key": "loss"}).status_code == 404


def test_body_size_limit(client):
    run = _create(client)
    huge = b"{" + b" " * (33 * 1024 * 1024) + b"}"
    response = client.post(
        f"/api/v1/runs/{run['id']}/batches", content=huge, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert "larger than" in response.json()["detail"]


def test_delete_run_removes_its_data(client):
    run = _create(client)
    client.post(f"/api/v1/runs/{run['id']}/batches", json=_batch(0, events=[{"step": 0, "kind": "skip"}]))
    assert client.delete(f"/api/v1/runs/{run['id']}").status_code == 204
    assert client.get(f"/api/v1/runs/{run['id']}").status_code == 404
    assert client.get("/api/v1/runs").json()["count"] == 0


def test_list_runs_filters_by_project_and_pages(client):
    for i in range(3):
        _create(client, project="a", name=f"a{i}")
    _create(client, project="b")
    page = client.get("/api/v1/runs", params={"project": "a", "limit": 2}).json()
    assert page["count"] == 3 and len(page["data"]) == 2
    assert {r["project"] for r in page["data"]} == {"a"}


def test_openapi_docs_are_served(client):
    spec = client.get("/openapi.json").json()
    assert "/api/v1/runs/{run_id}/series" in spec["paths"]
    assert client.get("/docs").status_code == 200


def _layer_batch(seq, steps, layers=("a.weight", "b.weight"), **extra):
    width = 121 + 2
    return {
        "seq": seq,
        "layers": list(layers),
        "vectors": [
            {"key": "grad/norm", "steps": list(steps), "values": [[float(s), float(s) * 2] for s in steps]}
        ],
        "histograms": [
            {
                "key": "grad/hist",
                "step": s,
                "exponent_min": -80,
                "exponent_max": 40,
                "counts": [[s] * width, [1] * width],
            }
            for s in steps
        ],
        **extra,
    }


def test_per_layer_vectors_come_back_as_a_step_by_layer_matrix(client):
    run = _create(client)
    url = f"/api/v1/runs/{run['id']}"
    assert client.post(f"{url}/batches", json=_layer_batch(0, range(10))).status_code == 200
    matrix = client.get(f"{url}/vectors", params={"key": "grad/norm"}).json()
    assert matrix["layers"] == ["a.weight", "b.weight"]
    assert matrix["steps"] == list(range(10))
    assert matrix["values"][3] == [3.0, 6.0]
    merged = client.get(f"{url}/vectors", params={"key": "grad/norm", "max_steps": 2}).json()
    assert merged["downsampled"] is True and merged["steps"] == [0, 5]
    assert merged["values"] == [[4.0, 8.0], [9.0, 18.0]]  # the largest per layer and bucket
    assert client.get(f"{url}/keys", params={"kind": "vector"}).json()["data"] == ["grad/norm"]
    assert client.get(f"{url}/keys").json()["data"] == []  # no scalar keys


def test_non_finite_per_layer_values_survive_merging(client):
    run = _create(client)
    url = f"/api/v1/runs/{run['id']}"
    batch = {
        "seq": 0,
        "layers": ["x"],
        "vectors": [{"key": "grad/norm", "steps": [0, 1, 2, 3], "values": [[1.0], ["NaN"], [5.0], [2.0]]}],
    }
    assert client.post(f"{url}/batches", json=batch).status_code == 200
    merged = client.get(f"{url}/vectors", params={"key": "grad/norm", "max_steps": 2}).json()
    assert merged["values"] == [["NaN"], [5.0]]


def test_histograms_of_one_layer_over_steps(client):
    run = _create(client)
    url = f"/api/v1/runs/{run['id']}"
    client.post(f"{url}/batches", json=_layer_batch(0, [0, 100, 200]))
    hist = client.get(f"{url}/histograms", params={"layer": "a.weight"}).json()
    assert hist["steps"] == [0, 100, 200]
    assert hist["exponents"][0] == -80 and len(hist["exponents"]) == 121
    assert hist["counts"][1] == [100] * 121 and hist["zeros"] == [0, 100, 200]
    other = client.get(f"{url}/histograms", params={"layer": "b.weight"}).json()
    assert other["non_finite"] == [1, 1, 1]
    missing = client.get(f"{url}/histograms", params={"layer": "nope"})
    assert missing.status_code == 404 and "not one of the run's 2 layers" in missing.json()["detail"]


def test_layer_data_that_does_not_fit_the_run_is_refused_whole(client):
    run = _create(client)
    url = f"/api/v1/runs/{run['id']}"
    client.post(f"{url}/batches", json=_layer_batch(0, [0]))
    wrong = {
        "seq": 1,
        "scalars": [{"key": "loss", "steps": [1], "values": [1.0]}],
        "vectors": [{"key": "grad/norm", "steps": [1], "values": [[1.0, 2.0, 3.0]]}],
    }
    response = client.post(f"{url}/batches", json=wrong)
    assert response.status_code == 422
    assert "3 values per step but the run has 2 layers" in response.json()["detail"]
    assert client.get(f"{url}/keys").json()["data"] == []  # the batch's scalar was not stored either
    bad_hist = _layer_batch(2, [5])
    bad_hist["histograms"][0]["counts"][0] = [1, 2]
    response = client.post(f"{url}/batches", json=bad_hist)
    assert response.status_code == 422 and "expected 123" in response.text


def test_downsampling_keeps_non_finite_points_and_bucket_extremes(client):
    run = _create(client)
    n = 10_000
    values = [float(i % 7) for i in range(n)]
    values[1_234] = "NaN"
    values[8_765] = "Infinity"
    values[5_000] = -50.0
    for seq, first in enumerate(range(0, n, 2_000)):  # batches within what the alert rules may evaluate
        part = range(first, first + 2_000)
        stored = client.post(
            f"/api/v1/runs/{run['id']}/batches",
            json=_batch(seq, steps=part, values=values[first : first + 2_000]),
        )
        assert stored.status_code == 200, stored.text
    sampled = client.get(f"/api/v1/runs/{run['id']}/series", params={"key": "loss", "max_points": 50}).json()
    assert sampled["downsampled"] is True and len(sampled["steps"]) <= 50
    kept = dict(zip(sampled["steps"], sampled["values"], strict=True))
    assert kept[1_234] == "NaN" and kept[8_765] == "Infinity" and kept[5_000] == -50.0
    assert sampled["steps"] == sorted(sampled["steps"])
    assert 6.0 in sampled["values"]  # each bucket's maximum is kept


def test_runs_are_filtered_by_tags_status_time_and_name_and_paged(client):
    import time
    from datetime import datetime, timezone

    a = _create(client, name="baseline-fp16", tags=["baseline", "fp16"])
    b = _create(client, name="LoRA r16", tags=["lora", "fp16"])
    c = _create(client, name="other", project="q", tags=["fp16"])
    client.post(f"/api/v1/runs/{b['id']}/batches", json=_batch(0, status="finished"))

    def ids(**params):
        response = client.get("/api/v1/runs", params=params)
        assert response.status_code == 200, response.text
        return [run["id"] for run in response.json()["data"]]

    assert ids(tag="fp16") == [c["id"], b["id"], a["id"]]  # newest first
    assert ids(tag=["fp16", "lora"]) == [b["id"]]  # every tag must match
    assert ids(tag="fp16", project="p") == [b["id"], a["id"]]
    assert ids(status="finished") == [b["id"]]
    assert ids(status=["finished", "running"], sort="name", order="asc") == [a["id"], b["id"], c["id"]]
    assert ids(name="lora") == [b["id"]]  # any case
    assert ids(name="%") == []  # LIKE wildcards are data
    moment = datetime.fromtimestamp(time.time() + 60, tz=timezone.utc).isoformat()
    assert ids(created_before=moment) == [c["id"], b["id"], a["id"]] and ids(created_after=moment) == []
    page = client.get("/api/v1/runs", params={"tag": "fp16", "limit": 1, "offset": 1}).json()
    assert page["count"] == 3 and [r["id"] for r in page["data"]] == [b["id"]]
    assert client.get(f"/api/v1/runs/{a['id']}").json()["tags"] == ["baseline", "fp16"]
    bad = client.get("/api/v1/runs", params={"status": "exploded"})
    assert bad.status_code == 422 and "status" in bad.text


def test_runs_can_be_renamed_and_retagged(client):
    run = _create(client, tags=["a"])
    response = client.patch(f"/api/v1/runs/{run['id']}", json={"name": "renamed", "tags": ["b", "c"]})
    assert response.status_code == 200, response.text
    assert response.json()["name"] == "renamed" and response.json()["tags"] == ["b", "c"]
    assert client.patch(f"/api/v1/runs/{run['id']}", json={"tags": []}).json()["tags"] == []
    assert client.patch("/api/v1/runs/nope", json={"name": "x"}).status_code == 404
    assert client.patch(f"/api/v1/runs/{run['id']}", json={"colour": "red"}).status_code == 422


def test_compare_returns_one_key_of_several_runs_in_one_call(client):
    first = _create(client, name="first")
    second = _create(client, name="<b>second</b>")
    client.post(f"/api/v1/runs/{first['id']}/batches", json=_batch(0, values=(1.0, 2.0, 3.0)))
    for seq, start in enumerate(range(0, 5000, 2500)):  # within the rule-evaluation cap per batch
        stored = client.post(
            f"/api/v1/runs/{second['id']}/batches",
            json=_batch(seq, steps=range(start, start + 2500), values=[0.5] * 2500),
        )
        assert stored.status_code == 200, stored.text
    response = client.get(
        "/api/v1/compare", params={"run": [second["id"], first["id"]], "key": "loss", "max_points": 100}
    )
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["name"] for d in data] == ["<b>second</b>", "first"]
    assert data[1]["values"] == [1.0, 2.0, 3.0] and data[1]["downsampled"] is False
    assert data[0]["downsampled"] is True and len(data[0]["steps"]) <= 100
    missing = client.get("/api/v1/compare", params={"run": [first["id"], "ghost"], "key": "loss"})
    assert missing.status_code == 404 and "ghost" in missing.json()["detail"]
    assert client.get("/api/v1/compare", params={"key": "loss"}).status_code == 422


def test_prune_deletes_only_old_finished_runs(database_url, api_server, client):
    import subprocess
    import sys
    import time
    from pathlib import Path

    from sqlalchemy import text

    from gradwatch.server.database import make_engine

    old_done = _create(client, name="old-finished")
    old_running = _create(client, name="old-running")
    new_done = _create(client, name="new-finished")
    for run in (old_done, new_done):
        client.post(f"/api/v1/runs/{run['id']}/batches", json=_batch(0, status="finished"))
    engine = make_engine(database_url)
    with engine.begin() as connection:
        connection.execute(
            text("UPDATE runs SET created_at = :t WHERE id IN (:a, :b)"),
            {"t": time.time() - 40 * 86400, "a": old_done["id"], "b": old_running["id"]},
        )
    engine.dispose()
    gradwatch = str(Path(sys.executable).with_name("gradwatch"))
    command = [gradwatch, "prune", "--older-than-days", "30", "--database-url", database_url]
    dry = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, timeout=120, check=False)
    assert dry.returncode == 0 and "would delete 1 run" in dry.stdout and old_done["id"] in dry.stdout
    assert client.get(f"/api/v1/runs/{old_done['id']}").status_code == 200
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "deleted 1 run" in done.stdout, done.stdout + done.stderr
    assert client.get(f"/api/v1/runs/{old_done['id']}").status_code == 404
    assert {r["name"] for r in client.get("/api/v1/runs").json()["data"]} == {"old-running", "new-finished"}


def test_deleting_a_run_while_its_agents_write_leaves_no_orphan_rows(database_url, api_server, client):
    """Per-point tables have no foreign keys (see server/models.py): the run-row locks must keep a
    delete racing with ingest from leaving points of a deleted series behind."""
    import threading

    from sqlalchemy import text

    from gradwatch.server.database import make_engine

    run = _create(client)
    errors = []

    def write() -> None:
        with httpx.Client(base_url=api_server.url, timeout=30) as writer:
            for seq in range(1, 60):
                response = writer.post(
                    f"/api/v1/runs/{run['id']}/batches",
                    json=_batch(seq, steps=range(seq * 100, seq * 100 + 100), values=[1.0] * 100),
                )
                if response.status_code == 404:
                    return  # deleted: the agent is told the run is gone
                if response.status_code != 200:
                    errors.append(response.text)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    import time

    time.sleep(0.3)
    assert client.delete(f"/api/v1/runs/{run['id']}").status_code == 204
    for thread in threads:
        thread.join(60)
    assert errors == []
    engine = make_engine(database_url)
    with engine.connect() as connection:
        for table in ("point_chunks", "point_rollups", "series", "agent_batches"):
            assert connection.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 0, table
    engine.dispose()


def test_a_rank_that_crashed_keeps_the_run_crashed_when_other_ranks_finish(client):
    run = _create(client)
    url = f"/api/v1/runs/{run['id']}/batches"
    assert client.post(url, json={"seq": 1, "rank": 1, "status": "crashed"}).status_code == 200
    assert client.post(url, json={"seq": 1, "rank": 0, "status": "finished"}).status_code == 200
    assert client.get(f"/api/v1/runs/{run['id']}").json()["status"] == "crashed"
    other = _create(client)
    client.post(f"/api/v1/runs/{other['id']}/batches", json={"seq": 1, "status": "finished"})
    assert client.get(f"/api/v1/runs/{other['id']}").json()["status"] == "finished"
