"""What the figure builders share: the API's values read safely, the house style, the empty figure,
the step marker. Private to the figures package (its names are public within the package).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from ..._text import power_of_two

NO_DATA_TEXT = "no data yet"
NON_FINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

LINE_COLOR = "#2563eb"
ALERT_COLOR = "#dc2626"
POST_CLIP_COLOR = "#f59e0b"
BAND_COLOR = "rgba(34, 197, 94, 0.16)"
BAND_EDGE_COLOR = "rgba(21, 128, 61, 0.45)"
STEP_MARKER_COLOR = "#7c3aed"
COMPARE_COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777")
FIGURE_HEIGHT_PX = 320
MAX_LAYERS_IN_HOVER = 5
NO_TEMPLATE = {"data": {"scatter": [{"type": "scatter"}]}}


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
        return non_finite_label(number)
    power = power_of_two(number)
    if power is not None:
        return power
    return f"{number:.4g}"


def log_axis(exponentformat: str = "e") -> dict[str, Any]:
    """A log axis (layout settings) whose every tick label is the number it stands at.

    plotly.js labels the ticks between powers of ten ("D1"/"D2" ticks, e.g. 0.2 and 0.5) with their
    leading digit alone by default, so 0.5 reads "5" beside a line at 0.5; "complete" labels write
    them out like the powers of ten. exponentformat "e": 0.5, 20, 0.01, 5e-3, 2e+3 (|exponent| > 2);
    "B" for counts: 500, 2k, 1M."""
    return {"type": "log", "minorloglabels": "complete", "exponentformat": exponentformat}


def format_count(count: float) -> str:
    """A count for a tick label: 1, 10, 100, 1k, 10k, 2.5M… (3 significant digits)."""
    rounded = float(f"{count:.3g}")  # first, so 999,999 is "1M", not "1e+03k"
    for divisor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(rounded) >= divisor:
            return f"{rounded / divisor:.3g}{suffix}"
    return f"{rounded:.3g}"


def empty_figure(title: str, message: str = NO_DATA_TEXT, *, uirevision: str = "gradwatch") -> go.Figure:
    """A blank figure with `message` in the middle, for series that have no points (yet)."""
    # Unvalidated: its values are fixed here (plotly's checks take ~30 ms a figure).
    return go.Figure(empty_figure_dict(title, message, uirevision=uirevision), _validate=False)


def empty_figure_dict(
    title: str, message: str = NO_DATA_TEXT, *, uirevision: str = "gradwatch"
) -> dict[str, Any]:
    """empty_figure as a plain figure dict (the run page's nine "loading…" graphs: no plotly.py)."""
    layout = base_layout_dict(title, uirevision)
    layout["xaxis"]["visible"] = layout["yaxis"]["visible"] = False
    layout["annotations"] = [
        {
            "text": message,
            "xref": "paper",
            "yref": "paper",
            "x": 0.5,
            "y": 0.5,
            "showarrow": False,
            "font": {"size": 14, "color": "#6b7280"},
        }
    ]
    return {"data": [], "layout": layout}


def step_marker_shapes(step: Any) -> list[dict[str, Any]]:
    """A dashed vertical line at `step` across the plot, as layout shapes; [] when step is not a step.

    For figures whose x axis is the step (every run-page chart but the histogram at one step).
    """
    if not is_step(step):
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


def new_figure(title: str, uirevision: str) -> go.Figure:
    """An empty figure in the house style (`base_layout_dict`), for builders to add to.

    Unchecked (`_validate=False`): builders give traces and layout in plotly.js's own names and
    forms ({"text": ...} titles), from numbers they have checked; plotly.py's checks would walk every
    point of every trace (~30 ms per 2000-point trace, on every refresh)."""
    return go.Figure(layout=base_layout_dict(title, uirevision), _validate=False)


def base_layout_dict(title: str, uirevision: str) -> dict[str, Any]:
    """The house style every figure starts from, as a layout dict: title, fonts, margins, grid,
    `uirevision`."""
    axis_style = {
        "visible": True,
        "gridcolor": "#eef0f3",
        "linecolor": "#d1d5db",
        "zeroline": False,
        "automargin": True,
        # plotly's default for numeric axes ("hide past div") measures every tick label again for
        # each label drawn: ~0.1 s per 50-label axis in the browser.
        "ticklabeloverflow": "allow",
    }
    return {
        # Title in the top strip (shared with the mode bar on hover), legend on its own row below it.
        "title": {
            "text": title,
            "x": 0.02,
            "xanchor": "left",
            "y": 0.97,
            "yanchor": "top",
            "font": {"size": 15},
        },
        # plotly.py's "none" template (as it sends it) plus a few settings: a named template like
        # "plotly_white" would be embedded in every figure, ~7 kB per graph on every refresh.
        "template": NO_TEMPLATE,
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "font": {
            "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
            "size": 12,
            "color": "#1f2933",
        },
        "height": FIGURE_HEIGHT_PX,
        # As wide as its card from the first drawing: without it plotly.js draws a graph 700 px wide,
        # and dcc.Graph's resize right after draws it all again at the card's width.
        "autosize": True,
        "margin": {"l": 60, "r": 20, "t": 64, "b": 40},
        "hovermode": "closest",
        "showlegend": False,
        "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
        # Kept constant across refreshes, so new data does not reset the user's zoom and pan.
        "uirevision": uirevision,
        "xaxis": {"title": {"text": "step"}, **axis_style},
        "yaxis": dict(axis_style),
    }


def series_points(series: Mapping[str, Any] | None) -> tuple[list[Any], list[Any]]:
    """Paired steps and raw values of an API series; anything malformed reads as no points."""
    if not isinstance(series, Mapping):
        return [], []
    steps, values = series.get("steps"), series.get("values")
    if not isinstance(steps, list) or not isinstance(values, list):
        return [], []
    pairs = [(step, value) for step, value in zip(steps, values, strict=False) if is_step(step)]
    return [step for step, _ in pairs], [value for _, value in pairs]


def positive_points(series: Mapping[str, Any] | None) -> tuple[list[Any], list[float | None]]:
    """Steps and values usable on a log axis (finite and > 0), the rest None."""
    steps, raw_values = series_points(series)
    values = [finite_or_none(value) for value in raw_values]
    return steps, [value if value is not None and value > 0 else None for value in values]


def layer_names(value: Any) -> list[str]:
    """The layer names of a skip event's "non_finite_layers", as strings; junk gives []."""
    if not isinstance(value, list):
        return []
    return [str(name) for name in value]


def summarize_layers(names: Sequence[str], limit: int = MAX_LAYERS_IN_HOVER) -> str:
    """The first `limit` names joined by commas, then "(+N more)" for the rest."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit} more)"


def non_finite_of(value: Any) -> str | None:
    """ "NaN", "Infinity" or "-Infinity" when value is one (as the API's string or a float), else None."""
    if isinstance(value, str):
        return value if value in NON_FINITE_STRINGS else None
    if isinstance(value, float) and not math.isfinite(value):
        return non_finite_label(value)
    return None


def non_finite_label(number: float) -> str:
    """The API's name for a non-finite float: "NaN", "Infinity" or "-Infinity"."""
    if math.isnan(number):
        return "NaN"
    return "Infinity" if number > 0 else "-Infinity"


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_step(value: Any) -> bool:
    """A usable step number (an int, not a bool)."""
    return is_int(value)
