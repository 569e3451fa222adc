"""Access control against a real server on SQLite and PostgreSQL: every endpoint with no token, a
bad token, a revoked token, another project's token, a read token where writing is needed, and the
right token; listings limited to the token's project; a server without tokens stays open."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gradwatch.server.auth import Tokens, hash_token
from gradwatch.server.database import make_engine

LAYERS = ["l0", "l1"]
GRADWATCH = str(Path(sys.executable).with_name("gradwatch"))


# Tokens of the matrix: name -> (project, scope as given to Tokens.create).
TOKENS = {
    "ingest-alpha": ("alpha", "ingest"),
    "read-alpha": ("alpha", "read"),
    "admin-alpha": ("alpha", "admin"),
    "legacy-alpha": ("alpha", "write"),
    "all-alpha": ("alpha", "*"),
    "ingest,read-alpha": ("alpha", "ingest,read"),
    "read-beta": ("beta", "read"),
    "admin-beta": ("beta", "*"),
    "read-operator": ("*", "read"),
    "operator": ("*", "*"),
}


def _setup(url: str, tokens: Tokens) -> dict:
    """The TOKENS, a revoked one, and in project alpha a run with data, a rule, a webhook, an alert and
    its incident (a NaN loss fires loss_non_finite, a default rule)."""
    made = {name: tokens.create(project, scope, name)[1] for name, (project, scope) in TOKENS.items()}
    made["write-beta"] = made["admin-beta"]
    revoked, made["revoked"] = tokens.create("alpha", "*")
    tokens.revoke(revoked.id)
    with httpx.Client(base_url=url, headers=_auth(made["operator"]), timeout=30) as client:
        run = client.post("/api/v1/runs", json={"project": "alpha", "name": "a"}).json()
        batch = {
            "seq": 0,
            "layers": LAYERS,
            "scalars": [{"key": "loss", "steps": [0, 1], "values": [1.0, "NaN"]}],
            "vectors": [{"key": "grad/norm", "steps": [0], "values": [[1.0, 2.0]]}],
            "histograms": [
                {
                    "key": "grad/hist",
                    "step": 0,
                    "exponent_min": 0,
                    "exponent_max": 0,
                    "counts": [[1, 0, 0], [2, 0, 0]],
                }
            ],
            "events": [{"step": 1, "kind": "skip"}],
        }
        stored = client.post(f"/api/v1/runs/{run['id']}/batches", json=batch)
        assert stored.status_code == 200, stored.text  # a 429 names its limit
        rule = client.post("/api/v1/alert-rules", json={"project": "alpha", "type": "skip_storm"})
        assert rule.status_code == 201, rule.text
        hook = client.post("/api/v1/webhooks", json={"project": "alpha", "url": "http://127.0.0.1:9/hook"})
        assert hook.status_code == 201, hook.text
        # A resume at step 10 keeps what it supersedes (step 10 and after) as an attempt of the run.
        later = {"seq": 1, "scalars": [{"key": "extra", "steps": [10, 11], "values": [1.0, 2.0]}]}
        stored = client.post(f"/api/v1/runs/{run['id']}/batches", json=later)
        assert stored.status_code == 200, stored.text
        resume = {"seq": int(time.time() * 1000) << 20, "events": [{"step": 10, "kind": "resume"}]}
        assert client.post(f"/api/v1/runs/{run['id']}/batches", json=resume).status_code == 200
        [attempt] = client.get(f"/api/v1/runs/{run['id']}/attempts").json()["data"]
        alert = client.get("/api/v1/alerts", params={"run_id": run["id"]}).json()["data"][0]
        incident = client.get("/api/v1/incidents", params={"run_id": run["id"]}).json()["data"][0]
    made.update(
        run=run["id"],
        rule=rule.json()["id"],
        hook=hook.json()["id"],
        alert=alert["id"],
        incident=incident["id"],
        attempt=attempt["id"],
    )
    return made


def _auth(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


# What another project's token gets: 404 where alpha's resource is named by its id (it cannot learn
# which ids exist), 403 where alpha is named in the request.
HIDDEN, REFUSED = 404, 403


def _endpoints(ids: dict) -> list[tuple[str, str, str, dict, str, int]]:
    """(method, route, path, request kwargs, scope needed, another project's answer) for every route."""
    run, r = f"/api/v1/runs/{ids['run']}", "/api/v1/runs/{run_id}"
    rule, hook, alert = ids["rule"], ids["hook"], ids["alert"]
    batch = {"json": {"seq": 99, "scalars": [{"key": "x", "steps": [5], "values": [1.0]}]}}
    return [
        ("GET", "/api/v1/runs", "/api/v1/runs", {"params": {"project": "alpha"}}, "read", REFUSED),
        ("GET", r, run, {}, "read", HIDDEN),
        ("GET", r + "/keys", f"{run}/keys", {}, "read", HIDDEN),
        ("GET", r + "/series", f"{run}/series", {"params": {"key": "loss"}}, "read", HIDDEN),
        ("GET", r + "/vectors", f"{run}/vectors", {"params": {"key": "grad/norm"}}, "read", HIDDEN),
        ("GET", r + "/histograms", f"{run}/histograms", {"params": {"layer": "l0"}}, "read", HIDDEN),
        ("GET", r + "/events", f"{run}/events", {}, "read", HIDDEN),
        ("GET", r + "/incidents", f"{run}/incidents", {}, "read", HIDDEN),
        ("GET", r + "/attempts", f"{run}/attempts", {}, "read", HIDDEN),
        ("GET", r + "/attempts/{attempt_id}", f"{run}/attempts/{ids['attempt']}", {}, "read", HIDDEN),
        ("GET", r + "/ranks", f"{run}/ranks", {}, "read", HIDDEN),
        ("GET", r + "/ranks/series", f"{run}/ranks/series", {"params": {"key": "loss"}}, "read", HIDDEN),
        (
            "GET",
            r + "/ranks/vectors",
            f"{run}/ranks/vectors",
            {"params": {"key": "grad/norm"}},
            "read",
            HIDDEN,
        ),
        (
            "GET",
            r + "/ranks/histograms",
            f"{run}/ranks/histograms",
            {"params": {"layer": "l0"}},
            "read",
            HIDDEN,
        ),
        ("GET", r + "/ranks/disagreements", f"{run}/ranks/disagreements", {}, "read", HIDDEN),
        (
            "GET",
            "/api/v1/compare",
            "/api/v1/compare",
            {"params": {"run": ids["run"], "key": "loss"}},
            "read",
            HIDDEN,
        ),
        ("GET", "/api/v1/alerts", "/api/v1/alerts", {"params": {"run_id": ids["run"]}}, "read", HIDDEN),
        ("GET", "/api/v1/alerts/{alert_id}", f"/api/v1/alerts/{alert}", {}, "read", HIDDEN),
        ("GET", "/api/v1/incidents", "/api/v1/incidents", {"params": {"project": "alpha"}}, "read", REFUSED),
        (
            "GET",
            "/api/v1/incidents/{incident_id}",
            f"/api/v1/incidents/{ids['incident']}",
            {},
            "read",
            HIDDEN,
        ),
        (
            "GET",
            "/api/v1/alert-rules",
            "/api/v1/alert-rules",
            {"params": {"run_id": ids["run"]}},
            "read",
            HIDDEN,
        ),
        ("GET", "/api/v1/alert-rules/{rule_id}", f"/api/v1/alert-rules/{rule}", {}, "read", HIDDEN),
        ("GET", "/api/v1/webhooks", "/api/v1/webhooks", {"params": {"project": "alpha"}}, "read", REFUSED),
        ("GET", "/api/v1/webhooks/{webhook_id}", f"/api/v1/webhooks/{hook}", {}, "read", HIDDEN),
        (
            "GET",
            "/api/v1/webhooks/{webhook_id}/deliveries",
            f"/api/v1/webhooks/{hook}/deliveries",
            {},
            "read",
            HIDDEN,
        ),
        (
            "GET",
            "/api/v1/deliveries",
            "/api/v1/deliveries",
            {"params": {"project": "alpha"}},
            "read",
            REFUSED,
        ),
        (
            "POST",
            "/api/v1/runs",
            "/api/v1/runs",
            {"json": {"project": "alpha", "name": "new"}},
            "ingest",
            REFUSED,
        ),
        ("POST", r + "/batches", f"{run}/batches", batch, "ingest", HIDDEN),
        ("PATCH", r, run, {"json": {"tags": ["t"]}}, "admin", HIDDEN),
        (
            "POST",
            "/api/v1/alert-rules",
            "/api/v1/alert-rules",
            {"json": {"project": "alpha", "type": "scale_drop"}},
            "admin",
            REFUSED,
        ),
        (
            "PATCH",
            "/api/v1/alert-rules/{rule_id}",
            f"/api/v1/alert-rules/{rule}",
            {"json": {"enabled": True}},
            "admin",
            HIDDEN,
        ),
        (
            "POST",
            "/api/v1/alerts/{alert_id}/acknowledge",
            f"/api/v1/alerts/{alert}/acknowledge",
            {},
            "admin",
            HIDDEN,
        ),
        (
            "POST",
            "/api/v1/webhooks",
            "/api/v1/webhooks",
            {"json": {"project": "alpha", "url": "http://127.0.0.1:9/x"}},
            "admin",
            REFUSED,
        ),
        ("POST", "/api/v1/webhooks/{webhook_id}/test", f"/api/v1/webhooks/{hook}/test", {}, "admin", HIDDEN),
        # Once only, like the deletes: a restored attempt cannot be restored again.
        (
            "POST",
            r + "/attempts/{attempt_id}/restore",
            f"{run}/attempts/{ids['attempt']}/restore",
            {},
            "admin",
            HIDDEN,
        ),
        # Deletes last: they remove what the others use.
        ("DELETE", "/api/v1/alert-rules/{rule_id}", f"/api/v1/alert-rules/{rule}", {}, "admin", HIDDEN),
        ("DELETE", "/api/v1/webhooks/{webhook_id}", f"/api/v1/webhooks/{hook}", {}, "admin", HIDDEN),
        ("DELETE", r, run, {}, "admin", HIDDEN),
    ]


# Routes every valid token may call, whatever its project and scopes.
ANY_TOKEN = {("GET", "/healthz"), ("GET", "/api/v1/auth/whoami"), ("GET", "/api/v1/alert-rules/types")}


def _scopes(name: str) -> set[str]:
    scope = TOKENS[name][1]
    return (
        {"ingest", "read", "admin"}
        if scope == "*"
        else (
            {"ingest", "read"}
            if scope == "write"
            else set(scope.split(",")) | ({"read"} if "admin" in scope else set())
        )
    )


def test_every_endpoint_times_every_scope(api_server, tokens):
    """The authorisation matrix: each route of the API (read from its OpenAPI schema, so a new route
    without a row fails here) against no token, bad and revoked tokens, another project's tokens, and
    alpha's tokens of every scope; 2xx only where the scope allows, a message saying why elsewhere."""
    ids = _setup(api_server.url, tokens)
    endpoints = _endpoints(ids)
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        schema = client.get("/openapi.json").json()
        routes = {(m.upper(), path) for path, ops in schema["paths"].items() for m in ops}
        assert routes == {(m, route) for m, route, *_ in endpoints} | ANY_TOKEN
        for method, route, path, kwargs, scope, elsewhere in endpoints:
            expectations = [
                (None, 401),
                ("gw_not-a-token", 401),
                (ids["revoked"], 401),
                # A write's scope is checked before its body is read, before its resource is looked up:
                # 403 whether alpha's run exists or not (nothing learnt).
                (ids["read-beta"], REFUSED if method != "GET" else elsewhere),
                (ids["admin-beta"], elsewhere),
            ]
            for name in TOKENS:
                if TOKENS[name][0] != "beta":
                    expectations.append((ids[name], 200 if scope in _scopes(name) else 403))
            for token, expected in expectations:
                once = method == "DELETE" or route.endswith("/restore")
                if once and expected == 200 and token != ids["operator"]:
                    continue  # a delete (or a restore) succeeds once: the operator does it, below
                response = client.request(method, path, headers=_auth(token), **kwargs)
                got = 200 if response.status_code in (200, 201, 202, 204) else response.status_code
                who = next((n for n in TOKENS if ids[n] == token), token)
                assert got == expected, f"{method} {route} as {who}: {response.status_code} {response.text}"
                if expected != 200:
                    assert response.json()["detail"], route  # says what is wrong
                if expected == 401:
                    assert response.headers["www-authenticate"] == "Bearer"
                if expected == 403 and TOKENS.get(who, ("beta",))[0] == "alpha":
                    assert f"needs a token with {scope} scope" in response.json()["detail"], route
                if expected == HIDDEN:  # the same words as for an id that never existed
                    assert "does not exist" in response.json()["detail"] and "alpha" not in response.text, (
                        route
                    )
        for token in ("read-alpha", "ingest-alpha", "read-beta"):
            assert client.get("/api/v1/alert-rules/types", headers=_auth(ids[token])).status_code == 200


def test_legacy_write_tokens_become_ingest_and_read(api_server, tokens):
    _, token = tokens.create("alpha", "write")
    with httpx.Client(base_url=api_server.url, headers=_auth(token), timeout=30) as client:
        assert client.get("/api/v1/auth/whoami").json() == {
            "open": False,
            "project": "alpha",
            "scope": "ingest,read",
            "scopes": ["ingest", "read"],
        }
        run = client.post("/api/v1/runs", json={"project": "alpha"}).json()["id"]
        assert client.delete(f"/api/v1/runs/{run}").status_code == 403  # a job's token wipes nothing
        assert client.get(f"/api/v1/runs/{run}").status_code == 200


def test_a_run_id_taken_by_another_project_is_not_squatted(api_server, tokens):
    """Project beta creates a run with the id alpha's agents will use: alpha's agent still gets a run of
    its own under the id it asked for (run ids are a project's own), and keeps finding it by that id."""
    alpha, beta = tokens.create("alpha", "ingest,read")[1], tokens.create("beta", "*")[1]
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        squat = client.post("/api/v1/runs", json={"project": "beta", "id": "job-42"}, headers=_auth(beta))
        assert squat.status_code == 201 and squat.json()["id"] == "job-42"
        first = client.post(
            "/api/v1/runs", json={"project": "alpha", "id": "job-42", "name": "mine"}, headers=_auth(alpha)
        )
        assert first.status_code == 201, first.text
        assert (
            first.json()["id"] == "job-42" and first.json()["project"] == "alpha" and "beta" not in first.text
        )
        again = client.post("/api/v1/runs", json={"project": "alpha", "id": "job-42"}, headers=_auth(alpha))
        assert again.json()["id"] == "job-42" and again.json()["name"] == "mine"  # another rank: same run
        batch = {"seq": 1, "scalars": [{"key": "loss", "steps": [0], "values": [1.0]}]}
        assert client.post("/api/v1/runs/job-42/batches", headers=_auth(alpha), json=batch).status_code == 200
        assert client.get("/api/v1/runs/job-42", headers=_auth(alpha)).json()["last_step"] == 0
        assert client.get("/api/v1/runs/job-42", headers=_auth(beta)).json()["last_step"] is None


def test_the_agent_keeps_its_id_when_another_project_has_it(api_server, tokens):
    import gradwatch

    beta = tokens.create("beta", "*")[1]
    alpha = tokens.create("alpha", "ingest,read")[1]
    httpx.post(
        f"{api_server.url}/api/v1/runs",
        json={"project": "beta", "id": "shared-id"},
        headers=_auth(beta),
        timeout=30,
    )
    run = gradwatch.init(project="alpha", run_id="shared-id", server=api_server.url, token=alpha)
    run.log({"loss": 1.5}, step=0)
    run.finish()
    assert run.stats.dropped_points == 0
    listed = httpx.get(f"{api_server.url}/api/v1/runs", headers=_auth(alpha), timeout=30).json()["data"]
    assert len(listed) == 1 and listed[0]["id"] == "shared-id"  # run ids are a project's own (issue 28)
    assert run.id == "shared-id" and run.url.endswith("/dashboard/runs/shared-id?project=alpha")
    series = httpx.get(
        f"{api_server.url}/api/v1/runs/{listed[0]['id']}/series",
        params={"key": "loss"},
        headers=_auth(alpha),
        timeout=30,
    ).json()
    assert series["values"] == [1.5]


def test_listings_show_only_the_tokens_project(api_server, tokens):
    ids = _setup(api_server.url, tokens)
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        beta = client.post(
            "/api/v1/runs", json={"project": "beta", "name": "b"}, headers=_auth(ids["write-beta"])
        )
        assert beta.status_code == 201
        as_beta = client.get("/api/v1/runs", headers=_auth(ids["read-beta"])).json()
        assert [r["project"] for r in as_beta["data"]] == ["beta"]
        as_operator = client.get("/api/v1/runs", headers=_auth(ids["read-operator"])).json()
        assert {r["project"] for r in as_operator["data"]} == {"alpha", "beta"}
        for path in ("/api/v1/alerts", "/api/v1/webhooks", "/api/v1/alert-rules", "/api/v1/deliveries"):
            listed = client.get(path, headers=_auth(ids["read-beta"]))
            assert listed.status_code == 200, (path, listed.text)
            assert all(item.get("project", "beta") == "beta" for item in listed.json()["data"]), path
        refused = client.get("/api/v1/runs", params={"project": "alpha"}, headers=_auth(ids["read-beta"]))
        assert refused.status_code == 403 and "'beta', not 'alpha'" in refused.json()["detail"]
        compare = client.get(
            "/api/v1/compare",
            params={"run": [beta.json()["id"], ids["run"]], "key": "loss"},
            headers=_auth(ids["read-beta"]),
        )
        assert compare.status_code == 404  # one of the runs belongs to another project: as if absent


def test_without_tokens_the_server_is_open_and_stray_tokens_are_ignored(api_server):
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        assert client.post("/api/v1/runs", json={"project": "p"}).status_code == 201
        assert client.get("/api/v1/runs", headers=_auth("gw_whatever")).status_code == 200
        assert client.get("/healthz").status_code == 200


def test_tokens_are_stored_only_as_hashes_and_revocation_is_immediate(database_url, api_server, tokens):
    record, token = tokens.create("alpha", "read", "ci")
    assert token.startswith("gw_") and len(token) > 40 and record.prefix == token[:10]
    engine = make_engine(database_url)
    with engine.connect() as connection:
        stored = [tuple(row) for row in connection.exec_driver_sql("SELECT * FROM api_tokens")]
    engine.dispose()
    assert not any(token in str(column) for row in stored for column in row)
    assert any(hash_token(token) in row for row in stored)
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        assert client.get("/api/v1/runs", headers=_auth(token)).status_code == 200
        tokens.revoke(record.id)
        assert client.get("/api/v1/runs", headers=_auth(token)).status_code == 401
        malformed = client.get("/api/v1/runs", headers={"Authorization": "Basic abc"})
        assert malformed.status_code == 401 and "Bearer" in malformed.json()["detail"]
    assert [t.name for t in tokens.list(include_revoked=True)] == ["ci"]
    assert tokens.list() == []


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRADWATCH, *args], check=False, capture_output=True, text=True, timeout=120)


def test_token_cli_create_list_revoke_against_a_real_server(database_url, api_server):
    created = _cli(
        "token",
        "create",
        "--project",
        "alpha",
        "--scope",
        "ingest",
        "--name",
        "ci agents",
        "--database-url",
        database_url,
    )
    assert created.returncode == 0, created.stderr
    token = created.stdout.split()[-1]  # the last word of the output is the token
    assert token.startswith("gw_")
    listed = _cli("token", "list", "--database-url", database_url)
    assert "ci agents" in listed.stdout and "ingest" in listed.stdout and token not in listed.stdout
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        assert client.post("/api/v1/runs", json={"project": "alpha"}, headers=_auth(token)).status_code == 201
        assert client.post("/api/v1/runs", json={"project": "alpha"}).status_code == 401
        revoked = _cli("token", "revoke", "1", "--database-url", database_url)
        assert revoked.returncode == 0 and "revoked token 1" in revoked.stdout
        assert client.get("/api/v1/runs", headers=_auth(token)).status_code == 401
        # Revoking the last token never opens the server (issue 14: it answered anonymous requests).
        assert client.get("/api/v1/runs").status_code == 401
        assert client.delete("/api/v1/runs/anything").status_code == 401
    bad = _cli("token", "create", "--project", "alpha", "--scope", "root", "--database-url", database_url)
    assert bad.returncode == 2 and "'root' unknown" in bad.stderr and "ingest, read, admin" in bad.stderr
    missing = _cli("token", "revoke", "42", "--database-url", database_url)
    assert missing.returncode == 2 and "token 42 does not exist" in missing.stderr


def test_listening_beyond_loopback_needs_tokens_or_insecure(sqlite_url, capsys):
    from gradwatch.server.app import create_app
    from gradwatch.server.serve import ExposureRefused, check_exposure
    from gradwatch.server.settings import Settings

    # The command refuses before binding anything.
    refused = _cli("server", "--host", "0.0.0.0", "--port", "9", "--database-url", sqlite_url)
    assert refused.returncode == 2 and "refusing to listen on 0.0.0.0" in refused.stderr
    app = create_app(Settings(database_url=sqlite_url))
    check_exposure(app, "127.0.0.1", insecure=False)  # loopback: open is fine
    with pytest.raises(ExposureRefused, match="--insecure"):
        check_exposure(app, "192.168.1.20", insecure=False)
    check_exposure(app, "192.168.1.20", insecure=True)
    assert "WARNING" in capsys.readouterr().err
    app.state.tokens.create("p", "read")
    check_exposure(app, "192.168.1.20", insecure=False)  # tokens exist: allowed
    app.state.store.engine.dispose()


def test_tokens_in_request_paths_never_reach_the_log():
    import logging

    from gradwatch.server.serve import _RedactTokens

    record = logging.LogRecord(
        "uvicorn.error",
        logging.INFO,
        __file__,
        1,
        '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5000", "/api/v1/runs/r/live?key=loss&token=gw_secret123&rank=0"),
        None,
    )
    _RedactTokens().filter(record)
    assert "gw_secret123" not in record.getMessage() and "token=[redacted]&rank=0" in record.getMessage()
    for path in (
        "/api/v1/runs/r/live?tok%65n=gw_secret123",
        "/api/v1/runs?TOKEN=gw_secret123&x=1",
        "/api/v1/runs?a=1&Token=gw_secret123",
        "/api/v1/runs?token[]=gw_secret123",  # issue 28: array spellings and ; separators
        "/api/v1/runs?token%5B%5D=gw_secret123&x=1",
        "/api/v1/runs?a=1;token=gw_secret123",
        "/api/v1/runs?access_token=gw_secret123",
    ):  # parsed names, not spellings (issue 14)
        record = logging.LogRecord(
            "uvicorn.access", logging.INFO, __file__, 1, '%s - "GET %s"', ("127.0.0.1:5000", path), None
        )
        _RedactTokens().filter(record)
        assert "gw_secret123" not in record.getMessage(), path
    shaped = "gw_" + "Ab3_-x" * 6  # a real token's shape, in a path segment: redacted wherever it is
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "GET %s"',
        ("127.0.0.1:5000", f"/x/{shaped}/y"),
        None,
    )
    _RedactTokens().filter(record)
    assert shaped not in record.getMessage() and "/x/gw_[redacted]/y" in record.getMessage()


def test_open_after_revocation_only_when_asked(sqlite_url):
    from conftest import free_port

    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    for open_after_revocation, expected in ((False, 401), (True, 200)):
        settings = Settings(database_url=sqlite_url, open_after_revocation=open_after_revocation)
        server = BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False).start()
        try:
            tokens = server.server.config.app.state.tokens
            record, _ = tokens.create("p", "read")
            tokens.revoke(record.id)
            time.sleep(0.1)
            assert httpx.get(f"{server.url}/api/v1/runs", timeout=10).status_code == expected
        finally:
            server.stop()


def test_read_tokens_see_webhook_hosts_not_their_secret_urls(database_url, api_server):
    engine = make_engine(database_url)
    tokens = Tokens(engine)
    _, write = tokens.create("alpha", "admin")
    _, read = tokens.create("alpha", "read")
    engine.dispose()
    url = "https://hooks.slack.com/services/T000/B000/SECRETSECRET"
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        hook = client.post("/api/v1/webhooks", json={"url": url, "project": "alpha"}, headers=_auth(write))
        assert hook.status_code == 201 and hook.json()["url"] == url
        for path in ("/api/v1/webhooks", f"/api/v1/webhooks/{hook.json()['id']}"):
            seen = client.get(path, headers=_auth(read)).json()
            shown = seen["data"][0]["url"] if "data" in seen else seen["url"]
            assert shown == "https://hooks.slack.com/…" and "SECRET" not in json.dumps(seen)
            assert "SECRET" in client.get(path, headers=_auth(write)).text  # admins manage them
