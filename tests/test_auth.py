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


@pytest.fixture
def tokens(database_url, api_server):
    engine = make_engine(database_url)
    yield Tokens(engine)
    engine.dispose()


def _setup(url: str, tokens: Tokens) -> dict:
    """Tokens of two projects and one run with data in project alpha."""
    made = {}
    for project in ("alpha", "beta"):
        for scope in ("read", "write"):
            made[f"{scope}-{project}"] = tokens.create(project, scope, f"{scope} {project}")[1]
    made["read-all"] = tokens.create("*", "read", "operator")[1]
    revoked, made["revoked"] = tokens.create("alpha", "write")
    tokens.revoke(revoked.id)
    with httpx.Client(base_url=url, headers=_auth(made["write-alpha"])) as client:
        run = client.post("/api/v1/runs", json={"project": "alpha", "name": "a"}).json()
        batch = {
            "seq": 0, "layers": LAYERS,
            "scalars": [{"key": "loss", "steps": [0, 1], "values": [1.0, 2.0]}],
            "vectors": [{"key": "grad/norm", "steps": [0], "values": [[1.0, 2.0]]}],
            "histograms": [{"key": "grad/hist", "step": 0, "exponent_min": 0, "exponent_max": 0,
                            "counts": [[1, 0, 0], [2, 0, 0]]}],
            "events": [{"step": 1, "kind": "skip"}],
        }
        assert client.post(f"/api/v1/runs/{run['id']}/batches", json=batch).status_code == 200
        rule = client.post("/api/v1/alert-rules", json={"project": "alpha", "type": "skip_storm"})
        assert rule.status_code == 201, rule.text
        hook = client.post("/api/v1/webhooks", json={"project": "alpha", "url": "http://127.0.0.1:9/hook"})
        assert hook.status_code == 201, hook.text
    made.update(run=run["id"], rule=rule.json()["id"], hook=hook.json()["id"])
    return made


def _auth(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _endpoints(ids: dict) -> list[tuple[str, str, dict, str]]:
    """(method, path, request kwargs, scope needed) for every endpoint that touches project alpha."""
    run = f"/api/v1/runs/{ids['run']}"
    return [
        ("GET", run, {}, "read"),
        ("GET", f"{run}/keys", {}, "read"),
        ("GET", f"{run}/series", {"params": {"key": "loss"}}, "read"),
        ("GET", f"{run}/vectors", {"params": {"key": "grad/norm"}}, "read"),
        ("GET", f"{run}/histograms", {"params": {"layer": "l0"}}, "read"),
        ("GET", f"{run}/events", {}, "read"),
        ("GET", "/api/v1/compare", {"params": {"run": ids["run"], "key": "loss"}}, "read"),
        ("GET", "/api/v1/alerts", {"params": {"run_id": ids["run"]}}, "read"),
        ("GET", "/api/v1/alert-rules", {"params": {"run_id": ids["run"]}}, "read"),
        ("GET", "/api/v1/alert-rules", {"params": {"project": "alpha"}}, "read"),
        ("GET", f"/api/v1/alert-rules/{ids['rule']}", {}, "read"),
        ("GET", "/api/v1/webhooks", {"params": {"project": "alpha"}}, "read"),
        ("GET", f"/api/v1/webhooks/{ids['hook']}", {}, "read"),
        ("GET", f"/api/v1/webhooks/{ids['hook']}/deliveries", {}, "read"),
        ("GET", "/api/v1/runs", {"params": {"project": "alpha"}}, "read"),
        ("POST", "/api/v1/runs", {"json": {"project": "alpha", "name": "new"}}, "write"),
        ("POST", f"{run}/batches", {"json": {"seq": 99, "scalars": [{"key": "x", "steps": [5], "values": [1.0]}]}},
         "write"),
        ("PATCH", run, {"json": {"tags": ["t"]}}, "write"),
        ("POST", "/api/v1/alert-rules", {"json": {"project": "alpha", "type": "scale_drop"}}, "write"),
        ("PATCH", f"/api/v1/alert-rules/{ids['rule']}", {"json": {"enabled": True}}, "write"),
        ("POST", "/api/v1/webhooks", {"json": {"project": "alpha", "url": "http://127.0.0.1:9/x"}}, "write"),
        ("POST", f"/api/v1/webhooks/{ids['hook']}/test", {}, "write"),
    ]


def test_every_endpoint_checks_token_scope_and_project(api_server, tokens):
    ids = _setup(api_server.url, tokens)
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        for method, path, kwargs, scope in _endpoints(ids):
            where = f"{method} {path} {kwargs}"
            for token, expected in (
                (None, 401), ("gw_not-a-token", 401), (ids["revoked"], 401),
                (ids["read-beta"], 403), (ids["write-beta"], 403),
                (ids["read-alpha"], 403 if scope == "write" else 200),
                (ids["read-all"], 403 if scope == "write" else 200),
                (ids["write-alpha"], 200),
            ):
                response = client.request(method, path, headers=_auth(token), **kwargs)
                got = 200 if response.status_code in (200, 201, 202) else response.status_code
                assert got == expected, f"{where} with {token}: {response.status_code} {response.text}"
                if expected != 200:
                    assert response.json()["detail"], where  # says what is wrong
                if expected == 401:
                    assert response.headers["www-authenticate"] == "Bearer"
        # A write token may delete its project's run; another project's may not.
        run = f"/api/v1/runs/{ids['run']}"
        assert client.delete(run, headers=_auth(ids["write-beta"])).status_code == 403
        assert client.delete(run, headers=_auth(ids["read-alpha"])).status_code == 403
        assert client.delete(run, headers=_auth(ids["write-alpha"])).status_code == 204


def test_listings_show_only_the_tokens_project(api_server, tokens):
    ids = _setup(api_server.url, tokens)
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        beta = client.post("/api/v1/runs", json={"project": "beta", "name": "b"}, headers=_auth(ids["write-beta"]))
        assert beta.status_code == 201
        as_beta = client.get("/api/v1/runs", headers=_auth(ids["read-beta"])).json()
        assert [r["project"] for r in as_beta["data"]] == ["beta"]
        as_operator = client.get("/api/v1/runs", headers=_auth(ids["read-all"])).json()
        assert {r["project"] for r in as_operator["data"]} == {"alpha", "beta"}
        for path in ("/api/v1/alerts", "/api/v1/webhooks", "/api/v1/alert-rules", "/api/v1/deliveries"):
            listed = client.get(path, headers=_auth(ids["read-beta"]))
            assert listed.status_code == 200, (path, listed.text)
            assert all(item.get("project", "beta") == "beta" for item in listed.json()["data"]), path
        refused = client.get("/api/v1/runs", params={"project": "alpha"}, headers=_auth(ids["read-beta"]))
        assert refused.status_code == 403 and "'beta', not 'alpha'" in refused.json()["detail"]
        compare = client.get("/api/v1/compare", params={"run": [beta.json()["id"], ids["run"]], "key": "loss"},
                             headers=_auth(ids["read-beta"]))
        assert compare.status_code == 403  # one of the runs belongs to another project


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
    created = _cli("token", "create", "--project", "alpha", "--scope", "write", "--name", "ci agents",
                   "--database-url", database_url)
    assert created.returncode == 0, created.stderr
    token = created.stdout.split()[-1]  # the last word of the output is the token
    assert token.startswith("gw_")
    listed = _cli("token", "list", "--database-url", database_url)
    assert "ci agents" in listed.stdout and "write" in listed.stdout and token not in listed.stdout
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        assert client.post("/api/v1/runs", json={"project": "alpha"}, headers=_auth(token)).status_code == 201
        assert client.post("/api/v1/runs", json={"project": "alpha"}).status_code == 401
        revoked = _cli("token", "revoke", "1", "--database-url", database_url)
        assert revoked.returncode == 0 and "revoked token 1" in revoked.stdout
        assert client.get("/api/v1/runs", headers=_auth(token)).status_code == 401
        # Revoking the last token never opens the server (issue 14: it answered anonymous requests).
        assert client.get("/api/v1/runs").status_code == 401
        assert client.delete("/api/v1/runs/anything").status_code == 401
    bad = _cli("token", "create", "--project", "alpha", "--scope", "admin", "--database-url", database_url)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
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

    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5000", "/api/v1/runs/r/live?key=loss&token=gw_secret123&rank=0"), None)
    _RedactTokens().filter(record)
    assert "gw_secret123" not in record.getMessage() and "token=[redacted]&rank=0" in record.getMessage()
    for path in ("/api/v1/runs/r/live?tok%65n=gw_secret123", "/api/v1/runs?TOKEN=gw_secret123&x=1",
                 "/api/v1/runs?a=1&Token=gw_secret123"):  # parsed names, not spellings (issue 14)
        record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "GET %s"',
                                   ("127.0.0.1:5000", path), None)
        _RedactTokens().filter(record)
        assert "gw_secret123" not in record.getMessage(), path


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
    _, write = tokens.create("alpha", "write")
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
            assert "SECRET" in client.get(path, headers=_auth(write)).text  # writers manage them
