"""Figure builders: API data in, plotly Figure out. Pure functions — no HTTP, no Dash.

A `series` argument is the API's series object, {"steps": [int...], "values": [...]}, where a value is a
number, one of the strings "NaN" / "Infinity" / "-Infinity", or null. Non-finite and missing values
become gaps in lines; non-finite loss and gradient-norm values are also marked with red triangles
along the top of the plot area, hover text "NaN at step N". Malformed input never raises: what cannot
be read is drawn as a gap, and a series with no points gives a figure saying "no data yet".

Text that comes from users (layer names) is escaped before it reaches hover text, so plotly shows it
as text and never interprets tags in it.

Each trace of the line charts has a `uid` naming its role ("line", "non-finite", "scale", "skipped-step",
"safe-band-low"…): live updates append new points to the trace with the same uid (see `live`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

__all__ = [
    "NO_DATA_TEXT",
    "compare_figure",
    "empty_figure",
    "finite_or_none",
    "format_scale",
    "fp16_thresholds",
    "grad_norm_figure",
    "heatmap_height",
    "histogram_figure",
    "histogram_steps",
    "histogram_time_figure",
    "layer_heatmap_figure",
    "layer_names",
    "layer_names_of",
    "loss_figure",
    "lr_figure",
    "scale_figure",
    "step_marker_shapes",
    "summarize_layers",
]

NO_DATA_TEXT = "no data yet"
NON_FINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

LINE_COLOR = "#2563eb"
ALERT_COLOR = "#dc2626"
POST_CLIP_COLOR = "#f59e0b"
BAND_COLOR = "rgba(34, 197, 94, 0.16)"
BAND_EDGE_COLOR = "rgba(21, 128, 61, 0.45)"
STEP_MARKER_COLOR = "#7c3aed"
NON_FINITE_CELL_COLOR = "#ef4444"
COMPARE_COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777")
# fp16 limits for a scaled gradient: below the smallest subnormal it flushes to 0, above the max it is inf.
FP16_SMALLEST_SUBNORMAL = 2.0**-24
FP16_MAX = 65504.0
# Per-layer heatmaps grow with the layer count, within bounds; past the cap rows get thinner and
# tick labels are thinned to one per HEATMAP_TICK_PX.
HEATMAP_ROW_PX = 16
HEATMAP_MARGIN_PX = 100
HEATMAP_MIN_HEIGHT_PX = 260
HEATMAP_MAX_HEIGHT_PX = 900
HEATMAP_TICK_PX = 13
MAX_TICK_LABEL_CHARS = 40
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
    steps, values = _positive_points(post_clip) if log_y else _points(post_clip)
    values = [finite_or_none(value) for value in values]
    if not any(value is not None for value in values):
        return figure
    if figure.data:
        figure.data[0].name = "pre-clip"
    else:  # only the post-clip norm so far: replace the "no data yet" placeholder
        figure = go.Figure()
        _base_layout(figure, "Gradient norm (global, unscaled)", uirevision)
        figure.layout.yaxis.update(title="‖g‖₂", type="log" if log_y else "linear")
    figure.add_trace(
        go.Scatter(
            x=steps,
            y=values,
            mode="lines",
            line={"color": POST_CLIP_COLOR, "width": 1.2},
            connectgaps=False,
            name="post-clip",
            uid="post-clip",
            hovertemplate="step %{x}<br>post-clip %{y:.6g}<extra></extra>",
        )
    )
    figure.update_layout(showlegend=True)
    return figure


def lr_figure(series: Mapping[str, Any] | None, *, uirevision: str = "gradwatch") -> go.Figure:
    """Learning rate per step (of the first param group)."""
    figure = _scalar_figure(series, "Learning rate", "lr", mark_non_finite=False, uirevision=uirevision)
    figure.layout.yaxis.update(exponentformat="e")
    _, raw_values = _points(series)
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
    uirevision: str = "gradwatch",
) -> go.Figure:
    """Loss scale S per step on a log2 axis (ticks 2^k), each skipped step a red x at S before the skip.

    skip_events: the API's events of kind "skip", {"step", "data": {"scale_before", "scale_after",
    "non_finite_layers"}}. When an event lacks a usable scale_before, the last scale recorded before its
    step is used; an event with neither gets no marker.
    safe_band: the (amp/safe_scale_min, amp/safe_scale_max) series: scales at which no gradient would
    underflow or overflow in fp16. Known only at histogram steps, so it is shaded behind the scale as
    a step-shaped band, each value held until the next histogram step (the last up to the last step).
    """
    title = "Loss scale"
    steps, values = _positive_points(scale_series)
    skips = _skip_markers(skip_events or (), steps, values)
    if not any(value is not None for value in values) and not skips:
        return empty_figure(title, uirevision=uirevision)

    figure = go.Figure()
    _base_layout(figure, title, uirevision)
    band = _band_points(*(safe_band or (None, None)), last_step=max(steps, default=None))
    if band:
        band_steps = [step for step, _, _ in band]
        figure.add_trace(
            go.Scatter(
                x=band_steps,
                y=[low for _, low, _ in band],
                mode="lines",
                line={"color": BAND_EDGE_COLOR, "width": 0.5, "shape": "hv"},
                name="safe band (low)",
                uid="safe-band-low",
                showlegend=False,
                hovertemplate="step %{x}<br>safe scale ≥ %{y:.3g}<extra></extra>",
            )
        )
        figure.add_trace(
            go.Scatter(
                x=band_steps,
                y=[high for _, _, high in band],
                mode="lines",
                line={"color": BAND_EDGE_COLOR, "width": 0.5, "shape": "hv"},
                fill="tonexty",
                fillcolor=BAND_COLOR,
                name="fp16 safe band",
                uid="safe-band-high",
                hovertemplate="step %{x}<br>safe scale ≤ %{y:.3g}<extra></extra>",
            )
        )
    figure.add_trace(
        go.Scatter(
            x=steps,
            y=values,
            customdata=[format_scale(value) if value is not None else None for value in values],
            mode="lines",
            line={"color": LINE_COLOR, "width": 2, "shape": "hv"},
            connectgaps=False,
            name="scale",
            uid="scale",
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
                uid="skipped-step",
            )
        )
    band_values = [value for _, low, high in band for value in (low, high)]
    tickvals, ticktext = _log2_ticks(
        [v for v in values if v is not None] + [s for _, s, _ in skips] + band_values
    )
    figure.layout.yaxis.update(
        type="log", tickmode="array", tickvals=tickvals, ticktext=ticktext, title="scale"
    )
    figure.update_layout(showlegend=bool(skips or band))
    return figure


def _band_points(
    low_series: Mapping[str, Any] | None, high_series: Mapping[str, Any] | None, last_step: Any
) -> list[tuple[int, float, float]]:
    """(step, low, high) where both band edges are positive and finite, plus a closing point at
    last_step holding the last band so the step-shaped fill reaches the end of the scale line."""
    low_steps, low_values = _positive_points(low_series)
    highs = dict(zip(*_positive_points(high_series)))
    band = [
        (step, low, highs[step])
        for step, low in zip(low_steps, low_values)
        if low is not None and highs.get(step) is not None
    ]
    band.sort()
    if band and _is_step(last_step) and last_step > band[-1][0]:
        band.append((last_step, band[-1][1], band[-1][2]))
    return band


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
            uid="line",
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
            uid="non-finite",
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_step(value: Any) -> bool:
    return _is_int(value)


# -- step marker -----------------------------------------------------------------------------------


def step_marker_shapes(step: Any) -> list[dict[str, Any]]:
    """A dashed vertical line at `step` across the plot, as layout shapes; [] when step is not a step.

    For figures whose x axis is the step (every run-page chart but the histogram at one step).
    """
    if not _is_step(step):
        return []
    return [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": step,
            "x1": step,
            "y0": 0,
            "y1": 1,
            "line": {"color": STEP_MARKER_COLOR, "width": 1.5, "dash": "dash"},
            "layer": "above",
        }
    ]


# -- per-layer heatmaps ----------------------------------------------------------------------------


def heatmap_height(layer_count: int) -> int:
    """Pixel height of a layer × step heatmap: HEATMAP_ROW_PX per layer plus margins, within bounds."""
    rows = max(0, layer_count) * HEATMAP_ROW_PX + HEATMAP_MARGIN_PX
    return int(min(HEATMAP_MAX_HEIGHT_PX, max(HEATMAP_MIN_HEIGHT_PX, rows)))


def layer_heatmap_figure(
    vectors: Mapping[str, Any] | None,
    title: str,
    value_label: str,
    *,
    log_scale: bool = True,
    value_range: tuple[float, float] | None = None,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """A per-layer quantity as a heatmap: layers on y (model order, first at the top), steps on x.

    vectors: the API's /vectors object {"layers": [...], "steps": [...], "values": [[per layer]...]}.
    log_scale: colour by log10 of the value (norms and update ratios span decades); the colour bar
        is labelled in powers of ten and hover shows 10^x. Zeros and negatives are then blank cells.
    value_range: fixed colour range (in value units), e.g. (0, 1) for fractions; None: from the data.
    NaN/±Inf cells are red square markers over the heatmap, hover "<layer> NaN at step N".
    Layer names are escaped; more layers than fit get thinned tick labels (every name stays in hover).
    """
    layers, steps, rows = _matrix(vectors)
    if not layers or not steps:
        return empty_figure(title, uirevision=uirevision)
    labels = [html.escape(name) for name in layers]
    height = heatmap_height(len(layers))
    # z[layer][step]: plotly heatmaps take rows along y. A 200-layer × 500-step heatmap is 100k
    # cells, so the common case (a finite float) takes the fast path; the rest are looked at once.
    width = len(layers)
    padded = [row[:width] if len(row) >= width else row + [None] * (width - len(row)) for row in rows]
    cell = _log10_cell if log_scale else _linear_cell
    z = [[cell(value) for value in column] for column in zip(*padded)]
    bad_cells: list[tuple[int, str, str]] = []
    for column, row in enumerate(padded):
        if all(
            (value.__class__ is float or value.__class__ is int) and math.isfinite(value) for value in row
        ):
            continue
        for index, raw in enumerate(row):
            label = _non_finite_of(raw)
            if label is not None:
                bad_cells.append((steps[column], labels[index], label))

    figure = go.Figure()
    _base_layout(figure, title, uirevision)
    colorbar: dict[str, Any] = {"title": {"text": value_label, "side": "right"}, "thickness": 12, "len": 0.9}
    heatmap: dict[str, Any] = {}
    if log_scale:
        finite = [value for row in z for value in row if value is not None]
        if finite:
            low, high = math.floor(min(finite)), math.ceil(max(finite))
            if low == high:
                high = low + 1
            stride = max(1, math.ceil((high - low + 1) / 8))
            exponents = list(range(low, high + 1, stride))
            colorbar.update(tickvals=exponents, ticktext=[f"1e{exponent}" for exponent in exponents])
        hover_value = value_label + " 10^%{z:.2f}"
    else:
        hover_value = value_label + " %{z:.3g}"
    if value_range is not None:
        low_value, high_value = value_range
        if log_scale:
            low_value, high_value = math.log10(low_value), math.log10(high_value)
        heatmap.update(zmin=low_value, zmax=high_value)
    figure.add_trace(
        go.Heatmap(
            x=steps,
            y=labels,
            z=z,
            colorscale="Viridis",
            colorbar=colorbar,
            hoverongaps=False,
            name=value_label,
            hovertemplate="%{y}<br>step %{x}<br>" + hover_value + "<extra></extra>",
            # z is built above from checked floats: plotly's per-cell validation would only cost
            # time (about 0.3 s per 100k cells) on every refresh.
            _validate=False,
            **heatmap,
        )
    )
    if bad_cells:
        row_px = (height - HEATMAP_MARGIN_PX) / len(labels)
        figure.add_trace(
            go.Scatter(
                x=[step for step, _, _ in bad_cells],
                y=[label for _, label, _ in bad_cells],
                hovertext=[f"{label}<br>{kind} at step {step}" for step, label, kind in bad_cells],
                hoverinfo="text",
                mode="markers",
                marker={
                    "symbol": "square",
                    "size": max(4, min(10, row_px)),
                    "color": NON_FINITE_CELL_COLOR,
                    "line": {"width": 0},
                },
                name="non-finite",
                showlegend=False,
            )
        )
    tick_stride = max(1, math.ceil(len(labels) / max(1, (height - HEATMAP_MARGIN_PX) // HEATMAP_TICK_PX)))
    shown = labels[::tick_stride]
    figure.layout.yaxis.update(
        type="category",
        # First layer at the top. Not autorange="reversed": refreshes keep the user's zoom by not
        # sending ranges (app.keep_view), so the order must live in the category array.
        categoryorder="array",
        categoryarray=labels[::-1],
        tickmode="array",
        tickvals=shown,
        ticktext=[_shorten(label) for label in shown],
        title=None,
        showgrid=False,
        tickfont={"size": 10},
    )
    figure.layout.xaxis.update(showgrid=False)
    figure.update_layout(height=height, margin={"l": 60, "r": 20, "t": 48, "b": 40})
    if len(layers) > len(shown):
        figure.update_layout(
            annotations=[
                {
                    "text": f"{len(layers)} layers (every {tick_stride}th labelled; hover for names)",
                    "xref": "paper",
                    "yref": "paper",
                    "x": 1,
                    "y": 1.0,
                    "yanchor": "bottom",
                    "xanchor": "right",
                    "showarrow": False,
                    "font": {"size": 11, "color": "#6b7280"},
                }
            ]
        )
    return figure


def _log10_cell(value: Any) -> float | None:
    if (value.__class__ is float or value.__class__ is int) and 0 < value < math.inf:
        return round(math.log10(value), 3)
    return None


def _linear_cell(value: Any) -> float | None:
    if (value.__class__ is float or value.__class__ is int) and -math.inf < value < math.inf:
        return round(value, 4)
    return None


def _matrix(vectors: Mapping[str, Any] | None) -> tuple[list[str], list[int], list[list[Any]]]:
    """Layer names, steps and rows (one list per step) of a /vectors object; malformed → empty."""
    if not isinstance(vectors, Mapping):
        return [], [], []
    layers, steps, values = vectors.get("layers"), vectors.get("steps"), vectors.get("values")
    if not isinstance(layers, list) or not isinstance(steps, list) or not isinstance(values, list):
        return [], [], []
    pairs = [(step, row) for step, row in zip(steps, values) if _is_step(step) and isinstance(row, list)]
    return [str(name) for name in layers], [step for step, _ in pairs], [row for _, row in pairs]


def _shorten(label: str, limit: int = MAX_TICK_LABEL_CHARS) -> str:
    # Keep the end: "…layers.31.mlp.down_proj.weight" says more than "model.layers.31.mlp…".
    return label if len(label) <= limit else "…" + label[-(limit - 1) :]


def layer_names_of(vectors: Mapping[str, Any] | None) -> list[str]:
    """The layer names of a /vectors object, in model order ([] when malformed)."""
    layers = vectors.get("layers") if isinstance(vectors, Mapping) else None
    return [str(name) for name in layers] if isinstance(layers, list) else []


# -- histograms ------------------------------------------------------------------------------------


def fp16_thresholds(scale: Any) -> tuple[float, float] | None:
    """(underflow, overflow) as log2 of an unscaled |g|: below 2^-24 / S a scaled gradient flushes to
    zero in fp16, above 65504 / S it becomes inf. None when the scale is not a positive number."""
    value = finite_or_none(scale)
    if value is None or value <= 0:
        return None
    return math.log2(FP16_SMALLEST_SUBNORMAL / value), math.log2(FP16_MAX / value)


def histogram_steps(histograms: Mapping[str, Any] | None) -> list[int]:
    """The steps of a /histograms object that have a row of counts."""
    return [step for step, _, _, _ in _histogram_rows(histograms)]


def histogram_figure(
    histograms: Mapping[str, Any] | None,
    step: Any,
    scale: Any = None,
    *,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """One layer's |g| histogram at `step` (or the latest step before it): count per power of two.

    Bars span log2|g| in [e-1, e). scale: the loss scale at that step; when given, fp16's underflow
    (2^-24/S) and overflow (65504/S) limits are drawn as vertical lines. Zeros and NaN/Inf counts,
    which have no bin, are in the title.
    """
    rows = _histogram_rows(histograms)
    title = "Gradient histogram"
    if not rows:
        return empty_figure(title, uirevision=uirevision)
    at_or_before = [row for row in rows if _is_step(step) and row[0] <= step]
    chosen = at_or_before[-1] if at_or_before else rows[0] if _is_step(step) else rows[-1]
    at_step, counts, zeros, non_finite = chosen
    exponents = _exponents(histograms)
    layer = html.escape(str(histograms.get("layer", ""))) if isinstance(histograms, Mapping) else ""
    figure = go.Figure()
    _base_layout(figure, f"{title} · {layer} · step {at_step:,}", uirevision)
    used = [e for e, count in zip(exponents, counts) if count]
    lines = fp16_thresholds(scale)
    low, high = (min(used), max(used)) if used else (-30, 0)
    if lines:
        low, high = min(low, math.floor(lines[0])), max(high, math.ceil(lines[1]))
    # Only the bins from just below the lowest used one (or the underflow limit) to just above the
    # highest: the axis autoscales to them, also after the app's zoom-keeping updates.
    shown = [(e, count) for e, count in zip(exponents, counts) if low - 2 <= e <= high + 1]
    figure.add_trace(
        go.Bar(
            x=[e - 0.5 for e, _ in shown],
            y=[count for _, count in shown],
            width=1,
            marker={"color": LINE_COLOR},
            name="count",
            customdata=[e for e, _ in shown],
            hovertemplate="|g| in [2^(%{customdata}-1), 2^%{customdata})<br>%{y} values<extra></extra>",
        )
    )
    shapes, annotations = [], []
    if lines:
        for x, label in ((lines[0], "fp16 underflow"), (lines[1], "fp16 overflow")):
            shapes.append(
                {
                    "type": "line",
                    "xref": "x",
                    "yref": "paper",
                    "x0": x,
                    "x1": x,
                    "y0": 0,
                    "y1": 1,
                    "line": {"color": ALERT_COLOR, "width": 1.5, "dash": "dot"},
                }
            )
            annotations.append(
                {
                    "text": f"{label} at S={format_scale(scale)}",
                    "x": x,
                    "xref": "x",
                    "y": 1.0,  # above the plot, clear of the bars
                    "yref": "paper",
                    "yanchor": "bottom",
                    "showarrow": False,
                    # Labels face inwards so neither is cut off at the plot's edge.
                    "xanchor": "left" if label.endswith("underflow") else "right",
                    "xshift": 4 if label.endswith("underflow") else -4,
                    "font": {"size": 10, "color": ALERT_COLOR},
                }
            )
    figure.update_layout(shapes=shapes, annotations=annotations, bargap=0)
    figure.layout.xaxis.update(
        title="log2 |g| (unscaled)", range=[low - 2, high + 1], dtick=4 if high - low > 24 else 2
    )
    figure.layout.yaxis.update(title="values", type="log" if max(counts, default=0) > 1000 else "linear")
    figure.layout.title.text += f"<br><sup>zeros {zeros:,} · NaN/Inf {non_finite:,}</sup>"
    figure.update_layout(margin={"t": 72})
    return figure


def histogram_time_figure(
    histograms: Mapping[str, Any] | None,
    scale_series: Mapping[str, Any] | None = None,
    *,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """One layer's |g| histograms over steps: exponent × step heatmap of log10(count).

    With the loss-scale series, fp16's underflow and overflow limits at each step's scale are drawn
    as step-shaped lines (values beyond them would flush to zero / become inf when scaled).
    """
    rows = _histogram_rows(histograms)
    title = "Gradient histogram over steps"
    if not rows:
        return empty_figure(title, uirevision=uirevision)
    exponents = _exponents(histograms)
    used = [e for _, counts, _, _ in rows for e, count in zip(exponents, counts) if count]
    low, high = (min(used) - 2, max(used) + 2) if used else (exponents[0], exponents[-1])
    kept = [i for i, e in enumerate(exponents) if low <= e <= high]
    steps = [step for step, _, _, _ in rows]
    z = [
        [round(math.log10(counts[i]), 3) if counts[i] > 0 else None for _, counts, _, _ in rows] for i in kept
    ]
    figure = go.Figure()
    _base_layout(figure, title, uirevision)
    figure.add_trace(
        go.Heatmap(
            x=steps,
            y=[exponents[i] - 0.5 for i in kept],
            z=z,
            customdata=[[exponents[i]] * len(steps) for i in kept],
            colorscale="Blues",
            colorbar={"title": {"text": "count", "side": "right"}, "thickness": 12, "tickprefix": "1e"},
            hoverongaps=False,
            name="count",
            hovertemplate="step %{x}<br>|g| in [2^(%{customdata}-1), 2^%{customdata})"
            "<br>count 10^%{z:.2f}<extra></extra>",
        )
    )
    scale_steps, scale_values = _positive_points(scale_series)
    if scale_steps:
        for index, name in ((0, "fp16 underflow"), (1, "fp16 overflow")):
            limits = [fp16_thresholds(value) for value in scale_values]
            figure.add_trace(
                go.Scatter(
                    x=scale_steps,
                    y=[limit[index] if limit else None for limit in limits],
                    mode="lines",
                    line={"color": ALERT_COLOR, "width": 1.5, "dash": "dot", "shape": "hv"},
                    name=name,
                    hovertemplate=name + " at step %{x}: 2^%{y:.0f}<extra></extra>",
                )
            )
        figure.update_layout(showlegend=True)
    figure.layout.yaxis.update(title="log2 |g|", range=[low - 1, high])
    figure.layout.xaxis.update(showgrid=False)
    return figure


def _exponents(histograms: Mapping[str, Any] | None) -> list[int]:
    exponents = histograms.get("exponents") if isinstance(histograms, Mapping) else None
    if not isinstance(exponents, list) or not all(_is_int(e) for e in exponents):
        return []
    return exponents


def _histogram_rows(histograms: Mapping[str, Any] | None) -> list[tuple[int, list[int], int, int]]:
    """(step, counts per exponent, zeros, non-finite) of each well-formed snapshot."""
    if not isinstance(histograms, Mapping):
        return []
    exponents = _exponents(histograms)
    steps, counts = histograms.get("steps"), histograms.get("counts")
    zeros, non_finite = histograms.get("zeros"), histograms.get("non_finite")
    if not isinstance(steps, list) or not isinstance(counts, list):
        return []
    zeros = zeros if isinstance(zeros, list) else []
    non_finite = non_finite if isinstance(non_finite, list) else []
    rows = []
    for index, (step, row) in enumerate(zip(steps, counts)):
        if not _is_step(step) or not isinstance(row, list) or len(row) != len(exponents):
            continue
        clean = [count if _is_int(count) else 0 for count in row]
        zero = zeros[index] if index < len(zeros) and _is_int(zeros[index]) else 0
        bad = non_finite[index] if index < len(non_finite) and _is_int(non_finite[index]) else 0
        rows.append((step, clean, zero, bad))
    return rows


# -- compare ---------------------------------------------------------------------------------------


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
    figure = go.Figure()
    _base_layout(figure, title, uirevision)
    drawn = 0
    for index, (label, series) in enumerate(runs):
        steps, raw_values = _points(series)
        values = [finite_or_none(value) for value in raw_values]
        if log_y:
            values = [value if value is not None and value > 0 else None for value in values]
        if not any(value is not None for value in values):
            continue
        drawn += 1
        name = html.escape(label)
        figure.add_trace(
            go.Scatter(
                x=steps,
                y=values,
                mode="lines",
                line={"color": COMPARE_COLORS[index % len(COMPARE_COLORS)], "width": 1.5},
                connectgaps=False,
                name=name,
                hovertemplate=name + "<br>step %{x}<br>%{y:.6g}<extra></extra>",
            )
        )
    if not drawn:
        return empty_figure(title, uirevision=uirevision)
    figure.layout.yaxis.update(title=title, type="log" if log_y else "linear")
    figure.update_layout(showlegend=True, height=FIGURE_HEIGHT_PX + 100)
    return figure
