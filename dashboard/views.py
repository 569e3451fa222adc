"""Small view pieces shared by the dashboard's pages: pure functions from API values to components,
and `keep_view`, the chart update that keeps the user's zoom.

Every user-supplied string is passed as a component's children (or a title attribute), which React
renders as text, never as HTML.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any, Protocol

import dash
import plotly.graph_objects as go
from dash import dcc, html

from . import figures
from .api_client import ApiError, ApiUnavailable

__all__ = [
    "ALERT_STATES",
    "GRAPH_CONFIG",
    "RunHref",
    "alert_state",
    "data_attributes",
    "error_banner",
    "form_message",
    "format_step",
    "format_time",
    "keep_view",
    "run_status",
    "scale_text",
    "severity_badge",
    "status_badge",
    "summarize_fields",
]


class RunHref(Protocol):
    """run_href(run_id, step=None) → the run page's URL; with an int step, marked on the page."""

    def __call__(self, run_id: str, step: Any = None, /) -> str: ...


# An alert is open while its condition holds and nobody has acknowledged it, acknowledged while it
# holds and somebody has, resolved once its condition cleared.
ALERT_STATES = ("open", "acknowledged", "resolved")
MAX_FIELDS_TEXT = 200
SILENT_AFTER_S = 300  # a "running" run with nothing new for this long is shown as silent
GRAPH_CONFIG: dcc.Graph.Config = {"displaylogo": False, "responsive": True}
_AXIS_KEY = re.compile(r"^[xy]axis\d*$")
_LIST_LAYOUT_KEYS = ("annotations", "shapes")

_STATUS_CLASSES = {
    "running": "badge-live",
    "finished": "badge-ok",
    "crashed": "badge-bad",
    "silent": "badge-warn",
    "firing": "badge-bad",
    "open": "badge-bad",
    "acknowledged": "badge-warn",
    "resolved": "badge-ok",
}
_SEVERITY_CLASSES = {"critical": "badge-bad", "warning": "badge-warn"}


def data_attributes(values: dict[str, str]) -> dict[str, Any]:
    """HTML data-* attributes for a component: html.Tr(..., **data_attributes({"alert": "7"})) renders
    data-alert="7". Dash takes them only as keyword arguments whose names are not identifiers."""
    return {f"data-{name}": value for name, value in values.items()}


def error_banner(error: ApiError | str) -> html.Div:
    """A red banner with the error; an unreachable API says that it is retried."""
    if isinstance(error, ApiUnavailable):
        text = f"Cannot reach the gradwatch API; retrying. ({error})"
    else:
        text = str(error)
    return html.Div(text, className="banner banner-error", role="alert")


def form_message(error: ApiError | str | None = None, success: str | None = None) -> Any:
    """What a form says after its button was pressed: the server's reason for refusing (e.g. a 422
    on a bad threshold), or a short confirmation; None clears it."""
    if error is not None:
        if isinstance(error, ApiError) and not isinstance(error, ApiUnavailable):
            code = f" ({error.status_code})" if error.status_code else ""
            text = f"The server refused this{code}: {error.detail}"
        else:
            text = str(error)
        return html.Div(text, className="form-message form-error", role="alert")
    if success is not None:
        return html.Div(success, className="form-message form-ok", role="status")
    return None


def status_badge(status: Any, reason: Any = None) -> html.Span:
    """A run's or an alert's status as a coloured pill; `reason` (a run's status_reason: why it
    crashed) as its hover text."""
    status = str(status or "unknown")
    kind = _STATUS_CLASSES.get(status, "")
    title = str(reason) if reason else None
    return html.Span(status, className=f"badge {kind}".strip(), title=title)


def run_status(run: dict[str, Any], now: datetime | None = None) -> str:
    """The run's status for people: the API's, or "silent" for a running run quiet for SILENT_AFTER_S."""
    status = str(run.get("status") or "unknown")
    if status != "running" or not isinstance(run.get("updated_at"), str):
        return status
    try:
        updated = datetime.fromisoformat(run["updated_at"])
    except ValueError:
        return status
    if updated.tzinfo is None:
        updated = updated.replace(tzinfo=timezone.utc)
    quiet_s = ((now or datetime.now(timezone.utc)) - updated).total_seconds()
    return "silent" if quiet_s > SILENT_AFTER_S else status


def severity_badge(severity: Any) -> html.Span:
    severity = str(severity or "info")
    return html.Span(severity, className=f"badge {_SEVERITY_CLASSES.get(severity, '')}".strip())


def scale_text(scale: Any) -> Any:
    """A loss scale for a table cell ("2^16"); a non-finite scale in red."""
    text = figures.format_scale(scale)
    if isinstance(scale, str):  # "NaN" / "Infinity": the scale itself has gone non-finite
        return html.Span(text, className="bad")
    return text


def format_step(step: Any) -> str:
    """A step with thousands separators, "–" when there is none."""
    return f"{step:,}" if isinstance(step, int) and not isinstance(step, bool) else "–"


def format_time(iso: Any) -> str:
    """An ISO 8601 time from the API as "YYYY-MM-DD HH:MM UTC", "–" when there is none."""
    if not isinstance(iso, str):
        return "–"
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def alert_state(alert: dict[str, Any]) -> str:
    """An alert's state for people: open, acknowledged or resolved. From the API's status ("firing"
    or "resolved") and "acknowledged_at" (set once someone acknowledged it)."""
    if alert.get("status") == "resolved":
        return "resolved"
    return "acknowledged" if alert.get("acknowledged_at") else "open"


def summarize_fields(
    data: dict[str, Any], leave_out: tuple[str, ...] = (), limit: int = MAX_FIELDS_TEXT
) -> str:
    """key=value, … of an event's data or an alert's evidence, one line of at most `limit` characters;
    scales as 2^k, lists abbreviated."""
    parts = []
    for key, value in data.items():
        if key in leave_out:
            continue
        shown = figures.format_scale(value) if "scale" in key else value
        if isinstance(shown, list):
            shown = figures.summarize_layers([_short(item) for item in shown])
        else:
            shown = _short(shown)
        parts.append(f"{key}={shown}")
    text = ", ".join(str(part) for part in parts)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    return str(value)


def keep_view(figure: go.Figure | dict[str, Any]) -> dash.Patch:
    """`figure` (a plotly Figure, or a figure dict as plotly.js reads it) as an update that replaces
    traces and layout but keeps the axis ranges on screen.

    dcc.Graph (Dash 4) writes every zoom and pan into its own `figure` prop, so sending a whole new
    figure would count as the app resetting the ranges, and `uirevision` alone could not keep the
    user's view on refresh. Ranges of fixed axes (the hidden marker axis) are the figure's own and
    are sent. `uirevision` still keeps legend clicks. A dict is used as it is (not copied).
    """
    spec = figure if isinstance(figure, dict) else figure.to_plotly_json()
    layout = spec.get("layout", {})
    patch = dash.Patch()
    patch["data"] = spec.get("data", [])
    for key in _LIST_LAYOUT_KEYS:  # left out of the JSON when empty, but must replace "no data yet"
        patch["layout"][key] = layout.get(key, [])
    for key, value in layout.items():
        if _AXIS_KEY.match(key) and isinstance(value, dict) and not value.get("fixedrange"):
            for axis_key, axis_value in value.items():
                if axis_key not in ("range", "autorange"):
                    patch["layout"][key][axis_key] = axis_value
        else:
            patch["layout"][key] = value
    return patch
