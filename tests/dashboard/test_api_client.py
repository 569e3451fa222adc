"""The dashboard's API client over httpx.MockTransport: paths, parameters, tokens, errors."""

from __future__ import annotations

import gc
import json

import httpx
import pytest
from dashboard_support import LAYERS, RUN, AlertsApi, FakeApi, client_for

from gradwatch.dashboard import figures
from gradwatch.dashboard.api_client import ApiClient, ApiError, ApiUnavailable, RunNotFound


def test_list_runs_sends_paging_and_token_and_returns_runs_with_total():
    api = FakeApi()

    runs, count = client_for(api, token="s3cret").list_runs("llm", limit=10, offset=20)

    assert (runs, count) == ([RUN], 1)
    request = api.requests[0]
    assert str(request.url).startswith("http://gradwatch.test/api/v1/runs?")
    assert dict(request.url.params) == {"project": "llm", "limit": "10", "offset": "20"}
    assert request.headers["Authorization"] == "Bearer s3cret"


def test_no_token_sends_no_authorization_header():
    api = FakeApi()
    client_for(api).get_run("r1")
    assert "Authorization" not in api.requests[0].headers


def test_series_passes_key_and_range_and_keeps_non_finite_strings():
    api = FakeApi(series={"loss": {"steps": [0, 1], "values": [1.5, "NaN"]}})

    body = client_for(api).series("r1", "loss", start=0, end=100)

    assert body["values"] == [1.5, "NaN"]
    assert dict(api.requests[0].url.params) == {
        "key": "loss",
        "max_points": "2000",
        "start": "0",
        "end": "100",
    }
    client_for(api).series("r1", "loss", max_points=50)
    assert dict(api.requests[1].url.params) == {"key": "loss", "max_points": "50"}


@pytest.mark.parametrize("max_points", [1, 2001, 100_000])
def test_series_refuses_more_than_2000_points(max_points):
    with pytest.raises(ValueError, match=str(max_points)):
        client_for(FakeApi()).series("r1", "loss", max_points=max_points)


def test_events_and_keys():
    api = FakeApi()
    client = client_for(api)

    events, count = client.events("r1", kind="skip")
    assert (len(events), count) == (3, 3)
    assert api.requests[0].url.params["kind"] == "skip"
    assert client.keys("r1") == ["amp/scale"]


def test_unknown_run_raises_run_not_found_with_the_servers_message():
    with pytest.raises(RunNotFound, match="does not exist") as caught:
        client_for(FakeApi()).get_run("unknown")
    assert caught.value.run_id == "unknown"
    assert caught.value.status_code == 404


@pytest.mark.parametrize(
    ("run_id", "segment"), [("a/b", "a%2Fb"), ("..", "%2E%2E"), (".", "%2E"), ("x?y", "x%3Fy")]
)
def test_run_ids_stay_one_path_segment(run_id, segment):
    api = FakeApi()
    with pytest.raises(RunNotFound):
        client_for(api).get_run(run_id)
    assert api.requests[0].url.raw_path.decode() == f"/api/v1/runs/{segment}"


def test_connection_failure_and_server_errors_are_api_unavailable():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ApiUnavailable, match="did not answer"):
        client_for(refuse).list_runs()
    with pytest.raises(ApiUnavailable) as caught:
        client_for(lambda request: httpx.Response(503, json={"detail": "database is locked"})).list_runs()
    assert caught.value.status_code == 503
    assert "database is locked" in str(caught.value)


def test_other_client_errors_are_api_errors_with_the_detail():
    with pytest.raises(ApiError, match="limit must be") as caught:
        client_for(lambda request: httpx.Response(422, json={"detail": "limit must be <= 500"})).list_runs()
    assert not isinstance(caught.value, (ApiUnavailable, RunNotFound))
    with pytest.raises(ApiError, match="not JSON"):
        client_for(lambda request: httpx.Response(200, text="<html>")).list_runs()


@pytest.mark.parametrize("base_url", ["127.0.0.1:8765", "", "ftp://x"])
def test_base_url_must_be_http(base_url):
    with pytest.raises(ValueError, match="base_url"):
        ApiClient(base_url)


def test_close_leaves_a_passed_in_client_open_and_closes_its_own():
    passed = httpx.Client(transport=httpx.MockTransport(FakeApi()))
    with ApiClient("http://x", client=passed):
        pass
    assert not passed.is_closed
    passed.close()

    own = ApiClient("http://x")
    own.close()
    own.close()
    assert own._client.is_closed


def test_an_own_client_is_closed_when_the_api_client_is_collected():
    # A Dash app holds its ApiClient without a shutdown hook; pooled sockets must not be left to the GC.
    api = ApiClient("http://x")
    own = api._client
    del api
    gc.collect()
    assert own.is_closed


# -- per-layer data --------------------------------------------------------------------------------


def test_vectors_histograms_and_keys_by_kind():
    api = FakeApi()
    client = client_for(api)

    assert client.vectors("r1", "grad/norm")["layers"] == LAYERS
    assert dict(api.requests[-1].url.params) == {"key": "grad/norm", "max_steps": "500", "encoding": "f64"}
    assert client.histograms("r1", "fc1.bias")["steps"] == [0, 20]
    assert dict(api.requests[-1].url.params) == {"layer": "fc1.bias", "key": "grad/hist", "max_steps": "200"}
    assert client.keys("r1", "vector") == ["grad/norm"]
    with pytest.raises(ApiError, match="not one of") as caught:
        client.histograms("r1", "nope")
    assert caught.value.status_code == 404 and not isinstance(caught.value, RunNotFound)
    with pytest.raises(ValueError, match="max_steps"):
        client.vectors("r1", "grad/norm", max_steps=501)
    with pytest.raises(ValueError, match="kind"):
        client.keys("r1", "tensor")


# -- alerts, rules, webhooks -----------------------------------------------------------------------


def test_alert_endpoints_use_the_right_methods_paths_and_bodies():
    api = AlertsApi(
        answers={
            ("DELETE", "/api/v1/alert-rules/3"): (204, None),
            ("PATCH", "/api/v1/alert-rules/3"): (200, {"id": 3, "enabled": False}),
            ("POST", "/api/v1/webhooks/5/test"): (202, {"id": 11, "status": "pending"}),
            ("POST", "/api/v1/alerts/8/acknowledge"): (200, {"id": 8, "acknowledged_at": "x"}),
        }
    )
    client = client_for(api)

    assert client.alerts(project="llm", status="firing") == ([], 0)
    assert dict(api.requests[-1].url.params) == {
        "project": "llm",
        "status": "firing",
        "limit": "100",
        "offset": "0",
    }
    assert client.rule_types()[0]["type"] == "skip_storm"
    assert client.update_alert_rule(3, {"enabled": False}) == {"id": 3, "enabled": False}
    assert json.loads(api.requests[-1].content) == {"enabled": False}
    assert client.delete_alert_rule(3) is None
    assert client.send_test(5)["status"] == "pending"
    assert client.acknowledge_alert(8)["acknowledged_at"] == "x"
    assert [(r.method, r.url.path) for r in api.requests[-4:]] == [
        ("PATCH", "/api/v1/alert-rules/3"),
        ("DELETE", "/api/v1/alert-rules/3"),
        ("POST", "/api/v1/webhooks/5/test"),
        ("POST", "/api/v1/alerts/8/acknowledge"),
    ]
    with pytest.raises(TypeError):
        client.delete_webhook("5; drop")
    with pytest.raises(ApiError) as caught:
        client.create_webhook({"url": "ftp://x"})
    assert caught.value.status_code == 404 and caught.value.detail == "Not Found"


def test_a_real_server_sends_the_layer_matrix_packed_and_it_reads_as_the_json_one(sqlite_server):
    layers = ["a.weight", "a.bias"]
    values = [[1.5, float("nan")], [float("inf"), 0.25], [2.0, 3.0]]
    with httpx.Client(base_url=sqlite_server.url, timeout=30) as http:
        run_id = http.post("/api/v1/runs", json={"project": "p", "name": "n"}).json()["id"]
        batch = {
            "seq": 0,
            "layers": layers,
            "vectors": [{"key": "grad/norm", "steps": [0, 10, 20], "values": values}],
        }
        http.post(
            f"/api/v1/runs/{run_id}/batches",
            content=json.dumps(batch),  # NaN and Infinity literals, which the API reads
            headers={"Content-Type": "application/json"},
        ).raise_for_status()
        as_json = http.get(f"/api/v1/runs/{run_id}/vectors", params={"key": "grad/norm"}).json()

    packed = ApiClient(sqlite_server.url).vectors(run_id, "grad/norm")

    assert "values" not in packed and isinstance(packed["values_f64"], str)
    assert packed["steps"] == as_json["steps"] == [0, 10, 20]
    read_packed, read_json = figures.layers.layer_matrix(packed), figures.layers.layer_matrix(as_json)
    assert read_packed.values.tobytes() == read_json.values.tobytes()  # NaN and ±inf included
    assert figures.layer_heatmap_figure(packed, "g", "‖g‖") == figures.layer_heatmap_figure(
        as_json, "g", "‖g‖"
    )
