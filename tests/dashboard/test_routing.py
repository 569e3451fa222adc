"""The Dash app's shell through Flask's test client: exports, routes, query strings, pages served."""

from __future__ import annotations

import gzip
import json
import re

import pytest
from dashboard_support import app_client, callback_outputs, render, run_api

import gradwatch.dashboard
from gradwatch.dashboard import app, create_dash_app, figures, live, verdict, views
from gradwatch.dashboard.app import parse_route
from gradwatch.dashboard.pages import alerts, alerts_views, compare, run, run_views, runs
from gradwatch.dashboard.pages.compare import parse_run_ids
from gradwatch.dashboard.pages.run import parse_step

PAGES = (alerts, alerts_views, compare, run, run_views, runs)


@pytest.fixture
def fake_api():
    return run_api()


@pytest.fixture
def dash_client(fake_api):
    return app_client(fake_api)


def test_package_exports_exactly_create_dash_app():
    assert gradwatch.dashboard.__all__ == ["create_dash_app"]
    modules = (gradwatch.dashboard, app, figures, live, verdict, views, *PAGES)
    for module in modules:
        for name in module.__all__:
            assert hasattr(module, name), name


@pytest.mark.parametrize(
    ("pathname", "route"),
    [
        ("/dashboard/", ("runs", None)),
        ("/dashboard", ("runs", None)),
        (None, ("runs", None)),
        ("/dashboard/runs/abc", ("run", "abc")),
        ("/dashboard/runs/abc/", ("run", "abc")),
        ("/dashboard/runs/a%2Fb", ("run", "a/b")),
        ("/dashboard/nope", ("unknown", "/nope")),
        ("/dashboard/runs", ("unknown", "/runs")),
        ("/dashboard/alerts", ("alerts", None)),
        ("/dashboard/alerts/", ("alerts", None)),
    ],
)
def test_parse_route(pathname, route):
    assert parse_route(pathname, "/dashboard/") == route


def test_prefix_must_be_slash_delimited():
    with pytest.raises(ValueError, match="requests_pathname_prefix"):
        create_dash_app("http://127.0.0.1:1", "dashboard")


def get(client, path):
    response = client.get(path)
    response.close()  # static files are streamed; an unclosed one warns
    return response


def test_index_layout_and_assets_are_served_relative_to_the_mount(dash_client):
    index = get(dash_client, "/")
    assert index.status_code == 200
    assert b"<title>gradwatch</title>" in index.data
    assert b"/dashboard/assets/style.css" in index.data  # browser URLs carry the mount prefix

    layout = get(dash_client, "/_dash-layout")
    assert layout.status_code == 200
    layout_text = json.dumps(layout.json)
    assert '"id": "url"' in layout_text and '"id": "page"' in layout_text

    assert get(dash_client, "/runs/r1").status_code == 200  # deep links serve the app too
    assert get(dash_client, "/assets/style.css").status_code == 200


def test_graphs_get_plotly_js_cartesian_bundle_of_plotly_py_s_version_preloaded_and_compressed(dash_client):
    from plotly.offline import get_plotlyjs_version

    index = get(dash_client, "/")
    url = "/dashboard/" + app.PLOTLY_JS
    assert f'<link rel="preload" href="{url}" as="script" fetchpriority="low">'.encode() in index.data
    assert app.PLOTLY_BUNDLE.encode() not in index.data  # loaded by dcc.Graph, not by every page

    served = dash_client.get("/" + app.PLOTLY_JS, headers={"Accept-Encoding": "gzip, br"})
    assert served.headers["Content-Encoding"] == "gzip"
    bundle = gzip.decompress(served.data)
    assert bundle == (app.ASSETS_FOLDER / app.PLOTLY_BUNDLE).read_bytes()
    # The same plotly.js as plotly.py's (its figures' format), cut to the traces the dashboard draws.
    assert f"plotly.js (cartesian - minified) v{get_plotlyjs_version()}\n".encode() in bundle[:200]
    again = dash_client.get("/" + app.PLOTLY_JS, headers={"If-None-Match": served.headers["ETag"]})
    assert again.status_code == 304


def test_pages_load_regenerator_runtime_instead_of_babel_s_polyfill(dash_client):
    scripts = re.findall(r'<script src="([^"]+)"', get(dash_client, "/").data.decode())
    assert not [src for src in scripts if "polyfill" in src]
    runtime = next(src for src in scripts if "/assets/regenerator-runtime.js" in src)
    renderer = next(src for src in scripts if "dash_renderer" in src)
    assert scripts.index(runtime) < scripts.index(renderer)  # there before any component loads lazily
    served = dash_client.get(runtime.removeprefix("/dashboard"))
    assert "regeneratorRuntime = runtime" in served.get_data(as_text=True)
    served.close()


def test_the_figures_draw_only_traces_the_plotly_bundle_has():
    # plotly.js's cartesian bundle: bar, box, contour, heatmap, histogram(2d, 2dcontour), image,
    # pie, scatter, scatterternary, violin. A figure builder with another trace type needs another.
    cartesian = {"bar", "box", "contour", "heatmap", "histogram", "image", "pie", "scatter", "violin"}
    source = "".join(path.read_text() for path in (app.ASSETS_FOLDER.parent / "figures").glob("*.py"))
    used = set(re.findall(r'"type": "([a-z0-9]+)",\n', source)) - {"line", "rect", "path"}  # shapes
    assert used and used <= cartesian


def test_run_page_has_the_four_graphs_and_a_live_refresh(dash_client):
    page = render(dash_client, "/dashboard/runs/r1")

    text = json.dumps(page)
    for graph_id in ("loss-graph", "scale-graph", "grad-norm-graph", "lr-graph"):
        assert f'"id": "{graph_id}"' in text
    assert '"id": "refresh"' in text and '"interval": 2000' in text
    for graph_id in (
        "grad-norm-heatmap",
        "update-ratio-heatmap",
        "underflow-heatmap",
        "hist-graph",
        "hist-time-graph",
    ):
        assert f'"id": "{graph_id}"' in text
    assert '"value": "fc1.weight"' in text  # the histogram's layer picker is filled up front


def test_unknown_run_shows_a_friendly_not_found_page(dash_client):
    page = render(dash_client, "/dashboard/runs/unknown")

    assert "Run not found" in json.dumps(page)


@pytest.mark.parametrize(
    ("search", "step"), [("?step=120", 120), ("?step=x", None), ("", None), (None, None)]
)
def test_parse_step(search, step):
    assert parse_step(search) == step


def test_an_alert_link_opens_the_run_page_with_its_step_marked(dash_client):
    page = json.dumps(render(dash_client, "/dashboard/runs/r1", "?step=4"))
    assert '"id": "selected-step", "data": 4' in page


@pytest.mark.parametrize(
    ("search", "ids"), [("?runs=a,b", ["a", "b"]), ("?runs=a,,a,b%2Fc", ["a", "b/c"]), ("", []), (None, [])]
)
def test_parse_run_ids(search, ids):
    assert parse_run_ids(search) == ids


def test_the_step_marker_is_not_patched_onto_charts_on_the_page_s_first_call(dash_client):
    # Drawn with the marker (or none) from the start; a patch then would draw them all again. The
    # renderer calls it as the page's layout is inserted, with the step as changed: "opened-step"
    # tells that call apart from a click.
    outputs = callback_outputs(
        dash_client, [*(f"{graph_id}.figure" for graph_id in run.STEP_GRAPHS), "opened-step.data"]
    )

    def mark(step, opened):
        body = {
            "output": ".." + "...".join(outputs) + "..",
            "outputs": [dict(zip(("id", "property"), o.split("."), strict=True)) for o in outputs],
            "inputs": [{"id": "selected-step", "property": "data", "value": step}],
            "state": [{"id": "opened-step", "property": "data", "value": opened}],
            "changedPropIds": ["selected-step.data"],
        }
        return dash_client.post("/_dash-update-component", json=body).json["response"]

    for opened_at in (None, 4):  # a plain page; an alert's link (?step=4)
        assert mark(opened_at, {"step": opened_at}) == {"opened-step": {"data": None}}  # charts untouched
    marked = mark(7, None)  # a click
    assert set(marked) == set(run.STEP_GRAPHS)
    assert mark(4, None).keys() == marked.keys()  # back to the step the page opened at: marked too
