"""How the pages declare their callbacks, and what the callbacks read through.

A page module declares its callbacks at module level, beside its layout, on a `PageCallbacks` of its
own: `@callbacks.callback(...)` takes dash.callback's arguments and leaves the function as it is.
`create_dash_app` adds every page's callbacks to the app it builds (`PageCallbacks.register`). Not
dash.callback itself: that hands the callbacks it collected to the first app that serves a request,
and none to the apps made after it (a process may make several: tests make one each).

What a callback reads through besides its inputs (the API client, the workers for its independent
calls, the run events kept between refreshes, the run page's links) is its app's `Services`: set on
the app's Flask server when the app is built (`attach_services`), read with `services()` while
serving one of its requests, the background workers' copies of a request included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import dash
import flask

from .event_log import EventLog

if TYPE_CHECKING:
    from .api_client import ApiClient
    from .app import Background
    from .views import RunHref

__all__ = ["SERVICES_KEY", "PageCallbacks", "Services", "attach_services", "services"]

SERVICES_KEY = "gradwatch.dashboard"  # the app's Services, in its Flask server's `extensions`

CallbackFunction = TypeVar("CallbackFunction", bound=Callable[..., Any])


class PageCallbacks:
    """The callbacks one page module declares, to be added to each app that shows the page."""

    def __init__(self) -> None:
        self._declared: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
        # Callbacks that run in the browser: dash.clientside_callback's arguments.
        self._clientside: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def callback(self, *args: Any, **kwargs: Any) -> Callable[[CallbackFunction], CallbackFunction]:
        """Declare the decorated function a callback, with dash.callback's arguments (outputs,
        inputs, states, prevent_initial_call, ...); it is returned unchanged."""

        def declare(function: CallbackFunction) -> CallbackFunction:
            self._declared.append((function, args, kwargs))
            return function

        return declare

    def clientside_callback(self, function: Any, *args: Any, **kwargs: Any) -> None:
        """Declare a callback that runs in the browser (a dash.ClientsideFunction of the assets'
        scripts), with dash.clientside_callback's arguments."""
        self._clientside.append((function, args, kwargs))

    def register(self, app: dash.Dash) -> None:
        """Add every callback declared here to `app`."""
        for function, args, kwargs in self._declared:
            app.callback(*args, **kwargs)(function)
        for clientside, args, kwargs in self._clientside:
            app.clientside_callback(clientside, *args, **kwargs)


@dataclass(frozen=True)
class Services:
    """What the callbacks of one app read through.

    app: the Dash app (its URLs: app.get_relative_path, app.config.requests_pathname_prefix).
    api: the ApiClient every page reads and changes through.
    background: workers that run a callback's independent API calls together.
    run_href: run_href(run_id, step) → a run page's URL, with that step marked when given.
    event_log: the runs' events kept between the run page's refreshes.
    live_doorbell: the URL path under which the server streams a run's news to its page
        ("/dashboard/live/"; the run id follows), None where the dashboard runs without that server
        (its pages then poll).
    """

    app: dash.Dash
    api: ApiClient
    background: Background
    run_href: RunHref
    event_log: EventLog = field(default_factory=EventLog)
    live_doorbell: str | None = None


def attach_services(app: dash.Dash, app_services: Services) -> None:
    """Make `app_services` what `services()` returns while `app` serves a request."""
    app.server.extensions[SERVICES_KEY] = app_services


def services() -> Services:
    """The Services of the app serving the current request (a callback's, or a background worker's
    copy of it). Raises LookupError outside one, or for an app that create_dash_app did not build."""
    found: Services | None = (
        flask.current_app.extensions.get(SERVICES_KEY) if flask.has_app_context() else None
    )
    if found is None:
        raise LookupError("no gradwatch dashboard is serving a request here (build it with create_dash_app)")
    return found
