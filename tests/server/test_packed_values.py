"""values_f64: a scalar series' values as base64 float64 (what the agent sends to a server that
announces it), against a real server on SQLite and PostgreSQL: stored exactly as the same values sent
as JSON numbers, and a malformed one refused with a message that says what is wrong."""

import base64
import math
import struct


def _packed(values):
    return base64.b64encode(struct.pack(f"<{len(values)}d", *values)).decode()


def _run(client):
    response = client.post("/api/v1/runs", json={"project": "p"})
    assert response.status_code == 201, response.text
    assert "values_f64" in response.json()["wire_features"]  # what an agent reads to use them
    return response.json()["id"]


def test_packed_values_are_stored_as_the_same_values_sent_as_numbers(client):
    values = [0.1 * i for i in range(40)]
    values[3], values[5], values[7] = math.nan, math.inf, -math.inf
    plain, packed = _run(client), _run(client)
    wire = [
        v if math.isfinite(v) else ("NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity")
        for v in values
    ]
    batch = {"seq": 1, "scalars": [{"key": "loss", "steps": list(range(40)), "values": wire}]}
    assert client.post(f"/api/v1/runs/{plain}/batches", json=batch).status_code == 200
    batch = {"seq": 1, "scalars": [{"key": "loss", "steps": list(range(40)), "values_f64": _packed(values)}]}
    ack = client.post(f"/api/v1/runs/{packed}/batches", json=batch)
    assert ack.status_code == 200 and ack.json()["points"] == 40
    read = [
        client.get(f"/api/v1/runs/{run}/series", params={"key": "loss"}).json() for run in (plain, packed)
    ]
    assert read[0] == read[1] and read[1]["values"][3:8:2] == ["NaN", "Infinity", "-Infinity"]


def test_malformed_packed_values_are_refused_with_the_reason_and_nothing_is_stored(client):
    run = _run(client)
    steps = list(range(4))
    cases = {
        "not both": {"values": [1.0] * 4, "values_f64": _packed([1.0] * 4)},
        "not valid base64": {"values_f64": "@@@@"},
        "whole number of float64s": {"values_f64": base64.b64encode(b"\0" * 12).decode()},
        "pair up": {"values_f64": _packed([1.0] * 3)},
    }
    for seq, (reason, fields) in enumerate(cases.items(), start=1):
        batch = {"seq": seq, "scalars": [{"key": "loss", "steps": steps, **fields}]}
        response = client.post(f"/api/v1/runs/{run}/batches", json=batch)
        assert response.status_code == 422 and reason in response.text, (reason, response.text)
    assert client.get(f"/api/v1/runs/{run}/series", params={"key": "loss"}).json()["steps"] == []


def _packed_steps(steps):
    return base64.b64encode(struct.pack(f"<{len(steps)}q", *steps)).decode()


def test_packed_steps_are_stored_as_the_same_steps_sent_as_numbers(client):
    run = _run(client)
    assert "steps_i64" in client.post("/api/v1/runs", json={"project": "p"}).json()["wire_features"]
    steps = [0, 3, 4, 2**40, 2**62]
    values = [1.0, 2.0, math.nan, 4.0, 5.0] * 4
    batch = {
        "seq": 1,
        "scalars": [
            {"key": "a", "steps_i64": _packed_steps(steps), "values": [1.0, 2.0, "NaN", 4.0, 5.0]},
            {"key": "b", "steps_i64": _packed_steps(list(range(20))), "values_f64": _packed(values)},
        ],
    }
    ack = client.post(f"/api/v1/runs/{run}/batches", json=batch)
    assert ack.status_code == 200 and ack.json()["points"] == 25, ack.text
    a = client.get(f"/api/v1/runs/{run}/series", params={"key": "a", "max_points": 10}).json()
    assert a["steps"] == steps and a["values"] == [1.0, 2.0, "NaN", 4.0, 5.0]
    b = client.get(f"/api/v1/runs/{run}/series", params={"key": "b"}).json()
    assert b["steps"] == list(range(20)) and b["values"][:3] == [1.0, 2.0, "NaN"]


def test_malformed_packed_steps_are_refused_with_the_reason_and_nothing_is_stored(client):
    run = _run(client)
    cases = {
        "not both": {"steps": [0, 1], "steps_i64": _packed_steps([0, 1])},
        "not valid base64": {"steps_i64": "@@@@"},
        "whole number of int64s": {"steps_i64": base64.b64encode(b"\0" * 12).decode()},
        "between 0 and": {"steps_i64": _packed_steps([0, -1])},
        "pair up": {"steps_i64": _packed_steps([0, 1, 2])},
    }
    for seq, (reason, fields) in enumerate(cases.items(), start=1):
        batch = {"seq": seq, "scalars": [{"key": "loss", "values": [1.0, 2.0], **fields}]}
        response = client.post(f"/api/v1/runs/{run}/batches", json=batch)
        assert response.status_code == 422 and reason in response.text, (reason, response.text)
    assert client.get(f"/api/v1/runs/{run}/series", params={"key": "loss"}).json()["steps"] == []
