"""The run page's per-layer part: the layer × step heatmaps (grad norm, update ratio, underflow
fraction), the layer picker, and the chosen layer's histogram at a step and over steps.

Each heatmap is a callback of its own, so the three are fetched, built and drawn side by side, and the
histogram does not wait for them (the picker is filled when the page is built). A heatmap is drawn as
one image (figures.layers); a live run's heatmaps refresh every LAYERS_REFRESH_MS, and only when the
run has news (its signature in the page's live cursor moved): they fetch the steps after the last one
drawn and append them as columns of the heatmap's "live-cells" trace, in the image's colours (see
`live.append_columns_patch`), redrawing in full after MAX_APPENDED_COLUMNS of them, after a resume
(it rewrote steps already drawn), or when the layers change. The histogram is read again on such a
tick too, or when another layer or step is picked; it reads the loss scale itself, for fp16's limits,
instead of waiting for the line charts' copy. The layer picker lists MAX_PICKED_OPTIONS layers at a
time and searches the others by what is typed (`picker_options`), the step picker likewise
MAX_STEP_OPTIONS steps (`step_picker_options`).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import dash
from dash import Input, Output, State, ctx

from .. import figures, live
from ..api_client import ApiError
from ..callbacks import PageCallbacks, services
from ..views import keep_view
from .run_views import scaler_empty_text

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "HEATMAP_CURSOR_SUFFIX",
    "LAYER_HEATMAPS",
    "callbacks",
    "heatmap_cursor_id",
    "picker_options",
    "step_picker_options",
]

# Per-layer heatmaps: graph id → (vector key, title, colour-bar label, log colour scale, fixed range,
# what +inf means when it is not an alarm: figures.layer_heatmap_figure's infinity_means).
LAYER_HEATMAPS = {
    "grad-norm-heatmap": ("grad/norm", "Gradient norm per layer", "‖g‖", True, None, None),
    "update-ratio-heatmap": (
        "update/ratio",
        "Update ratio per layer (‖Δw‖/‖w‖)",
        "ratio",
        True,
        None,
        # The agent records +inf where the weights were zero before the step (a LoRA B matrix, a
        # zero-initialised head or bias), NaN where the weights or the update were not finite.
        "undefined: the weight was zero",
    ),
    "underflow-heatmap": (
        "grad/underflow_frac",
        "fp16 underflow fraction per layer",
        "fraction",
        False,
        (0, 1),
        None,
    ),
}
# The heatmaps of what only a run with a GradScaler records (fp16 fractions need a loss scale).
SCALER_HEATMAPS = frozenset({"underflow-heatmap"})
HEATMAP_CURSOR_SUFFIX = "-cursor"
SCALE_KEY = "amp/scale"
MAX_PICKED_OPTIONS = 40  # the layer picker's options at a time (see picker_options)
MAX_STEP_OPTIONS = 20  # the step picker's (see step_picker_options)

callbacks = PageCallbacks()


def heatmap_cursor_id(graph_id: str) -> str:
    """The dcc.Store that records what heatmap `graph_id` shows (the run page's layout has one each)."""
    return graph_id + HEATMAP_CURSOR_SUFFIX


# -- callbacks -------------------------------------------------------------------------------------


def refresh_heatmap(
    graph_id: str, _n_intervals: int | None, run_id: str, selected_step: Any, run_cursor: Any, cursor: Any
) -> tuple[Any, Any]:
    """Heatmap `graph_id` of LAYER_HEATMAPS (a callback each, below) and what it shows: drawn in full,
    or, on a live tick with news, the steps after the last one drawn appended as columns."""
    key, title, label, log_scale, value_range, infinity_means = LAYER_HEATMAPS[graph_id]
    run_cursor = run_cursor if isinstance(run_cursor, dict) else {}
    signature, resumes = run_cursor.get("run"), run_cursor.get("resumes", 0)
    appendable = (
        isinstance(cursor, dict)
        and cursor.get("run_id") == run_id
        and cursor.get("resumes") == resumes
        and cursor.get("appended", 0) < live.MAX_APPENDED_COLUMNS
        and isinstance(cursor.get("last"), int)
        and isinstance(cursor.get("colour_range"), list)
    )
    if appendable and cursor.get("signature") == signature:
        return dash.no_update, dash.no_update  # nothing new since it was drawn: nothing asked
    api = services().api
    try:
        if appendable:
            new = api.vectors(run_id, key, start=cursor["last"] + 1)
            patch = None if new.get("downsampled") else _append(cursor, new, label, log_scale, infinity_means)
            if patch is not None:
                return patch, _advanced(cursor, new, signature)
        vectors = api.vectors(run_id, key)
    except ApiError as exc:
        message = figures.empty_figure(title, str(exc), uirevision=run_id)
        return keep_view(message), None
    figure = figures.layer_heatmap_figure(
        vectors,
        title,
        label,
        log_scale=log_scale,
        value_range=value_range,
        infinity_means=infinity_means,
        uirevision=run_id,
    )
    if not figure["data"] and graph_id in SCALER_HEATMAPS:
        figure = _without_scaler(figure, run_id, title)
    marker = figures.step_marker_shapes(selected_step)
    if marker and figure["data"]:
        figure["layout"]["shapes"] = marker
    drawn = {
        "run_id": run_id,
        "signature": signature,
        "resumes": resumes,
        "last": live.last_step(vectors),
        "layers": figures.layer_names_of(vectors),
        "uids": [trace.get("uid") for trace in figure["data"]],
        "colour_range": figure["layout"].get("meta", {}).get("colour_range"),
        "appended": 0,
    }
    return keep_view(figure), drawn


for _graph_id in LAYER_HEATMAPS:
    callbacks.callback(
        Output(_graph_id, "figure"),
        Output(heatmap_cursor_id(_graph_id), "data"),
        Input("layers-refresh", "n_intervals"),
        State("run-id", "data"),
        State("selected-step", "data"),
        State("live-cursor", "data"),
        State(heatmap_cursor_id(_graph_id), "data"),
    )(partial(refresh_heatmap, _graph_id))


@callbacks.callback(
    Output("hist-layer", "options"),
    Output("hist-layer", "value"),
    Output("layer-names", "data"),
    Input("layers-refresh", "n_intervals"),
    State("run-id", "data"),
    State("hist-layer", "options"),
    prevent_initial_call=True,
)
def fill_layer_picker(_n_intervals: int | None, run_id: str, shown: Any) -> tuple[Any, Any, Any]:
    # The layout fills the picker; a live run that had no layers then gets them here, once.
    if shown:
        raise dash.exceptions.PreventUpdate
    try:
        vectors = services().api.vectors(run_id, LAYER_HEATMAPS["grad-norm-heatmap"][0], max_steps=1, end=0)
    except ApiError:
        raise dash.exceptions.PreventUpdate from None
    layers = figures.layer_names_of(vectors)
    if not layers:
        raise dash.exceptions.PreventUpdate
    return picker_options(layers, None, layers[0]), layers[0], layers


@callbacks.callback(
    Output("hist-layer", "options", allow_duplicate=True),
    Input("hist-layer", "search_value"),
    Input("hist-layer", "value"),
    State("layer-names", "data"),
    prevent_initial_call=True,
)
def search_layers(search: str | None, chosen: Any, layers: Any) -> Any:
    if not isinstance(layers, list):
        raise dash.exceptions.PreventUpdate
    return picker_options(layers, search, chosen)


@callbacks.callback(
    Output("hist-step", "options", allow_duplicate=True),
    Input("hist-step", "search_value"),
    State("hist-step", "value"),
    State("hist-steps", "data"),
    prevent_initial_call=True,
)
def search_steps(search: str | None, chosen: Any, steps: Any) -> Any:
    if not isinstance(steps, list):
        raise dash.exceptions.PreventUpdate
    return step_picker_options(steps, search, chosen)


@callbacks.callback(
    output={
        "step_options": Output("hist-step", "options"),
        "steps": Output("hist-steps", "data"),
        "step": Output("hist-step", "value"),
        "at_step": Output("hist-graph", "figure"),
        "over_steps": Output("hist-time-graph", "figure"),
        "drawn": Output("hist-cursor", "data"),
    },
    inputs=[
        Input("hist-layer", "value"),
        Input("hist-step", "value"),
        Input("selected-step", "data"),
        Input("layers-refresh", "n_intervals"),
    ],
    state=[
        State("run-id", "data"),
        State("live-cursor", "data"),
        State("hist-cursor", "data"),
    ],
)
def show_histogram(
    layer: str | None,
    step: Any,
    selected_step: Any,
    _n_intervals: int | None,
    run_id: str,
    cursor: Any,
    drawn: Any,
) -> dict[str, Any]:
    signature = cursor.get("run") if isinstance(cursor, dict) else None
    if ctx.triggered_id == "layers-refresh" and drawn == [run_id, layer, signature]:
        raise dash.exceptions.PreventUpdate  # a live tick, and the run has no news
    if not layer:
        return _no_histogram("no per-layer histograms recorded (yet)", run_id)
    api = services().api
    try:
        # The loss scale for fp16's limits, read here rather than waiting for the line charts'
        # (so the histogram loads alongside them).
        calls: dict[str, Callable[[], Any]] = {
            "histograms": partial(api.histograms, run_id, layer),
            "scale": partial(api.series, run_id, SCALE_KEY),
        }
        fetched = services().background.fetch_all(calls)
        histograms, scale_series = fetched["histograms"], fetched["scale"]
        steps = figures.histogram_steps(histograms)
        if isinstance(selected_step, int) and (ctx.triggered_id == "selected-step" or step is None):
            step = _nearest_step(steps, selected_step)  # a clicked step, or ?step=N on arrival
        elif step not in steps:
            step = steps[-1] if steps else None
        # The exact scale at that step (the stored series may be downsampled).
        at_step = api.series(run_id, SCALE_KEY, start=step, end=step + 1) if step is not None else None
    except ApiError as exc:
        return _no_histogram(str(exc), run_id)
    scale = latest(at_step) if latest(at_step) is not None else _value_at(scale_series, step)
    bar = figures.histogram_figure(histograms, step, scale, uirevision=f"{run_id}/{layer}")
    over_time = figures.histogram_time_figure(histograms, scale_series, uirevision=f"{run_id}/{layer}")
    over_time.update_layout(shapes=figures.step_marker_shapes(selected_step))
    # Both as updates that keep the user's zoom: a live run redraws them as the scale moves.
    return {
        "step_options": step_picker_options(steps, None, step),
        "steps": steps,
        "step": step,
        "at_step": keep_view(bar),
        "over_steps": keep_view(over_time),
        "drawn": [run_id, layer, signature],
    }


def picker_options(layers: list[str], search: str | None, chosen: Any) -> list[dict[str, str]]:
    """The layer picker's options: the layers whose names contain `search` (any case), or without
    one the first layers, at most MAX_PICKED_OPTIONS in model order, `chosen` always among them.

    Not all of a big model's layers at once: the dropdown indexes every substring of every option's
    name as it renders (~0.3 s of the browser's time for 200 layers on the development VM, while
    the page's graphs wait to be drawn), and the names are searched here instead."""
    needle = (search or "").strip().lower()
    found = [name for name in layers if needle in name.lower()][:MAX_PICKED_OPTIONS]
    if isinstance(chosen, str) and chosen in layers and chosen not in found:
        found = sorted([*found[: MAX_PICKED_OPTIONS - 1], chosen], key=layers.index)
    return [{"label": name, "value": name} for name in found]


def step_picker_options(steps: list[int], search: str | None, chosen: Any) -> list[dict[str, Any]]:
    """The step picker's options, latest step first: the steps whose number contains what was typed
    (`search`; digits, thousands separators ignored), or without it the steps around `chosen`; at
    most MAX_STEP_OPTIONS, `chosen` always among them.

    Not every histogram step of a long run (a hundred for 100k steps), for the reason picker_options
    gives: the dropdown indexes every option's text as it renders, while the page's graphs wait."""
    latest_first = sorted((step for step in steps if isinstance(step, int)), reverse=True)
    needle = "".join(character for character in (search or "") if character.isdigit())
    if needle:
        shown = [step for step in latest_first if needle in str(step)][:MAX_STEP_OPTIONS]
        if chosen in latest_first and chosen not in shown:
            shown = sorted([*shown[: MAX_STEP_OPTIONS - 1], chosen], reverse=True)
    else:
        at = latest_first.index(chosen) if chosen in latest_first else 0
        first = max(0, min(at - MAX_STEP_OPTIONS // 2, len(latest_first) - MAX_STEP_OPTIONS))
        shown = latest_first[first : first + MAX_STEP_OPTIONS]
    return [{"label": f"step {step:,}", "value": step} for step in shown]


def _append(
    cursor: dict[str, Any], new: dict[str, Any], label: str, log_scale: bool, infinity_means: str | None
) -> Any:
    """The patch appending the steps of `new` (a /vectors answer) to the heatmap `cursor`
    describes; None: redraw it (other layers, or a kind of non-finite value it does not show)."""
    if not new.get("steps"):
        return dash.no_update
    if figures.layer_names_of(new) != cursor.get("layers"):
        return None
    low, high = cursor["colour_range"]
    traces = figures.layer_heatmap_columns(
        new, label, log_scale=log_scale, colour_range=(low, high), infinity_means=infinity_means
    )
    return live.append_columns_patch(cursor, traces)


def _without_scaler(figure: dict[str, Any], run_id: str, title: str) -> dict[str, Any]:
    """A heatmap with no data (`figure`), or, for a run that has no GradScaler and so never has any,
    one that says so (the run read once more: only while the heatmap has nothing to draw)."""
    try:
        text = scaler_empty_text(services().api.get_run(run_id))
    except ApiError:
        return figure
    if text == figures.NO_DATA_TEXT:
        return figure
    return figures.empty_figure_dict(title, text, uirevision=run_id)


def _advanced(cursor: dict[str, Any], new: dict[str, Any], signature: Any) -> dict[str, Any]:
    last = live.last_step(new)
    steps = new.get("steps") or []
    return {
        **cursor,
        "signature": signature,
        "last": cursor["last"] if last is None else max(cursor["last"], last),
        "appended": cursor.get("appended", 0) + len(steps),
    }


def _no_histogram(message: str, run_id: str) -> dict[str, Any]:
    """show_histogram's result when there is no histogram to draw: `message` in both charts."""
    return {
        "step_options": [],
        "steps": [],
        "step": None,
        "at_step": figures.empty_figure("Gradient histogram", message, uirevision=run_id),
        "over_steps": figures.empty_figure("Gradient histogram over steps", message, uirevision=run_id),
        "drawn": None,
    }


def latest(series: Any) -> Any:
    """The last value of an API series, or None."""
    values = series.get("values") if isinstance(series, dict) else None
    return values[-1] if isinstance(values, list) and values else None


def _value_at(series: Any, step: Any) -> Any:
    """The value of an API series at `step`, or the last one before it; None when there is none."""
    if not isinstance(series, dict) or not isinstance(step, int):
        return None
    found = None
    for at, value in zip(series.get("steps") or [], series.get("values") or [], strict=False):
        if isinstance(at, int) and at <= step:
            found = value
    return found


def _nearest_step(steps: list[int], step: int) -> int | None:
    """The step of `steps` closest to `step` (the earlier one on a tie)."""
    return min(steps, key=lambda candidate: (abs(candidate - step), candidate)) if steps else None
