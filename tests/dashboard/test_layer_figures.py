"""The per-layer figure builders as pure functions: layer × step heatmaps and gradient histograms."""

from __future__ import annotations

import base64
import math
import struct
import zlib

import pytest
from dashboard_support import GRAD_NORMS, HISTOGRAMS, annotation_texts, histogram_counts, trace_named

from gradwatch.dashboard import figures
from gradwatch.dashboard.figures import layers
from gradwatch.dashboard.pages.run_layers import LAYER_HEATMAPS

# -- per-layer heatmaps ----------------------------------------------------------------------------


def png_pixels(data_uri):
    """(palette RGBA rows, pixel rows of palette indices) of the heatmaps' 8-bit palette PNG."""
    png = base64.b64decode(data_uri.removeprefix("data:image/png;base64,"))
    chunks, at = {}, 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        kind = png[at + 4 : at + 8]
        chunks[kind] = chunks.get(kind, b"") + png[at + 8 : at + 8 + length]
        at += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [list(raw[r * (width + 1) + 1 : (r + 1) * (width + 1)]) for r in range(height)]
    palette = [(*chunks[b"PLTE"][3 * i : 3 * i + 3], chunks[b"tRNS"][i]) for i in range(256)]
    return palette, rows


def traces_by_uid(figure):
    return {trace["uid"]: trace for trace in figure["data"]}


EVEN = {"layers": ["a", "b"], "steps": [0, 10, 20], "values": [[1.0, 10.0], [10.0, 0.0], [100.0, "NaN"]]}


def test_layer_heatmap_is_one_image_with_layers_top_down_and_real_values_in_hover():
    figure = figures.layer_heatmap_figure(EVEN, "Gradient norm per layer", "‖g‖")

    image = figure["data"][0]
    assert image["type"] == "image" and image["uid"] == "cells"
    assert (image["x0"], image["dx"], image["y0"], image["dy"]) == (0, 10, 0, 1)  # a column per step
    palette, rows = png_pixels(image["source"])
    assert len(rows) == 2 and len(rows[0]) == 3  # one pixel per cell: layers × steps
    # log10 colours: 1, 10, 100 span the scale; a zero has no log (blank). The NaN at step 20 is a
    # red marker at its step: its 10-step-wide column holds the layer's value before it (blank 0).
    assert palette[rows[0][0]] == (0x44, 0x01, 0x54, 255) and palette[rows[0][2]] == (0xFD, 0xE7, 0x25, 255)
    assert palette[rows[1][1]][3] == 0 and palette[rows[1][2]][3] == 0
    assert image["hovertext"] == [["1", "10", "100"], ["10", "0", "0 (step 10)"]]
    assert (traces_by_uid(figure)["non-finite-NaN"]["x"], traces_by_uid(figure)["non-finite-NaN"]["y"]) == (
        [20],
        [1],
    )
    assert image["hoverinfo"] == "x+y+text+name"  # step, layer name (the axis' alias), value
    yaxis = figure["layout"]["yaxis"]
    assert yaxis["type"] == "linear" and "autorange" not in yaxis  # the placeholder's: reversed
    assert figures.heatmap_placeholder("g", "loading…")["layout"]["yaxis"]["autorange"] == "reversed"
    # As tall as the heatmap that replaces it (a change of height makes plotly.js draw it twice).
    placeholder = figures.heatmap_placeholder("g", "loading…", layer_count=2)
    assert placeholder["layout"]["height"] == figure["layout"]["height"]
    assert yaxis["labelalias"] == {"0": "a", "1": "b"}  # y = the layer's index, named
    assert figure["layout"]["meta"]["colour_range"] == [0.0, 2.0]
    colour_bar = traces_by_uid(figure)["colour-scale"]["marker"]
    assert colour_bar["colorbar"]["ticktext"] == ["1e0", "1e1", "1e2"] and colour_bar["cmax"] == 2.0


def test_layer_names_are_escaped_and_irregular_steps_each_get_a_column():
    figure = figures.layer_heatmap_figure(GRAD_NORMS, "g", "‖g‖")  # steps 0, 10, 13, 20

    image = figure["data"][0]
    assert figure["layout"]["yaxis"]["labelalias"]["2"] == "&lt;b&gt;head&lt;/b&gt;.weight"
    assert image["dx"] == pytest.approx(20 / 3)  # each step in its own column, near its centre
    assert image["hovertext"][2] == ["1 (step 0)", "2 (step 10)", "3 (step 13)", "4 (step 20)"]
    uneven = {**GRAD_NORMS, "steps": [0, 1, 2, 20]}
    image = figures.layer_heatmap_figure(uneven, "g", "‖g‖")["data"][0]
    assert image["dx"] == 1  # the closest two steps: one column each, the gap filled by step 2
    assert len(image["hovertext"][2]) == 21 and image["hovertext"][2][-1] == "4 (step 20)"
    assert {text.rsplit("(step ", 1)[1] for text in image["hovertext"][2]} == {"0)", "1)", "2)", "20)"}
    downsampled = figures.layer_heatmap_figure({**GRAD_NORMS, "downsampled": True}, "g", "‖g‖")
    assert downsampled["data"][0]["hovertext"][2] == ["1", "2", "3", "4"]  # a bucket's step: no note


def test_layer_heatmap_marks_non_finite_cells_with_their_layer_and_step():
    figure = figures.layer_heatmap_figure(GRAD_NORMS, "g", "‖g‖")

    nan, infinity = (trace for trace in figure["data"] if trace.get("name") == "non-finite")
    assert (nan["x"], nan["y"]) == ([13], [0])  # y: the layer's index (fc1.weight)
    assert (infinity["x"], infinity["y"]) == ([13], [1])
    assert nan["marker"]["color"] == infinity["marker"]["color"] == layers.NON_FINITE_CELL_COLOR
    # Hover from a template per kind: "fc1.weight<br>NaN at step 13", with no text per point to send.
    assert (
        "Na&#78; at step %{x}" in nan["hovertemplate"]
        and "Infinit&#121; at step" in infinity["hovertemplate"]
    )
    assert "hovertext" not in nan


RED = (0xEF, 0x44, 0x44, 255)


def red_steps(figure):
    """Per image row (layer), the steps its red pixels cover: columns × the column width."""
    image = figure["data"][0]
    palette, rows = png_pixels(image["source"])
    return [sum(palette[index] == RED for index in row) * image["dx"] for row in rows]


# Per-layer norms as the agent records them: every 4 steps during the first 200, every 20 after, and
# on each skipped step (206: fc1.weight overflowed; 267: every layer did).
SAMPLED = [*range(0, 200, 4), *range(200, 320, 20)]
SKIPPED = {206: ["Infinity", 0.5, 0.6], 267: ["NaN", "NaN", "NaN"]}
WITH_SKIPS = {
    "layers": ["fc1.weight", "fc1.bias", "head.weight"],
    "steps": sorted([*SAMPLED, *SKIPPED]),
    "values": [SKIPPED.get(step, [1.0 + step / 100, 0.5, 0.6]) for step in sorted([*SAMPLED, *SKIPPED])],
}


def test_a_skipped_step_between_samples_is_marked_at_its_own_step_not_held_until_the_next():
    figure = figures.layer_heatmap_figure(WITH_SKIPS, "g", "‖g‖")

    image = figure["data"][0]
    assert image["dx"] == 4  # columns 4 steps wide: a red cell would draw one skipped step as four
    assert red_steps(figure) == [0, 0, 0]  # nor held over the steps up to the next sample (220, 280)
    column_210 = round((210 - image["x0"]) / image["dx"])  # after the skip at 206, before 220
    assert image["hovertext"][0][column_210] == "3 (step 200)"  # the last value that was recorded
    assert image["hovertext"][1][column_210] == "0.5 (step 206)"  # a finite layer's own value holds
    # The skips are marked at their own steps: a marker on the layer, a column over every layer.
    markers = traces_by_uid(figure)
    assert (markers["non-finite-Infinity"]["x"], markers["non-finite-Infinity"]["y"]) == ([206], [0])
    assert markers["non-finite-steps"]["x"] == [267, 267, None]


def test_a_non_finite_cell_is_red_in_the_image_only_one_step_wide():
    every_step = {"layers": ["a", "b"], "steps": list(range(10)), "values": [[1.0, 2.0]] * 10}
    every_step["values"] = [*every_step["values"][:5], ["NaN", 2.0], *every_step["values"][6:]]
    figure = figures.layer_heatmap_figure(every_step, "g", "‖g‖")

    assert figure["data"][0]["dx"] == 1 and red_steps(figure) == [1, 0]  # exactly its own step
    palette, rows = png_pixels(figure["data"][0]["source"])
    assert palette[rows[0][5]] == RED and figure["data"][0]["hovertext"][0][5] == "Na&#78;"
    gap = {**every_step, "steps": [0, 1, 2, 3, 4, 5, 12, 13, 14, 15]}  # irregular: columns 1 step wide
    gapped = figures.layer_heatmap_figure(gap, "g", "‖g‖")
    assert gapped["data"][0]["dx"] == 1 and red_steps(gapped) == [1, 0]  # not held over 6…11
    assert gapped["data"][0]["hovertext"][0][6:8] == ["1 (step 4)", "1 (step 4)"]


def test_a_step_where_every_layer_is_non_finite_is_one_red_column():
    vectors = {"layers": ["a", "b", "c"], "steps": [0, 1, 2], "values": [[1.0] * 3, ["NaN"] * 3, [2.0] * 3]}
    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")

    column = traces_by_uid(figure)["non-finite-steps"]
    assert column["x"] == [1, 1, None] and column["y"] == [0, 2, None]
    assert "all 3 layers non-finite at step" in column["hovertemplate"]
    assert [trace["uid"] for trace in figure["data"]] == [
        "cells",
        "live-cells",
        "colour-scale",
        "non-finite-steps",
    ]


# update/ratio as the agent recorded it for a real Adam loop (tests/agent/test_quantities.py:
# test_update_ratio_of_zero_initialised_layers_is_infinite_and_of_non_finite_updates_nan): a zero
# head and a LoRA B behind it are +inf (the weights were zero, the ratio undefined: B gets a gradient
# only once the head is non-zero), until they are not; an infinite gradient made body.weight NaN.
ZERO_INITIALISED = {
    "layers": ["body.weight", "lora_b.weight", "head.weight", "head.bias"],
    "steps": [0, 1, 2],
    "values": [
        [0.0, "Infinity", "Infinity", "Infinity"],
        [0.037, "Infinity", 0.71, 0.879],
        ["NaN", 0.951, 0.421, 0.556],
    ],
}


def _update_ratio_heatmap(vectors):
    _key, title, label, log_scale, value_range, infinity_means = LAYER_HEATMAPS["update-ratio-heatmap"]
    return figures.layer_heatmap_figure(
        vectors, title, label, log_scale=log_scale, value_range=value_range, infinity_means=infinity_means
    )


def test_update_ratio_of_weights_that_were_zero_is_undefined_not_red():
    figure = _update_ratio_heatmap(ZERO_INITIALISED)

    image = figure["data"][0]
    palette, rows = png_pixels(image["source"])
    undefined = "undefined: the weight was zero"
    for layer, step in ((1, 0), (2, 0), (3, 0), (1, 1)):  # +inf: blank, and hover says why
        assert palette[rows[layer][step]][3] == 0, (layer, step)
        assert image["hovertext"][layer][step] == undefined
    assert palette[rows[0][2]] == (0xEF, 0x44, 0x44, 255)  # the NaN stays red
    assert image["hovertext"][0] == ["0", "0.037", "Na&#78;"]
    assert palette[rows[2][1]][3] == palette[rows[1][2]][3] == 255  # real ratios keep their colours
    # One red marker, the NaN's; no +inf markers, no red column.
    assert [trace["uid"] for trace in figure["data"]] == [
        "cells",
        "live-cells",
        "colour-scale",
        "non-finite-NaN",
    ]
    nan = traces_by_uid(figure)["non-finite-NaN"]
    assert (nan["x"], nan["y"]) == ([2], [0])
    assert figure["layout"]["meta"]["colour_range"] == pytest.approx([math.log10(0.037), math.log10(0.951)])

    # A live run's new steps: the same.
    new = {**ZERO_INITIALISED, "steps": [3, 4], "values": ZERO_INITIALISED["values"][:2]}
    live_cells, *markers = figures.layer_heatmap_columns(
        new, "ratio", log_scale=True, colour_range=(-1.5, 0.0), infinity_means=undefined
    )
    assert markers == []
    assert live_cells["z"][1] == [None, None] and live_cells["hovertext"][1] == [undefined, undefined]
    assert live_cells["hoverongaps"] is True  # a blank live cell hovers too


def test_infinity_stays_an_alarm_where_the_quantity_gives_it_no_meaning():
    vectors = {"layers": ["a", "b"], "steps": [0, 1], "values": [["Infinity", 1.0], ["Infinity", "Infinity"]]}
    key, *_, infinity_means = LAYER_HEATMAPS["grad-norm-heatmap"]
    assert key == "grad/norm" and infinity_means is None
    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")

    palette, rows = png_pixels(figure["data"][0]["source"])
    assert palette[rows[0][0]] == palette[rows[1][1]] == (0xEF, 0x44, 0x44, 255)
    assert figure["data"][0]["hovertext"][0] == ["+Infinit&#121;", "+Infinit&#121;"]
    assert set(traces_by_uid(figure)) >= {"non-finite-Infinity", "non-finite-steps"}
    # The update ratio's +inf is no alarm, but its -inf would be (a ratio of norms cannot be negative).
    negative = _update_ratio_heatmap({"layers": ["a"], "steps": [0], "values": [["-Infinity"]]})
    assert "non-finite--Infinity" in traces_by_uid(negative)


def test_fraction_heatmap_has_a_fixed_linear_range():
    fractions = {"layers": ["a", "b"], "steps": [0], "values": [[0.25, 1.0]]}
    figure = figures.layer_heatmap_figure(fractions, "u", "fraction", log_scale=False, value_range=(0, 1))
    assert figure["layout"]["meta"]["colour_range"] == [0.0, 1.0]
    assert traces_by_uid(figure)["live-cells"]["zmax"] == 1.0
    assert figure["data"][0]["hovertext"] == [["0.25"], ["1"]]


def test_the_api_float64_matrix_reads_like_json_rows():
    packed = base64.b64encode(struct.pack("<6d", 1.0, 10.0, 10.0, 0.0, 100.0, math.nan)).decode()
    figure = figures.layer_heatmap_figure({**EVEN, "values": None, "values_f64": packed}, "g", "‖g‖")
    assert figure == figures.layer_heatmap_figure(EVEN, "g", "‖g‖")


def test_new_steps_come_as_live_columns_in_the_drawn_colours():
    new = {"layers": ["a", "b"], "steps": [30, 40], "values": [[1000.0, "Infinity"], [1.0, 0.5]]}
    live_cells, markers = figures.layer_heatmap_columns(new, "‖g‖", log_scale=True, colour_range=(0.0, 2.0))

    assert live_cells["uid"] == "live-cells" and live_cells["x"] == [30, 40]
    assert live_cells["z"] == [[3.0, 0.0], [None, round(math.log10(0.5), 4)]]  # a row per layer
    assert (live_cells["zmin"], live_cells["zmax"]) == (0.0, 2.0)
    assert live_cells["hovertext"] == [["1e+03", "1"], ["+Infinit&#121;", "0.5"]]
    assert markers["uid"] == "non-finite-Infinity" and (markers["x"], markers["y"]) == ([30], [1])


def test_many_layers_stay_readable():
    names = [f"model.layers.{i}.mlp.down_proj.weight.with_a_long_suffix" for i in range(200)]
    vectors = {"layers": names, "steps": [0, 10], "values": [[1.0] * 200, [2.0] * 200]}

    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")

    layout = figure["layout"]
    assert layout["height"] == layers.HEATMAP_MAX_HEIGHT_PX
    ticks = layout["yaxis"]["tickvals"]
    assert 20 <= len(ticks) <= 70 and ticks[0] == 0
    assert all(len(text) <= layers.MAX_TICK_LABEL_CHARS for text in layout["yaxis"]["ticktext"])
    assert layout["yaxis"]["labelalias"]["7"] == names[7]  # whole in hover
    assert "200 layers" in layout["annotations"][0]["text"]
    assert len(figure["data"][0]["hovertext"]) == 200  # every layer still has its row


def test_layers_named_by_numbers_keep_whole_names_as_tick_labels():
    vectors = {"layers": ["0", "2", "4"], "steps": [0], "values": [[1.0, 2.0, 3.0]]}
    yaxis = figures.layer_heatmap_figure(vectors, "g", "‖g‖")["layout"]["yaxis"]
    # plotly would read a tick text "2" as the alias of the layer at index 2.
    assert "ticktext" not in yaxis and yaxis["labelalias"] == {"0": "0", "1": "2", "2": "4"}


def test_heatmap_height_grows_with_layers_within_bounds():
    assert figures.heatmap_height(1) == layers.HEATMAP_MIN_HEIGHT_PX
    assert figures.heatmap_height(20) == 20 * layers.HEATMAP_ROW_PX + layers.HEATMAP_MARGIN_PX
    assert figures.heatmap_height(10_000) == layers.HEATMAP_MAX_HEIGHT_PX


@pytest.mark.parametrize(
    "vectors",
    [
        None,
        {},
        {"layers": ["a"], "steps": [], "values": []},
        {"layers": ["a"], "steps": [], "values_f64": ""},
        {"layers": ["a"], "steps": [0], "values_f64": "AAAA"},  # not a whole row
        {"layers": ["a"], "steps": [0], "values_f64": "not base64!"},
        {"layers": "x"},
    ],
)
def test_heatmap_without_data_says_so(vectors):
    figure = figures.layer_heatmap_figure(vectors, "g", "‖g‖")
    assert figures.NO_DATA_TEXT in [annotation["text"] for annotation in figure["layout"]["annotations"]]


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
    counts = figure.layout.title.subtitle.text
    assert "zeros 4" in counts and "NaN/Inf 1" in counts
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


def test_histogram_colour_bar_reads_real_counts_at_powers_of_ten():
    spread = {**HISTOGRAMS, "counts": [histogram_counts(-10, 3), histogram_counts(-12, 250_000)]}

    heatmap = figures.histogram_time_figure(spread).data[0]
    # z is log10(count) from 0.477 to 5.4: ticks at whole powers only (never "1e0.5"), as counts.
    assert list(heatmap.colorbar.tickvals) == [1, 2, 3, 4, 5]
    assert list(heatmap.colorbar.ticktext) == ["10", "100", "1k", "10k", "100k"]
    assert heatmap.colorbar.tickprefix is None
    assert heatmap.hovertemplate.endswith("count %{text}<extra></extra>")  # the count, not 10^0.48
    texts = dict(zip([y + 0.5 for y in heatmap.y], heatmap.text, strict=True))
    assert list(texts[-10]) == ["3", "0"] and list(texts[-12]) == ["0", "250,000"]
    # Under a decade (100 and 100 in HISTOGRAMS; 3 to 8 here): the counts themselves.
    assert list(figures.histogram_time_figure(HISTOGRAMS).data[0].colorbar.ticktext) == ["100"]
    narrow = {**HISTOGRAMS, "counts": [histogram_counts(-10, 3), histogram_counts(-12, 8)]}
    colour_bar = figures.histogram_time_figure(narrow).data[0].colorbar
    assert list(colour_bar.ticktext) == ["3", "8"]
    assert list(colour_bar.tickvals) == [
        pytest.approx(math.log10(3), abs=1e-3),
        pytest.approx(math.log10(8), abs=1e-3),
    ]


def test_histogram_counts_on_a_log_axis_are_labelled_as_numbers():
    many = {**HISTOGRAMS, "counts": [histogram_counts(-10, 50_000), histogram_counts(-12, 7)]}
    yaxis = figures.histogram_figure(many, 0).layout.yaxis
    assert (yaxis.type, yaxis.minorloglabels, yaxis.exponentformat) == ("log", "complete", "B")


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
