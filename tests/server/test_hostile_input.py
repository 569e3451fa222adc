"""Hostile and malformed input against a real server (SQLite and PostgreSQL): every bad payload gets a
4xx whose detail says what is wrong, nothing of a rejected batch is stored, and a schema-driven fuzzer
(schemathesis, over the OpenAPI spec) finds no 5xx and no response that breaks the spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

SCALAR = '{{"seq":{seq},"scalars":[{{"key":{key},"steps":{steps},"values":{values}}}]}}'
CASES = [
    # (name, raw body, expected status, a phrase the detail must contain)
    ("not JSON", b"hello", 422, "JSON decode error"),
    (
        "not UTF-8",
        b'{"seq":1,"scalars":[{"key":"\xff\xfe","steps":[0],"values":[1.0]}]}',
        400,
        "not valid UTF-8",
    ),
    ("nested 100k deep", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (
        "event data 40 deep",
        ('{"seq":1,"events":[{"step":0,"kind":"x","data":' + '{"a":' * 40 + "1" + "}" * 40 + "}]}").encode(),
        422,
        "nested deeper than 32 levels",
    ),
    (
        "lone surrogate key",
        SCALAR.format(seq=1, key='"\\ud800"', steps="[0]", values="[1]").encode(),
        422,
        "unicode",
    ),
    ("NUL in key", SCALAR.format(seq=1, key='"a\\u0000b"', steps="[0]", values="[1]").encode(), 422, "NUL"),
    (
        "string value",
        SCALAR.format(seq=1, key='"a"', steps="[0]", values='["abc"]').encode(),
        422,
        "valid number",
    ),
    (
        "boolean value",
        SCALAR.format(seq=1, key='"a"', steps="[0]", values="[true]").encode(),
        422,
        "not true/false",
    ),
    (
        "negative step",
        SCALAR.format(seq=1, key='"a"', steps="[-5]", values="[1]").encode(),
        422,
        "greater than or equal to 0",
    ),
    (
        "fractional step",
        SCALAR.format(seq=1, key='"a"', steps="[1.5]", values="[1]").encode(),
        422,
        "fractional part",
    ),
    (
        "huge step",
        SCALAR.format(seq=1, key='"a"', steps="[1" + "0" * 30 + "]", values="[1]").encode(),
        422,
        "less than or equal to",
    ),
    ("huge seq", b'{"seq":1' + b"0" * 30 + b"}", 422, "less than or equal to"),
    (
        "steps and values differ",
        SCALAR.format(seq=1, key='"a"', steps="[0,1]", values="[1]").encode(),
        422,
        "2 steps but 1 values",
    ),
    ("wrong type", b'{"seq":"one"}', 422, "valid integer"),
    ("unknown field", b'{"seq":1,"colour":"red"}', 422, "Extra inputs"),
    ("null body", b"null", 422, "valid dictionary"),
    (
        "negative count",
        (
            b'{"seq":1,"layers":["a"],"histograms":[{"key":"h","step":0,"exponent_min":0,'
            b'"exponent_max":0,"counts":[[-1,0,0]]}]}'
        ),
        422,
        "greater than or equal to 0",
    ),
    (
        "huge count",
        b'{"seq":1,"layers":["a"],"histograms":[{"key":"h","step":0,"exponent_min":0,'
        b'"exponent_max":0,"counts":[[1' + b"0" * 25 + b",0,0]]}]}",
        422,
        "less than or equal to",
    ),
    (
        "too many layers' values",
        (
            b'{"seq":1,"vectors":[{"key":"v","steps":[0],"values":[[1,2,3]]}],'
            b'"scalars":[{"key":"a","steps":[0],"values":[1]}]}'
        ),
        422,
        "run has 2 layers",
    ),
]


@pytest.mark.parametrize(("name", "body", "status", "phrase"), CASES, ids=[c[0] for c in CASES])
def test_bad_batches_are_refused_with_a_reason_and_store_nothing(client, name, body, status, phrase):
    run = client.post("/api/v1/runs", json={"project": "p", "name": "<script>alert(1)</script>"}).json()
    url = f"/api/v1/runs/{run['id']}/batches"
    good = {
        "seq": 0,
        "layers": ["l0", "l1"],
        "scalars": [{"key": "loss", "steps": [0], "values": [1.0]}],
        "events": [{"step": 0, "kind": "skip"}],
    }
    assert client.post(url, json=good).status_code == 200
    response = client.post(url, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, (name, response.text)
    assert phrase in response.text, (name, response.text)
    # Nothing of the rejected batch was stored, and what was stored before is intact.
    assert client.get(f"/api/v1/runs/{run['id']}/keys").json()["data"] == ["loss"]
    assert client.get(f"/api/v1/runs/{run['id']}/keys", params={"kind": "vector"}).json()["data"] == []
    assert client.get(f"/api/v1/runs/{run['id']}/events").json()["count"] == 1
    assert client.get(f"/api/v1/runs/{run['id']}/series", params={"key": "loss"}).json()["values"] == [1.0]
    # The same seq can still be used: a refused batch is not remembered as received.
    retry = client.post(url, json={"seq": 1, "scalars": [{"key": "later", "steps": [1], "values": [2.0]}]})
    assert retry.json()["duplicate"] is False


def test_a_body_over_the_size_limit_is_refused_before_it_is_read(client):
    run = client.post("/api/v1/runs", json={"project": "p"}).json()
    response = client.post(
        f"/api/v1/runs/{run['id']}/batches",
        content=b" " * (33 * 1024 * 1024),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413 and "larger than" in response.json()["detail"]


def test_unknown_run_and_out_of_range_ids_are_4xx(client):
    missing = client.post("/api/v1/runs/nope/batches", json={"seq": 0})
    assert missing.status_code == 404 and "does not exist" in missing.json()["detail"]
    huge = client.get("/api/v1/alerts/" + "9" * 30)
    assert huge.status_code == 422 and "less than or equal to 2147483647" in huge.text


def test_schema_driven_fuzzing_finds_no_server_error_and_no_spec_violation(api_server, tmp_path):
    """schemathesis generates requests from /openapi.json (valid and invalid ones) against the real
    server and checks every answer: no 5xx, status codes and bodies as documented."""
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{api_server.url}/openapi.json",
        "--checks",
        checks,
        "--max-examples",
        "15",
        "--seed",
        "20261129",
        "--no-color",
        "--request-timeout",
        "30",
        "--report-dir",
        str(tmp_path),
    ]
    env = os.environ | {"SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "generated" in result.stdout and " 0 passed" not in result.stdout
    httpx.get(f"{api_server.url}/healthz").raise_for_status()  # still up afterwards


@pytest.mark.parametrize(
    ("value", "phrase"),
    [('"\\ud800"', "Unicode"), ('"a\\u0000b"', "NUL"), ('"' + "k" * 100_000 + '"', "at most 200 characters")],
    ids=["lone surrogate", "NUL", "100 KB"],
)
def test_patching_a_rule_validates_its_text_as_creating_one_does(client, value, phrase):
    """PATCH took params as any dict: a lone surrogate, a NUL or a 100 KB key name was stored, and
    every later answer carrying the rule broke or grew (issue 39, item 9). Both ways now refuse it."""
    created = client.post(
        "/api/v1/alert-rules",
        json={"project": "p", "type": "underflow", "params": {"key": "grad/underflow_frac"}},
    )
    assert created.status_code == 201, created.text
    rule = created.json()
    body = ('{"params": {"key": ' + value + "}}").encode()
    headers = {"content-type": "application/json"}
    patched = client.patch(f"/api/v1/alert-rules/{rule['id']}", content=body, headers=headers)
    assert patched.status_code == 422 and phrase in patched.text, patched.text
    posted = client.post(
        "/api/v1/alert-rules",
        content=('{"project": "p", "type": "underflow", "params": {"key": ' + value + "}}").encode(),
        headers=headers,
    )
    assert posted.status_code == 422 and phrase in posted.text, posted.text
    assert client.get(f"/api/v1/alert-rules/{rule['id']}").json()["params"]["key"] == "grad/underflow_frac"
