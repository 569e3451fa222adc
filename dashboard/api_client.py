"""The dashboard's only way to data: a small client over the server's JSON API (/api/v1).

Bodies come back as the API writes them (plain dicts and lists); non-finite floats stay the strings
"NaN", "Infinity", "-Infinity" and are turned into gaps or markers by the figure builders.

Errors, one rooted hierarchy:

    ApiError                 any failed request; `status_code` is None when no response came
    ├── ApiUnavailable       no answer: connection refused, timeout, or a 5xx from the server
    └── RunNotFound          404 for a run id the server does not know
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "MAX_HISTOGRAM_STEPS",
    "MAX_SERIES_POINTS",
    "MAX_VECTOR_STEPS",
    "ApiClient",
    "ApiError",
    "ApiUnavailable",
    "RunNotFound",
]

# The most points the dashboard asks for per series; the server downsamples larger ranges (min/max kept).
MAX_SERIES_POINTS = 2000
# The most steps asked for per heatmap (rows of one value per layer) and per layer histogram view.
MAX_VECTOR_STEPS = 500
MAX_HISTOGRAM_STEPS = 200
KEY_KINDS = ("scalar", "vector", "histogram")
DEFAULT_TIMEOUT_S = 5.0

Json = dict[str, Any]


class ApiError(Exception):
    """A request to the gradwatch API failed."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ApiUnavailable(ApiError):
    """The API did not answer (down, unreachable, timed out) or failed on its side (5xx)."""


class RunNotFound(ApiError):
    """The server has no run with this id."""

    def __init__(self, run_id: str, message: str) -> None:
        super().__init__(message, status_code=404)
        self.run_id = run_id


class ApiClient:
    """Reads runs, series, per-layer vectors, histograms and events from a gradwatch server.

    base_url: the server root, e.g. "http://127.0.0.1:8765" (without /api/v1).
    token: a read-scope token sent as `Authorization: Bearer <token>`, or None.
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
        client: httpx.Client | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._client = client if client is not None else httpx.Client(timeout=timeout_s)
        # An own client is closed by close(), or when this object is collected (a Dash app holds it
        # with no shutdown hook), or at exit: pooled keep-alive sockets are never left to the GC.
        self._close_own_client = weakref.finalize(self, self._client.close) if client is None else None

    # -- endpoints ---------------------------------------------------------------------------------

    def list_runs(
        self, project: str | None = None, *, limit: int = 100, offset: int = 0
    ) -> tuple[list[Json], int]:
        """Runs, newest first, and how many match before limit/offset (GET /api/v1/runs)."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if project is not None:
            params["project"] = project
        body = self._get("/api/v1/runs", params)
        return list(body.get("data", [])), int(body.get("count", 0))

    def get_run(self, run_id: str) -> Json:
        """One run: id, project, name, status, created_at, last_step, summary… (GET /api/v1/runs/{id})."""
        return self._get(_run_path(run_id), run_id=run_id)

    def keys(self, run_id: str, kind: str = "scalar") -> list[str]:
        """The keys the run has of one kind: "scalar" (e.g. "amp/scale", "loss"), "vector" (per-layer,
        e.g. "grad/norm") or "histogram" (e.g. "grad/hist")."""
        if kind not in KEY_KINDS:
            raise ValueError(f"kind must be one of {KEY_KINDS}, got {kind!r}")
        params = None if kind == "scalar" else {"kind": kind}
        return list(self._get(_run_path(run_id, "keys"), params, run_id=run_id).get("data", []))

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
        return self._get(_run_path(run_id, "series"), params, run_id=run_id)

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
        "values" (one row of one value per layer per step), "downsampled"}.

        max_steps: at most MAX_VECTOR_STEPS (500) rows; the server merges more steps into buckets.
        """
        if not 1 <= max_steps <= MAX_VECTOR_STEPS:
            raise ValueError(f"max_steps must be between 1 and {MAX_VECTOR_STEPS}, got {max_steps!r}")
        params: dict[str, Any] = {"key": key, "max_steps": max_steps}
        if start is not None:
            params["start"] = start
        if end is not None:
            params["end"] = end
        return self._get(_run_path(run_id, "vectors"), params, run_id=run_id)

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
        return self._get(_run_path(run_id, "histograms"), params)

    def events(self, run_id: str, kind: str | None = None, *, limit: int = 10_000) -> tuple[list[Json], int]:
        """Events in step order ({"step", "kind", "rank", "data"}) and how many exist in all."""
        params: dict[str, Any] = {"limit": limit}
        if kind is not None:
            params["kind"] = kind
        body = self._get(_run_path(run_id, "events"), params, run_id=run_id)
        return list(body.get("data", [])), int(body.get("count", 0))

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

    def _get(self, path: str, params: dict[str, Any] | None = None, *, run_id: str | None = None) -> Json:
        url = self.base_url + path
        try:
            response = self._client.get(url, params=params, headers=self._headers)
        except httpx.HTTPError as exc:
            raise ApiUnavailable(f"gradwatch API at {self.base_url} did not answer: {exc}") from exc
        if response.status_code == 404 and run_id is not None:
            raise RunNotFound(run_id, _detail(response) or f"run {run_id!r} does not exist")
        if response.status_code >= 500:
            raise ApiUnavailable(
                f"GET {path} failed on the server ({response.status_code}): {_detail(response)}",
                response.status_code,
            )
        if response.status_code >= 400:
            raise ApiError(f"GET {path} → {response.status_code}: {_detail(response)}", response.status_code)
        try:
            body = response.json()
        except ValueError as exc:
            raise ApiError(f"GET {path} returned a body that is not JSON", response.status_code) from exc
        if not isinstance(body, dict):
            raise ApiError(f"GET {path} returned {type(body).__name__}, expected an object")
        return body


def _run_path(run_id: str, *rest: str) -> str:
    # The id comes from the browser's URL: quote it so it stays one path segment.
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    segment = quote(run_id, safe="")
    if segment in (".", ".."):  # dot segments would be resolved away by URL normalisation
        segment = segment.replace(".", "%2E")
    return "/".join(["/api/v1/runs", segment, *rest])


def _detail(response: httpx.Response) -> str:
    """The server's {"detail": ...} message, or the start of the body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str):
        return detail
    if detail is not None:
        return str(detail)
    return response.text[:200]
