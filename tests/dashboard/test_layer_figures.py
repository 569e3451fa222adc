"""The per-layer figure builders as pure functions: layer × step heatmaps and gradient histograms."""

from __future__ import annotations

import math

import pytest
from dashboard_support import GRAD_NORMS, HISTOGRAMS, annotation_texts, trace_named

from gradwatch.dashboard import figures
from gradwatch.dashboard.figures import layers

# -- per-layer heatmaps ----------------------------------------------------------------------------


def test_layer_heatmap_has_layers_in_model_order_top_down_and_log10_values():
    figure = figures.layer_heatmap_figure(GRAD_NORMS, "Gradient norm per layer", "‖g‖")

    heatmap = figure.data[0]
    assert heatmap.type == "heatmap"
    escaped = ["fc1.weight", "fc1.bias", "&lt;b&gt;head&lt;/b&gt;.weight"]
    assert list(heatmap.y) == escaped
    assert list(figure.layout.yaxis.categoryarray) == escaped[::-1]  # first layer at the top
    assert list(heatmap.x) == [0, 10, 13, 20]
    assert heatmap.transpose  # z holds one row per step, as the API sends it (live steps append)
    assert heatmap.z[0][0] == -1.0 and heatmap.z[1][2] == round(math.log10(2.0), 3)
    assert heatmap.z[3][0] is None  # a zero norm has no log: a blank cell, not an error
    assert "1e0" in heatmap.colorbar.ticktext


def test_layer_heatmap_marks_non_finite_cells_with_their_layer_and_step():
    figure = figures.layer_heatmap_figure(GRAD_NORMS, "g", "‖g‖")

    nan, infinity = (trace for trace in figure.data if trace.name == "non-finite")
    assert (list(nan.x), list(nan.y)) == ([13], ["fc1.weight"])
    assert (list(infinity.x), list(infinity.y)) == ([13], ["fc1.bias"])
    assert nan.marker.color == infinity.marker.color == layers.NON_FINITE_CELL_COLOR
    # Hover from a template per kind: "fc1.weight<br>NaN at step 13", with no text per point to send.
    assert "NaN at step %{x}" in nan.hovertemplate and "Infinity at step" in infinity.hovertemplate
    assert nan.hovertext is None
    assert figure.data[0].z[2][0] is None


def test_a_step_where_every_layer_is_non_finite_is_one_red_column():
    vectors = {"layers": ["a", "b", "c"], "steps": [0, 1, 2], "values": [[1.0] * 3, ["NaN"] * 3, [2.0] * 3]}
    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")

    column = next(trace for trace in figure.data if trace.uid == "non-finite-steps")
    assert list(column.x) == [1, 1, None] and list(column.y) == ["a", "c", None]
    assert "all 3 layers non-finite at step" in column.hovertemplate
    assert [trace.uid for trace in figure.data] == ["cells", "non-finite-steps"]


def test_fraction_heatmap_has_a_fixed_linear_range():
    fractions = {"layers": ["a", "b"], "steps": [0], "values": [[0.25, 1.0]]}
    figure = figures.layer_heatmap_figure(fractions, "u", "fraction", log_scale=False, value_range=(0, 1))
    heatmap = figure.data[0]
    assert (heatmap.zmin, heatmap.zmax) == (0, 1)
    assert list(heatmap.z[0]) == [0.25, 1.0]


def test_many_layers_stay_readable():
    names = [f"model.layers.{i}.mlp.down_proj.weight.with_a_long_suffix" for i in range(200)]
    vectors = {"layers": names, "steps": [0, 10], "values": [[1.0] * 200, [2.0] * 200]}

    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")

    assert figure.layout.height == layers.HEATMAP_MAX_HEIGHT_PX
    ticks = list(figure.layout.yaxis.tickvals)
    assert 20 <= len(ticks) <= 70 and ticks[0] == names[0]
    assert all(len(text) <= layers.MAX_TICK_LABEL_CHARS for text in figure.layout.yaxis.ticktext)
    assert "200 layers" in annotation_texts(figure)[0]
    assert len(figure.data[0].y) == 200  # every layer still has its row (and its name in hover)


def test_heatmap_height_grows_with_layers_within_bounds():
    assert figures.heatmap_height(1) == layers.HEATMAP_MIN_HEIGHT_PX
    assert figures.heatmap_height(20) == 20 * layers.HEATMAP_ROW_PX + layers.HEATMAP_MARGIN_PX
    assert figures.heatmap_height(10_000) == layers.HEATMAP_MAX_HEIGHT_PX


@pytest.mark.parametrize("vectors", [None, {}, {"layers": ["a"], "steps": [], "values": []}, {"layers": "x"}])
def test_heatmap_without_data_says_so(vectors):
    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")
    assert figures.NO_DATA_TEXT in annotation_texts(figure)


# -- histograms ------------------------------------------------------------------------------------


def test_fp16_thresholds_move_with_the_scale():
    assert figures.fp16_thresholds(2.0**16) == (-40.0, pytest.approx(math.log2(65504) - 16))
    assert figures.fp16_thresholds(1.0)[0] == -24.0
    assert figures.fp16_thresholds("NaN") is None and figures.fp16_thresholds(0) is None


def test_histogram_at_a_step_draws_bins_and_the_fp16_limits():
    figure = figures.histogram_figure({**HISTOGRAMS, "layer": "<b>x</b>"}, 25, 2.0**10)

    bars = figure.data[0]
    assert bars.type == "bar"
    heights = dict(zip(bars.customdata, bars.y, strict=True))
    assert heights[-12] == 100 and sum(bars.y) == 100  # step 25 shows the snapshot of step 20
    assert (
        dict(zip(bars.customdata, bars.x, strict=True))[-12] == -12.5
    )  # bin -12 spans log2|g| in [-13, -12)
    assert min(bars.customdata) == -36 and max(bars.customdata) <= 8  # from the underflow limit up
    assert "step 20" in figure.layout.title.text and "&lt;b&gt;x&lt;/b&gt;" in figure.layout.title.text
    assert "zeros 4" in figure.layout.title.text and "NaN/Inf 1" in figure.layout.title.text
    assert sorted(shape.x0 for shape in figure.layout.shapes) == [-34.0, pytest.approx(math.log2(65504) - 10)]


def test_histogram_step_defaults_to_the_latest_and_before_the_first_to_the_first():
    assert "step 20" in figures.histogram_figure(HISTOGRAMS, None).layout.title.text
    assert "step 0" in figures.histogram_figure(HISTOGRAMS, 0).layout.title.text
    assert figures.histogram_figure(HISTOGRAMS, 5).layout.shapes == ()  # no scale: no limit lines
    assert figures.histogram_steps(HISTOGRAMS) == [0, 20]


def test_histogram_over_time_is_an_exponent_by_step_heatmap_with_the_limits():
    scale = {"steps": [0, 10, 20], "values": [2.0**16, 2.0**15, "NaN"]}

    figure = figures.histogram_time_figure(HISTOGRAMS, scale)

    heatmap = figure.data[0]
    assert list(heatmap.x) == [0, 20]
    rows = dict(zip([y + 0.5 for y in heatmap.y], heatmap.z, strict=True))
    assert rows[-10] == [2.0, None] and rows[-12] == [None, 2.0]  # log10 of the counts
    underflow = trace_named(figure, "fp16 underflow")
    assert list(underflow.y) == [-40.0, -39.0, None]


@pytest.mark.parametrize(
    "histograms",
    [
        None,
        {},
        {**HISTOGRAMS, "counts": [[1, 2]]},
        {**HISTOGRAMS, "exponents": ["a"]},
        {**HISTOGRAMS, "steps": []},
    ],
)
def test_histograms_without_usable_rows_say_no_data(histograms):
    assert figures.NO_DATA_TEXT in annotation_texts(figures.histogram_figure(histograms, 0))
    assert figures.NO_DATA_TEXT in annotation_texts(figures.histogram_time_figure(histograms))
