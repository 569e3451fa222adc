from typing import Annotated

from fastapi import APIRouter, Query

from ..deps import StoreDep
from ..schemas import EventList, EventOut, SeriesOut, json_float

router = APIRouter(prefix="/api/v1/runs", tags=["series"])


@router.get("/{run_id}/series")
def get_series(
    run_id: str,
    store: StoreDep,
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. amp/scale, loss")],
    max_points: Annotated[int, Query(ge=2, le=100_000)] = 2000,
    start: Annotated[int | None, Query(ge=0, description="first step, inclusive")] = None,
    end: Annotated[int | None, Query(ge=0, description="last step, exclusive")] = None,
    rank: Annotated[int, Query(ge=0)] = 0,
) -> SeriesOut:
    """One scalar series over [start, end); exact up to max_points points, min/max-downsampled beyond."""
    result = store.series(run_id, key, rank, start, end, max_points)
    return SeriesOut(
        key=key,
        rank=rank,
        steps=result.steps,
        values=[json_float(v) for v in result.values],
        downsampled=result.downsampled,
    )


@router.get("/{run_id}/events")
def list_events(
    run_id: str,
    store: StoreDep,
    kind: str | None = None,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> EventList:
    """Events in step order (e.g. kind=skip for skipped optimizer steps)."""
    records, total = store.events(run_id, kind, start, end, limit)
    return EventList(
        data=[EventOut(step=e.step, kind=e.kind, rank=e.rank, data=e.data) for e in records], count=total
    )
