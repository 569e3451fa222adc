"""Figure builders: API data in, plotly Figure out. Pure functions — no HTTP, no Dash.

A `series` argument is the API's series object, {"steps": [int...], "values": [...]}, where a value is a
number, one of the strings "NaN" / "Infinity" / "-Infinity", or null. Non-finite and missing values
become gaps in lines; non-finite loss and gradient-norm values are also marked with red triangles
along the top of the plot area, hover text "NaN at step N". Malformed input never raises: what cannot
be read is drawn as a gap, and a series with no points gives a figure saying "no data yet".

Text that comes from users (layer names) is escaped before it reaches hover text, so plotly shows it
as text and never interprets tags in it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

__all__ = [
    "NO_DATA_TEXT",
    "empty_figure",
    "finite_or_none",
    "format_scale",
    "grad_norm_figure",
    "layer_names",
    "loss_figure",
    "lr_figure",
    "scale_figure",
    "summarize_layers",
]

NO_DATA_TEXT = "no data yet"
NON_FINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

LINE_COLOR = "#2563eb"
ALERT_COLOR = "#dc2626"
FIGURE_HEIGHT_PX = 320
# Where non-finite markers sit, as a fraction of the plot height (on a hidden, fixed 0..1 axis).
NON_FINITE_MARKER_Y = 0.96
MAX_LAYERS_IN_HOVER = 5


def finite_or_none(value: Any) -> float | None:
    """A finite float, or None for "NaN"/"Infinity"/"-Infinity", null, non-finite floats and junk."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def format_scale(scale: Any) -> str:
    """A loss scale for people: "2^16" for exact powers of two, else 4 significant digits.

    Accepts what the API sends (a number, "NaN", "Infinity", null); null and junk give "–".
    """
    if isinstance(scale, str) and scale in NON_FINITE_STRINGS:
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return "–"
    number = float(scale)
    if not math.isfinite(number):
        return _non_finite_label(number)
    if number > 0:
        mantissa, exponent = math.frexp(number)
        if mantissa == 0.5:
            return f"2^{exponent - 1}"
    return f"{number:.4g}"


def empty_figure(title: str, message: str = NO_DATA_TEXT, *, uirevision: str = "gradwatch") -> go.Figure:
    """A blank figure with `message` in the middle, for series that have no points (yet)."""
    figure = go.Figure()
    _base_layout(figure, title, uirevision)
    figure.update_layout(
        xaxis={"visible": False},
        yaxis={"visible": False},
        annotations=[
            {
                "text": message,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "showarrow": False,
                "font": {"size": 14, "color": "#6b7280"},
            }
        ],
    )
    return figure


def loss_figure(series: Mapping[str, Any] | None, *, uirevision: str = "gradwatch") -> go.Figure:
    """Loss per optimizer step; NaN/Inf losses are gaps in the line and red markers along the top."""
    return _scalar_figure(series, "Loss", "loss", uirevision=uirevision)


def grad_norm_figure(
    series: Mapping[str, Any] | None, *, log_y: bool = True, uirevision: str = "gradwatch"
) -> go.Figure:
    """L2 norm of the unscaled gradients per step (log y-axis by default: explosions span decades).

    Non-finite norms (a skipped step's overflow) are marked along the top; on a log axis, zero norms
    cannot be drawn and show as gaps.
    """
    return _scalar_figure(
        series, "Gradient norm (global, unscaled)", "‖g‖₂", log_y=log_y, uirevision=uirevision
    )


def lr_figure(series: Mapping[str, Any] | None, *, uirevision: str = "gradwatch") -> go.Figure:
    """Learning rate per step (of the first param group)."""
    figure = _scalar_figure(series, "Learning rate", "lr", mark_non_finite=False, uirevision=uirevision)
    figure.layout.yaxis.update(exponentformat="e")
    _, raw_values = _points(series)
    finite = [v for v in (finite_or_none(value) for value in raw_values) if v is not None]
    if finite and min(finite) == max(finite):
        # Plotly pads a constant line to value ± 1, which draws a 3e-4 learning rate as "0".
        figure.layout.yaxis.update(range=[0, 2 * finite[0]] if finite[0] > 0 else None)
    return figure


def scale_figure(
    scale_series: Mapping[str, Any] | None,
    skip_events: Sequence[Mapping[str, Any]] | None = None,
    *,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """Loss scale S per step on a log2 axis (ticks 2^k), each skipped step a red x at S before the skip.

    skip_events: the API's events of kind "skip", {"step", "data": {"scale_before", "scale_after",
    "non_finite_layers"}}. When an event lacks a usable scale_before, the last scale recorded before its
    step is used; an event with neither gets no marker.
    """
    title = "Loss scale"
    steps, values = _positive_points(scale_series)
    skips = _skip_markers(skip_events or (), steps, values)
    if not any(value is not None for value in values) and not skips:
        return empty_figure(title, uirevision=uirevision)

    figure = go.Figure()
    _base_layout(figure, title, uirevision)
    figure.add_trace(
        go.Scatter(
            x=steps,
            y=values,
            customdata=[format_scale(value) if value is not None else None for value in values],
            mode="lines",
            line={"color": LINE_COLOR, "width": 2, "shape": "hv"},
            connectgaps=False,
            name="scale",
            hovertemplate="step %{x}<br>scale %{customdata}<extra></extra>",
        )
    )
    if skips:
        figure.add_trace(
            go.Scatter(
                x=[step for step, _, _ in skips],
                y=[scale for _, scale, _ in skips],
                hovertext=[text for _, _, text in skips],
                hoverinfo="text",
                mode="markers",
                marker={"symbol": "x", "size": 9, "color": ALERT_COLOR, "line": {"width": 1}},
                name="skipped step",
            )
        )
    tickvals, ticktext = _log2_ticks([v for v in values if v is not None] + [s for _, s, _ in skips])
    figure.layout.yaxis.update(
        type="log", tickmode="array", tickvals=tickvals, ticktext=ticktext, title="scale"
    )
    figure.update_layout(showlegend=bool(skips))
    return figure


# -- shared pieces ---------------------------------------------------------------------------------


def _scalar_figure(
    series: Mapping[str, Any] | None,
    title: str,
    y_title: str,
    *,
    log_y: bool = False,
    mark_non_finite: bool = True,
    uirevision: str,
) -> go.Figure:
    """The one line-chart builder behind loss, grad norm and lr."""
    steps, raw_values = _points(series)
    values = [finite_or_none(value) for value in raw_values]
    if log_y:
        values = [value if value is not None and value > 0 else None for value in values]
    non_finite = [(step, label) for step, value in zip(steps, raw_values) if (label := _non_finite_of(value))]
    if not mark_non_finite:
        non_finite = []
    if not steps or (not any(value is not None for value in values) and not non_finite):
        return empty_figure(title, uirevision=uirevision)

    figure = go.Figure()
    _base_layout(figure, title, uirevision)
    figure.add_trace(
        go.Scatter(
            x=steps,
            y=values,
            mode="lines",
            line={"color": LINE_COLOR, "width": 1.5},
            connectgaps=False,
            name=y_title,
            hovertemplate="step %{x}<br>" + y_title + " %{y:.6g}<extra></extra>",
        )
    )
    figure.layout.yaxis.update(title=y_title, type="log" if log_y else "linear")
    if non_finite:
        _add_non_finite_markers(figure, non_finite)
    return figure


def _add_non_finite_markers(figure: go.Figure, points: list[tuple[int, str]]) -> None:
    # A hidden 0..1 axis over the plot keeps the markers at the top whatever the y zoom is.
    figure.add_trace(
        go.Scatter(
            x=[step for step, _ in points],
            y=[NON_FINITE_MARKER_Y] * len(points),
            yaxis="y2",
            hovertext=[f"{label} at step {step}" for step, label in points],
            hoverinfo="text",
            mode="markers",
            marker={"symbol": "triangle-down", "size": 10, "color": ALERT_COLOR},
            name="non-finite",
        )
    )
    figure.update_layout(
        yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True},
        showlegend=True,
    )


def _base_layout(figure: go.Figure, title: str, uirevision: str) -> None:
    figure.update_layout(
        # Title in the top strip (shared with the mode bar on hover), legend on its own row below it.
        title={
            "text": title,
            "x": 0.02,
            "xanchor": "left",
            "y": 0.97,
            "yanchor": "top",
            "font": {"size": 15},
        },
        # The "none" template plus a few settings: a named template like "plotly_white" would be
        # embedded in every figure, ~7 kB per graph on every refresh.
        template="none",
        paper_bgcolor="white",
        plot_bgcolor="white",
        font={
            "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
            "size": 12,
            "color": "#1f2933",
        },
        height=FIGURE_HEIGHT_PX,
        margin={"l": 60, "r": 20, "t": 64, "b": 40},
        hovermode="closest",
        showlegend=False,
        legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
        # Kept constant across refreshes, so new data does not reset the user's zoom and pan.
        uirevision=uirevision,
    )
    axis_style = {
        "visible": True,
        "gridcolor": "#eef0f3",
        "linecolor": "#d1d5db",
        "zeroline": False,
        "automargin": True,
    }
    figure.update_xaxes(title="step", **axis_style)
    figure.update_yaxes(**axis_style)


def _points(series: Mapping[str, Any] | None) -> tuple[list[Any], list[Any]]:
    """Paired steps and raw values of an API series; anything malformed reads as no points."""
    if not isinstance(series, Mapping):
        return [], []
    steps, values = series.get("steps"), series.get("values")
    if not isinstance(steps, list) or not isinstance(values, list):
        return [], []
    pairs = [(step, value) for step, value in zip(steps, values) if _is_step(step)]
    return [step for step, _ in pairs], [value for _, value in pairs]


def _positive_points(series: Mapping[str, Any] | None) -> tuple[list[Any], list[float | None]]:
    """Steps and values usable on a log axis (finite and > 0), the rest None."""
    steps, raw_values = _points(series)
    values = [finite_or_none(value) for value in raw_values]
    return steps, [value if value is not None and value > 0 else None for value in values]


def _skip_markers(
    events: Iterable[Mapping[str, Any]], steps: list[Any], values: list[float | None]
) -> list[tuple[int, float, str]]:
    """(step, scale before the skip, hover text) for each skip event that has a drawable scale."""
    markers = []
    for event in events:
        if not isinstance(event, Mapping) or not _is_step(event.get("step")):
            continue
        step = event["step"]
        data = event.get("data") if isinstance(event.get("data"), Mapping) else {}
        scale_before = finite_or_none(data.get("scale_before"))
        if scale_before is None or scale_before <= 0:
            scale_before = _last_value_before(step, steps, values)
        if scale_before is None:
            continue
        text = f"skipped step {step}<br>scale {format_scale(scale_before)} → {format_scale(data.get('scale_after'))}"
        layers = layer_names(data.get("non_finite_layers"))
        if layers:
            text += "<br>non-finite: " + html.escape(summarize_layers(layers))
        markers.append((step, scale_before, text))
    return markers


def _last_value_before(step: int, steps: list[Any], values: list[float | None]) -> float | None:
    best_step, best_value = None, None
    for candidate_step, value in zip(steps, values):
        if value is not None and candidate_step < step and (best_step is None or candidate_step > best_step):
            best_step, best_value = candidate_step, value
    return best_value


def _log2_ticks(values: list[float], max_ticks: int = 10) -> tuple[list[float], list[str]]:
    """Tick positions at powers of two spanning `values`, labelled "2^k", at most about max_ticks."""
    positive = [value for value in values if value > 0 and math.isfinite(value)]
    if not positive:
        return [], []
    low = math.floor(math.log2(min(positive)))
    high = math.ceil(math.log2(max(positive)))
    if low == high:
        low, high = low - 1, high + 1
    stride = max(1, math.ceil((high - low + 1) / max_ticks))
    first = low - low % stride  # multiples of the stride: 2^0, 2^4, 2^8… rather than 2^1, 2^5…
    exponents = range(first, high + stride, stride)
    return [2.0**exponent for exponent in exponents], [f"2^{exponent}" for exponent in exponents]


def layer_names(value: Any) -> list[str]:
    """The layer names of a skip event's "non_finite_layers", as strings; junk gives []."""
    if not isinstance(value, list):
        return []
    return [str(name) for name in value]


def summarize_layers(names: Sequence[str], limit: int = MAX_LAYERS_IN_HOVER) -> str:
    """The first `limit` names joined by commas, then "(+N more)" for the rest."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit} more)"


def _non_finite_of(value: Any) -> str | None:
    """ "NaN", "Infinity" or "-Infinity" when value is one (as the API's string or a float), else None."""
    if isinstance(value, str):
        return value if value in NON_FINITE_STRINGS else None
    if isinstance(value, float) and not math.isfinite(value):
        return _non_finite_label(value)
    return None


def _non_finite_label(number: float) -> str:
    if math.isnan(number):
        return "NaN"
    return "Infinity" if number > 0 else "-Infinity"


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
