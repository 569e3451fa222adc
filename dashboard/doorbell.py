"""Live pages that refresh when the server says something moved, instead of polling.

The server streams news to the dashboard over WebSockets under the dashboard's path, signed in by the
dashboard's cookie (server/routers/live.py: `doorbell` for a run page, `runs_doorbell` for the runs
list). A page that can use one lays out `components(...)`: the stream's settings, the bells it rings
(dcc.Store) and a line saying how the page is live. assets/live_doorbell.js opens the stream; each
message rings the page's bells, each at most once per its `every` ms; a ring ticks the page's
dcc.Interval (the `tick` clientside callbacks below), so the page's own Python callbacks refresh
exactly as on a poll. While the stream is open the intervals keep only a slow safety net (a lost
notification then delays news by at most that long); whenever it is not (a proxy that does not pass
WebSockets, a restart, a standalone dashboard without the server's streams) the page polls at the
intervals' normal periods.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from .callbacks import PageCallbacks

__all__ = ["INTERVALS", "SAFETY_NET_MS", "Bell", "callbacks", "components"]

SAFETY_NET_MS = 60_000  # the intervals' period while the stream is open
RETRY_MS = (2_000, 30_000)  # the first retry of a closed stream, and the longest wait between retries
MODE_LINE = "live-mode"


# The bells of every page, each with the dcc.Interval it ticks: the clientside callback of each is
# declared once, below (the run page's charts and header, its heatmaps and histogram, the runs list).
INTERVALS = {"live-bell": "refresh", "layers-bell": "layers-refresh", "runs-bell": "runs-refresh"}


@dataclass(frozen=True)
class Bell:
    """A dcc.Store `bell` of INTERVALS that the stream rings at most once per `every` ms; each ring
    ticks its dcc.Interval, whose period is `normal` ms while the page polls."""

    bell: str
    every: int
    normal: int


callbacks = PageCallbacks()


def components(url: str | None, bells: tuple[Bell, ...], polling: str) -> list[Any]:
    """What a live page lays out: with `url` (the stream's path) the doorbell's settings and its bells;
    either way the line saying how the page is live (`polling` until the stream is open)."""
    line = html.P(f"Live: {polling}.", id=MODE_LINE, className="muted hint")
    if url is None:
        return [line]
    unknown = [bell.bell for bell in bells if bell.bell not in INTERVALS]
    if unknown:
        raise ValueError(f"bells {unknown} are not in doorbell.INTERVALS")
    config = {
        "url": url,
        "mode": MODE_LINE,
        "polling": polling,
        "bells": [{**asdict(bell), "interval": INTERVALS[bell.bell]} for bell in bells],
        "safety_net": SAFETY_NET_MS,
        "retry": list(RETRY_MS),
    }
    return [
        dcc.Store(id="live-doorbell", data=config),
        dcc.Store(id="live-doorbell-state", data=None),
        *(dcc.Store(id=bell.bell, data=None) for bell in bells),
        line,
    ]


callbacks.clientside_callback(
    dash.ClientsideFunction("gradwatch_doorbell", "connect"),
    Output("live-doorbell-state", "data"),
    Input("live-doorbell", "data"),
)
for _bell, _interval in INTERVALS.items():
    # A ring ticks the interval, so every callback that refreshes on it runs as on a tick.
    callbacks.clientside_callback(
        dash.ClientsideFunction("gradwatch_doorbell", "tick"),
        Output(_interval, "n_intervals", allow_duplicate=True),
        Input(_bell, "data"),
        State(_interval, "n_intervals"),
        prevent_initial_call=True,
    )
