"""A layer's gradient histogram, one bin per power of two of |g|: at one step, and over steps; both
with fp16's underflow and overflow limits at the loss scale."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from ._common import (
    ALERT_COLOR,
    LINE_COLOR,
    empty_figure,
    finite_or_none,
    format_count,
    format_scale,
    is_int,
    is_step,
    log_axis,
    new_figure,
    positive_points,
)

# fp16 limits for a scaled gradient: below the smallest subnormal it flushes to 0, above the max it is inf.
FP16_SMALLEST_SUBNORMAL = 2.0**-24
FP16_MAX = 65504.0


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
    which have no bin, are in the title's subtitle.
    """
    rows = _histogram_rows(histograms)
    title = "Gradient histogram"
    if not rows:
        return empty_figure(title, uirevision=uirevision)
    at_or_before = [row for row in rows if is_step(step) and row[0] <= step]
    chosen = at_or_before[-1] if at_or_before else rows[0] if is_step(step) else rows[-1]
    at_step, counts, zeros, non_finite = chosen
    exponents = _exponents(histograms)
    layer = html.escape(str(histograms.get("layer", ""))) if isinstance(histograms, Mapping) else ""
    figure = new_figure(f"{title} · {layer} · step {at_step:,}", uirevision)
    used = [e for e, count in zip(exponents, counts, strict=True) if count]
    lines = fp16_thresholds(scale)
    low, high = (min(used), max(used)) if used else (-30, 0)
    if lines:
        low, high = min(low, math.floor(lines[0])), max(high, math.ceil(lines[1]))
    # Only the bins from just below the lowest used one (or the underflow limit) to just above the
    # highest: the axis autoscales to them, also after the app's zoom-keeping updates.
    shown = [(e, count) for e, count in zip(exponents, counts, strict=True) if low - 2 <= e <= high + 1]
    figure.add_trace(
        {
            "type": "bar",
            "x": [e - 0.5 for e, _ in shown],
            "y": [count for _, count in shown],
            "width": 1,
            "marker": {"color": LINE_COLOR},
            "name": "count",
            "customdata": [e for e, _ in shown],
            "hovertemplate": "|g| in [2^(%{customdata}-1), 2^%{customdata})<br>%{y} values<extra></extra>",
        }
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
        title={"text": "log2 |g| (unscaled)"}, range=[low - 2, high + 1], dtick=4 if high - low > 24 else 2
    )
    counts_axis = log_axis("B") if max(counts, default=0) > 1000 else {"type": "linear"}
    figure.layout.yaxis.update(title={"text": "values"}, **counts_axis)
    # A subtitle, which plotly.js lays out below the title (a second line of the title's own text,
    # "<br><sup>…</sup>", is pushed above it by the title's top anchor and cut off at the top edge).
    figure.layout.title.subtitle = {
        "text": f"zeros {zeros:,} · NaN/Inf {non_finite:,}",
        "font": {"size": 11, "color": "#4b5563"},
    }
    figure.update_layout(margin={"t": 72})
    return figure


def histogram_time_figure(
    histograms: Mapping[str, Any] | None,
    scale_series: Mapping[str, Any] | None = None,
    *,
    uirevision: str = "gradwatch",
) -> go.Figure:
    """One layer's |g| histograms over steps: exponent × step heatmap of log10(count), its colour bar
    labelled in counts at powers of ten (1, 10, 100, 1k…; the ends' counts when under a decade).

    With the loss-scale series, fp16's underflow and overflow limits at each step's scale are drawn
    as step-shaped lines (values beyond them would flush to zero / become inf when scaled).
    """
    rows = _histogram_rows(histograms)
    title = "Gradient histogram over steps"
    if not rows:
        return empty_figure(title, uirevision=uirevision)
    exponents = _exponents(histograms)
    used = [e for _, counts, _, _ in rows for e, count in zip(exponents, counts, strict=True) if count]
    low, high = (min(used) - 2, max(used) + 2) if used else (exponents[0], exponents[-1])
    kept = [i for i, e in enumerate(exponents) if low <= e <= high]
    steps = [step for step, _, _, _ in rows]
    z = [
        [round(math.log10(counts[i]), 3) if counts[i] > 0 else None for _, counts, _, _ in rows] for i in kept
    ]
    text = [[f"{counts[i]:,}" for _, counts, _, _ in rows] for i in kept]
    figure = new_figure(title, uirevision)
    figure.add_trace(
        {
            "type": "heatmap",
            "x": steps,
            "y": [exponents[i] - 0.5 for i in kept],
            "z": z,
            "customdata": [[exponents[i]] * len(steps) for i in kept],
            "colorscale": "Blues",
            "colorbar": {
                "title": {"text": "count", "side": "right"},
                "thickness": 12,
                **_count_ticks([counts[i] for _, counts, _, _ in rows for i in kept if counts[i] > 0]),
            },
            "text": text,
            "hoverongaps": False,
            "name": "count",
            "hovertemplate": "step %{x}<br>|g| in [2^(%{customdata}-1), 2^%{customdata})"
            "<br>count %{text}<extra></extra>",
        }
    )
    scale_steps, scale_values = positive_points(scale_series)
    if scale_steps:
        for index, name in ((0, "fp16 underflow"), (1, "fp16 overflow")):
            limits = [fp16_thresholds(value) for value in scale_values]
            figure.add_trace(
                {
                    "type": "scatter",
                    "x": scale_steps,
                    "y": [limit[index] if limit else None for limit in limits],
                    "mode": "lines",
                    "line": {"color": ALERT_COLOR, "width": 1.5, "dash": "dot", "shape": "hv"},
                    "name": name,
                    "hovertemplate": name + " at step %{x}: 2^%{y:.0f}<extra></extra>",
                }
            )
        figure.update_layout(showlegend=True)
    figure.layout.yaxis.update(title={"text": "log2 |g|"}, range=[low - 1, high])
    figure.layout.xaxis.update(showgrid=False)
    return figure


def _count_ticks(counts: list[int]) -> dict[str, Any]:
    """The ticks of a colour bar of log10(count) (the heatmap's z, to 3 decimals) for these counts
    (> 0): at the powers of ten among them, labelled as counts (1, 10, 100, 1k…), at most 8; with
    fewer than two powers of ten, also at the smallest and largest count."""
    if not counts:
        return {}
    low, high = min(counts), max(counts)
    first, last = math.ceil(round(math.log10(low), 3)), math.floor(round(math.log10(high), 3))
    stride = max(1, math.ceil((last - first + 1) / 8))
    exponents = range(first, last + 1, stride)
    ticks = {float(e): format_count(10**e) for e in exponents}
    if len(ticks) < 2:  # under about a decade: the ends too, as the counts they are
        ticks |= {round(math.log10(count), 3): f"{count:,}" for count in (low, high)}
    tickvals = sorted(ticks)
    return {"tickvals": tickvals, "ticktext": [ticks[value] for value in tickvals]}


def _exponents(histograms: Mapping[str, Any] | None) -> list[int]:
    exponents = histograms.get("exponents") if isinstance(histograms, Mapping) else None
    if not isinstance(exponents, list) or not all(is_int(e) for e in exponents):
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
    for index, (step, row) in enumerate(zip(steps, counts, strict=False)):
        if not is_step(step) or not isinstance(row, list) or len(row) != len(exponents):
            continue
        clean = [count if is_int(count) else 0 for count in row]
        zero = zeros[index] if index < len(zeros) and is_int(zeros[index]) else 0
        bad = non_finite[index] if index < len(non_finite) and is_int(non_finite[index]) else 0
        rows.append((step, clean, zero, bad))
    return rows
