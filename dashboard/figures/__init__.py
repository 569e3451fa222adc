"""Figure builders: API data in, plotly Figure out. Pure functions — no HTTP, no Dash.

    lines        loss, loss scale (skipped steps, fp16 safe band), gradient norm, learning rate; compare;
                 resume markers (add_resume_markers)
    layers       per-layer heatmaps (layer × step), as plain dicts: one image each
    histograms   a layer's |g| histogram at a step and over steps, with fp16's limits at the scale
    _common      what they share: reading API values, the house layout, the empty figure, step marker,
                 log axes labelled with their numbers
    _image_grid  where a heatmap's cells go in its image: columns of steps, the row each cell shows

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

from ._common import (
    COMPARE_COLORS,
    NO_DATA_TEXT,
    empty_figure,
    empty_figure_dict,
    finite_or_none,
    format_scale,
    layer_names,
    step_marker_shapes,
    summarize_layers,
)
from .histograms import fp16_thresholds, histogram_figure, histogram_steps, histogram_time_figure
from .layers import (
    heatmap_height,
    heatmap_placeholder,
    layer_heatmap_columns,
    layer_heatmap_figure,
    layer_names_of,
)
from .lines import (
    add_resume_markers,
    compare_figure,
    grad_norm_figure,
    loss_figure,
    lr_figure,
    scale_figure,
)

__all__ = [
    "COMPARE_COLORS",
    "NO_DATA_TEXT",
    "add_resume_markers",
    "compare_figure",
    "empty_figure",
    "empty_figure_dict",
    "finite_or_none",
    "format_scale",
    "fp16_thresholds",
    "grad_norm_figure",
    "heatmap_height",
    "heatmap_placeholder",
    "histogram_figure",
    "histogram_steps",
    "histogram_time_figure",
    "layer_heatmap_columns",
    "layer_heatmap_figure",
    "layer_names",
    "layer_names_of",
    "loss_figure",
    "lr_figure",
    "scale_figure",
    "step_marker_shapes",
    "summarize_layers",
]
