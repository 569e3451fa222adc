"""Line charts by step: loss, loss scale (with skipped steps and the fp16 safe band), gradient norm,
learning rate, and one key of several runs overlaid (compare); where a run was resumed from a
checkpoint, a dotted line across each chart (add_resume_markers).

Each trace of the run page's line charts has a `uid` naming its role ("line", "non-finite", "scale",
"skipped-step", "safe-band-low"…): live updates append new points to the trace with the same uid
(see `live`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from ._common import (
    ALERT_COLOR,
    BAND_COLOR,
    BAND_EDGE_COLOR,
    COMPARE_COLORS,
    FIGURE_HEIGHT_PX,
    LINE_COLOR,
    NO_DATA_TEXT,
    POST_CLIP_COLOR,
    empty_figure,
    finite_or_none,
    format_scale,
    is_step,
    layer_names,
    log_axis,
    new_figure,
    non_finite_of,
    positive_points,
    series_points,
    summarize_layers,
)

# Where non-finite markers sit, as a fraction of the plot height (on a hidden, fixed 0..1 axis).
NON_FINITE_MARKER_Y = 0.96
RESUME_COLOR = "#0d9488"
# The hidden axis over the plot that markers independent of the y zoom are drawn on.
_MARKER_AXIS = {"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True}


def loss_figure(series: Mapping[str, Any] | None, *, uirevision: str = "gradwatch") -> go.Figure:
    """Loss per optimizer step; NaN/Inf losses are gaps in the line and red markers along the top."""
    return _scalar_figure(series, "Loss", "loss", uirevision=uirevision)


def grad_norm_figure(
    series: Mapping[str, Any] | None,
    post_clip: Mapping[str, Any] | None = None,
    *,
    log_y: bool = True,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """L2 norm of the unscaled gradients per step (log y-axis by default: explosions span decades).

    post_clip: the norm after gradient clipping (grad/global_norm_post_clip), drawn as a second line
    when it has points. Non-finite norms (a skipped step's overflow) are marked along the top; on a
    log axis, zero norms cannot be drawn and show as gaps.
    """
    figure = _scalar_figure(
        series, "Gradient norm (global, unscaled)", "‖g‖₂", log_y=log_y, uirevision=uirevision
    )
    steps, values = positive_points(post_clip) if log_y else series_points(post_clip)
    values = [finite_or_none(value) for value in values]
    if not any(value is not None for value in values):
        return figure
    if figure.data:
        figure.data[0].name = "pre-clip"
    else:  # only the post-clip norm so far: replace the "no data yet" placeholder
        figure = new_figure("Gradient norm (global, unscaled)", uirevision)
        figure.layout.yaxis.update(title={"text": "‖g‖₂"}, **_y_type(log_y))
    figure.add_trace(
        {
            "type": "scatter",
            "x": steps,
            "y": values,
            "mode": "lines",
            "line": {"color": POST_CLIP_COLOR, "width": 1.2},
            "connectgaps": False,
            "name": "post-clip",
            "uid": "post-clip",
            "hovertemplate": "step %{x}<br>post-clip %{y:.6g}<extra></extra>",
        }
    )
    figure.update_layout(showlegend=True)
    return figure


def lr_figure(series: Mapping[str, Any] | None, *, uirevision: str = "gradwatch") -> go.Figure:
    """Learning rate per step (of the first param group)."""
    figure = _scalar_figure(series, "Learning rate", "lr", mark_non_finite=False, uirevision=uirevision)
    figure.layout.yaxis.update(exponentformat="e")
    _, raw_values = series_points(series)
    finite = [v for v in (finite_or_none(value) for value in raw_values) if v is not None]
    if finite and min(finite) == max(finite) and finite[0] > 0:
        # Plotly pads a constant line to value ± 1, which draws a 3e-4 learning rate as "0". The clip
        # bounds say the same as the range in a form the app's zoom-keeping updates still send.
        figure.layout.yaxis.update(
            range=[0, 2 * finite[0]], autorangeoptions={"clipmin": 0, "clipmax": 2 * finite[0]}
        )
    return figure


def scale_figure(
    scale_series: Mapping[str, Any] | None,
    skip_events: Sequence[Mapping[str, Any]] | None = None,
    safe_band: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] | None = None,
    *,
    empty_text: str = NO_DATA_TEXT,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """Loss scale S per step on a log2 axis (ticks 2^k), each skipped step a red x at S before the skip.

    skip_events: the API's events of kind "skip", {"step", "data": {"scale_before", "scale_after",
    "non_finite_layers"}}. When an event lacks a usable scale_before, the last scale recorded before its
    step is used; an event with neither gets no marker.
    safe_band: the (amp/safe_scale_min, amp/safe_scale_max) series: scales at which no gradient would
    underflow or overflow in fp16. Known only at histogram steps, so it is shaded behind the scale as
    a step-shaped band, each value held until the next histogram step (the last up to the last step).
    empty_text: what the chart says when it has nothing to draw (e.g. that the run has no GradScaler).
    """
    title = "Loss scale"
    steps, values = positive_points(scale_series)
    skips = _skip_markers(skip_events or (), steps, values)
    if not any(value is not None for value in values) and not skips:
        return empty_figure(title, empty_text, uirevision=uirevision)

    figure = new_figure(title, uirevision)
    band = _band_points(*(safe_band or (None, None)), last_step=max(steps, default=None))
    if band:
        band_steps = [step for step, _, _ in band]
        figure.add_trace(
            _band_edge(
                band_steps,
                [low for _, low, _ in band],
                "≥",
                name="safe band (low)",
                uid="safe-band-low",
                legend=False,
            )
        )
        figure.add_trace(
            _band_edge(
                band_steps,
                [high for _, _, high in band],
                "≤",
                name="fp16 safe band",
                uid="safe-band-high",
                fill={"fill": "tonexty", "fillcolor": BAND_COLOR},
            )
        )
    figure.add_trace(
        {
            "type": "scatter",
            "x": steps,
            "y": values,
            "customdata": [format_scale(value) if value is not None else None for value in values],
            "mode": "lines",
            "line": {"color": LINE_COLOR, "width": 2, "shape": "hv"},
            "connectgaps": False,
            "name": "scale",
            "uid": "scale",
            "hovertemplate": "step %{x}<br>scale %{customdata}<extra></extra>",
        }
    )
    if skips:
        figure.add_trace(
            {
                "type": "scatter",
                "x": [step for step, _, _ in skips],
                "y": [scale for _, scale, _ in skips],
                "hovertext": [text for _, _, text in skips],
                "hoverinfo": "text",
                "mode": "markers",
                "marker": {"symbol": "x", "size": 9, "color": ALERT_COLOR, "line": {"width": 1}},
                "name": "skipped step",
                "uid": "skipped-step",
            }
        )
    band_values = [value for _, low, high in band for value in (low, high)]
    tickvals, ticktext = _log2_ticks(
        [v for v in values if v is not None] + [s for _, s, _ in skips] + band_values
    )
    figure.layout.yaxis.update(
        type="log", tickmode="array", tickvals=tickvals, ticktext=ticktext, title={"text": "scale"}
    )
    figure.update_layout(showlegend=bool(skips or band))
    return figure


def compare_figure(
    runs: Sequence[tuple[str, Mapping[str, Any] | None]],
    key: str,
    *,
    log_y: bool = False,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """One scalar key of several runs overlaid by step: `runs` is [(run label, API series)...].

    Labels (run names) are escaped. Non-finite values are gaps; a run without points is left out.
    """
    title = html.escape(key)
    figure = new_figure(title, uirevision)
    drawn = 0
    for index, (label, series) in enumerate(runs):
        steps, raw_values = series_points(series)
        values = [finite_or_none(value) for value in raw_values]
        if log_y:
            values = [value if value is not None and value > 0 else None for value in values]
        if not any(value is not None for value in values):
            continue
        drawn += 1
        name = html.escape(label)
        figure.add_trace(
            {
                "type": "scatter",
                "x": steps,
                "y": values,
                "mode": "lines",
                "line": {"color": COMPARE_COLORS[index % len(COMPARE_COLORS)], "width": 1.5},
                "connectgaps": False,
                "name": name,
                "hovertemplate": name + "<br>step %{x}<br>%{y:.6g}<extra></extra>",
            }
        )
    if not drawn:
        return empty_figure(title, uirevision=uirevision)
    figure.layout.yaxis.update(title={"text": title}, **_y_type(log_y))
    figure.update_layout(showlegend=True, height=FIGURE_HEIGHT_PX + 100)
    return figure


def _band_points(
    low_series: Mapping[str, Any] | None, high_series: Mapping[str, Any] | None, last_step: Any
) -> list[tuple[int, float, float]]:
    """(step, low, high) where both band edges are positive and finite, plus a closing point at
    last_step holding the last band so the step-shaped fill reaches the end of the scale line."""
    low_steps, low_values = positive_points(low_series)
    highs = dict(zip(*positive_points(high_series), strict=True))
    band = [
        (step, low, highs[step])
        for step, low in zip(low_steps, low_values, strict=True)
        if low is not None and highs.get(step) is not None
    ]
    band.sort()
    if band and is_step(last_step) and last_step > band[-1][0]:
        band.append((last_step, band[-1][1], band[-1][2]))
    return band


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
    steps, raw_values = series_points(series)
    values = [finite_or_none(value) for value in raw_values]
    if log_y:
        values = [value if value is not None and value > 0 else None for value in values]
    non_finite = [
        (step, label)
        for step, value in zip(steps, raw_values, strict=True)
        if (label := non_finite_of(value))
    ]
    if not mark_non_finite:
        non_finite = []
    if not steps or (not any(value is not None for value in values) and not non_finite):
        return empty_figure(title, uirevision=uirevision)

    figure = new_figure(title, uirevision)
    figure.add_trace(
        {
            "type": "scatter",
            "x": steps,
            "y": values,
            "mode": "lines",
            "line": {"color": LINE_COLOR, "width": 1.5},
            "connectgaps": False,
            "name": y_title,
            "uid": "line",
            "hovertemplate": "step %{x}<br>" + y_title + " %{y:.6g}<extra></extra>",
        }
    )
    figure.layout.yaxis.update(title={"text": y_title}, **_y_type(log_y))
    if non_finite:
        _add_non_finite_markers(figure, non_finite)
    return figure


def _y_type(log_y: bool) -> dict[str, Any]:
    """A y axis' type, a log one with every tick labelled by its number (`log_axis`)."""
    return log_axis() if log_y else {"type": "linear"}


def _add_non_finite_markers(figure: go.Figure, points: list[tuple[int, str]]) -> None:
    # A hidden 0..1 axis over the plot keeps the markers at the top whatever the y zoom is.
    figure.add_trace(
        {
            "type": "scatter",
            "x": [step for step, _ in points],
            "y": [NON_FINITE_MARKER_Y] * len(points),
            "yaxis": "y2",
            "hovertext": [f"{label} at step {step}" for step, label in points],
            "hoverinfo": "text",
            "mode": "markers",
            "marker": {"symbol": "triangle-down", "size": 10, "color": ALERT_COLOR},
            "name": "non-finite",
            "uid": "non-finite",
        }
    )
    figure.update_layout(yaxis2=_MARKER_AXIS, showlegend=True)


def add_resume_markers(figure: go.Figure, events: Iterable[Mapping[str, Any]] | None) -> go.Figure:
    """A dotted line across the plot at each `resume` event's step, where the run continued from a
    checkpoint; the hover says how far the abandoned attempt had got (its steps from there on were
    replaced by the resumed ones, so the line itself stays one line) and how it had ended.

    events: the API's events ({"step", "kind", "data"}); those of other kinds are ignored. A figure
    without data ("no data yet") is returned as it is; so is one when there is no resume."""
    markers = _resume_markers(events or ())
    if not markers or not figure.data:
        return figure
    x: list[Any] = []
    y: list[Any] = []
    text: list[Any] = []
    sizes: list[int] = []
    for step, hover in markers:  # a vertical segment per resume, a triangle at its top
        x += [step, step, None]
        y += [0, 1, None]
        text += [hover, hover, None]
        sizes += [0, 9, 0]
    figure.add_trace(
        {
            "type": "scatter",
            "x": x,
            "y": y,
            "yaxis": "y2",
            "mode": "lines+markers",
            "line": {"color": RESUME_COLOR, "width": 1.5, "dash": "dot"},
            "marker": {"symbol": "triangle-down", "size": sizes, "color": RESUME_COLOR},
            "hovertext": text,
            "hoverinfo": "text",
            "name": "resumed",
            "uid": "resume",
        }
    )
    figure.update_layout(yaxis2=_MARKER_AXIS, showlegend=True)
    return figure


def _resume_markers(events: Iterable[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """(step, hover text) of each resume event that continued something (previous_last_step known)."""
    markers = []
    for event in events:
        if not isinstance(event, Mapping) or event.get("kind") != "resume" or not is_step(event.get("step")):
            continue
        step = event["step"]
        data = event.get("data")
        if not isinstance(data, Mapping):
            data = {}
        previous = data.get("previous_last_step")
        if not is_step(previous):
            continue  # the run had no data before: a resume of nothing is no mark on the charts
        text = f"resumed at step {step}<br>the previous attempt had reached step {previous}"
        if previous >= step:
            text += f"; its steps {step}–{previous} are replaced"
        status, reason = data.get("previous_status"), data.get("previous_status_reason")
        if isinstance(status, str) and status != "running":
            ended = f"{status}: {reason}" if isinstance(reason, str) and reason else status
            text += "<br>it had ended " + html.escape(ended)
        markers.append((step, text))
    return markers


def _skip_markers(
    events: Iterable[Mapping[str, Any]], steps: list[Any], values: list[float | None]
) -> list[tuple[int, float, str]]:
    """(step, scale before the skip, hover text) for each skip event that has a drawable scale."""
    markers = []
    for event in events:
        if not isinstance(event, Mapping) or not is_step(event.get("step")):
            continue
        step = event["step"]
        data = event.get("data")
        if not isinstance(data, Mapping):
            data = {}
        scale_before = finite_or_none(data.get("scale_before"))
        if scale_before is None or scale_before <= 0:
            scale_before = _last_value_before(step, steps, values)
        if scale_before is None:
            continue
        text = (
            f"skipped step {step}<br>"
            f"scale {format_scale(scale_before)} → {format_scale(data.get('scale_after'))}"
        )
        layers = layer_names(data.get("non_finite_layers"))
        if layers:
            text += "<br>non-finite: " + html.escape(summarize_layers(layers))
        markers.append((step, scale_before, text))
    return markers


def _last_value_before(step: int, steps: list[Any], values: list[float | None]) -> float | None:
    best_step, best_value = None, None
    for candidate_step, value in zip(steps, values, strict=True):
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


def _band_edge(
    steps: list[int],
    scales: list[float],
    bound: str,
    *,
    name: str,
    uid: str,
    legend: bool = True,
    fill: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One edge of the safe-scale band as a step line; `bound` ("≥" or "≤") says which in the hover,
    `fill` fills down to the trace before it (the other edge)."""
    trace: dict[str, Any] = {
        "type": "scatter",
        "x": steps,
        "y": scales,
        "mode": "lines",
        "line": {"color": BAND_EDGE_COLOR, "width": 0.5, "shape": "hv"},
        **(fill or {}),
        "name": name,
        "uid": uid,
    }
    if not legend:
        trace["showlegend"] = False
    trace["hovertemplate"] = f"step %{{x}}<br>safe scale {bound} %{{y:.3g}}<extra></extra>"
    return trace
