"""The dashboard's only way to data: a small client over the server's JSON API (/api/v1).

Bodies come back as the API writes them (plain dicts and lists); non-finite floats stay the strings
"NaN", "Infinity", "-Infinity" and are turned into gaps or markers by the figure builders. Besides
reading runs, the client reads incidents (a run's verdict) and manages alerts: rules, alerts (and
acknowledging them), webhooks and their test deliveries.

Requests, paging and errors are gradwatch._http's, which gradwatch.Api shares; this client sends
through an httpx.Client (pooled connections, its timeout). Errors, those of gradwatch.Api too, all
gradwatch.GradwatchError (the whole tree: gradwatch._errors):

    ApiError                 any failed request; `status_code` is None when no response came,
    │                        `detail` is the server's own message (what to show next to a form)
    ├── ApiUnavailable       no answer: connection refused, timeout, or a 5xx from the server
    │   └── ApiUnreachable   no answer
    └── RunNotFound          404 for a run id the server does not know
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from .._errors import ApiError, ApiUnavailable, ApiUnreachable, RunNotFound
from .._http import Answer, HttpCore, Request, Send, Wording, path_segment

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "MAX_HISTOGRAM_STEPS",
    "MAX_SERIES_POINTS",
    "MAX_VECTOR_STEPS",
    "VERDICTS",
    "ApiClient",
    "ApiError",
    "ApiUnavailable",
    "ApiUnreachable",
    "RunNotFound",
]

# The most points the dashboard asks for per series; the server downsamples larger ranges (min/max kept).
MAX_SERIES_POINTS = 2000
# The most steps asked for per heatmap (rows of one value per layer) and per layer histogram view.
MAX_VECTOR_STEPS = 500
MAX_HISTOGRAM_STEPS = 200
KEY_KINDS = ("scalar", "vector", "histogram")
VERDICTS = ("healthy", "warning", "critical")  # a run's health as GET /runs/{id}/incidents judges it
INCIDENT_STATUSES = ("open", "resolved")
DEFAULT_TIMEOUT_S = 5.0

Json = dict[str, Any]

# What the dashboard's errors say (shown in its banners and next to its forms).
_UNREACHABLE = "gradwatch API at {base} did not answer: {reason}"
_WORDING = Wording(
    unreachable=_UNREACHABLE,
    unreachable_detail=_UNREACHABLE,
    refused="{method} {path} → {status}: {detail}",
    failed="{method} {path} failed on the server ({status}): {detail}",
    not_json="{method} {path} returned a body that is not JSON",
    not_object="{method} {path} returned {type}, expected an object",
)


class ApiClient:
    """Reads runs, series, per-layer vectors, histograms and events from a gradwatch server, and
    manages its alert rules, alerts and webhooks.

    base_url: the server root, e.g. "http://127.0.0.1:8765" (without /api/v1).
    token: a read-scope token sent as `Authorization: Bearer <token>`, or None.
    token_provider: called on every request for the token of the person asking (the dashboard reads
        its session cookie); when it returns one, it replaces `token`.
    client: an httpx.Client to send through (tests pass one with a MockTransport); the caller keeps
        ownership of it. Without one, this object creates its own and `close()` closes it.
    timeout_s: per-request timeout in seconds for the client created here.

    Safe to share between threads (httpx.Client is); Dash runs callbacks concurrently.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        token_provider: Callable[[], str | None] | None = None,
        client: httpx.Client | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/")
        self._client = client if client is not None else httpx.Client(timeout=timeout_s)
        self._http = HttpCore(
            self.base_url,
            token=token,
            token_provider=token_provider,
            send=_send_with(self._client),
            wording=_WORDING,
        )
        # An own client is closed by close(), or when this object is collected (a Dash app holds it
        # with no shutdown hook), or at exit: pooled keep-alive sockets are never left to the GC.
        self._close_own_client = weakref.finalize(self, self._client.close) if client is None else None

    # -- endpoints ---------------------------------------------------------------------------------

    def list_runs(
        self,
        project: str | None = None,
        *,
        limit: int = 100,
        offset: int = 0,
        statuses: tuple[str, ...] | list[str] = (),
        tags: tuple[str, ...] | list[str] = (),
    ) -> tuple[list[Json], int]:
        """Runs, newest first, and how many match before limit/offset (GET /api/v1/runs); statuses:
        any of them (running, finished, crashed); tags: all of them."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if project is not None:
            params["project"] = project
        if statuses:
            params["status"] = list(statuses)
        if tags:
            params["tag"] = list(tags)
        body = self._request("GET", "/api/v1/runs", params)
        return list(body.get("data", [])), int(body.get("count", 0))

    def combined_series(
        self, run_id: str, key: str, *, max_points: int = MAX_SERIES_POINTS, start: int | None = None
    ) -> Json:
        """One key combined over a distributed run's ranks (sharded norms: sqrt of the sum of squares),
        shaped like series(): {"key", "steps", "values", "downsampled", "per_rank", …}."""
        params: dict[str, Any] = {"key": key, "max_points": max_points, "combine": "auto"}
        if start is not None:
            params["start"] = start
        return self._request("GET", _run_path(run_id, "ranks", "series"), params, run_id=run_id)

    def compare(self, run_ids: list[str], key: str, *, max_points: int = MAX_SERIES_POINTS) -> list[Json]:
        """One key of several runs in one request, in the order given: [{"run_id", "name", "project",
        "steps", "values", "downsampled"}] (GET /api/v1/compare); RunNotFound names a run that is gone."""
        params: dict[str, Any] = {"run": list(run_ids), "key": key, "max_points": max_points}
        return list(self._request("GET", "/api/v1/compare", params).get("data", []))

    def ranks(self, run_id: str) -> Json:
        """A distributed run's ranks: {"data": [{rank, host, gradients, status, batches, last_seen…}],
        "world_size", "gradients"} (GET /api/v1/runs/{id}/ranks)."""
        return self._request("GET", _run_path(run_id, "ranks"), run_id=run_id)

    def get_run(self, run_id: str, project: str | None = None) -> Json:
        """One run: id, project, name, status, created_at, last_step, summary… (GET /api/v1/runs/{id}).
        With `project`: the run that project calls run_id (alert links name it so); the answer's id is
        the one to use for the run from then on."""
        params = None if project is None else {"project": project}
        return self._request("GET", _run_path(run_id), params, run_id=run_id)

    def keys(self, run_id: str, kind: str = "scalar") -> list[str]:
        """The keys the run has of one kind: "scalar" (e.g. "amp/scale", "loss"), "vector" (per-layer,
        e.g. "grad/norm") or "histogram" (e.g. "grad/hist")."""
        if kind not in KEY_KINDS:
            raise ValueError(f"kind must be one of {KEY_KINDS}, got {kind!r}")
        params = None if kind == "scalar" else {"kind": kind}
        return list(self._request("GET", _run_path(run_id, "keys"), params, run_id=run_id).get("data", []))

    def series(
        self,
        run_id: str,
        key: str,
        *,
        max_points: int = MAX_SERIES_POINTS,
        start: int | None = None,
        end: int | None = None,
    ) -> Json:
        """One series of rank 0 over steps start <= step < end: {"key", "steps", "values", "downsampled"}.

        max_points: at most MAX_SERIES_POINTS (2000); larger ranges come back downsampled by the server.
        """
        if not 2 <= max_points <= MAX_SERIES_POINTS:
            raise ValueError(f"max_points must be between 2 and {MAX_SERIES_POINTS}, got {max_points!r}")
        params: dict[str, Any] = {"key": key, "max_points": max_points}
        if start is not None:
            params["start"] = start
        if end is not None:
            params["end"] = end
        return self._request("GET", _run_path(run_id, "series"), params, run_id=run_id)

    def vectors(
        self,
        run_id: str,
        key: str,
        *,
        max_steps: int = MAX_VECTOR_STEPS,
        start: int | None = None,
        end: int | None = None,
    ) -> Json:
        """A per-layer quantity as a step × layer matrix: {"key", "layers" (model order), "steps",
        "values" (one row of one value per layer per step), "downsampled"}; from a server that
        packs it, "values_f64" (base64 of little-endian float64, step-major) instead of "values"
        (figures.layer_matrix reads either).

        max_steps: at most MAX_VECTOR_STEPS (500) rows; the server merges more steps into buckets.
        """
        if not 1 <= max_steps <= MAX_VECTOR_STEPS:
            raise ValueError(f"max_steps must be between 1 and {MAX_VECTOR_STEPS}, got {max_steps!r}")
        # Packed: 100k floats as JSON cost the server and this process ~0.1 s of CPU to write and read.
        params: dict[str, Any] = {"key": key, "max_steps": max_steps, "encoding": "f64"}
        if start is not None:
            params["start"] = start
        if end is not None:
            params["end"] = end
        return self._request("GET", _run_path(run_id, "vectors"), params, run_id=run_id)

    def histograms(
        self, run_id: str, layer: str, *, key: str = "grad/hist", max_steps: int = MAX_HISTOGRAM_STEPS
    ) -> Json:
        """One layer's log2 |g| histograms: {"layer", "exponents", "steps", "counts" (one row per
        step, one count per exponent), "zeros", "non_finite"}. Bin e counts |g| in [2^(e-1), 2^e).

        An unknown layer (or run) is an ApiError with status_code 404 and the server's message.
        """
        if not 1 <= max_steps <= MAX_HISTOGRAM_STEPS:
            raise ValueError(f"max_steps must be between 1 and {MAX_HISTOGRAM_STEPS}, got {max_steps!r}")
        params = {"layer": layer, "key": key, "max_steps": max_steps}
        return self._request("GET", _run_path(run_id, "histograms"), params)

    def events(self, run_id: str, kind: str | None = None, *, limit: int = 10_000) -> tuple[list[Json], int]:
        """Events in step order ({"step", "kind", "rank", "data"}) and how many exist in all."""
        params: dict[str, Any] = {"limit": limit}
        if kind is not None:
            params["kind"] = kind
        body = self._request("GET", _run_path(run_id, "events"), params, run_id=run_id)
        return list(body.get("data", [])), int(body.get("count", 0))

    def event_page(
        self, run_id: str, *, after_id: int | None = None, limit: int = 10_000
    ) -> tuple[list[Json], int, int | None]:
        """(events, how many the run has in all, the cursor to read on from): without after_id the
        first `limit` in step order, with it those stored after the previous answer's cursor, in
        the order they were stored. The cursor is None when the server gives none (an older server,
        or `limit` cut a list in step order short)."""
        params: dict[str, Any] = {"limit": limit}
        if after_id is not None:
            params["after_id"] = after_id
        body = self._request("GET", _run_path(run_id, "events"), params, run_id=run_id)
        last_id = body.get("last_id")
        cursor = last_id if isinstance(last_id, int) and not isinstance(last_id, bool) else None
        return list(body.get("data", [])), int(body.get("count", 0)), cursor

    # -- alerts ------------------------------------------------------------------------------------

    def alerts(
        self,
        *,
        project: str | None = None,
        run_id: str | None = None,
        status: str | None = None,
        acknowledged: bool | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[list[Json], int]:
        """Alerts, newest first, and how many match (GET /api/v1/alerts). status: "firing" or
        "resolved" (None: both); acknowledged: only those someone has (True) or has not (False)
        acknowledged. Each has id, project, run_id, run_name, rule_id, type, severity, status, step,
        title, hint, evidence, created_at, resolved_at, acknowledged_at…"""
        params = _present(
            project=project,
            run_id=run_id,
            status=status,
            acknowledged=acknowledged,
            limit=limit,
            offset=offset,
        )
        body = self._request("GET", "/api/v1/alerts", params)
        return list(body.get("data", [])), int(body.get("count", 0))

    # -- incidents ---------------------------------------------------------------------------------

    def run_incidents(self, run_id: str) -> tuple[list[Json], str | None]:
        """A run's incidents, newest first, and its verdict: "healthy", "warning" or "critical"
        (GET /api/v1/runs/{id}/incidents); the verdict is None when the server sends none of those.

        An incident groups the findings of one cause: id, status ("open" or "resolved"), severity,
        cause (one sentence), title, first_step, last_step, resolved_step, rules, findings ({"rule",
        "title", "step", "severity", "evidence"}), next_steps, link, created_at… A 404 (an unknown run,
        or a server without incidents) is an ApiError with status_code 404, not RunNotFound: the run
        page asks this of runs it has just read.
        """
        body = self._request("GET", _run_path(run_id, "incidents"))
        verdict = body.get("verdict")
        return list(body.get("data", [])), verdict if verdict in VERDICTS else None

    def incidents(
        self,
        *,
        project: str | None = None,
        run_id: str | None = None,
        status: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[list[Json], int]:
        """Incidents, newest first, and how many match (GET /api/v1/incidents). status: "open" or
        "resolved" (None: both)."""
        if status not in (None, *INCIDENT_STATUSES):
            raise ValueError(f"status must be one of {INCIDENT_STATUSES} or None, got {status!r}")
        params = _present(project=project, run_id=run_id, status=status, limit=limit, offset=offset)
        body = self._request("GET", "/api/v1/incidents", params)
        return list(body.get("data", [])), int(body.get("count", 0))

    def acknowledge_alert(self, alert_id: int) -> Json:
        """Mark an alert as seen (POST /api/v1/alerts/{id}/acknowledge); the updated alert."""
        return self._request("POST", f"/api/v1/alerts/{_int_id(alert_id)}/acknowledge")

    def whoami(self, token: str | None = None) -> Json:
        """What the current token may do: {"open", "project", "scope", "scopes"} (GET /api/v1/auth/whoami);
        ApiError with status_code 401 when the server needs a token and has none or a bad one.
        token: check this token instead of the current one (signing in)."""
        return self._request("GET", "/api/v1/auth/whoami", token=token)

    def rule_types(self) -> list[Json]:
        """The server's rule types: {"type", "severity", "description", "default_rule", "params":
        {name: {"default", "minimum", "maximum", "doc"}}} (GET /api/v1/alert-rules/types)."""
        return list(self._request("GET", "/api/v1/alert-rules/types").get("data", []))

    def alert_rules(self, project: str | None = None) -> list[Json]:
        """Alert rules (of one project, or all), oldest first (GET /api/v1/alert-rules)."""
        return list(self._request("GET", "/api/v1/alert-rules", _present(project=project)).get("data", []))

    def alert_rule(self, rule_id: int) -> Json:
        return self._request("GET", f"/api/v1/alert-rules/{_int_id(rule_id)}")

    def create_alert_rule(self, rule: Json) -> Json:
        """POST /api/v1/alert-rules with {"project", "type", "params", "name"?, "run_id"?, "enabled"?,
        "cooldown_steps"?}; bad parameters are an ApiError (422) whose detail says what is wrong."""
        return self._request("POST", "/api/v1/alert-rules", json=rule)

    def update_alert_rule(self, rule_id: int, changes: Json) -> Json:
        """PATCH /api/v1/alert-rules/{id} with any of "name", "params" (replaces them all), "enabled",
        "cooldown_steps"."""
        return self._request("PATCH", f"/api/v1/alert-rules/{_int_id(rule_id)}", json=changes)

    def delete_alert_rule(self, rule_id: int) -> None:
        self._request("DELETE", f"/api/v1/alert-rules/{_int_id(rule_id)}")

    def webhooks(self, project: str | None = None) -> list[Json]:
        """Webhooks (of one project, or all): {"id", "project", "url", "format", "signed", "enabled",
        "created_at"} (GET /api/v1/webhooks)."""
        return list(self._request("GET", "/api/v1/webhooks", _present(project=project)).get("data", []))

    def create_webhook(self, webhook: Json) -> Json:
        """POST /api/v1/webhooks with {"project", "url", "format": "json"|"slack"|"discord", "secret"?}."""
        return self._request("POST", "/api/v1/webhooks", json=webhook)

    def delete_webhook(self, webhook_id: int) -> None:
        self._request("DELETE", f"/api/v1/webhooks/{_int_id(webhook_id)}")

    def send_test(self, webhook_id: int) -> Json:
        """Queue a test notification (POST /api/v1/webhooks/{id}/test): the delivery, still "pending";
        follow it with `deliveries`."""
        return self._request("POST", f"/api/v1/webhooks/{_int_id(webhook_id)}/test")

    def deliveries(self, webhook_id: int, *, limit: int = 20) -> list[Json]:
        """One webhook's delivery log, newest first: {"id", "event", "status" (pending, sending,
        delivered, failed), "attempts", "response_status", "last_error", "next_attempt_at"…}."""
        path = f"/api/v1/webhooks/{_int_id(webhook_id)}/deliveries"
        return list(self._request("GET", path, {"limit": limit}).get("data", []))

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP client if this object created it. Idempotent."""
        if self._close_own_client is not None:
            self._close_own_client()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        params: dict[str, Any] | None = None,
        *,
        json: Json | None = None,
        run_id: str | None = None,
        token: str | None = None,
    ) -> Json:
        """One API call; the JSON object it answers ({} for 204 No Content), or an ApiError.
        token: send this one instead of the current person's (checking a token at sign-in)."""
        return self._http.request(method, path, params, body=json, token=token, run_id=run_id)


def _send_with(client: httpx.Client) -> Send:
    """gradwatch._http's send over an httpx.Client, with the client's own timeout."""

    def send(request: Request) -> Answer:
        try:
            response = client.request(request.method, request.url, json=request.json, headers=request.headers)
        except httpx.HTTPError as exc:
            raise ConnectionError(str(exc)) from exc
        return Answer(response.status_code, response.content, response.reason_phrase)

    return send


def _run_path(run_id: str, *rest: str) -> str:
    # The id comes from the browser's URL: quote it so it stays one path segment.
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    return "/".join(["/api/v1/runs", path_segment(run_id), *rest])


def _int_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ids of rules, alerts and webhooks are integers, got {value!r}")
    return value


def _present(**params: Any) -> dict[str, Any]:
    """The query parameters that have a value."""
    return {name: value for name, value in params.items() if value is not None}
