"""The Dash app's shell: the page routing, the chrome every page shares, the plumbing that lets a
callback's API calls carry the signed-in person's token, also from worker threads, and how the
browser gets its scripts (plotly.js's cartesian bundle for the full one, what the run page's graphs
load fetched from the start, scripts and style sheets compressed).

Pages (one dcc.Location, routed by a callback on its pathname), with the default prefix; each is a
module of `pages` with its layout and its callbacks, declared beside it (`callbacks.PageCallbacks`)
and added to every app built here:
    /dashboard/                         runs list (`pages.runs`)
    /dashboard/runs/{run_id}[?step=N]   run page (`pages.run`); ?step=N (alert links) marks step N,
                                        ?project=P (alert links) names P's run of that id
    /dashboard/compare?runs=id1,id2     one scalar key of several runs overlaid (`pages.compare`)
    /dashboard/alerts                   alerts, rules and webhooks (`pages.alerts`, with the cards
                                        of `pages.alert_rules` and `pages.webhooks`)
    /dashboard/signin                   the token form, also shown instead of any page while the
                                        server asks for a token (`pages.signin`)

Every page reads through one ApiClient, which the callbacks reach as `services().api` (the app's
`callbacks.Services`, set on its Flask server here); user-supplied names are only ever passed as
component children, which Dash renders as text (and escaped before they reach plotly, which would
otherwise read tags in them).
"""

from __future__ import annotations

import gzip
import hashlib
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

import dash
import flask
import httpx
from dash import Input, Output, dcc, html

from . import doorbell
from .api_client import ApiClient, ApiError, RunNotFound
from .callbacks import PageCallbacks, Services, attach_services, services
from .pages import alert_rules, alerts, compare, run, run_layers, runs, signin, webhooks
from .views import error_banner

__all__ = ["Background", "create_dash_app", "parse_route"]

ASSETS_FOLDER = Path(__file__).parent / "assets"
BACKGROUND_WORKERS = 8
# Where dcc.Graph loads plotly.js from when Dash serves it (serve_locally).
PLOTLY_JS = "_dash-component-suites/plotly/package_data/plotly.min.js"
# What is served there instead: plotly.js's cartesian bundle, of the version plotly.py ships (a test
# keeps them equal), with every trace type the dashboard draws (scatter, bar, heatmap, image). A third
# of the full bundle (1.5 MB against 4.8 MB), the browser runs it in a third of the time (0.65-0.97 s
# against 1.8-2.5 s on the busy development VM), and the run page's graphs wait for it.
# From the npm package plotly.js-cartesian-dist-min (MIT: plotly-cartesian.LICENSE.txt beside it).
PLOTLY_BUNDLE = "plotly-cartesian.min.js"  # in ASSETS_FOLDER, left out of the pages' scripts
# What the run page's graphs and dropdowns load when they first render (paths as Dash serves them
# with serve_locally: plotly.js and dcc's lazily loaded chunks).
PRELOADED = (
    PLOTLY_JS,
    "_dash-component-suites/dash/dcc/async-graph.js",
    "_dash-component-suites/dash/dcc/async-dropdown.js",
)
# Dash's default page with a {%preload%} slot in its head.
INDEX = """<!DOCTYPE html>
<html>
    <head>
        {%metas%}
        <title>{%title%}</title>
        {%favicon%}
        {%css%}
        {%preload%}
    </head>
    <body>
        {%app_entry%}
        <footer>
            {%config%}
            {%scripts%}
            {%renderer%}
        </footer>
    </body>
</html>"""
# Dash's first script, @babel/polyfill (core-js 2), is for browsers without ES2015: it costs ~0.2 s of
# the main thread to run as a page opens, and it swaps in its own, slower String.prototype.trim and
# parseInt, which plotly.js calls for every colour it parses. Left out; of what it brings the
# browsers Dash 4 supports lack only `regeneratorRuntime`, which dcc's lazily loaded components
# (graphs, dropdowns) call: assets/regenerator-runtime.js has it.
POLYFILL_SCRIPT = re.compile(r'<script src="[^"]*/deps/polyfill@[^"]*"></script>\s*')
COMPRESSED_TYPES = ("text/javascript", "application/javascript", "text/css")
MIN_COMPRESSED_BYTES = 1024


def create_dash_app(
    api_base_url: str,
    requests_pathname_prefix: str = "/dashboard/",
    *,
    token: str | None = None,
    http_client: httpx.Client | None = None,
    live_doorbell: bool = False,
) -> dash.Dash:
    """The dashboard as a Dash app whose Flask server (`app.server`) routes relative to "/".

    api_base_url: root of the gradwatch server whose /api/v1 the dashboard reads, e.g.
        "http://127.0.0.1:8765".
    requests_pathname_prefix: the URL path the app is mounted under, with leading and trailing "/";
        the browser requests pages and assets below it (mount the WSGI app there, e.g. with
        a2wsgi.WSGIMiddleware(app.server) at "/dashboard").
    token: an API token, sent as a Bearer token; None when the server needs none. A read-scope token
        shows everything; the Alerts page's changes (rules, acknowledging, webhooks) need admin scope,
        and what the server refuses is shown next to the form.
    http_client: an httpx.Client for API calls (tests pass one with a MockTransport); the caller owns it.
    live_doorbell: whether the server this app is mounted in streams each run's news to its page at
        {prefix}live/{run_id} (gradwatch.server.serve does): a live run page then refreshes when told
        to, instead of polling every 2 s (and polls again whenever the stream is not open).
    """
    prefix = requests_pathname_prefix
    if not prefix.startswith("/") or not prefix.endswith("/"):
        raise ValueError(f"requests_pathname_prefix must start and end with '/', got {prefix!r}")
    # Each API call carries the token of the person asking (their session cookie), else `token`.
    api = ApiClient(api_base_url, token=token, token_provider=signin.token_from_request, client=http_client)
    app = _DashApp(
        __name__,
        requests_pathname_prefix=prefix,
        routes_pathname_prefix="/",
        title="gradwatch",
        # No "Updating..." flicker in the tab title on every refresh. Dash documents None for this;
        # its annotation says str.
        update_title=None,  # type: ignore[arg-type]
        serve_locally=True,
        suppress_callback_exceptions=True,
        assets_folder=str(ASSETS_FOLDER),
        assets_ignore=re.escape(PLOTLY_BUNDLE),
    )
    app.layout = _shell(app)
    # The run page's graphs load plotly.js (4.8 MB) and dcc's graph and dropdown code only once
    # they are on the page; fetched from the start instead, they are there by then. At low
    # priority: Chromium then fetches the page's own scripts first (over HTTP/1.1's six connections),
    # which the page's layout, and so its first callbacks, wait for.
    preloads = "".join(
        f'<link rel="preload" href="{prefix}{path}" as="script" fetchpriority="low">' for path in PRELOADED
    )
    app.index_string = INDEX.replace("{%preload%}", preloads)
    _serve_plotly_bundle(app.server)
    _compress_static_files(app.server)
    doorbell = f"{prefix}live/" if live_doorbell else None
    attach_services(app, Services(app, api, Background(), partial(run.href, app), live_doorbell=doorbell))
    signin.register(app, api, prefix)
    for declared in CALLBACKS:
        declared.register(app)
    return app


class _DashApp(dash.Dash):
    """dash.Dash, its pages' scripts without POLYFILL_SCRIPT."""

    def interpolate_index(  # type: ignore[no-untyped-def]  # as untyped as Dash's own
        self,
        metas="",
        title="",
        css="",
        config="",
        scripts="",
        app_entry="",
        favicon="",
        renderer="",
    ):
        return super().interpolate_index(  # type: ignore[no-untyped-call]
            metas, title, css, config, POLYFILL_SCRIPT.sub("", scripts), app_entry, favicon, renderer
        )


def parse_route(pathname: str | None, prefix: str = "/dashboard/") -> tuple[str, str | None]:
    """("runs", None) for the runs list, ("run", run_id) for a run page, ("compare", None) for the
    compare page, ("alerts", None) for the alerts page, ("signin", None) for the sign-in page,
    ("unknown", path) otherwise."""
    path = pathname or prefix
    root = prefix.rstrip("/")
    if path == root or path.startswith(root + "/"):
        path = path[len(root) :]
    parts = [part for part in path.split("/") if part]
    if not parts:
        return "runs", None
    if len(parts) == 2 and parts[0] == "runs":
        return "run", unquote(parts[1])
    if parts == ["compare"]:
        return "compare", None
    if parts == ["alerts"]:
        return "alerts", None
    if parts == ["signin"]:
        return "signin", None
    return "unknown", path


class Background:
    """Worker threads for the independent API calls of one callback, so a page load waits for the
    slowest call rather than for their sum. Each call runs inside a copy of the request's context:
    the API client reads the signed-in person's token from the request's cookie, and a worker
    thread has no request of its own."""

    def __init__(self, workers: int = BACKGROUND_WORKERS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gradwatch-dashboard")

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        """Start `call` on a worker; its result (or exception) comes from the future."""
        if flask.has_request_context():
            call = flask.copy_current_request_context(call)
        return self._pool.submit(call)

    def fetch_all(self, calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run `calls` together; their results by name. The first exception, in `calls` order, is
        raised once all have been started."""
        futures = {name: self.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


routing = PageCallbacks()


@routing.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"))
def render_page(pathname: str | None, search: str | None) -> Any:
    """The page at the URL's path (and query), or the sign-in page while the server asks for a token."""
    app, api = services().app, services().api
    prefix = app.config.requests_pathname_prefix
    page, run_id = parse_route(pathname, prefix)
    query = parse_qs((search or "").lstrip("?"))
    if page == "signin":
        error = query.get("error")
        return signin.layout(
            prefix,
            (query.get("next") or [prefix])[0],
            signin.error_message(error[0]) if error else None,
            signed_in=signin.token_from_request() is not None,
        )
    try:
        api.whoami()  # a server with tokens: sign in first (one small request per page)
    except ApiError as exc:
        if exc.status_code == 401:
            here = (pathname or prefix) + (search or "")
            message = "Signed-in token no longer accepted." if signin.token_from_request() else None
            return signin.layout(prefix, here, message, signed_in=False)
    if page == "runs":
        return runs.layout(services().live_doorbell)
    if page == "compare":
        return compare.layout(compare.parse_run_ids(search))
    if page == "alerts":
        return alerts.layout(api, services().background)
    if page == "run" and run_id:
        try:
            return run.layout(
                api, run_id, selected_step=run.parse_step(search), project=run.parse_project(search)
            )
        except RunNotFound:
            return _not_found_page(app, "Run not found", f"There is no run with id “{run_id}”.")
        except ApiError as exc:
            return _api_error_page(app, exc)
    return _not_found_page(app, "Page not found", f"There is no dashboard page at “{pathname}”.")


# What every app gets, in this order: the pages' callbacks, then the routing.
CALLBACKS = (
    doorbell.callbacks,
    runs.callbacks,
    run_layers.callbacks,
    run.callbacks,
    compare.callbacks,
    alerts.callbacks,
    alert_rules.callbacks,
    webhooks.callbacks,
    routing,
)


def _serve_plotly_bundle(server: flask.Flask) -> None:
    """Answer dcc.Graph's request for plotly.js with PLOTLY_BUNDLE (read once)."""
    bundle = (ASSETS_FOLDER / PLOTLY_BUNDLE).read_bytes()
    tag = hashlib.blake2b(bundle, digest_size=16).hexdigest()

    @server.before_request
    def plotly_bundle() -> flask.Response | None:
        if flask.request.path != "/" + PLOTLY_JS:
            return None
        if tag in flask.request.headers.get("If-None-Match", ""):
            return flask.Response(status=304)
        response = flask.Response(bundle, mimetype="text/javascript")
        response.set_etag(tag)
        return response


def _compress_static_files(server: flask.Flask) -> None:
    """Serve the scripts and style sheets gzip-compressed to browsers that accept it, each compressed
    once (plotly.js: 4.8 MB, 1.4 MB compressed; the process that sends it is the busy API server)."""
    compressed: dict[tuple[str, str], bytes] = {}
    lock = threading.Lock()

    @server.after_request
    def compress(response: flask.Response) -> flask.Response:
        if (
            response.status_code != 200
            or response.direct_passthrough
            or response.is_streamed
            or response.mimetype not in COMPRESSED_TYPES
            or "gzip" not in flask.request.headers.get("Accept-Encoding", "")
            or "Content-Encoding" in response.headers
        ):
            return response
        body = response.get_data()
        if len(body) < MIN_COMPRESSED_BYTES:
            return response
        key = (flask.request.path, hashlib.blake2b(body, digest_size=16).hexdigest())
        with lock:  # one thread compresses a file; the others wait for it
            if key not in compressed:
                compressed[key] = gzip.compress(body, compresslevel=6, mtime=0)
            response.set_data(compressed[key])
        response.headers["Content-Encoding"] = "gzip"
        response.vary.add("Accept-Encoding")
        tag, weak = response.get_etag()
        if tag:  # another representation: another tag
            response.set_etag(tag + "-gzip", weak=bool(weak))
        return response


# -- chrome ------------------------------------------------------------------------------------------


def _shell(app: dash.Dash) -> html.Div:
    return html.Div(
        [
            dcc.Location(id="url", refresh=False),
            # Kept across pages, so picking runs to compare survives paging and searching.
            dcc.Store(id="selected-runs", data=[]),
            html.Header(
                [
                    dcc.Link("gradwatch", href=app.get_relative_path("/"), className="brand"),
                    html.Span("training health", className="tagline"),
                    html.Nav(
                        [
                            dcc.Link("Runs", href=app.get_relative_path("/"), id="nav-runs"),
                            dcc.Link("Alerts", href=app.get_relative_path("/alerts"), id="nav-alerts"),
                            dcc.Link("Token", href=app.get_relative_path("/signin"), id="nav-signin"),
                        ],
                        className="nav",
                    ),
                ],
                className="topbar",
            ),
            html.Main(id="page", className="page"),
        ],
        className="app",
    )


def _not_found_page(app: dash.Dash, title: str, message: str) -> html.Div:
    return html.Div(
        [
            html.H1(title),
            html.P(message),
            dcc.Link("← All runs", href=app.get_relative_path("/")),
        ],
        className="card not-found",
    )


def _api_error_page(app: dash.Dash, error: ApiError) -> html.Div:
    return html.Div([error_banner(error), dcc.Link("← All runs", href=app.get_relative_path("/"))])
