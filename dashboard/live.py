"""Live updates of the run page's line charts: fetch only the points after the last step shown and
append them to the traces on screen (a dash.Patch that extends arrays), so a refresh costs O(new
points) and leaves the user's zoom and pan alone.

The new points are drawn by the same figure builders as the full charts, into a small figure of their
own, and each of its traces is appended to the chart's trace with the same uid (figures gives every
line-chart trace a uid naming its role). When appending would not give the chart a full redraw would,
`append_patch` says so (None) and the caller redraws in full:
- the new points bring a trace the chart does not have yet (the first NaN marker, the safe-scale band
  appearing, data in a chart that said "no data yet");
- they leave the range of the chart's fixed tick labels (the loss scale's 2^k ticks);
- they change a constant learning rate (drawn with a fixed range around its value).
A downsampled series grows by raw points this way; after MAX_APPENDED_POINTS of them the caller
redraws in full, downsampled again by the server.

The cursor (a dcc.Store on the page) records what is on screen: per series the last step shown, per
chart its trace uids and tick/range facts, the number of skip markers and the points appended since
the last full redraw, and the run's `run_signature` when it was drawn: a tick whose run has the same
signature has nothing new, and asks for nothing more. It is plain JSON.

The per-layer heatmaps grow the same way, a column per new step (`append_columns_patch`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import dash
import plotly.graph_objects as go

__all__ = [
    "APPENDED_ATTRIBUTES",
    "MAX_APPENDED_COLUMNS",
    "MAX_APPENDED_POINTS",
    "advance",
    "append_columns_patch",
    "append_patch",
    "can_append",
    "chart_shape",
    "fetch_starts",
    "full_cursor",
    "last_step",
    "run_signature",
]

MAX_APPENDED_POINTS = 2000
MAX_APPENDED_COLUMNS = 500  # heatmap steps appended before a full redraw (downsampled by the server)
# Per-point arrays of a trace; all of them grow together.
APPENDED_ATTRIBUTES = ("x", "y", "customdata", "hovertext", "text")

Cursor = dict[str, Any]


def last_step(series: Mapping[str, Any] | None) -> int | None:
    """The largest step of an API series, None when it has no points."""
    steps = series.get("steps") if isinstance(series, Mapping) else None
    numbers = [step for step in steps or [] if isinstance(step, int) and not isinstance(step, bool)]
    return max(numbers) if numbers else None


def chart_shape(figure: go.Figure) -> dict[str, Any]:
    """What appending must keep of a chart: its trace uids in order, the values of its y axis'
    fixed tick labels (None for automatic ticks) and its fixed y range (None when autoscaled)."""
    yaxis = figure.layout.yaxis
    tickvals = list(yaxis.tickvals) if yaxis.tickmode == "array" and yaxis.tickvals else None
    return {
        "uids": [trace.uid for trace in figure.data],
        "tickvals": tickvals,
        "yrange": list(yaxis.range) if yaxis.range is not None else None,
    }


def full_cursor(
    run_id: str, charts: Mapping[str, go.Figure], series: Mapping[str, Any], skips: int
) -> Cursor:
    """The cursor after a full redraw: `charts` by graph id, `series` the API series drawn, by name."""
    return {
        "run_id": run_id,
        "last": {name: last_step(value) for name, value in series.items()},
        "charts": {graph_id: chart_shape(figure) for graph_id, figure in charts.items()},
        "skips": skips,
        "appended": 0,
    }


def run_signature(run: Mapping[str, Any]) -> list[Any]:
    """What changes in a run object whenever the run has new data or a new status: [status,
    updated_at, last_step]. Equal signatures: nothing to fetch."""
    return [run.get("status"), run.get("updated_at"), run.get("last_step")]


def can_append(cursor: Any, run_id: str) -> bool:
    """Whether the page's cursor describes this run's charts and may still grow."""
    return (
        isinstance(cursor, dict)
        and cursor.get("run_id") == run_id
        and isinstance(cursor.get("last"), dict)
        and isinstance(cursor.get("charts"), dict)
        and cursor.get("appended", 0) < MAX_APPENDED_POINTS
    )


def fetch_starts(cursor: Cursor, names: Iterable[str], inclusive: Iterable[str] = ()) -> dict[str, int]:
    """The first step to fetch per series: one past the last step shown (0 for a series with none).

    inclusive: series fetched from their last step shown instead, so the new slice starts with the
    point already drawn (the safe-scale band: each value is held until the next, and the slice must
    carry the last one forward to the new last step).
    """
    inclusive = set(inclusive)
    starts = {}
    for name in names:
        last = cursor["last"].get(name)
        if last is None:
            starts[name] = 0
        else:
            starts[name] = last if name in inclusive else last + 1
    return starts


def advance(cursor: Cursor, new_series: Mapping[str, Any], counted: Iterable[str]) -> Cursor:
    """The cursor after appending `new_series` (by name); `counted`: the names whose points count
    towards MAX_APPENDED_POINTS (not the inclusive ones, which repeat a point)."""
    last = dict(cursor["last"])
    appended = cursor.get("appended", 0)
    counted = set(counted)
    for name, series in new_series.items():
        step = last_step(series)
        if step is not None and (last.get(name) is None or step > last[name]):
            last[name] = step
        if name in counted and isinstance(series, Mapping):
            appended += len(series.get("steps") or [])
    return {**cursor, "last": last, "appended": appended}


def append_patch(shape: Mapping[str, Any], new_points: go.Figure) -> Any:
    """A dash.Patch appending the traces of `new_points` (a figure of the new points only, built by
    the same builder as the chart) to the chart described by `shape` (see chart_shape).

    dash.no_update when there is nothing to append; None when appending would draw something else
    than a full redraw would (see the module docstring): the caller must redraw the chart.
    """
    if not new_points.data:  # "no data yet": no new drawable points
        return dash.no_update
    uids = list(shape.get("uids") or [])
    if any(trace.uid not in uids for trace in new_points.data):
        return None
    tickvals = shape.get("tickvals")
    if tickvals and not _within(_y_values(new_points), min(tickvals), max(tickvals)):
        return None
    yrange = shape.get("yrange")
    if yrange is not None:
        new_range = new_points.layout.yaxis.range
        if new_range is None or list(new_range) != list(yrange):
            return None
    patch = dash.Patch()
    for trace in new_points.data:
        index = uids.index(trace.uid)
        for attribute in APPENDED_ATTRIBUTES:
            values = trace[attribute]
            if isinstance(values, (list, tuple)):
                patch["data"][index][attribute].extend(list(values))
    return patch


def append_columns_patch(shape: Mapping[str, Any], new_traces: list[dict[str, Any]]) -> Any:
    """A dash.Patch appending new steps to a layer heatmap: `new_traces` are
    figures.layer_heatmap_columns of them (its "live-cells" trace, then non-finite markers), `shape`
    the drawn heatmap's trace uids ({"uids": [...]}). The live cells grow by columns (x, and each
    layer's row of z and hovertext), the markers by points.

    dash.no_update when there is nothing to append; None when the heatmap must be redrawn: a
    non-finite trace the heatmap does not have yet.
    """
    live_cells = new_traces[0] if new_traces else {}
    if not live_cells.get("x"):
        return dash.no_update
    uids = list(shape.get("uids") or [])
    if any(trace.get("uid") not in uids for trace in new_traces):
        return None
    patch = dash.Patch()
    for trace in new_traces:
        index = uids.index(trace["uid"])
        if trace.get("type") == "heatmap":
            patch["data"][index]["x"].extend(list(trace["x"]))
            for attribute in ("z", "hovertext"):
                for row, values in enumerate(trace[attribute]):
                    patch["data"][index][attribute][row].extend(list(values))
            continue
        for attribute in APPENDED_ATTRIBUTES:
            values = trace.get(attribute)
            if isinstance(values, (list, tuple)):
                patch["data"][index][attribute].extend(list(values))
    return patch


def _y_values(figure: go.Figure) -> list[float]:
    """The finite y values of the traces on the main y axis."""
    values: list[float] = []
    for trace in figure.data:
        if getattr(trace, "yaxis", None) not in (None, "y") or trace.y is None:
            continue
        values.extend(
            float(value)
            for value in trace.y
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
    return values


def _within(values: list[float], low: float, high: float) -> bool:
    return all(low <= value <= high for value in values)
