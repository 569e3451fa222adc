"""Per-layer heatmaps: a quantity by layer (y, in model order, the first at the top) and step (x).

A heatmap is ONE image: the layer × step matrix colour-mapped here with numpy into a PNG (one pixel
per cell), which the browser draws natively, where plotly's heatmap trace would colour 100k cells
one by one in JavaScript (~0.3-0.6 s each on the development VM against ~0.05 s for the image).
Hover shows the real value of each cell (`hovertext`, 3 significant digits) and the layer's name;
the y axis is linear (plotly draws images only on linear axes), layer i at y = i, reversed (the
default with an image: first layer at the top), its numbers named by `labelalias`.

Figures are plain dicts, as plotly.js reads them: building them through plotly.py's objects would
validate and deep-copy every cell (~0.6 s per heatmap on every refresh).

Traces, by uid: "cells" (the image), "live-cells" (a heatmap trace, empty until a live run's new
steps are appended to it as columns: `layer_heatmap_columns`, `live.append_columns_patch`),
"colour-scale" (an invisible point that carries the colour bar: an image has none),
"non-finite-NaN" / "-Infinity" / "--Infinity" (red markers over such cells, at their own steps) and
"non-finite-steps" (a red column over a step where every layer is non-finite). The image is red at a
non-finite cell only where its columns are one step wide; it never holds one over the steps after
it (a skipped step is one step: `_image_grid`).

Non-finite values are alarms, except +inf where the quantity gives it a meaning of its own
(`infinity_means`): update/ratio is +inf where the weights were zero before the step (the ratio is
undefined there; see the agent's update_ratios). Such cells are blank, like missing ones, and hover
says what they mean.
"""

from __future__ import annotations

import base64
import html
import math
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._common import base_layout_dict, empty_figure_dict, is_step
from ._image_grid import cell_rows, grid, take_cells

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
HEATMAP_RIGHT_PX = 90  # room for the colour bar, so plotly need not redraw to make it
# plotly's Viridis; the image's palette and the colour bar's scale are made from the same stops.
VIRIDIS = (
    "#440154",
    "#482878",
    "#3e4989",
    "#31688e",
    "#26828e",
    "#1f9e89",
    "#35b779",
    "#6ece58",
    "#b5de2b",
    "#fde725",
)
COLOUR_SCALE = [[index / (len(VIRIDIS) - 1), colour] for index, colour in enumerate(VIRIDIS)]
_LEVELS = 254  # palette entries 0..253: the colour scale; 254: non-finite (red); 255: no value
_RED, _BLANK = _LEVELS, _LEVELS + 1
# Hover words for non-finite cells. Written with a character reference, which plotly shows as the
# letter: an answer with "NaN" or "Infinity" anywhere in it is decoded and encoded again by the
# JSON encoder Dash uses (it looks for non-standard JSON), ~40 ms per heatmap.
_NON_FINITE_HOVER = {"NaN": "Na&#78;", "Infinity": "+Infinit&#121;", "-Infinity": "-Infinit&#121;"}


@dataclass(frozen=True)
class LayerMatrix:
    """A /vectors answer read into numpy: `values[step index, layer index]` (float64, with NaN/±inf
    for non-finite values) and `missing` (True where the API had no value: null, junk, a short row)."""

    layers: list[str]
    steps: list[int]
    values: np.ndarray
    missing: np.ndarray


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
    infinity_means: str | None = None,
    uirevision: str = "gradwatch",
) -> dict[str, Any]:
    """A per-layer quantity as a heatmap figure (a plain dict): layers on y (model order, first at
    the top), steps on x.

    vectors: the API's /vectors object {"layers": [...], "steps": [...], "values": [[per layer]...]}
        (or "values_f64": the matrix as little-endian float64, step-major).
    log_scale: colour by log10 of the value (norms and update ratios span decades); the colour bar
        is labelled in powers of ten. Zeros and negatives are then blank cells.
    value_range: fixed colour range (in value units), e.g. (0, 1) for fractions; None: from the data.
    infinity_means: what +inf stands for in this quantity when it is not an alarm (hover text, e.g.
        "undefined: the weight was zero"): such cells are blank; None: +inf is an alarm like NaN.
    Hover: the layer's name, the step and the value. NaN/±Inf cells get red square markers at their
    own steps (hover "<layer> NaN at step N"); a step where every layer is non-finite, one red
    column. In the image, such a cell holds the layer's value before it (`_image_grid`).
    Layer names are escaped; more layers than fit get thinned tick labels (every name stays in hover).
    The figure's "meta" holds what live appends need: {"colour_range": [low, high]}.
    """
    matrix = layer_matrix(vectors)
    if matrix is None:
        return empty_figure_dict(title, uirevision=uirevision)
    layers, steps = matrix.layers, matrix.steps
    labels = [html.escape(name) for name in layers]
    height = heatmap_height(len(layers))
    colour = colour_values(matrix.values, log_scale=log_scale)
    low, high = _colour_range(colour, value_range, log_scale)
    x0, dx, columns, centred = grid(steps)
    # Hover shows a column's centre as its step: when that is not the step drawn there, the text
    # says which it is (not for downsampled answers, whose steps stand for buckets anyway).
    exact = centred or bool(vectors and vectors.get("downsampled"))
    alarms = alarm_cells(matrix, infinity_means)
    bad_cells, bad_steps = non_finite_cells(matrix, alarms)
    # One column per grid step; image rows are layers (first at the top, y = 0). A non-finite
    # value is red in its own step's cell alone (`cell_rows`), and marked by non_finite_traces.
    rows, red = cell_rows(steps, columns, x0, dx, alarms)
    palette_index = _palette_indices(take_cells(colour, rows, math.nan), red, low, high).T
    texts = _cell_texts(matrix, rows, columns, exact, infinity_means)
    traces: list[dict[str, Any]] = [
        {
            "type": "image",
            "uid": "cells",
            "source": png_data_uri(palette_index, _palette()),
            "x0": x0,
            "dx": dx,
            "y0": 0,
            "dy": 1,
            "zsmooth": False,  # drawn as it is (crisp cells), by the browser
            "hovertext": texts,
            # Not a hovertemplate: plotly's image hover gives one neither the axis' names for y
            # (labelalias) nor the text.
            "hoverinfo": "x+y+text+name",
            "name": value_label,
        },
        *layer_heatmap_columns(
            None,
            value_label,
            log_scale=log_scale,
            colour_range=(low, high),
            layers=layers,
            infinity_means=infinity_means,
        ),
        _colour_bar(value_label, low, high, log_scale),
    ]
    traces += non_finite_traces(bad_cells, bad_steps, len(layers), (height - HEATMAP_MARGIN_PX) / len(layers))
    layout = base_layout_dict(title, uirevision)
    tick_stride = max(1, math.ceil(len(labels) / max(1, (height - HEATMAP_MARGIN_PX) // HEATMAP_TICK_PX)))
    shown = list(range(0, len(labels), tick_stride))
    ticktext = [_shorten(labels[index]) for index in shown]
    # Margins fixed from the labels rather than by plotly's automargin, which draws the plot again
    # once it has measured them.
    left = min(HEATMAP_MAX_LABEL_PX, 16 + HEATMAP_LABEL_CHAR_PX * max(len(text) for text in ticktext))
    layout["xaxis"].update(showgrid=False, automargin=False, hoverformat="d")
    layout["yaxis"].update(
        # Layer i at y = i, on a reversed axis (first layer at the top). Not sent here: refreshes keep
        # the user's zoom by not sending ranges (views.keep_view), so the placeholder figure the
        # page starts with has it (`heatmap_placeholder`). Clipped to the rows: the markers' padding
        # would add blank bands.
        type="linear",
        autorangeoptions={"clipmin": -0.5, "clipmax": len(layers) - 0.5},
        scaleanchor=False,  # an image's default would make every cell square
        tickmode="array",
        tickvals=shown,
        # The layers' names for their numbers: in hover whole, in tick labels shortened. plotly
        # applies the aliases to tick text too, so names that are numbers ("3", an nn.Sequential's
        # modules) keep the whole names as tick labels.
        labelalias={str(index): label for index, label in enumerate(labels)},
        **({} if any(text.isdigit() for text in ticktext) else {"ticktext": ticktext}),
        tickformat="d",
        hoverformat="d",
        title=None,
        showgrid=False,
        zeroline=False,
        tickfont={"size": 10},
        automargin=False,
    )
    layout.update(
        height=height,
        # Fixed: no second drawing to make room for the colour bar (it has it).
        margin={"l": left, "r": HEATMAP_RIGHT_PX, "t": 48, "b": 40, "autoexpand": False},
        meta={"colour_range": [low, high]},
    )
    if len(layers) > len(shown):
        layout["annotations"] = [
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
    return {"data": traces, "layout": layout}


def heatmap_placeholder(
    title: str, message: str, *, uirevision: str = "gradwatch", layer_count: int = 0
) -> dict[str, Any]:
    """The "loading…" figure (a dict) a heatmap's graph starts with: empty_figure with the y axis
    reversed, which the heatmap keeps (layer 0, the first, at the top). With `layer_count` (the
    page knows its layers) as tall as the heatmap of that many layers will be: a graph that changes
    height when its data arrives is drawn twice (plotly.js answers the resize with a relayout)."""
    figure = empty_figure_dict(title, message, uirevision=uirevision)
    figure["layout"]["yaxis"]["autorange"] = "reversed"
    if layer_count > 0:
        figure["layout"]["height"] = heatmap_height(layer_count)
    return figure


def layer_heatmap_columns(
    vectors: Mapping[str, Any] | None,
    value_label: str,
    *,
    log_scale: bool,
    colour_range: tuple[float, float],
    layers: list[str] | None = None,
    infinity_means: str | None = None,
) -> list[dict[str, Any]]:
    """The traces that new steps add to a heatmap drawn by layer_heatmap_figure: its "live-cells"
    trace holding them (x: the steps, z and hovertext: one row per layer), then the non-finite
    markers among them. `colour_range`: the drawn heatmap's (its meta), so the colours match;
    `infinity_means`: as the heatmap's. vectors None: the empty "live-cells" trace of `layers` that
    a new heatmap starts with."""
    matrix = layer_matrix(vectors)
    names = matrix.layers if matrix is not None else list(layers or [])
    low, high = colour_range
    live: dict[str, Any] = {
        "type": "heatmap",
        "uid": "live-cells",
        "x": [],
        "y": list(range(len(names))),
        "z": [[] for _ in names],
        "hovertext": [[] for _ in names],
        "zmin": low,
        "zmax": high,
        "zsmooth": False,
        "colorscale": COLOUR_SCALE,
        "showscale": False,
        # Blank cells hover too, as the image's do: a blank +inf cell says what it means there.
        "hoverongaps": True,
        "name": value_label,
        "hoverinfo": "x+y+text+name",  # as the image's
    }
    if matrix is None:
        return [live]
    colour = colour_values(matrix.values, log_scale=log_scale)
    everything = list(range(len(matrix.steps)))
    live["x"] = matrix.steps
    live["z"] = [
        [None if math.isnan(value) else round(value, 4) for value in row] for row in colour.T.tolist()
    ]
    own_rows = np.broadcast_to(np.arange(len(everything))[:, None], matrix.values.shape)
    live["hovertext"] = _cell_texts(matrix, own_rows, everything, True, infinity_means)
    bad_cells, bad_steps = non_finite_cells(matrix, alarm_cells(matrix, infinity_means))
    return [live, *non_finite_traces(bad_cells, bad_steps, len(names), 8)]


def layer_matrix(vectors: Mapping[str, Any] | None) -> LayerMatrix | None:
    """The layer × step matrix of a /vectors object; None when it has no layers or no steps (or
    is malformed). Reads "values_f64" (float64, step-major) when the server sent it."""
    if not isinstance(vectors, Mapping):
        return None
    layers, steps = vectors.get("layers"), vectors.get("steps")
    if not isinstance(layers, list) or not isinstance(steps, list) or not layers or not steps:
        return None
    width = len(layers)
    packed = vectors.get("values_f64")
    if isinstance(packed, str):
        try:
            raw = base64.b64decode(packed, validate=True)
        except ValueError:  # binascii.Error included
            return None
        if not all(is_step(step) for step in steps) or len(raw) != 8 * len(steps) * width:
            return None
        values = np.frombuffer(raw, dtype="<f8")
        values = values.reshape(len(steps), width).astype(np.float64)
        return _sorted(LayerMatrix([str(n) for n in layers], steps, values, np.zeros(values.shape, bool)))
    rows = vectors.get("values")
    if not isinstance(rows, list):
        return None
    pairs = [
        (step, row) for step, row in zip(steps, rows, strict=False) if is_step(step) and isinstance(row, list)
    ]
    if not pairs:
        return None
    kept_steps, kept_rows = [step for step, _ in pairs], [row for _, row in pairs]
    try:
        # Fast path: full rows of numbers (and the API's "NaN"/"Infinity" strings, which numpy reads).
        if any(len(row) != width or None in row for row in kept_rows):
            raise ValueError("short rows or nulls")
        values = np.array(kept_rows, dtype=np.float64)
        missing = np.zeros(values.shape, bool)
    except (TypeError, ValueError):
        values, missing = _read_cells(kept_rows, width)
    return _sorted(LayerMatrix([str(n) for n in layers], kept_steps, values, missing))


def colour_values(values: np.ndarray, *, log_scale: bool) -> np.ndarray:
    """What each cell's colour stands for: log10 of the value with `log_scale` (NaN where the value
    is not > 0 and finite), else the value (NaN where not finite)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        if log_scale:
            positive = np.isfinite(values) & (values > 0)
            return np.where(positive, np.log10(np.where(positive, values, 1.0)), np.nan)
        return np.where(np.isfinite(values), values, np.nan)


def alarm_cells(matrix: LayerMatrix, infinity_means: str | None = None) -> np.ndarray:
    """True where a cell (step × layer, as `matrix.values`) is an alarm: a value that is not finite,
    but for +inf when the quantity says what +inf means (`infinity_means`, layer_heatmap_figure)."""
    alarms: np.ndarray = ~np.isfinite(matrix.values) & ~matrix.missing
    if infinity_means is not None:
        alarms &= matrix.values != math.inf
    return alarms


def non_finite_cells(matrix: LayerMatrix, bad: np.ndarray) -> tuple[list[tuple[int, int, str]], list[int]]:
    """(the cells of `matrix` that are True in `bad` (its alarm_cells) as (step, layer index,
    "NaN"/"Infinity"/"-Infinity"); the steps where every layer is one, which are drawn as one red
    column each rather than cell by cell)."""
    if not bad.any():
        return [], []
    width = len(matrix.layers)
    whole_steps = np.all(bad, axis=1) if width > 1 else np.zeros(len(matrix.steps), bool)
    cells = []
    for row, column in zip(*np.nonzero(bad & ~whole_steps[:, None]), strict=True):
        value = matrix.values[row, column]
        kind = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        cells.append((matrix.steps[row], int(column), kind))
    return cells, [matrix.steps[row] for row in np.nonzero(whole_steps)[0]]


def non_finite_traces(
    bad_cells: list[tuple[int, int, str]], bad_steps: list[int], layer_count: int, row_px: float
) -> list[dict[str, Any]]:
    """Red square markers over NaN/Inf cells, one trace per kind (uid "non-finite-NaN"…), hover
    "<layer><br>NaN at step N"; a red column over each step where every layer is non-finite (uid
    "non-finite-steps"). y is the layer's index (named by the axis). Hover comes from templates: no
    per-point text to send."""
    traces = []
    for kind in NON_FINITE_KINDS:
        cells = [(step, layer) for step, layer, found in bad_cells if found == kind]
        if not cells:
            continue
        traces.append(
            {
                "type": "scatter",
                "uid": f"non-finite-{kind}",
                "x": [step for step, _ in cells],
                "y": [layer for _, layer in cells],
                "hovertemplate": "%{y}<br>" + _NON_FINITE_HOVER[kind] + " at step %{x}<extra></extra>",
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
                "y": [value for _ in bad_steps for value in (0, layer_count - 1, None)],
                "hovertemplate": f"all {layer_count} layers non-finite at step %{{x}}<extra></extra>",
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


def png_data_uri(pixels: np.ndarray, palette: np.ndarray) -> str:
    """An 8-bit palette PNG as a data: URI. pixels: rows × columns of palette indices (uint8);
    palette: 256 × 4 RGBA (uint8)."""
    height, width = pixels.shape
    rows = np.zeros((height, width + 1), np.uint8)  # each row starts with filter type 0 (none)
    rows[:, 1:] = pixels

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"".join(
        (
            b"\x89PNG\r\n\x1a\n",
            chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)),
            chunk(b"PLTE", palette[:, :3].tobytes()),
            chunk(b"tRNS", palette[:, 3].tobytes()),
            chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)),
            chunk(b"IEND", b""),
        )
    )
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# -- the parts -------------------------------------------------------------------------------------


def _sorted(matrix: LayerMatrix) -> LayerMatrix:
    if all(a < b for a, b in zip(matrix.steps, matrix.steps[1:], strict=False)):
        return matrix
    order = sorted(range(len(matrix.steps)), key=matrix.steps.__getitem__)
    return LayerMatrix(
        matrix.layers, [matrix.steps[i] for i in order], matrix.values[order], matrix.missing[order]
    )


def _read_cells(rows: list[list[Any]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Cell by cell (the slow path: nulls, junk, rows of another length), padded or cut to `width`."""
    values = np.full((len(rows), width), np.nan)
    missing = np.ones((len(rows), width), bool)
    non_finite = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    for row_index, row in enumerate(rows):
        for column, value in enumerate(row[:width]):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[row_index, column], missing[row_index, column] = value, False
            elif isinstance(value, str) and value in non_finite:
                values[row_index, column], missing[row_index, column] = non_finite[value], False
    return values, missing


def _colour_range(
    colour: np.ndarray, value_range: tuple[float, float] | None, log_scale: bool
) -> tuple[float, float]:
    if value_range is not None:
        low, high = value_range
        return (math.log10(low), math.log10(high)) if log_scale else (float(low), float(high))
    finite = colour[~np.isnan(colour)]
    if not finite.size:
        return (0.0, 1.0)
    low, high = float(finite.min()), float(finite.max())
    return (low, high) if high > low else (low - 0.5, high + 0.5)


def _palette() -> np.ndarray:
    stops = np.array([[int(colour[i : i + 2], 16) for i in (1, 3, 5)] for colour in VIRIDIS], np.float64)
    positions = np.linspace(0, 1, len(VIRIDIS))
    levels = np.linspace(0, 1, _LEVELS)
    palette = np.zeros((256, 4), np.uint8)
    for channel in range(3):
        palette[:_LEVELS, channel] = np.round(np.interp(levels, positions, stops[:, channel]))
    palette[:_LEVELS, 3] = 255
    palette[_RED] = [0xEF, 0x44, 0x44, 255]  # NON_FINITE_CELL_COLOR
    palette[_BLANK] = [0, 0, 0, 0]
    return palette


def _palette_indices(colour: np.ndarray, red: np.ndarray, low: float, high: float) -> np.ndarray:
    """Columns × layers of palette indices: the colour scale, red where `red` (cell_rows': alarms in
    their own step's cell), blank for no colour (no value, no log, a +inf that is not an alarm)."""
    with np.errstate(invalid="ignore"):
        scaled = np.clip(np.round((colour - low) / (high - low) * (_LEVELS - 1)), 0, _LEVELS - 1)
    indices = np.where(np.isnan(colour), _BLANK, scaled).astype(np.uint8)
    indices[red] = _RED
    return indices


def _cell_texts(
    matrix: LayerMatrix,
    rows: np.ndarray,
    columns: list[int],
    exact: bool,
    infinity_means: str | None = None,
) -> list[list[str]]:
    """Hover text per cell, one row per layer, one entry per column: the value to 3 significant
    digits of the matrix row the cell shows (`rows`: columns × layers, as cell_rows gives; "" where
    the API had no value or the cell no row, `infinity_means` for +inf when given), and the step it
    was recorded at: in every cell when the grid is not `exact`, else only where a cell shows
    another row than its column's (`columns`: the row each column shows)."""
    values, missing = take_cells(matrix.values, rows, math.nan).T, take_cells(matrix.missing, rows, True).T
    # str.format over whole rows (~0.2 µs a cell); the rare non-finite and missing cells after.
    texts = [list(map("{:.3g}".format, row)) for row in values.tolist()]
    infinity_text = None if infinity_means is None else html.escape(infinity_means)
    for row, column in zip(*np.nonzero(~np.isfinite(values) | missing), strict=True):
        texts[row][column] = _value_text(
            float(values[row, column]), bool(missing[row, column]), infinity_text
        )
    if not exact:
        at = [f" (step {matrix.steps[row]})" for row in columns]
        texts = [[text + suffix for text, suffix in zip(row, at, strict=True)] for row in texts]
    # Cells that show an earlier row than their column's (in place of a non-finite value) say which.
    for layer, column in zip(*np.nonzero(rows.T != np.asarray(columns)[None, :]), strict=True):
        shown, text = rows[column, layer], ""
        if shown >= 0:
            text = _value_text(float(values[layer, column]), bool(missing[layer, column]), infinity_text)
            text += f" (step {matrix.steps[shown]})"
        texts[layer][column] = text
    return texts


def _value_text(value: float, missing: bool, infinity_text: str | None = None) -> str:
    if missing:
        return ""
    if math.isfinite(value):
        return f"{value:.3g}"
    if value == math.inf and infinity_text is not None:
        return infinity_text
    return _NON_FINITE_HOVER["NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")]


def _colour_bar(value_label: str, low: float, high: float, log_scale: bool) -> dict[str, Any]:
    """An invisible point whose marker carries the colour bar (an image trace has none)."""
    colorbar: dict[str, Any] = {"title": {"text": value_label, "side": "right"}, "thickness": 12, "len": 0.9}
    if log_scale:
        first, last = math.floor(low), math.ceil(high)
        stride = max(1, math.ceil((last - first + 1) / 8))
        exponents = [e for e in range(first, last + 1, stride) if low <= e <= high]
        if exponents:
            colorbar.update(tickvals=exponents, ticktext=[f"1e{exponent}" for exponent in exponents])
        else:  # less than a decade: its ends
            colorbar.update(tickvals=[low, high], ticktext=[f"{10**low:.2g}", f"{10**high:.2g}"])
    return {
        "type": "scatter",
        "uid": "colour-scale",
        "x": [None],
        "y": [None],
        "mode": "markers",
        "hoverinfo": "skip",
        "showlegend": False,
        "marker": {
            "color": [low],
            "cmin": low,
            "cmax": high,
            "colorscale": COLOUR_SCALE,
            "showscale": True,
            "colorbar": colorbar,
        },
    }


def _shorten(label: str, limit: int = MAX_TICK_LABEL_CHARS) -> str:
    # Keep the end: "…layers.31.mlp.down_proj.weight" says more than "model.layers.31.mlp…".
    return label if len(label) <= limit else "…" + label[-(limit - 1) :]
