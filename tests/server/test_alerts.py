"""Alerts end to end: real fp16 GradScaler training loops on CPU → agent → real uvicorn server
(SQLite file and PostgreSQL) → rules → alerts with evidence → webhooks to a real HTTP receiver."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from conftest import free_port
from training import RecordingTransport, train
from webhook_receiver import WebhookReceiver, settled_deliveries

import gradwatch
from gradwatch.server.alerts.webhooks import verify
from gradwatch.server.serve import BackgroundServer
from gradwatch.server.settings import Settings

PUBLIC_URL = "http://gradwatch.example:8765"

# Rules beyond the defaults, sized for TinyNet's short runs (GradScaler growth_interval=20 in training.py).
# TinyNet's "overflow" multiplies activations by 1e6: inf in the fp16 forward, so the loss is NaN too.
SCENARIO_RULES = [
    {"type": "no_scale_growth", "params": {"growth_interval": 20, "intervals": 2}},
    {"type": "update_ratio", "params": {"low": 1e-3, "high": 0.5}},
]


@pytest.fixture
def alert_server(database_url) -> Iterator[BackgroundServer]:
    """The API with a fast outbox (short polls and backoff) and heartbeat checks."""
    settings = Settings(
        database_url=database_url,
        public_url=PUBLIC_URL,
        outbox_poll_interval_s=0.1,
        outbox_backoff_base_s=0.2,
        outbox_backoff_max_s=1.0,
        heartbeat_check_interval_s=0.2,
    )
    server = BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False).start()
    yield server
    server.stop()


@pytest.fixture
def api(alert_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=alert_server.url, timeout=30) as c:
        yield c


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


def _configure(api: httpx.Client, project: str) -> None:
    for rule in SCENARIO_RULES:
        response = api.post("/api/v1/alert-rules", json={"project": project, **rule})
        assert response.status_code == 201, response.text


def _train(server: BackgroundServer, project: str, steps: int, **kwargs) -> str:
    with gradwatch.init(project=project, server=server.url, flush_interval=0.05) as run:
        train(steps, run=run, **kwargs)
    assert run.stats.dropped_points == 0 and run.stats.last_error is None
    return run.id


def _alerts(api: httpx.Client, run_id: str) -> dict[str, dict]:
    data = api.get("/api/v1/alerts", params={"run_id": run_id}).json()["data"]
    by_type = {}
    for alert in data:
        assert alert["type"] not in by_type, f"two {alert['type']} alerts: {data}"
        by_type[alert["type"]] = alert
    return by_type


LAYERS = {"inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "out.weight", "out.bias"}


def _incidents(api: httpx.Client, run_id: str) -> dict:
    return api.get(f"/api/v1/runs/{run_id}/incidents").json()


def test_overflow_burst_is_one_incident_with_the_nan_loss_as_cause(alert_server, api):
    _configure(api, "burst")
    run_id = _train(alert_server, "burst", 60, overflow_steps=(10, 11, 12))
    alerts = _alerts(api, run_id)
    assert set(alerts) == {"scale_drop", "loss_non_finite"}  # the scaler calibrated by step 9

    drop = alerts["scale_drop"]
    assert drop["step"] == 12 and drop["severity"] == "critical"
    # 20 clean steps later the scaler doubles the scale: 8192 -> 16384 is a 4x drop, below the factor 8.
    assert drop["status"] == "resolved" and drop["resolved_step"] == 32
    assert drop["occurrences"] == 20 and drop["last_step"] == 31  # one alert while the condition held
    # The evidence is the latest finding's (updated while open): the peak at step 9, the scale at step 31.
    assert drop["evidence"]["steps"] == [9, 31] and drop["evidence"]["values"] == [65536.0, 8192.0]
    assert drop["evidence"]["skip_steps"] == [10, 11, 12]
    assert drop["evidence"]["layers"] and set(drop["evidence"]["layers"]) <= LAYERS
    assert drop["link"] == f"{PUBLIC_URL}/dashboard/runs/{run_id}?project={quote(drop['project'])}&step=12"

    nan = alerts["loss_non_finite"]
    assert (
        nan["step"] == 10 and nan["evidence"]["steps"] == [10, 11, 12] and nan["evidence"]["first_step"] == 10
    )
    assert nan["status"] == "firing"  # resolves after 100 finite losses

    health = _incidents(api, run_id)
    assert health["verdict"] == "critical" and health["count"] == 1
    [incident] = health["data"]
    assert set(incident["rules"]) == {"loss_non_finite", "scale_drop"} and incident["first_step"] == 10
    assert incident["cause_key"] == "loss_non_finite" and "step 10" in incident["cause"]
    assert any("run.log_batch" in step for step in incident["next_steps"])
    assert {alert["incident_id"] for alert in alerts.values()} == {incident["id"]}


def test_healthy_run_of_the_same_length_fires_nothing(alert_server, api):
    _configure(api, "healthy")
    run_id = _train(
        alert_server, "healthy", 60, watch_options={"update_ratio_every": 1, "histograms_every": 1}
    )
    assert api.get("/api/v1/alerts", params={"run_id": run_id}).json() == {"data": [], "count": 0}


def test_skip_storm_after_calibration(alert_server, api):
    run_id = _train(alert_server, "storm", 30, overflow_steps=(2, 14, 16, 18, 20))
    alerts = _alerts(api, run_id)
    storm = alerts["skip_storm"]  # step 2: calibration; the scaler settles on steps 3-12
    assert storm["step"] == 20 and storm["evidence"]["steps"] == [14, 16, 18, 20]
    assert storm["evidence"]["count"] == 4 and set(storm["evidence"]["layers"]) <= LAYERS
    assert "scaler_calibration" not in alerts


def test_scale_below_floor_and_below_one_then_recovered(alert_server, api):
    run_id = _train(alert_server, "floor", 40, overflow_steps=(5, 6, 7), init_scale=4.0)
    floor = _alerts(api, run_id)["scale_floor"]
    assert floor["step"] == 7 and floor["evidence"]["values"] == [0.5]
    assert "below 1" in floor["title"]
    assert floor["status"] == "resolved" and floor["resolved_step"] == 27  # 20 clean steps: 0.5 -> 1


def test_no_scale_growth_for_two_growth_intervals(alert_server, api):
    _configure(api, "stuck")
    run_id = _train(alert_server, "stuck", 50, overflow_steps=(14, 29, 44))
    stuck = _alerts(api, run_id)["no_scale_growth"]
    assert stuck["step"] == 40 and stuck["evidence"]["since_step"] == 0 and stuck["status"] == "firing"


def test_gradient_norm_spike_in_bf16_only_when_it_lasts(alert_server, api):
    blip = _train(alert_server, "spike", 50, precision="bf16", overflow_steps=(40,))
    assert "grad_norm_spike" not in _alerts(api, blip)  # one odd batch is not a divergence
    run_id = _train(alert_server, "spike", 50, precision="bf16", overflow_steps=(40, 41, 42))
    spike = _alerts(api, run_id)["grad_norm_spike"]
    assert spike["step"] == 42 and spike["evidence"]["onset_step"] == 40 and spike["evidence"]["ratio"] > 1000
    assert spike["status"] == "resolved" and spike["resolved_step"] == 47  # no spike in the last 5 steps
    assert "learning rate" in spike["hint"]


def test_a_scale_set_below_one_is_one_incident_about_init_scale(alert_server, api):
    _configure(api, "underflow")
    run_id = _train(
        alert_server,
        "underflow",
        20,
        init_scale=2.0**-20,
        watch_options={"update_ratio_every": 1, "histograms_every": 1},
    )
    alerts = _alerts(api, run_id)
    assert alerts["scale_floor"]["step"] == 0 and alerts["scaler_calibration"]["step"] == 0
    assert alerts["misuse"]["evidence"]["kinds"] == ["scale_below_one"]
    under = alerts["underflow"]
    assert under["step"] == 1 and under["evidence"]["layers"] and set(under["evidence"]["layers"]) <= LAYERS
    assert alerts["update_ratio"]["step"] == 0
    [incident] = _incidents(api, run_id)["data"]
    assert incident["cause_key"] == "scale_set_below_one" and "init_scale" in incident["cause"]
    assert set(incident["rules"]) >= {"scale_floor", "scaler_calibration", "misuse", "underflow"}


def test_rank_disagreement_on_a_skip(alert_server, api):
    run_id = "ddp-job"
    with gradwatch.init(
        project="ddp", server=alert_server.url, run_id=run_id, rank=0, flush_interval=0.05
    ) as r0:
        train(30, run=r0, overflow_steps=(10,))
    with gradwatch.init(
        project="ddp", server=alert_server.url, run_id=run_id, rank=1, flush_interval=0.05
    ) as r1:
        train(30, run=r1)
    alert = _alerts(api, run_id)["rank_disagreement"]
    assert alert["step"] == 10
    assert alert["evidence"]["skipped_ranks"] == [0] and alert["evidence"]["applied_ranks"] == [1]
    assert alert["status"] == "resolved" and alert["resolved_step"] == 11


def test_heartbeat_fires_when_a_run_goes_silent_and_resolves_when_it_reports(alert_server, api):
    run = api.post("/api/v1/runs", json={"project": "quiet"}).json()
    rule = api.post(
        "/api/v1/alert-rules",
        json={"project": "quiet", "type": "heartbeat", "run_id": run["id"], "params": {"timeout_s": 1}},
    ).json()
    batch = {"seq": 0, "scalars": [{"key": "loss", "steps": [0, 1], "values": [1.0, 0.9]}]}
    api.post(f"/api/v1/runs/{run['id']}/batches", json=batch)
    deadline = time.monotonic() + 10
    while not (
        alerts := api.get("/api/v1/alerts", params={"run_id": run["id"], "status": "firing"}).json()["data"]
    ):
        assert time.monotonic() < deadline, "no heartbeat alert"
        time.sleep(0.1)
    [alert] = [a for a in alerts if a["rule_id"] == rule["id"]]
    assert alert["type"] == "heartbeat" and alert["step"] == 1
    api.post(
        f"/api/v1/runs/{run['id']}/batches",
        json={"seq": 1, "scalars": [{"key": "loss", "steps": [2], "values": [0.8]}]},
    )
    resolved = api.get(f"/api/v1/alerts/{alert['id']}").json()
    assert resolved["status"] == "resolved" and resolved["resolved_step"] == 2

    while not api.get("/api/v1/alerts", params={"run_id": run["id"], "status": "firing"}).json()["count"]:
        assert time.monotonic() < deadline + 10, "no second heartbeat alert"
        time.sleep(0.1)
    api.post(
        f"/api/v1/runs/{run['id']}/batches", json={"seq": 2, "status": "finished"}
    )  # no points, just the end
    assert api.get("/api/v1/alerts", params={"run_id": run["id"], "status": "firing"}).json()["count"] == 0


def test_the_misuse_the_agent_reported_is_the_incident_cause(alert_server, api):
    run_id = _train(alert_server, "misuse", 20, overflow_steps=(10, 11, 12), clip="before_unscale")
    alerts = _alerts(api, run_id)
    # told once two cuts of the scaled gradients agree on max_norm (step 0's come before any measurement)
    assert alerts["misuse"]["step"] == 2 and alerts["misuse"]["evidence"]["kinds"] == ["clip_before_unscale"]
    hint = alerts["scale_drop"]["hint"]
    assert hint.startswith("Likely cause (clip before unscale): the gradients are clipped while still SCALED")
    incidents = _incidents(api, run_id)["data"]
    assert incidents[-1]["cause_key"] == "clip_before_unscale"
    assert "scaler.unscale_(optimizer)" in incidents[-1]["next_steps"][0]


def _record(steps: int, **kwargs) -> tuple[list[str], dict]:
    """A real training run's wire data, merged per key and step."""
    transport = RecordingTransport()
    run = gradwatch.init(project="rec", transport=transport, flush_interval=0.05)
    train(steps, run=run, **kwargs)
    run.finish()
    scalars: dict[str, dict[int, object]] = {}
    vectors: dict[str, dict[int, list]] = {}
    for batch in transport.batches:
        for series in batch["scalars"]:
            scalars.setdefault(series["key"], {}).update(zip(series["steps"], series["values"], strict=True))
        for vector in batch.get("vectors", []):
            vectors.setdefault(vector["key"], {}).update(zip(vector["steps"], vector["values"], strict=True))
    events = [e for b in transport.batches for e in b.get("events", [])]
    return transport.layers(), {"scalars": scalars, "vectors": vectors, "events": events}


def _batches(layers: list[str], data: dict, steps: int, count: int) -> list[dict]:
    bounds = [steps * i // count for i in range(count + 1)]
    batches = []
    for seq, (lo, hi) in enumerate(itertools.pairwise(bounds)):

        def within(points: dict, lo: int = lo, hi: int = hi) -> tuple[list, list]:
            kept = sorted((s, v) for s, v in points.items() if lo <= s < hi)
            return [s for s, _ in kept], [v for _, v in kept]

        batch = {
            "seq": seq,
            "layers": layers,
            "scalars": [
                {"key": k, "steps": s, "values": v}
                for k, p in data["scalars"].items()
                for s, v in [within(p)]
                if s
            ],
            "vectors": [
                {"key": k, "steps": s, "values": v}
                for k, p in data["vectors"].items()
                for s, v in [within(p)]
                if s
            ],
            "events": [e for e in data["events"] if lo <= e["step"] < hi],
        }
        batches.append(batch)
    return batches


def test_same_alerts_however_the_points_are_batched(api):
    _configure(api, "batching")
    steps = 100
    layers, data = _record(
        steps, overflow_steps=(10, 11, 12, 30, 32, 34, 36), watch_options={"update_ratio_every": 1}
    )
    results = []
    for count in (1, 7, 50):
        run = api.post("/api/v1/runs", json={"project": "batching"}).json()
        for batch in _batches(layers, data, steps, count):
            response = api.post(f"/api/v1/runs/{run['id']}/batches", json=batch)
            assert response.status_code == 200, response.text
        alerts = api.get("/api/v1/alerts", params={"run_id": run["id"]}).json()["data"]
        results.append(
            sorted(
                (
                    a["type"],
                    a["status"],
                    a["step"],
                    a["last_step"],
                    a["resolved_step"],
                    a["occurrences"],
                    a["title"],
                    json.dumps({k: v for k, v in a["evidence"].items() if k != "link"}, sort_keys=True),
                )
                for a in alerts
            )
        )
    assert {r[0] for r in results[0]} >= {"scale_drop", "loss_non_finite", "skip_storm", "no_scale_growth"}
    assert results[0] == results[1] == results[2]


def test_rules_api_defaults_scoping_and_validation(api):
    rules = api.get("/api/v1/alert-rules", params={"project": "fresh"}).json()
    assert {"scale_drop", "skip_storm", "non_finite"} <= {r["type"] for r in rules["data"]}

    bad = api.post(
        "/api/v1/alert-rules", json={"project": "fresh", "type": "scale_drop", "params": {"factor": 0.5}}
    )
    assert bad.status_code == 422 and "factor must be greater than 1" in bad.json()["detail"]
    bad = api.post("/api/v1/alert-rules", json={"project": "fresh", "type": "sclae_drop"})
    assert bad.status_code == 422 and "unknown rule type 'sclae_drop'" in bad.json()["detail"]
    bad = api.post("/api/v1/alert-rules", json={"project": "fresh", "type": "scale_drop", "run_id": "nope"})
    assert bad.status_code == 422 and "no such run" in bad.json()["detail"]

    run = api.post("/api/v1/runs", json={"project": "fresh"}).json()
    created = api.post(
        "/api/v1/alert-rules",
        json={
            "project": "fresh",
            "run_id": run["id"],
            "type": "scale_drop",
            "params": {"factor": 4},
            "cooldown_steps": 0,
        },
    )
    assert created.status_code == 201, created.text
    rule = created.json()
    assert rule["params"] == {"factor": 4.0, "window": 100} and rule["run_id"] == run["id"]
    edited = api.patch(
        f"/api/v1/alert-rules/{rule['id']}", json={"params": {"factor": 16}, "enabled": False}
    ).json()
    assert edited["params"]["factor"] == 16.0 and edited["enabled"] is False
    other_run = api.post("/api/v1/runs", json={"project": "fresh"}).json()
    ids_for_other = {
        r["id"] for r in api.get("/api/v1/alert-rules", params={"run_id": other_run["id"]}).json()["data"]
    }
    assert rule["id"] not in ids_for_other
    assert api.delete(f"/api/v1/alert-rules/{rule['id']}").status_code == 204
    assert api.get(f"/api/v1/alert-rules/{rule['id']}").status_code == 404
    types = api.get("/api/v1/alert-rules/types").json()["data"]
    assert {t["type"] for t in types} >= {"heartbeat", "rank_disagreement", "underflow", "update_ratio"}


def test_webhook_validation(api):
    for body, message in [
        ({"url": "ftp://example.com/hook", "project": "p"}, "http:// or https://"),
        ({"url": "http:///nohost", "project": "p"}, "has no host"),
    ]:
        response = api.post("/api/v1/webhooks", json=body)
        assert response.status_code == 422 and message in response.json()["detail"], response.text
    response = api.post("/api/v1/webhooks", json={"url": "http://x/y", "project": "p", "format": "teams"})
    assert response.status_code == 422 and "format" in response.text
    assert api.post("/api/v1/webhooks/999/test").status_code == 404


def test_a_webhook_names_the_run_as_its_project_does(alert_server, api, receiver):
    """Issue 28: a run whose id another project had first is stored under a fresh id; its project's
    webhook names it by the id the project asked for, with a link that names the project too (so that
    it opens that run for any token: a token for every project takes the bare id for the other's)."""
    assert api.post("/api/v1/runs", json={"project": "first", "id": "job-7"}).status_code == 201
    hook = api.post("/api/v1/webhooks", json={"url": f"{receiver.url}/json", "project": "second"})
    assert hook.status_code == 201, hook.text
    with gradwatch.init(
        project="second", run_id="job-7", server=alert_server.url, flush_interval=0.05
    ) as run:
        train(30, run=run, overflow_steps=(10, 11, 12))
    assert run.id != "job-7"  # an open server names runs by the ids they are stored under
    [request] = receiver.wait_for(1)
    incident = request.json["incident"]
    assert (incident["run_id"], incident["project"]) == ("job-7", "second")
    assert incident["link"] == f"{PUBLIC_URL}/dashboard/runs/job-7?project=second&step=10"
    opened = api.get("/api/v1/runs/job-7", params={"project": "second"}).json()
    assert (opened["id"], opened["project"]) == (run.id, "second")
    assert api.get("/api/v1/runs/job-7").json()["project"] == "first"


def test_webhooks_in_three_formats_signed_with_a_test_and_a_delivery_log(alert_server, api, receiver):
    hooks = {}
    for fmt in ("json", "slack", "discord"):
        body = {"url": f"{receiver.url}/{fmt}", "format": fmt, "project": "hooked"}
        if fmt == "json":
            body["secret"] = "s3cret"
        response = api.post("/api/v1/webhooks", json=body)
        assert response.status_code == 201, response.text
        hooks[fmt] = response.json()
    assert hooks["json"]["signed"] is True and "secret" not in hooks["json"]

    test = api.post(f"/api/v1/webhooks/{hooks['slack']['id']}/test")
    assert test.status_code == 202
    [received] = receiver.wait_for(1)
    assert received.path.endswith("/slack") and "test" in received.json["text"]

    run_id = _train(alert_server, "hooked", 30, overflow_steps=(10, 11, 12))
    requests = receiver.wait_for(1 + 3)  # one incident (NaN loss + scale drop), x3 formats
    time.sleep(0.5)
    assert len(receiver.received) == 4
    by_format = {r.path.rsplit("/", 1)[1]: r for r in requests[1:]}

    generic = by_format["json"].json
    assert generic["event"] == "incident.firing"
    incident = generic["incident"]
    assert set(incident["rules"]) == {"loss_non_finite", "scale_drop"} and incident["severity"] == "critical"
    assert (
        incident["run_id"] == run_id
        and incident["link"]
        == f"{PUBLIC_URL}/dashboard/runs/{run_id}?project={quote(incident['project'])}&step=10"
    )
    assert incident["cause"] and incident["next_steps"] and "step 10" in generic["text"]
    assert verify("s3cret", by_format["json"].headers, by_format["json"].body, now=time.time())
    assert "X-Gradwatch-Signature" not in by_format["slack"].headers
    slack = by_format["slack"].json
    assert "blocks" in slack and "CRITICAL" in slack["text"]
    assert any("Next steps" in block.get("text", {}).get("text", "") for block in slack["blocks"])
    discord = by_format["discord"].json
    assert discord["content"] and discord["embeds"][0]["url"].startswith(PUBLIC_URL)

    log = settled_deliveries(api, hooks["json"]["id"])
    assert len(log) == 1 and {d["status"] for d in log} == {"delivered"}, log
    assert all(d["response_status"] == 200 and d["attempts"] == 1 for d in log)


def test_redirects_are_not_followed(alert_server, api, receiver):
    with WebhookReceiver() as elsewhere:
        receiver.redirect_to = elsewhere.url
        hook = api.post("/api/v1/webhooks", json={"url": receiver.url, "project": "moved"}).json()
        api.post(f"/api/v1/webhooks/{hook['id']}/test")
        receiver.wait_for(1)
        deadline = time.monotonic() + 10
        while (d := api.get(f"/api/v1/webhooks/{hook['id']}/deliveries").json()["data"][0])[
            "last_error"
        ] is None:
            assert time.monotonic() < deadline, d
            time.sleep(0.05)
        assert (
            d["response_status"] == 307
            and "not followed" in d["last_error"]
            and elsewhere.url in d["last_error"]
        )
        time.sleep(0.3)
        assert elsewhere.received == []


def test_webhook_hosts_outside_the_allow_list_are_refused(database_url, receiver, monkeypatch):
    monkeypatch.setenv("GRADWATCH_WEBHOOK_ALLOWED_HOSTS", "hooks.slack.com, Discord.com")
    settings = Settings(database_url=database_url, outbox_poll_interval_s=0.1)
    assert settings.webhook_allowed_hosts == ("hooks.slack.com", "discord.com")
    server = BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as api:
            response = api.post("/api/v1/webhooks", json={"url": receiver.url, "project": "p"})
            assert response.status_code == 422 and "'127.0.0.1' is not allowed" in response.json()["detail"]
            ok = api.post(
                "/api/v1/webhooks", json={"url": "https://hooks.slack.com/services/x", "project": "p"}
            )
            assert ok.status_code == 201
    finally:
        server.stop()


def test_failed_deliveries_are_retried_with_backoff(alert_server, api, receiver):
    receiver.status = 500
    hook = api.post("/api/v1/webhooks", json={"url": receiver.url, "project": "flaky"}).json()
    api.post(f"/api/v1/webhooks/{hook['id']}/test")
    receiver.wait_for(2)  # the first attempt and one retry after 0.2 s
    receiver.status = 200
    deadline = time.monotonic() + 10
    while (d := api.get("/api/v1/deliveries", params={"webhook_id": hook["id"]}).json()["data"][0])[
        "status"
    ] != "delivered":
        assert time.monotonic() < deadline, d
        time.sleep(0.05)
    assert d["attempts"] >= 3 and d["response_status"] == 200
    assert len({r.headers["X-Gradwatch-Delivery"] for r in receiver.received}) == 1


def test_a_blip_resolved_within_the_group_wait_is_never_sent_and_a_later_trigger_notifies(
    alert_server, api, receiver
):
    hook = api.post("/api/v1/webhooks", json={"url": receiver.url, "project": "cool"}).json()
    run = api.post("/api/v1/runs", json={"project": "cool"}).json()
    scales = {0: 0.5, 1: 2.0, 2: 0.5, 3: 2.0, 200: 0.5}  # floor 1: fire, clear, again within cooldown, …
    # The blip's incident waits on steps alone (a loaded machine once could have taken the 5 s wall-clock
    # wait over the four batches); the incident at step 200 waits the usual 5 s.
    incidents_of = alert_server.server.config.app.state.alerts.alert_engine.incidents
    for seq, (step, scale) in enumerate(scales.items()):
        incidents_of.group_wait_s = 5.0 if step == 200 else 600.0
        batch = {"seq": seq, "scalars": [{"key": "amp/scale", "steps": [step], "values": [scale]}]}
        assert api.post(f"/api/v1/runs/{run['id']}/batches", json=batch).status_code == 200
    alerts = api.get("/api/v1/alerts", params={"run_id": run["id"], "limit": 10}).json()["data"]
    assert [(a["type"], a["step"], a["status"], a["occurrences"]) for a in alerts] == [
        ("scale_floor", 200, "firing", 1),
        ("scale_floor", 0, "resolved", 2),
    ]
    assert alerts[1]["resolved_step"] == 3
    incidents = _incidents(api, run["id"])["data"]
    assert [(i["first_step"], i["status"], i["notified_at"] is None) for i in incidents] == [
        (200, "open", True),
        (0, "resolved", True),
    ]
    receiver.wait_for(1, timeout=60)  # the run sends nothing more: the wall-clock group wait (5 s) ends it
    time.sleep(0.3)
    assert [(r.json["event"], r.json["incident"]["first_step"]) for r in receiver.received] == [
        ("incident.firing", 200)
    ]
    assert api.get(f"/api/v1/webhooks/{hook['id']}/deliveries").json()["count"] == 1

    assert api.delete(f"/api/v1/runs/{run['id']}").status_code == 204  # its alerts and deliveries go too
    assert api.get("/api/v1/alerts", params={"run_id": run["id"]}).status_code == 404  # no such run
    assert api.get("/api/v1/alerts").json()["count"] == 0
    assert api.get(f"/api/v1/webhooks/{hook['id']}/deliveries").json()["count"] == 0


def test_disabled_webhooks_send_no_test_and_the_log_keeps_status_codes_only(alert_server, api, receiver):
    receiver.status = 500
    hook = api.post(
        "/api/v1/webhooks", json={"url": receiver.url, "project": "quiet", "enabled": False}
    ).json()
    refused = api.post(f"/api/v1/webhooks/{hook['id']}/test")
    assert refused.status_code == 422 and "disabled" in refused.json()["detail"]
    live = api.post("/api/v1/webhooks", json={"url": receiver.url, "project": "quiet"}).json()
    assert api.post(f"/api/v1/webhooks/{live['id']}/test").status_code == 202
    receiver.wait_for(1)
    deadline = time.monotonic() + 10
    while (d := api.get(f"/api/v1/webhooks/{live['id']}/deliveries").json()["data"][0])["last_error"] is None:
        assert time.monotonic() < deadline, d
        time.sleep(0.05)
    assert d["response_status"] == 500 and d["last_error"] == "HTTP 500 Internal Server Error"  # no body
    closed = api.post(
        "/api/v1/webhooks", json={"url": f"http://127.0.0.1:{free_port()}/x", "project": "quiet"}
    ).json()
    api.post(f"/api/v1/webhooks/{closed['id']}/test")
    while (d := api.get(f"/api/v1/webhooks/{closed['id']}/deliveries").json()["data"][0])[
        "last_error"
    ] is None:
        assert time.monotonic() < deadline + 10, d
        time.sleep(0.05)
    assert d["last_error"] == "no HTTP response from the receiver (refused, unreachable or timed out)"


def test_a_burst_that_passes_is_sent_again_as_an_update_naming_it_transient(alert_server, api, receiver):
    """An fp16 overflow burst (3 steps of inf activations) is notified when its group wait ends, as what
    it looked like then; once every rule that fired has cleared (the loss finite for 100 steps), the
    diagnosis names a burst that passed, and the webhook gets that as an update of the same incident."""
    hook = api.post("/api/v1/webhooks", json={"url": receiver.url, "project": "passing"})
    assert hook.status_code == 201, hook.text
    run_id = _train(alert_server, "passing", 140, overflow_steps=(10, 11, 12))
    [incident] = _incidents(api, run_id)["data"]
    assert incident["status"] == "resolved" and incident["cause_key"] == "transient_burst", incident
    assert (
        incident["title"].startswith("a transient burst at steps 10-12")
        and "recovered by step" in incident["title"]
    )
    sent = [r.json for r in receiver.wait_for(2)]
    assert [body["event"] for body in sent] == ["incident.firing", "incident.updated"], sent
    assert sent[0]["incident"]["cause_key"] == "loss_non_finite"  # what it looked like at step 20
    assert sent[1]["incident"]["cause_key"] == "transient_burst" and sent[1]["text"].startswith("[UPDATE, ")
    assert {body["incident"]["id"] for body in sent} == {incident["id"]}
    time.sleep(0.5)
    assert len(receiver.received) == 2  # one update for one change of cause, nothing more


def test_a_loop_that_never_clears_grad_is_diagnosed_as_such(alert_server, api):
    """No optimizer.zero_grad(): the gradients accumulate until one growth of the scale overflows, and
    that inf stays in .grad for ever; every later step skips and the scale halves past 1 (where a scaled
    gradient cannot overflow unless it is already inf). The diagnosis names the stale .grad first."""
    import torch
    from torch import nn
    from training import TinyNet

    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)
    generator = torch.Generator().manual_seed(0)
    with gradwatch.init(project="stale", server=alert_server.url, flush_interval=0.05) as run:
        run.watch(model, optimizer, scaler=scaler)
        for _ in range(120):
            x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            run.log({"loss": loss})
            scaler.scale(loss).backward()  # no optimizer.zero_grad() anywhere
            scaler.step(optimizer)
            scaler.update()
    assert scaler.get_scale() < 1.0  # the mechanism: every step skipped, the scale fell through 1
    causes = [incident["cause_key"] for incident in _incidents(api, run.id)["data"]]
    assert "overflow_at_any_scale" in causes, _incidents(api, run.id)
    [stale] = [i for i in _incidents(api, run.id)["data"] if i["cause_key"] == "overflow_at_any_scale"]
    assert "zero_grad" in stale["cause"] and "zero_grad" in stale["next_steps"][0]
    assert "init_scale below 1" not in json.dumps(_incidents(api, run.id))
