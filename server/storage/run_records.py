"""A run as the Store returns it (RunRecord) and the filters and sort orders of the run list
(RunFilter).

RunRecord is a frozen snapshot of a run's row with its tags, config and metadata, its skip count and
latest loss scale, and (from create_run) how a resumed run stood before; RunFilter is what the run
list's query parameters select by, _SORT_COLUMNS the columns it sorts by. Both records are built and
read by gradwatch.server.storage.store and re-exported by the storage package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func

from ..models import Run


@dataclass(frozen=True)
class RunRecord:
    id: str
    project: str
    name: str
    status: str
    created_at: float
    updated_at: float
    last_step: int | None
    tags: list[str]
    config: dict[str, Any]
    metadata: dict[str, Any]
    skips: int
    scale: float | None
    status_reason: str | None = None
    # The id the run's project asked for when another project's run had it (Store.find_run).
    requested_id: str | None = None
    # create_run only: the run was there already (not created by this call), and, when the call
    # resumed it, how it stood before (the resumed agent's `resume` event carries this along).
    existed: bool = False
    previous_status: str | None = None
    previous_status_reason: str | None = None


@dataclass(frozen=True)
class RunFilter:
    project: str | None = None
    tags: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()
    created_after: float | None = None  # seconds since the epoch
    created_before: float | None = None
    name_contains: str | None = None
    sort: str = "created"  # a key of _SORT_COLUMNS
    ascending: bool = False


_SORT_COLUMNS = {
    "created": Run.created_at,
    "updated": Run.updated_at,
    "name": func.lower(Run.name),
    "last_step": Run.last_step,
}
