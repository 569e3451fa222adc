"""The events of the runs the dashboard shows, kept in the dashboard process and brought up to date
with one request for what is new (GET /runs/{id}/events?after_id=N), so a live page never reads again
the events it has (skips, warnings, resumes: the run page's timeline, skip and resume markers).

What is kept is checked on every read: the server counts every event of the run, and when the events
kept plus the new ones are not that many (a resume deleted some, an event committed late, another
dashboard process read the run meanwhile) the run's events are read in full once. A cache, not a
source of truth: a process that has not seen a run (several workers) reads it in full, as before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .api_client import ApiClient

__all__ = ["MAX_EVENTS", "MAX_RUNS", "EventLog"]

MAX_EVENTS = 10_000  # per run, as many as the run page ever read at once
MAX_RUNS = 64  # runs kept, least recently read dropped first


@dataclass(frozen=True)
class _Kept:
    events: tuple[dict[str, Any], ...]
    count: int
    last_id: int | None


class EventLog:
    """A run's events, up to date as of each `read`; safe to share between threads."""

    def __init__(self, max_runs: int = MAX_RUNS, max_events: int = MAX_EVENTS) -> None:
        if max_runs < 1 or max_events < 1:
            raise ValueError(f"max_runs and max_events must be positive, got {max_runs!r}, {max_events!r}")
        self.max_runs, self.max_events = max_runs, max_events
        self._runs: OrderedDict[str, _Kept] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, api: ApiClient, run_id: str) -> tuple[list[dict[str, Any]], int, bool]:
        """(the run's events; how many the run has in all; whether the list continues the previous
        read's: the events read before, then those stored since, in the order they were stored; else
        it is all of them in step order, read afresh). One request when the run was read before and
        nothing was lost, two (the new ones, then all) otherwise."""
        with self._lock:
            kept = self._runs.get(run_id)
        continued = False
        if kept is not None and kept.last_id is not None:
            new, count, last_id = api.event_page(run_id, after_id=kept.last_id, limit=self.max_events)
            if len(kept.events) + len(new) == count and count <= self.max_events:
                kept = _Kept(kept.events + tuple(new), count, last_id)
                continued = True
            else:
                kept = None
        if kept is None or kept.last_id is None:
            events, count, last_id = api.event_page(run_id, limit=self.max_events)
            kept = _Kept(tuple(events), count, last_id)
        with self._lock:
            self._runs[run_id] = kept
            self._runs.move_to_end(run_id)
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
        return list(kept.events), kept.count, continued

    def kept(self, run_id: str) -> tuple[list[dict[str, Any]], int] | None:
        """(the run's events as the last `read` left them, how many the run has in all), without a
        request; None when none are kept."""
        with self._lock:
            kept = self._runs.get(run_id)
        return None if kept is None else (list(kept.events), kept.count)

    def forget(self, run_id: str) -> None:
        """Drop what is kept of a run (a run that no longer exists)."""
        with self._lock:
            self._runs.pop(run_id, None)
