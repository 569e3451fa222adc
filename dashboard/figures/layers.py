"""Per-layer heatmaps: a quantity by layer (y, in model order, the first at the top) and step (x)."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from ._common import base_layout, empty_figure, is_step, non_finite_of

NON_FINITE_CELL_COLOR = "#ef4444"
# Per-layer heatmaps grow with the layer count, within bounds; past the cap rows get thinner and
# tick labels are thinned to one per HEATMAP_TICK_PX.
HEATMAP_ROW_PX = 16
HEATMAP_MARGIN_PX = 100
HEATMAP_MIN_HEIGHT_PX = 260
HEATMAP_MAX_HEIGHT_PX = 900
HEATMAP_TICK_PX = 13
MAX_TICK_LABEL_CHARS = 40


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
    z = [[cell(value) for value in column] for column in zip(*padded, strict=True)]
    bad_cells: list[tuple[int, str, str]] = []
    for column, row in enumerate(padded):
        if all(
            (value.__class__ is float or value.__class__ is int) and math.isfinite(value) for value in row
        ):
            continue
        for index, raw in enumerate(row):
            label = non_finite_of(raw)
            if label is not None:
                bad_cells.append((steps[column], labels[index], label))

    figure = go.Figure()
    base_layout(figure, title, uirevision)
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
        # sending ranges (views.keep_view), so the order must live in the category array.
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
