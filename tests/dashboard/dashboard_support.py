"""What the dashboard's tests share: API data, fake APIs (httpx.MockTransport handlers), and posting a
callback the way the Dash renderer does. Imported as a top-level module (pytest puts this folder on
sys.path)."""

from __future__ import annotations

import re

import httpx

from gradwatch.dashboard import create_dash_app
from gradwatch.dashboard.api_client import ApiClient


def skip_event(step, scale_before, scale_after, layers=()):
    return {
        "step": step,
        "kind": "skip",
        "rank": 0,
        "data": {
            "scale_before": scale_before,
            "scale_after": scale_after,
            "non_finite_layers": list(layers),
            "non_finite_layer_count": len(layers),
        },
    }


SCALE_SERIES = {
    "key": "amp/scale",
    "steps": [0, 1, 2, 3, 4, 5],
    "values": [65536.0, 32768.0, 32768.0, 16384.0, 8192.0, 8192.0],
}


SKIPS = [
    skip_event(1, 65536.0, 32768.0, ["fc1.weight"]),
    skip_event(3, 32768.0, 16384.0),
    skip_event(4, 16384.0, 8192.0),
]


def trace_named(figure, name):
    matches = [trace for trace in figure.data if trace.name == name]
    assert len(matches) == 1, [trace.name for trace in figure.data]
    return matches[0]


def annotation_texts(figure):
    return [annotation.text for annotation in figure.layout.annotations]


RUN = {
    "id": "r1",
    "project": "llm",
    "name": "qlora-7b",
    "status": "running",
    "created_at": "2024-05-01T12:00:00+00:00",
    "updated_at": "2024-05-01T12:05:00+00:00",
    "last_step": 5,
    "config": {},
    "metadata": {},
    "summary": {"skips": 3, "scale": 8192.0},
}


LAYERS = ["fc1.weight", "fc1.bias", "<b>head</b>.weight"]


GRAD_NORMS = {
    "key": "grad/norm",
    "layers": LAYERS,
    "steps": [0, 10, 13, 20],
    "values": [[0.1, 0.01, 1.0], [0.2, 0.02, 2.0], ["NaN", "Infinity", 3.0], [0.0, 0.03, 4.0]],
}


EXPONENTS = list(range(-80, 41))


def histogram_counts(peak, total=100):
    row = [0] * len(EXPONENTS)
    row[EXPONENTS.index(peak)] = total
    return row


HISTOGRAMS = {
    "key": "grad/hist",
    "rank": 0,
    "exponents": EXPONENTS,
    "steps": [0, 20],
    "counts": [histogram_counts(-10), histogram_counts(-12)],
    "zeros": [3, 4],
    "non_finite": [0, 1],
}


class FakeApi:
    """A MockTransport handler serving one run; records every request it gets."""

    def __init__(self, run=RUN, series=None, events=SKIPS, vectors=None, alerts=()):
        self.run = dict(run)
        self.series = series if series is not None else {"amp/scale": SCALE_SERIES}
        self.vectors = vectors if vectors is not None else {"grad/norm": GRAD_NORMS}
        self.events = events
        self.alerts = list(alerts)
        self.ranks = {"data": [], "count": 0, "world_size": 1, "gradients": "local"}
        self.combined: dict = {}  # key -> {"steps", "values"} from /ranks/series
        self.requests: list[httpx.Request] = []

    def run_now(self) -> dict:
        """The run as the server would answer now: updated_at moves whenever its data changes (a live
        page asks for more only then)."""
        version = sum(len(series.get("steps", [])) for series in self.series.values())
        version += len(self.events) + sum(len(vectors.get("steps", [])) for vectors in self.vectors.values())
        return {**self.run, "updated_at": f"{self.run['updated_at'][:19]}.{version:06d}+00:00"}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path, run_path = request.url.path, f"/api/v1/runs/{self.run['id']}"
        if path == "/api/v1/runs":
            return httpx.Response(200, json={"data": [self.run], "count": 1})
        if path == run_path:
            return httpx.Response(200, json=self.run_now())
        if path == run_path + "/keys":
            kind = request.url.params.get("kind", "scalar")
            keys = {"scalar": sorted(self.series), "vector": sorted(self.vectors), "histogram": ["grad/hist"]}
            return httpx.Response(200, json={"data": keys[kind], "kind": kind})
        if path == run_path + "/vectors":
            key = request.url.params["key"]
            body = self.vectors.get(key, {"layers": [], "steps": [], "values": []})
            start, end = int(request.url.params.get("start", 0)), request.url.params.get("end")
            rows = [
                (step, row)
                for step, row in zip(body["steps"], body["values"], strict=True)
                if step >= start and (end is None or step < int(end))
            ]
            body = {**body, "steps": [step for step, _ in rows], "values": [row for _, row in rows]}
            return httpx.Response(200, json={"key": key, "rank": 0, "downsampled": False, **body})
        if path == run_path + "/ranks":
            return httpx.Response(200, json=self.ranks)
        if path == run_path + "/ranks/series":
            key = request.url.params["key"]
            body = self.combined.get(key, {"steps": [], "values": []})
            return httpx.Response(200, json={"key": key, "combine": "l2", "downsampled": False, **body})
        if path == run_path + "/histograms":
            layer = request.url.params["layer"]
            if layer not in LAYERS:
                return httpx.Response(404, json={"detail": f"layer {layer!r} is not one of the run's layers"})
            return httpx.Response(200, json={**HISTOGRAMS, "layer": layer})
        if path == run_path + "/series":
            key = request.url.params["key"]
            body = self.series.get(key, {"steps": [], "values": []})
            start = int(request.url.params.get("start", 0))
            points = [
                (step, value)
                for step, value in zip(body["steps"], body["values"], strict=True)
                if step >= start
            ]
            return httpx.Response(
                200,
                json={
                    "key": key,
                    "rank": 0,
                    "downsampled": False,
                    "steps": [step for step, _ in points],
                    "values": [value for _, value in points],
                },
            )
        if path == "/api/v1/compare":
            params = request.url.params
            unknown = [run_id for run_id in params.get_list("run") if run_id != self.run["id"]]
            if unknown:
                return httpx.Response(404, json={"detail": f"run {unknown[0]!r} does not exist"})
            body = self.series.get(params["key"], {"steps": [], "values": []})
            series = {"run_id": self.run["id"], "name": self.run["name"], "project": self.run["project"]}
            return httpx.Response(
                200,
                json={
                    "key": params["key"],
                    "rank": 0,
                    "data": [{**series, "downsampled": False, **body}] if params.get_list("run") else [],
                },
            )
        if path == "/api/v1/alerts":
            params = request.url.params
            acknowledged = {None: None, "true": True, "false": False}[params.get("acknowledged")]
            alerts = [
                alert
                for alert in self.alerts
                if all(params.get(name) in (None, alert[name]) for name in ("run_id", "status", "project"))
                and acknowledged in (None, bool(alert.get("acknowledged_at")))
            ]
            return httpx.Response(200, json={"data": alerts, "count": len(alerts)})
        if path == run_path + "/events":
            # An event's id is its place in the list plus one: appended events are "stored after".
            after_id = request.url.params.get("after_id")
            if after_id is None:
                data = sorted(self.events, key=lambda event: event.get("step", 0))
                return httpx.Response(200, json={"data": data, "count": len(data), "last_id": len(data)})
            data = self.events[int(after_id) :]
            last_id = max(int(after_id), len(self.events))
            return httpx.Response(200, json={"data": data, "count": len(self.events), "last_id": last_id})
        return httpx.Response(404, json={"detail": "run 'unknown' does not exist"})


def client_for(handler, **options) -> ApiClient:
    return ApiClient(
        "http://gradwatch.test/", client=httpx.Client(transport=httpx.MockTransport(handler)), **options
    )


SKIP_STORM = {
    "count": {"default": 10, "minimum": 1.0, "maximum": None, "doc": "skips"},
    "window": {"default": 100, "minimum": 1.0, "maximum": None, "doc": "steps"},
    "ignore_first": {"default": 50, "minimum": 0.0, "maximum": None, "doc": "calibration steps not counted"},
}


class AlertsApi:
    """A MockTransport handler for the alerts endpoints; records requests, answers what it is told."""

    def __init__(self, answers=None):
        self.requests: list[httpx.Request] = []
        self.answers = answers or {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        key = (request.method, request.url.path)
        if key in self.answers:
            status, body = self.answers[key]
            return httpx.Response(status, json=body) if body is not None else httpx.Response(status)
        if request.method == "GET" and request.url.path == "/api/v1/alert-rules/types":
            return httpx.Response(
                200,
                json={
                    "data": [
                        {
                            "type": "skip_storm",
                            "severity": "critical",
                            "description": "skips",
                            "params": SKIP_STORM,
                        }
                    ]
                },
            )
        if request.method == "GET":
            return httpx.Response(200, json={"data": [], "count": 0})
        return httpx.Response(404, json={"detail": "Not Found"})


def callback_outputs(client, outputs):
    """The outputs as the renderer names them: an allow_duplicate output carries its callback's
    "@hash" (found in the app's callback map when the client knows its Dash app, else in the
    callbacks the app lists to the renderer)."""
    app = getattr(client, "dash_app", None)
    plain = outputs[0] if len(outputs) == 1 else ".." + "...".join(outputs) + ".."
    if app is not None:
        known = list(app.callback_map)
    else:  # what the renderer reads: every callback's outputs, "@hash" included
        known = [callback["output"] for callback in client.get("/_dash-dependencies").json]
    key = next((k for k in known if re.sub(r"@[0-9a-f]+", "", k) == plain), plain)
    return key.strip(".").split("...") if len(outputs) > 1 else [key]


def dash_call(client, outputs, inputs, state=()):
    """POST one callback the way the Dash renderer does; returns {component id: {property: value}}."""
    outputs = callback_outputs(client, outputs)
    body = {
        "output": outputs[0] if len(outputs) == 1 else ".." + "...".join(outputs) + "..",
        "outputs": [dict(zip(("id", "property"), output.split("."), strict=True)) for output in outputs],
        "inputs": [{"id": i, "property": p, "value": v} for (i, p), v in inputs],
        "state": [{"id": i, "property": p, "value": v} for (i, p), v in state],
        "changedPropIds": [f"{i}.{p}" for (i, p), _ in inputs],
    }
    if len(outputs) == 1:
        body["outputs"] = body["outputs"][0]
    response = client.post("/_dash-update-component", json=body)
    assert response.status_code == 200, response.data
    return response.json["response"]


def render(client, pathname, search=""):
    return dash_call(
        client, ["page.children"], [(("url", "pathname"), pathname), (("url", "search"), search)]
    )


RUNS_OUTPUTS = ["runs-table.children", "runs-pager.children", "runs-total.data", "runs-seen.data"]


def refresh_runs(
    client, search=None, sort="newest", page=0, selected=(), statuses=None, tag=None, seen=None, tick=None
):
    return dash_call(
        client,
        RUNS_OUTPUTS,
        [
            (("runs-refresh", "n_intervals"), tick),
            (("runs-search", "value"), search),
            (("runs-sort", "value"), sort),
            (("runs-page", "data"), page),
            (("runs-status", "value"), statuses),
            (("runs-tag", "value"), tag),
        ],
        state=[(("selected-runs", "data"), list(selected)), (("runs-seen", "data"), seen)],
    )


REFRESH_OUTPUTS = [
    "run-header.children",
    "loss-graph.figure",
    "scale-graph.figure",
    "grad-norm-graph.figure",
    "lr-graph.figure",
    "refresh.disabled",
    "layers-refresh.disabled",
    "live-cursor.data",
    "header-cursor.data",
]
HEADER_OUTPUTS = ["run-header.children", "events-table.children", "header-cursor.data"]


def refresh(client, run_id="r1", selected_step=None, cursor=None, header_cursor=None):
    """One refresh of the run page as the renderer runs it: the line charts' callback, then, when
    it moved the live cursor, the header's; their answers merged (the header's slot from the latter)."""
    response = dash_call(
        client,
        REFRESH_OUTPUTS,
        [(("refresh", "n_intervals"), 3)],
        state=[
            (("run-id", "data"), run_id),
            (("selected-step", "data"), selected_step),
            (("live-cursor", "data"), cursor),
            (("header-cursor", "data"), header_cursor),
        ],
    )
    if "live-cursor" in response:
        header = dash_call(
            client,
            HEADER_OUTPUTS,
            [(("live-cursor", "data"), response["live-cursor"]["data"])],
            state=[(("run-id", "data"), run_id), (("header-cursor", "data"), header_cursor)],
        )
        response = {**response, **header}
    return response


def apply_patch(patch):
    """The figure a Dash Patch (as sent to the browser) makes out of an empty one."""
    assert patch["__dash_patch_update"] == "__dash_patch_update"
    figure: dict = {}
    for operation in patch["operations"]:
        assert operation["operation"] == "Assign", operation
        *parents, last = operation["location"]
        target = figure
        for key in parents:
            target = target.setdefault(key, {})
        target[last] = operation["params"]["value"]
    return figure


def alert(alert_id=1, *, run_id="r1", step=3, status="firing", **fields):
    return {
        "id": alert_id,
        "project": "llm",
        "run_id": run_id,
        "run_name": "qlora-7b",
        "rule_id": 7,
        "type": "scale_drop",
        "severity": "critical",
        "status": status,
        "step": step,
        "last_step": step,
        "resolved_step": None,
        "occurrences": 1,
        "title": "loss scale fell 8x in 3 steps",
        "hint": "<b>lower</b> the learning rate",
        "evidence": {"key": "amp/scale", "steps": [0, step], "values": [65536.0, 8192.0], "link": "http://x"},
        "link": f"http://x/dashboard/runs/{run_id}?step={step}",
        "created_at": "2024-05-01T12:01:00+00:00",
        "resolved_at": None,
        **fields,
    }


def run_api() -> FakeApi:
    """The FakeApi behind most app tests: a run whose name is markup, with NaN and Inf points."""
    return FakeApi(
        run={**RUN, "name": "<b>not bold</b>"},
        series={
            "amp/scale": SCALE_SERIES,
            "loss": {"steps": [0, 1, 2], "values": [2.0, "NaN", 1.5]},
            "grad/global_norm": {"steps": [0, 1, 2], "values": [1.0, "Infinity", 0.8]},
        },
    )


def app_client(handler):
    """Flask's test client of a dashboard reading the API through `handler` (a MockTransport handler)."""
    http_client = httpx.Client(transport=httpx.MockTransport(handler))
    app = create_dash_app("http://gradwatch.test", http_client=http_client)
    client = app.server.test_client()
    client.dash_app = app  # dash_call names allow_duplicate outputs from its callback map
    return client
