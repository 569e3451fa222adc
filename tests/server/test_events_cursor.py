"""GET /api/v1/runs/{id}/events?after_id=N: only the events stored after a previous answer's, for
pages that poll; count still counts them all, so a reader can tell when it missed or lost some."""

RESUMED_SEQ = 2 << 20  # a later agent process (its seqs start in a higher namespace)


def _run(client):
    response = client.post("/api/v1/runs", json={"project": "p", "name": "r"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _events(client, run_id, seq, *steps, kind="skip"):
    events = [{"step": step, "kind": kind, "data": {"at": step}} for step in steps]
    response = client.post(f"/api/v1/runs/{run_id}/batches", json={"seq": seq, "events": events})
    assert response.status_code == 200, response.text


def _read(client, run_id, **params):
    response = client.get(f"/api/v1/runs/{run_id}/events", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_after_id_returns_only_the_events_stored_since(client):
    run_id = _run(client)
    _events(client, run_id, 0, 3, 1)
    first = _read(client, run_id)
    assert [e["step"] for e in first["data"]] == [1, 3] and first["count"] == 2
    assert isinstance(first["last_id"], int)

    nothing = _read(client, run_id, after_id=first["last_id"])
    assert nothing == {"data": [], "count": 2, "last_id": first["last_id"]}

    _events(client, run_id, 1, 2, 7)
    new = _read(client, run_id, after_id=first["last_id"])
    assert new["data"] == [
        {"step": 2, "kind": "skip", "rank": 0, "data": {"at": 2}},
        {"step": 7, "kind": "skip", "rank": 0, "data": {"at": 7}},
    ]
    assert new["count"] == 4  # every event, so held (2) + new (2) == count: nothing missed
    assert new["last_id"] > first["last_id"]
    assert _read(client, run_id, after_id=new["last_id"])["data"] == []


def test_after_id_pages_in_the_order_events_were_stored(client):
    run_id = _run(client)
    _events(client, run_id, 0, 9, 8, 7, 6, 5)
    cursor, seen = 0, []
    while True:
        page = _read(client, run_id, after_id=cursor, limit=2)
        if not page["data"]:
            break
        seen += [e["step"] for e in page["data"]]
        cursor = page["last_id"]
    assert seen == [9, 8, 7, 6, 5]


def test_kind_and_step_range_apply_to_the_cursor_and_its_count(client):
    run_id = _run(client)
    _events(client, run_id, 0, 1, 2)
    _events(client, run_id, 1, 3, kind="warning")
    start = _read(client, run_id, kind="skip")
    _events(client, run_id, 2, 4)
    _events(client, run_id, 3, 5, kind="warning")
    skips = _read(client, run_id, kind="skip", after_id=start["last_id"])
    assert [e["step"] for e in skips["data"]] == [4] and skips["count"] == 3
    ranged = _read(client, run_id, after_id=0, start=2, end=5)
    assert [e["step"] for e in ranged["data"]] == [2, 3, 4] and ranged["count"] == 3


def test_a_list_cut_by_limit_in_step_order_gives_no_cursor(client):
    run_id = _run(client)
    _events(client, run_id, 0, 1, 2, 3)
    page = _read(client, run_id, limit=2)
    assert len(page["data"]) == 2 and page["count"] == 3 and page["last_id"] is None


def test_a_resume_that_deletes_events_shows_in_the_count(client):
    run_id = _run(client)
    _events(client, run_id, 0, 1, 5, 6)
    held = _read(client, run_id)
    # A resumed process continues from step 4: the events at steps 5 and 6 are superseded.
    _events(client, run_id, RESUMED_SEQ, 4, kind="resume")
    new = _read(client, run_id, after_id=held["last_id"])
    # SQLite may give the resume event an id a deleted event had: the count tells the reader that what
    # it holds is no longer what is stored, and it reads in full.
    assert new["count"] == 2 != len(held["data"]) + len(new["data"])
    assert [e["kind"] for e in _read(client, run_id)["data"]] == ["skip", "resume"]


def test_a_bad_cursor_is_refused_with_a_reason(client):
    run_id = _run(client)
    response = client.get(f"/api/v1/runs/{run_id}/events", params={"after_id": -1})
    assert response.status_code == 422 and "after_id" in response.text
    assert client.get("/api/v1/runs/nope/events", params={"after_id": 0}).status_code == 404
