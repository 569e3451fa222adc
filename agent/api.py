"""Reading runs back: `gradwatch.Api`, for notebooks and scripts (and the `gradwatch runs | alerts | show |
export` commands).

    api = gradwatch.Api()                        # GRADWATCH_SERVER / GRADWATCH_TOKEN, as init() uses
    runs = api.runs(project="llm", status="finished")
    run = api.run("3f2a9c...")                   # an id, or a run's exact name
    df = run.history(["loss", "amp/scale"])      # a pandas DataFrame indexed by step: every stored point
    df["loss"].plot()

history() reads every stored point by default: the series endpoint answers exactly up to its page
size (MAX_PAGE points) and downsamples beyond, so a range that comes back downsampled is split in two
and read again until every part is exact (a window of at most MAX_PAGE steps always is: a series
holds one point per step and rank). Pass max_points= for the server's min/max downsampling instead.

Without pandas (or with as_frame=False) history() returns plain rows, one dict per step:
    [{"step": 0, "loss": 2.31, "amp/scale": 65536.0}, {"step": 1, "loss": 2.28, "amp/scale": None}, ...]
a key without a point at that step is None there (a logged NaN stays float("nan")).

Errors (gradwatch.GradwatchError, see gradwatch._errors): ApiError (status: the HTTP status or None,
detail: the server's own message, url); its subclass ApiUnavailable when no answer came or the server
failed (5xx), and ApiUnavailable's subclass ApiUnreachable when no answer came (refused, timed out).

Only the standard library is imported here (HTTP: gradwatch._http); pandas and pyarrow when asked for.
"""

from __future__ import annotations

import dataclasses
import math
import os
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Any, ClassVar, Literal, overload

from ._errors import ApiError, ApiUnavailable, ApiUnreachable
from ._http import HttpCore, path_segment
from ._run import server_and_token
from ._tables import Row, Series, pandas_module, pyarrow_modules, to_frame, to_rows, write_csv

__all__ = [
    "MAX_PAGE",
    "Alert",
    "Api",
    "ApiError",
    "ApiUnavailable",
    "ApiUnreachable",
    "Event",
    "RunInfo",
]

# The most points one /series request returns exactly (the endpoint's max_points bound): larger ranges
# are read in parts. Also the page size of /events.
MAX_PAGE = 100_000
RUNS_PAGE = 500  # GET /runs: limit <= 500
ALERTS_PAGE = 1000  # GET /alerts: limit <= 1000
DEFAULT_TIMEOUT_S = 30.0
ALERT_STATES = ("open", "firing", "resolved", "all")  # "open" is "firing": alerts whose condition holds
EXPORT_FORMATS = ("csv", "parquet")


def _number(value: Any) -> float:
    """A value as the API writes it (a number, or "NaN" / "Infinity" / "-Infinity") as a float."""
    if isinstance(value, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value, math.nan)
    return float(value)


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _attach(obj: Any, api: Api, raw: dict[str, Any]) -> None:
    # Not dataclass fields: dataclasses.asdict(), repr() and == see the data only.
    object.__setattr__(obj, "_api", api)
    object.__setattr__(obj, "_raw", raw)


# -- what the reads return ------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """Something that happened at a step: a skipped optimizer step ("skip"), a bad batch…"""

    step: int
    kind: str
    rank: int
    data: dict[str, Any]


@dataclass(frozen=True)
class Alert:
    """An alert: a rule whose condition held in a run. status "firing" (open) or "resolved"."""

    id: int
    project: str
    run_id: str
    run_name: str
    type: str
    severity: str
    status: str
    step: int | None
    last_step: int | None
    title: str
    hint: str
    link: str
    created_at: datetime | None
    resolved_at: datetime | None
    acknowledged_at: datetime | None
    evidence: dict[str, Any]

    _raw: ClassVar[dict[str, Any]]

    @property
    def raw(self) -> dict[str, Any]:
        """The alert as the API returned it (GET /api/v1/alerts), every field included."""
        return self._raw

    @classmethod
    def _from_json(cls, api: Api, body: dict[str, Any]) -> Alert:
        alert = cls(
            id=int(body["id"]),
            project=str(body["project"]),
            run_id=str(body["run_id"]),
            run_name=str(body.get("run_name", "")),
            type=str(body.get("type", "")),
            severity=str(body.get("severity", "")),
            status=str(body.get("status", "")),
            step=_optional_int(body.get("step")),
            last_step=_optional_int(body.get("last_step")),
            title=str(body.get("title", "")),
            hint=str(body.get("hint", "")),
            link=str(body.get("link", "")),
            created_at=_time(body.get("created_at")),
            resolved_at=_time(body.get("resolved_at")),
            acknowledged_at=_time(body.get("acknowledged_at")),
            evidence=dict(body.get("evidence") or {}),
        )
        _attach(alert, api, body)
        return alert


@dataclass(frozen=True)
class RunInfo:
    """One run as the server stores it, and the way to its data: history(), events(), alerts().

    summary: {"skips": skipped optimizer steps stored, "scale": the latest amp/scale of rank 0 or None}.
    A snapshot: api.run(run.id) reads it again (a running run's last_step and status move on)."""

    id: str
    project: str
    name: str
    status: str
    created_at: datetime | None
    updated_at: datetime | None
    last_step: int | None
    tags: tuple[str, ...]
    config: dict[str, Any]
    metadata: dict[str, Any] = dataclasses.field(repr=False)  # host, pid, argv, git commit, torch…
    summary: dict[str, Any]

    _api: ClassVar[Api]
    _raw: ClassVar[dict[str, Any]]

    @property
    def raw(self) -> dict[str, Any]:
        """The run as the API returned it (GET /api/v1/runs/{id}), every field included."""
        return self._raw

    @property
    def url(self) -> str:
        """The run's dashboard page (with its project: two projects may each have a run of this id)."""
        page = f"{self._api.server}/dashboard/runs/{urllib.parse.quote(self.id, safe='')}"
        return f"{page}?project={urllib.parse.quote(self.project, safe='')}"

    @classmethod
    def _from_json(cls, api: Api, body: dict[str, Any]) -> RunInfo:
        summary = dict(body.get("summary") or {})
        if summary.get("scale") is not None:
            summary["scale"] = _number(summary["scale"])
        run = cls(
            id=str(body["id"]),
            project=str(body["project"]),
            name=str(body.get("name", "")),
            status=str(body.get("status", "")),
            created_at=_time(body.get("created_at")),
            updated_at=_time(body.get("updated_at")),
            last_step=_optional_int(body.get("last_step")),
            tags=tuple(str(tag) for tag in body.get("tags") or ()),
            config=dict(body.get("config") or {}),
            metadata=dict(body.get("metadata") or {}),
            summary=summary,
        )
        _attach(run, api, body)
        return run

    def keys(self, kind: Literal["scalar", "vector", "histogram"] = "scalar") -> list[str]:
        """The run's keys of one kind, sorted: scalar series ("loss", "amp/scale"…), per-layer vectors
        ("grad/norm"…) or histograms ("grad/hist")."""
        body = self._api._get(self._path("keys"), {"kind": kind})
        return [str(key) for key in body.get("data", [])]

    def ranks(self) -> list[int]:
        """The ranks that sent data (a single-process run: [0])."""
        body = self._api._get(self._path("ranks"))
        return sorted(int(r["rank"]) for r in body.get("data", [])) or [0]

    @overload
    def history(
        self,
        keys: str | Sequence[str] | None = None,
        *,
        rank: int | Sequence[int] | Literal["all"] = 0,
        start: int | None = None,
        end: int | None = None,
        max_points: int | None = None,
        as_frame: Literal[False],
    ) -> list[Row]: ...

    @overload
    def history(
        self,
        keys: str | Sequence[str] | None = None,
        *,
        rank: int | Sequence[int] | Literal["all"] = 0,
        start: int | None = None,
        end: int | None = None,
        max_points: int | None = None,
        as_frame: bool | None = None,
    ) -> Any: ...

    def history(
        self,
        keys: str | Sequence[str] | None = None,
        *,
        rank: int | Sequence[int] | Literal["all"] = 0,
        start: int | None = None,
        end: int | None = None,
        max_points: int | None = None,
        as_frame: bool | None = None,
    ) -> Any:
        """Scalar series of the run over steps start <= step < end.

        keys: one key or several (default: every scalar key of the run, sorted).
        rank: a rank, several, or "all" (those that sent data); rank 0 by default.
        max_points: None (default) reads every stored point, exactly; a number asks the server for at
            most that many points per key (2..100000), min/max-downsampled beyond: for plots of long runs.
        as_frame: None (default) gives a pandas DataFrame when pandas is installed, else plain rows;
            True requires pandas; False always gives plain rows.

        DataFrame: indexed by "step" (by "step" and "rank" when rank is a sequence or "all"), one float
        column per key, NaN where a key has no point at a step (and where it logged NaN).
        Plain rows: a list of dicts sorted by step (then rank), each {"step": ..., ["rank": ...,] key:
        value or None for every key}; None means no point, a logged NaN stays float("nan").
        A running run is read up to the steps stored when the call starts.
        """
        pandas = pandas_module(as_frame)
        series, many_ranks = self._series(keys, rank, start, end, max_points)
        key_names = list(dict.fromkeys(key for key, _ in series))
        if pandas is not None:
            return to_frame(pandas, series, key_names, many_ranks)
        return to_rows(series, key_names, many_ranks)

    def last_values(
        self, keys: str | Sequence[str] | None = None, rank: int = 0
    ) -> dict[str, tuple[int, float]]:
        """Each key's point at its highest step: {key: (step, value)}; keys without points are left out.
        At most two reads per key: the whole series downsampled (its points are stored points, so its
        highest step is at most the last one), then every point from that step on."""
        found: dict[str, tuple[int, float]] = {}
        last_step = self._api._get(self._path()).get("last_step")  # no point of any key lies beyond
        for key in self._key_names(keys):
            steps, values, downsampled = self._api._series_page(self.id, key, rank, None, None, MAX_PAGE)
            if steps and downsampled and last_step is not None:
                steps, values = self._api._points(self.id, key, rank, max(steps), int(last_step) + 1)
            if steps:
                found[key] = (steps[-1], values[-1])
        return found

    def events(
        self,
        kinds: str | Sequence[str] | None = None,
        *,
        start: int | None = None,
        end: int | None = None,
    ) -> list[Event]:
        """Events in step order over start <= step < end: all of them, or those of these kinds
        (e.g. "skip" for skipped optimizer steps, "bad_batch")."""
        wanted: list[str | None] = (
            [None] if kinds is None else [kinds] if isinstance(kinds, str) else list(dict.fromkeys(kinds))
        )
        found: list[Event] = []
        for kind in wanted:
            found.extend(self._events_of(kind, start, end))
        if len(wanted) > 1:
            found.sort(key=lambda e: e.step)  # stable: each kind keeps the server's order
        return found

    def _events_of(self, kind: str | None, start: int | None, end: int | None) -> Iterator[Event]:
        # /events has no offset: it is read in pages over steps
        params = {"kind": kind, "start": start, "end": end}
        pages = self._api._http.step_pages(
            self._path("events"), params, MAX_PAGE, owner=f"run {self.id!r}", items="events"
        )
        for page in pages:
            yield from (_event(e) for e in page)

    def alerts(self, state: str | None = None) -> list[Alert]:
        """This run's alerts, newest first; state "open" (or "firing"), "resolved", or None for all."""
        return self._api.alerts(run=self.id, state=state)

    def export(
        self,
        path: str | os.PathLike[str] | IO[str],
        format: Literal["csv", "parquet"] = "csv",
        keys: str | Sequence[str] | None = None,
        *,
        rank: int | Sequence[int] | Literal["all"] = 0,
        start: int | None = None,
        end: int | None = None,
    ) -> int:
        """Write history() (every stored point) to a file: one row per step, columns step, [rank,] keys.

        csv (the standard library): a missing value is an empty cell, non-finite ones nan / inf /
        -inf, finite ones as Python writes floats (they read back exactly); path may be an open text
        file. parquet needs pyarrow (pip install pyarrow): step (and rank) int64, keys float64, a
        missing value null, NaN kept. Returns the number of rows written."""
        if format not in EXPORT_FORMATS:
            raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {format!r}")
        arrow = pyarrow_modules() if format == "parquet" else None  # before reading: fail fast
        rows = self.history(keys, rank=rank, start=start, end=end, as_frame=False)
        key_names = list(self._key_names(keys))
        columns = ["step", *(["rank"] if rows and "rank" in rows[0] else []), *key_names]
        if arrow is None:
            if isinstance(path, (str, os.PathLike)):
                with open(path, "w", newline="", encoding="utf-8") as file:
                    write_csv(file, columns, rows)
            else:
                write_csv(path, columns, rows)
        else:
            if not isinstance(path, (str, os.PathLike)):
                raise ValueError("parquet is written to a path, not to an open text file")
            pa, parquet = arrow
            table = pa.table(
                {
                    name: pa.array(
                        [row.get(name) for row in rows],
                        type=pa.int64() if name in ("step", "rank") else pa.float64(),
                    )
                    for name in columns
                }
            )
            parquet.write_table(table, os.fspath(path))
        return len(rows)

    # -- helpers ----------------------------------------------------------------------------------

    def _path(self, *rest: str) -> str:
        return "/".join(["/api/v1/runs", _segment(self.id), *rest])

    def _key_names(self, keys: str | Sequence[str] | None) -> list[str]:
        if keys is None:
            return self.keys()
        if isinstance(keys, str):
            return [keys]
        return list(dict.fromkeys(keys))

    def _series(
        self,
        keys: str | Sequence[str] | None,
        rank: int | Sequence[int] | Literal["all"],
        start: int | None,
        end: int | None,
        max_points: int | None,
    ) -> tuple[Series, bool]:
        if max_points is not None and not 2 <= max_points <= MAX_PAGE:
            raise ValueError(f"max_points must be None (every point) or 2..{MAX_PAGE}, got {max_points!r}")
        for name, bound in (("start", start), ("end", end)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
                raise ValueError(f"{name} must be a step (an int >= 0) or None, got {bound!r}")
        if rank == "all":
            ranks = self.ranks()
            many = True
        elif isinstance(rank, int) and not isinstance(rank, bool):
            ranks, many = [rank], False
        elif isinstance(rank, Sequence) and not isinstance(rank, str):
            ranks, many = list(dict.fromkeys(int(r) for r in rank)), True
        else:
            raise ValueError(f"rank must be an int, a sequence of ints or 'all', got {rank!r}")
        key_names = self._key_names(keys)
        last_step = self._api._get(self._path()).get("last_step")  # the run's extent now, all keys
        series: Series = []
        for key in key_names:
            per_rank: dict[int, tuple[list[int], list[float]]] = {}
            for r in ranks:
                if max_points is not None:
                    per_rank[r] = self._api._series_page(self.id, key, r, start, end, max_points)[:2]
                elif last_step is None:
                    per_rank[r] = ([], [])
                else:
                    low = start or 0
                    high = int(last_step) + 1 if end is None else min(end, int(last_step) + 1)
                    per_rank[r] = self._api._points(self.id, key, r, low, high) if low < high else ([], [])
            series.append((key, per_rank))
        return series, many


def _event(body: dict[str, Any]) -> Event:
    return Event(
        step=int(body["step"]),
        kind=str(body["kind"]),
        rank=int(body.get("rank", 0)),
        data=dict(body.get("data") or {}),
    )


def _segment(run_id: str) -> str:
    """A run id as one path segment."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"a run id must be a non-empty string, got {run_id!r}")
    return path_segment(run_id)


# -- the client -----------------------------------------------------------------------------------


class Api:
    """Reads runs, their series, events and alerts from a gradwatch server (its JSON API, /api/v1).

    server: the server's URL (default: GRADWATCH_SERVER, else http://127.0.0.1:8765, as gradwatch.init).
    token: a token with read scope (default: GRADWATCH_TOKEN); none is needed on an open server.
    timeout: seconds per request.
    """

    def __init__(
        self, server: str | None = None, token: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        server, token = server_and_token(server, token)  # the same defaults as gradwatch.init()
        if not server.startswith(("http://", "https://")):
            raise ValueError(f"server must be an http:// or https:// URL, got {server!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive (seconds), got {timeout!r}")
        self.server = server.rstrip("/")
        self.token = token
        self.timeout = timeout

    @property
    def _http(self) -> HttpCore:
        # made on each use: server, token and timeout may be changed between calls, as ever
        return HttpCore(self.server, token=self.token, timeout=self.timeout)

    def __repr__(self) -> str:
        return f"Api(server={self.server!r}, token={'set' if self.token else None})"

    # -- runs -------------------------------------------------------------------------------------

    def runs(
        self,
        project: str | None = None,
        *,
        status: str | Sequence[str] | None = None,
        tags: str | Sequence[str] | None = None,
        name: str | None = None,
        created_after: datetime | str | None = None,
        created_before: datetime | str | None = None,
        sort: Literal["created", "updated", "name", "last_step"] = "created",
        order: Literal["asc", "desc"] = "desc",
        limit: int | None = None,
    ) -> list[RunInfo]:
        """Runs matching every filter given, newest first (unless sort/order say otherwise).

        status: running, finished or crashed (several: any of them); tags: runs with all of them;
        name: part of the run's name, any case; created_after / created_before: a datetime or an ISO
        8601 string (a time without a zone is UTC); limit: at most this many (default: all).
        A token for one project sees that project's runs only."""
        _check_limit(limit)
        params: dict[str, Any] = {
            "project": project,
            "status": _strings(status),
            "tag": _strings(tags),
            "name": name,
            "created_after": _iso(created_after),
            "created_before": _iso(created_before),
            "sort": sort,
            "order": order,
        }
        runs = self._http.offset_pages("/api/v1/runs", params, RUNS_PAGE, limit)
        return [RunInfo._from_json(self, r) for r in runs]

    def run(self, run: str) -> RunInfo:
        """One run, by id; or by its exact name (looked up among every run, not one page), when no run
        has that id and one run (of those the token sees) has that name: "name" or "project/name".
        Several runs of that name: an ApiError listing their ids."""
        try:
            return RunInfo._from_json(self, self._get(f"/api/v1/runs/{_segment(run)}"))
        except ApiError as exc:
            if exc.status != 404:
                raise
            project, _, name = run.rpartition("/")  # "project/name", or a name alone (project "")
            named = [r for r in self.runs(project or None, name=name) if r.name == name]
            if len(named) == 1:
                return named[0]
            if named:
                ids = ", ".join(f"{r.id} ({r.project})" for r in named[:10])
                raise ApiError(
                    f"{len(named)} runs are named {name!r}: {ids}; ask for one by id",
                    404,
                    exc.detail,
                    exc.url,
                ) from None
            raise

    # -- alerts -----------------------------------------------------------------------------------

    def alerts(
        self,
        project: str | None = None,
        *,
        run: str | RunInfo | None = None,
        state: str | None = None,
        acknowledged: bool | None = None,
        limit: int | None = None,
    ) -> list[Alert]:
        """Alerts, newest first: of a project, of one run, or all the token sees.

        state: "open" (the same as "firing": the condition holds), "resolved", or None / "all" for both;
        acknowledged: only those someone has (True) or has not (False) acknowledged; limit: at most
        this many (default: all)."""
        if state is not None and state not in ALERT_STATES:
            raise ValueError(f"state must be one of {ALERT_STATES} or None, got {state!r}")
        _check_limit(limit)
        status = {"open": "firing", "all": None}.get(state, state) if state else None
        params: dict[str, Any] = {
            "project": project,
            "run_id": run.id if isinstance(run, RunInfo) else run,
            "status": status,
            "acknowledged": acknowledged,
        }
        alerts = self._http.offset_pages("/api/v1/alerts", params, ALERTS_PAGE, limit)
        return [Alert._from_json(self, a) for a in alerts]

    # -- plumbing ---------------------------------------------------------------------------------

    def _get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET one API path: its JSON object, or an ApiError."""
        return self._http.request("GET", path, params)

    def _series_page(
        self, run_id: str, key: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> tuple[list[int], list[float], bool]:
        params = {"key": key, "rank": rank, "start": start, "end": end, "max_points": max_points}
        body = self._get(f"/api/v1/runs/{_segment(run_id)}/series", params)
        steps = [int(s) for s in body.get("steps", [])]
        return steps, [_number(v) for v in body.get("values", [])], bool(body.get("downsampled"))

    def _points(
        self, run_id: str, key: str, rank: int, start: int, end: int
    ) -> tuple[list[int], list[float]]:
        """Every stored point of one key and rank with start <= step < end, exactly. A part of the
        range that comes back downsampled (more than MAX_PAGE points) is halved and read again; a part
        of at most MAX_PAGE steps always comes back exact."""
        steps: list[int] = []
        values: list[float] = []
        pending = [(start, end)]
        while pending:
            low, high = pending.pop()
            page_steps, page_values, downsampled = self._series_page(run_id, key, rank, low, high, MAX_PAGE)
            if not downsampled:
                steps.extend(page_steps)
                values.extend(page_values)
                continue
            middle = (low + high) // 2
            if not low < middle < high:  # cannot happen: a range that small is never downsampled
                raise ApiError(f"the server downsampled {key!r} over steps [{low}, {high}) of run {run_id!r}")
            pending.extend([(middle, high), (low, middle)])  # popped low half first: steps stay in order
        return steps, values


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None (all), got {limit!r}")


def _strings(value: str | Sequence[str] | None) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def _iso(moment: datetime | str | None) -> str | None:
    return moment.isoformat() if isinstance(moment, datetime) else moment
