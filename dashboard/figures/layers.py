"""Per-layer heatmaps: a quantity by layer (y, in model order, the first at the top) and step (x).

z holds one row per step (the API's shape, drawn with plotly's `transpose`), so a live run's new
steps are appended to x and z as they are (see `live.append_columns_patch`). The traces carry uids:
"cells" (the heatmap), "non-finite-NaN" / "-Infinity" / "--Infinity" (red markers over such cells)
and "non-finite-steps" (a red column over a step where every layer is non-finite).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from ._common import base_layout, empty_figure, is_step, non_finite_of

NON_FINITE_CELL_COLOR = "#ef4444"
NON_FINITE_KINDS = ("NaN", "Infinity", "-Infinity")
# Per-layer heatmaps grow with the layer count, within bounds; past the cap rows get thinner and
# tick labels are thinned to one per HEATMAP_TICK_PX.
HEATMAP_ROW_PX = 16
HEATMAP_MARGIN_PX = 100
HEATMAP_MIN_HEIGHT_PX = 260
HEATMAP_MAX_HEIGHT_PX = 900
HEATMAP_TICK_PX = 13
MAX_TICK_LABEL_CHARS = 40
HEATMAP_LABEL_CHAR_PX = 6  # the width of a tick label's character at 10 px, generously
HEATMAP_MAX_LABEL_PX = 16 + HEATMAP_LABEL_CHAR_PX * MAX_TICK_LABEL_CHARS


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
    NaN/±Inf cells are red square markers over the heatmap, hover "<layer> NaN at step N"; a step
    where every layer is non-finite is one red column.
    Layer names are escaped; more layers than fit get thinned tick labels (every name stays in hover).
    """
    layers, steps, rows = _matrix(vectors)
    if not layers or not steps:
        return empty_figure(title, uirevision=uirevision)
    labels = [html.escape(name) for name in layers]
    height = heatmap_height(len(layers))
    z, bad_cells, bad_steps = heatmap_cells(layers, steps, rows, log_scale=log_scale)
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
    traces: list[dict[str, Any]] = [
        {
            "type": "heatmap",
            "uid": "cells",
            "x": steps,
            "y": labels,
            "z": z,
            "transpose": True,  # z[step][layer], as the API sends it
            "zsmooth": "fast",
            "colorscale": "Viridis",
            "colorbar": colorbar,
            "hoverongaps": False,
            "name": value_label,
            "hovertemplate": "%{y}<br>step %{x}<br>" + hover_value + "<extra></extra>",
            **heatmap,
        }
    ]
    traces += non_finite_traces(bad_cells, bad_steps, labels, (height - HEATMAP_MARGIN_PX) / len(labels))
    # Unvalidated: z is built above from checked floats, and plotly's checks and copies of 100k cells
    # would cost about 0.6 s per heatmap on every refresh.
    figure = go.Figure(data=traces, _validate=False)
    base_layout(figure, title, uirevision)
    tick_stride = max(1, math.ceil(len(labels) / max(1, (height - HEATMAP_MARGIN_PX) // HEATMAP_TICK_PX)))
    shown = labels[::tick_stride]
    ticktext = [_shorten(label) for label in shown]
    figure.layout.yaxis.update(
        type="category",
        # First layer at the top. Not autorange="reversed": refreshes keep the user's zoom by not
        # sending ranges (views.keep_view), so the order must live in the category array.
        categoryorder="array",
        categoryarray=labels[::-1],
        tickmode="array",
        tickvals=shown,
        ticktext=ticktext,
        title=None,
        showgrid=False,
        tickfont={"size": 10},
    )
    figure.layout.xaxis.update(showgrid=False, automargin=False)
    # Margins fixed from the labels rather than by plotly's automargin, which draws the plot again
    # once it has measured them (about 0.3 s of the browser's time per 100k-cell heatmap).
    left = min(HEATMAP_MAX_LABEL_PX, 16 + HEATMAP_LABEL_CHAR_PX * max(len(text) for text in ticktext))
    figure.layout.yaxis.update(automargin=False)
    figure.update_layout(height=height, margin={"l": left, "r": 20, "t": 48, "b": 40})
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


def heatmap_cells(
    layers: list[str], steps: list[int], rows: list[list[Any]], *, log_scale: bool
) -> tuple[list[list[float | None]], list[tuple[int, str, str]], list[int]]:
    """(z: one row per step of the colour values, log10 with `log_scale`; the non-finite cells as
    (step, escaped layer name, "NaN"/"Infinity"/"-Infinity"); the steps where every layer is
    non-finite, which are drawn as one red column each rather than cell by cell). Rows are padded or
    cut to the layers."""
    width = len(layers)
    cell = _log10_cell if log_scale else _linear_cell
    z: list[list[float | None]] = []
    bad_cells: list[tuple[int, str, str]] = []
    bad_steps: list[int] = []
    for step, row in zip(steps, rows, strict=True):
        padded = row[:width] if len(row) >= width else row + [None] * (width - len(row))
        z.append([cell(value) for value in padded])
        # A 200-layer × 500-step heatmap is 100k cells: the common row (finite floats) is looked at once.
        if all(
            (value.__class__ is float or value.__class__ is int) and math.isfinite(value) for value in padded
        ):
            continue
        found = [(index, non_finite_of(raw)) for index, raw in enumerate(padded)]
        if width > 1 and all(label is not None for _, label in found):
            bad_steps.append(step)
            continue
        bad_cells.extend(
            (step, html.escape(layers[index]), label) for index, label in found if label is not None
        )
    return z, bad_cells, bad_steps


def non_finite_traces(
    bad_cells: list[tuple[int, str, str]], bad_steps: list[int], labels: list[str], row_px: float
) -> list[dict[str, Any]]:
    """Red square markers over NaN/Inf cells, one trace per kind (uid "non-finite-NaN"…), hover
    "<layer><br>NaN at step N"; a red column over each step where every layer is non-finite (uid
    "non-finite-steps"). Hover comes from templates: no per-point text to send."""
    traces = []
    for kind in NON_FINITE_KINDS:
        cells = [(step, label) for step, label, found in bad_cells if found == kind]
        if not cells:
            continue
        traces.append(
            {
                "type": "scatter",
                "uid": f"non-finite-{kind}",
                "x": [step for step, _ in cells],
                "y": [label for _, label in cells],
                "hovertemplate": "%{y}<br>" + kind + " at step %{x}<extra></extra>",
                "mode": "markers",
                "marker": {
                    "symbol": "square",
                    "size": max(4, min(10, row_px)),
                    "color": NON_FINITE_CELL_COLOR,
                    "line": {"width": 0},
                },
                "name": "non-finite",
                "showlegend": False,
            }
        )
    if bad_steps:
        traces.append(
            {
                "type": "scatter",
                "uid": "non-finite-steps",
                "x": [value for step in bad_steps for value in (step, step, None)],
                "y": [value for _ in bad_steps for value in (labels[0], labels[-1], None)],
                "hovertemplate": f"all {len(labels)} layers non-finite at step %{{x}}<extra></extra>",
                "mode": "lines",
                "line": {"color": NON_FINITE_CELL_COLOR, "width": 3},
                "name": "non-finite",
                "showlegend": False,
            }
        )
    return traces


def layer_names_of(vectors: Mapping[str, Any] | None) -> list[str]:
    """The layer names of a /vectors object, in model order ([] when malformed)."""
    layers = vectors.get("layers") if isinstance(vectors, Mapping) else None
    return [str(name) for name in layers] if isinstance(layers, list) else []


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
    pairs = [
        (step, row)
        for step, row in zip(steps, values, strict=False)
        if is_step(step) and isinstance(row, list)
    ]
    return [str(name) for name in layers], [step for step, _ in pairs], [row for _, row in pairs]


def _shorten(label: str, limit: int = MAX_TICK_LABEL_CHARS) -> str:
    # Keep the end: "…layers.31.mlp.down_proj.weight" says more than "model.layers.31.mlp…".
    return label if len(label) <= limit else "…" + label[-(limit - 1) :]
