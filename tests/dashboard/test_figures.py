"""The line-chart figure builders as pure functions: loss scale with skips and the safe band, loss, gradient
norm, learning rate, the step marker, compare."""

from __future__ import annotations

import json
import math

import pytest
from dashboard_support import SCALE_SERIES, SKIPS, annotation_texts, skip_event, trace_named

from gradwatch.dashboard import figures
from gradwatch.dashboard.figures import lines

# -- loss scale ------------------------------------------------------------------------------------


def test_scale_figure_uses_a_log_axis_labelled_in_powers_of_two():
    figure = figures.scale_figure(SCALE_SERIES, SKIPS)

    assert figure.layout.title.text == "Loss scale"
    assert figure.layout.yaxis.type == "log"
    assert "2^16" in figure.layout.yaxis.ticktext
    for value, text in zip(figure.layout.yaxis.tickvals, figure.layout.yaxis.ticktext, strict=True):
        assert text == f"2^{round(math.log2(value))}"
        assert math.log2(value) == round(math.log2(value))


def test_scale_figure_has_one_skip_marker_per_event_at_the_scale_before_the_skip():
    figure = figures.scale_figure(SCALE_SERIES, SKIPS)

    markers = trace_named(figure, "skipped step")
    assert markers.mode == "markers"
    assert markers.marker.symbol == "x"
    assert markers.marker.color == lines.ALERT_COLOR
    assert list(markers.x) == [1, 3, 4]
    assert list(markers.y) == [65536.0, 32768.0, 16384.0]
    assert "2^16 → 2^15" in markers.hovertext[0]
    assert "fc1.weight" in markers.hovertext[0]


def test_skip_without_a_usable_scale_before_takes_the_last_recorded_scale():
    events = [skip_event(3, "NaN", 8192.0), {"step": 4, "kind": "skip", "rank": 0, "data": {}}]

    markers = trace_named(figures.scale_figure(SCALE_SERIES, events), "skipped step")

    assert list(markers.x) == [3, 4]
    assert list(markers.y) == [32768.0, 16384.0]  # the scales recorded at steps 2 and 3


def test_skip_hover_text_escapes_layer_names_and_abbreviates_long_lists():
    layers = ["<img src=x onerror=alert(1)>"] + [f"layer{i}" for i in range(10)]

    markers = trace_named(
        figures.scale_figure(SCALE_SERIES, [skip_event(1, 65536.0, 32768.0, layers)]), "skipped step"
    )

    assert "<img" not in markers.hovertext[0]
    assert "&lt;img src=x onerror=alert(1)&gt;" in markers.hovertext[0]
    assert "(+6 more)" in markers.hovertext[0]


def test_non_finite_and_non_positive_scales_are_gaps():
    series = {"steps": [0, 1, 2, 3, 4, 5], "values": [65536.0, "NaN", "Infinity", "-Infinity", 0.0, None]}

    figure = figures.scale_figure(series, [])

    line = trace_named(figure, "scale")
    assert list(line.y) == [65536.0, None, None, None, None, None]
    assert line.connectgaps is False
    assert figure.layout.yaxis.type == "log"


def test_collapsed_scale_far_below_one_still_gets_power_of_two_ticks():
    series = {"steps": list(range(200)), "values": [2.0 ** (16 - step) for step in range(200)]}

    figure = figures.scale_figure(series, [])

    ticks = figure.layout.yaxis.ticktext
    assert 2 <= len(ticks) <= 12
    assert all(text.startswith("2^") for text in ticks)
    assert figure.layout.yaxis.tickvals[0] <= 2.0 ** (16 - 199)


def test_safe_band_is_a_step_shaped_fill_behind_the_scale_reaching_the_last_step():
    low = {"steps": [0, 3], "values": [2.0**-4, 2.0**-2]}
    high = {"steps": [0, 3], "values": [2.0**18, "NaN"]}  # a NaN edge drops that band point

    figure = figures.scale_figure(SCALE_SERIES, SKIPS, (low, high))

    band = trace_named(figure, "fp16 safe band")
    assert band.fill == "tonexty" and band.line.shape == "hv"
    assert list(band.x) == [0, 5]  # held from the histogram step to the last scale step
    assert list(band.y) == [2.0**18, 2.0**18]
    assert figure.data[0].name == "safe band (low)" and list(figure.data[0].y) == [2.0**-4, 2.0**-4]
    assert [trace.name for trace in figure.data].index("scale") > 1  # drawn over the band
    assert min(figure.layout.yaxis.tickvals) <= 2.0**-4  # the axis spans the band


def test_scale_without_band_data_has_no_band():
    figure = figures.scale_figure(SCALE_SERIES, SKIPS, ({"steps": [], "values": []}, None))
    assert "fp16 safe band" not in [trace.name for trace in figure.data]


# -- loss, grad norm, lr ---------------------------------------------------------------------------


def test_non_finite_losses_are_gaps_in_the_line_and_markers_at_the_top():
    series = {"steps": [0, 1, 2, 3, 4], "values": [2.5, "NaN", 2.0, "Infinity", "-Infinity"]}

    figure = figures.loss_figure(series)

    line = trace_named(figure, "loss")
    assert list(line.y) == [2.5, None, 2.0, None, None]
    assert line.connectgaps is False
    markers = trace_named(figure, "non-finite")
    assert list(markers.x) == [1, 3, 4]
    assert list(markers.hovertext) == ["NaN at step 1", "Infinity at step 3", "-Infinity at step 4"]
    # Drawn on a hidden 0..1 axis overlaying y, so they sit at the top whatever the loss values are.
    assert markers.yaxis == "y2"
    assert all(y == lines.NON_FINITE_MARKER_Y for y in markers.y)
    assert figure.layout.yaxis2.overlaying == "y"
    assert tuple(figure.layout.yaxis2.range) == (0, 1)
    json.loads(figure.to_json())  # serialisable as Dash will send it


def test_python_float_nan_and_inf_are_treated_like_the_api_strings():
    figure = figures.loss_figure({"steps": [0, 1, 2], "values": [1.0, math.nan, math.inf]})

    assert list(trace_named(figure, "loss").y) == [1.0, None, None]
    assert list(trace_named(figure, "non-finite").hovertext) == ["NaN at step 1", "Infinity at step 2"]


def test_a_loss_that_is_only_nan_is_still_drawn_as_markers():
    figure = figures.loss_figure({"steps": [0, 1], "values": ["NaN", "NaN"]})

    assert figures.NO_DATA_TEXT not in annotation_texts(figure)
    assert len(trace_named(figure, "non-finite").x) == 2


def test_grad_norm_uses_a_log_axis_while_the_marker_axis_stays_linear():
    series = {"steps": [0, 1, 2, 3], "values": [0.5, 1200.0, "Infinity", 0.0]}

    figure = figures.grad_norm_figure(series)

    assert figure.layout.yaxis.type == "log"
    assert figure.layout.yaxis2.type in (None, "linear", "-")
    assert list(figure.data[0].y) == [0.5, 1200.0, None, None]
    assert list(trace_named(figure, "non-finite").x) == [2]
    assert figures.grad_norm_figure(series, log_y=False).layout.yaxis.type == "linear"


def test_log_axes_label_every_tick_with_its_number_not_its_leading_digit():
    # Under a decade or two, plotly.js ticks 1, 2, 5 (or every digit) between the powers of ten and
    # labels them "2", "5" by default: a post-clip norm at 0.5 sat beside a "5". "complete" labels
    # read 0.5, 2, 20; exponentformat "e" writes the small and the large ones 5e-3, 2e+3.
    norms = {"steps": [0, 1, 2], "values": [0.4, 0.5, 3.0]}
    post_clip_only = figures.grad_norm_figure(None, norms)
    loss_compare = figures.compare_figure([("a", norms)], "grad/global_norm", log_y=True)
    for figure in (figures.grad_norm_figure(norms, norms), post_clip_only, loss_compare):
        yaxis = figure.layout.yaxis
        assert (yaxis.type, yaxis.minorloglabels, yaxis.exponentformat) == ("log", "complete", "e")
        assert yaxis.tickmode is None and yaxis.dtick is None  # plotly's ticks for every zoom
    linear = figures.grad_norm_figure(norms, log_y=False).layout.yaxis
    assert linear.type == "linear" and linear.minorloglabels is None


def test_grad_norm_draws_pre_and_post_clip():
    pre = {"steps": [0, 1, 2], "values": [3.0, "NaN", 0.5]}
    post = {"steps": [0, 1, 2], "values": [1.0, "NaN", 0.5]}

    figure = figures.grad_norm_figure(pre, post)

    assert list(trace_named(figure, "pre-clip").y) == [3.0, None, 0.5]
    assert list(trace_named(figure, "post-clip").y) == [1.0, None, 0.5]
    assert figure.layout.showlegend is True
    only_post = figures.grad_norm_figure(None, post)
    assert [trace.name for trace in only_post.data] == ["post-clip"]


def test_lr_figure_draws_the_schedule():
    figure = figures.lr_figure({"steps": [0, 1, 2], "values": [1e-4, 2e-4, 3e-4]})

    assert list(figure.data[0].x) == [0, 1, 2]
    assert list(figure.data[0].y) == [1e-4, 2e-4, 3e-4]
    assert figure.layout.title.text == "Learning rate"


def test_constant_learning_rate_gets_a_range_around_its_value():
    figure = figures.lr_figure({"steps": [0, 1, 2], "values": [3e-4, 3e-4, 3e-4]})
    assert tuple(figure.layout.yaxis.range) == (0, 6e-4)


@pytest.mark.parametrize(
    "build",
    [
        figures.loss_figure,
        figures.grad_norm_figure,
        figures.lr_figure,
        lambda series: figures.scale_figure(series, []),
        lambda series: figures.scale_figure(series, None),
    ],
)
@pytest.mark.parametrize(
    "series",
    [
        {"key": "loss", "steps": [], "values": [], "downsampled": False},
        None,
        {},
        {"steps": "garbage", "values": None},
        {"steps": [0, 1], "values": [None, None]},
    ],
)
def test_empty_or_malformed_data_gives_a_no_data_figure(build, series):
    figure = build(series)

    assert figures.NO_DATA_TEXT in annotation_texts(figure)
    json.loads(figure.to_json())


def test_mismatched_or_junk_points_never_raise():
    series = {"steps": [0, 1, "two", 3, True], "values": [1.0, "oops", 3.0, {"x": 1}, 5.0, 6.0]}

    figure = figures.loss_figure(series)

    assert list(figure.data[0].x) == [0, 1, 3]
    assert list(figure.data[0].y) == [1.0, None, None]


def test_uirevision_is_set_so_refreshes_keep_the_users_zoom():
    assert (
        figures.loss_figure({"steps": [0], "values": [1.0]}, uirevision="run-7").layout.uirevision == "run-7"
    )
    assert figures.scale_figure(SCALE_SERIES, SKIPS, uirevision="run-7").layout.uirevision == "run-7"
    assert figures.empty_figure("Loss", uirevision="run-7").layout.uirevision == "run-7"


def test_every_figure_is_as_wide_as_its_card_from_the_first_drawing():
    # Else plotly.js draws it 700 px wide first, and dcc.Graph's resize draws it all again.
    drawn = [
        figures.loss_figure({"steps": [0], "values": [1.0]}).to_plotly_json(),
        figures.empty_figure_dict("Loss", "loading…"),
        figures.heatmap_placeholder("Gradient norm per layer", "loading…", layer_count=200),
        figures.layer_heatmap_figure(
            {"layers": ["a", "b"], "steps": [0, 10], "values": [[1.0, 2.0], [3.0, 4.0]]}, "Norm", "‖g‖"
        ),
    ]
    assert [figure["layout"]["autosize"] for figure in drawn] == [True] * len(drawn)


@pytest.mark.parametrize(
    ("scale", "text"),
    [
        (65536.0, "2^16"),
        (1.0, "2^0"),
        (2.0**-130, "2^-130"),
        (3000.0, "3000"),
        ("NaN", "NaN"),
        ("Infinity", "Infinity"),
        (None, "–"),
        (math.inf, "Infinity"),
    ],
)
def test_format_scale(scale, text):
    assert figures.format_scale(scale) == text


# -- step marker and compare -----------------------------------------------------------------------


def test_step_marker_is_a_vertical_line_at_the_step():
    (shape,) = figures.step_marker_shapes(42)
    assert (shape["x0"], shape["x1"], shape["yref"]) == (42, 42, "paper")
    assert figures.step_marker_shapes(None) == [] and figures.step_marker_shapes("7") == []


def test_compare_overlays_runs_by_step_with_escaped_names():
    figure = figures.compare_figure(
        [
            ("<i>a</i>", {"steps": [0, 1], "values": [2.0, 1.0]}),
            ("b", {"steps": [0, 5], "values": [3.0, "NaN"]}),
            ("empty", {"steps": [], "values": []}),
        ],
        "loss",
    )
    assert [trace.name for trace in figure.data] == ["&lt;i&gt;a&lt;/i&gt;", "b"]
    assert list(figure.data[1].y) == [3.0, None]
    assert figure.data[0].line.color != figure.data[1].line.color
    assert figures.NO_DATA_TEXT in annotation_texts(figures.compare_figure([], "loss"))
    assert (
        figures.compare_figure([("a", {"steps": [0], "values": [2.0]})], "loss", log_y=True).layout.yaxis.type
        == "log"
    )
