"""gradwatch dashboard: a Dash app that reads the server's HTTP API (never the store, never torch).

Build it with `create_dash_app("http://127.0.0.1:8765")` and mount its Flask server under the prefix
it was built for, e.g. `fastapi_app.mount("/dashboard", a2wsgi.WSGIMiddleware(dash_app.server))`.
"""

from .app import create_dash_app

__all__ = ["create_dash_app"]
