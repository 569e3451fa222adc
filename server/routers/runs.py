from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response, status

from ..deps import StoreDep
from ..schemas import BatchAck, BatchIn, KeyList, RunIn, RunList, RunOut, RunSummary, json_float
from ..store import RunRecord

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


def _iso(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def run_out(record: RunRecord) -> RunOut:
    return RunOut(
        id=record.id,
        project=record.project,
        name=record.name,
        status=record.status,
        created_at=_iso(record.created_at),
        updated_at=_iso(record.updated_at),
        last_step=record.last_step,
        config=record.config,
        metadata=record.metadata,
        summary=RunSummary(
            skips=record.skips, scale=None if record.scale is None else json_float(record.scale)
        ),
    )


@router.post("", status_code=status.HTTP_201_CREATED)
def create_run(run: RunIn, store: StoreDep) -> RunOut:
    """Create a run. With an `id` that already exists in the same project, returns that run."""
    return run_out(store.create_run(run))


@router.get("")
def list_runs(
    store: StoreDep,
    project: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> RunList:
    """Runs, newest first."""
    records, total = store.list_runs(project, limit, offset)
    return RunList(data=[run_out(r) for r in records], count=total)


@router.get("/{run_id}")
def get_run(run_id: str, store: StoreDep) -> RunOut:
    return run_out(store.get_run(run_id))


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_run(run_id: str, store: StoreDep) -> Response:
    """Delete a run and all of its data."""
    store.delete_run(run_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/{run_id}/batches")
def ingest_batch(run_id: str, batch: BatchIn, store: StoreDep) -> BatchAck:
    """Store one agent batch; a batch with a (rank, seq) seen before is acknowledged and ignored."""
    result = store.ingest(run_id, batch)
    return BatchAck(duplicate=result.duplicate, points=result.points, events=result.events)


@router.get("/{run_id}/keys")
def list_keys(
    run_id: str, store: StoreDep, kind: Literal["scalar", "vector", "histogram"] = "scalar"
) -> KeyList:
    """The keys a run has of one kind: scalar series, per-layer vectors or histograms."""
    return KeyList(data=store.keys(run_id, kind), kind=kind)
