"""The runs API: list, read, tag, end and delete runs, with their summaries."""

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Response, status
from fastapi.responses import JSONResponse

from ..attempt_schemas import AttemptDataOut, AttemptList, AttemptOut
from ..deps import (
    AdministeredRunId,
    AlertsDep,
    IngestibleRunId,
    PrincipalDep,
    ReadableRunId,
    RunNames,
    RunNamesDep,
    StoreDep,
    authorize_run,
)
from ..ingest_limits import RESPONSES as INGEST_REFUSALS
from ..ingest_limits import charge_ingest
from ..schemas import (
    BatchAck,
    BatchIn,
    KeyList,
    RunCreated,
    RunIn,
    RunList,
    RunOut,
    RunPatch,
    RunStatus,
    RunSummary,
    Tag,
    json_float,
)
from ..storage import RunFilter, RunRecord
from ..storage.codecs import iso_time

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


def run_out(record: RunRecord, names: RunNames) -> RunOut:
    return RunOut(
        id=names.of_record(record),
        project=record.project,
        name=record.name,
        status=record.status,
        status_reason=record.status_reason,
        created_at=iso_time(record.created_at),
        updated_at=iso_time(record.updated_at),
        last_step=record.last_step,
        tags=record.tags,
        config=record.config,
        metadata=record.metadata,
        summary=RunSummary(
            skips=record.skips, scale=None if record.scale is None else json_float(record.scale)
        ),
    )


@router.post("", status_code=status.HTTP_201_CREATED)
def create_run(run: RunIn, store: StoreDep, principal: PrincipalDep, names: RunNamesDep) -> RunCreated:
    """Create a run. With an `id` that already exists in the same project, returns that run. Run ids
    are a project's own: another project's run of the same id is neither returned nor told of.

    With `resume` (an agent continuing from a checkpoint): "must" answers 404 when there is no such
    run, "never" 409 when there is; "allow" and "must" set an existing run running again, and the
    answer's `resumed` says whether an existing run was continued."""
    principal.require(run.project, "ingest", f"creating a run in project {run.project!r}")
    record = store.create_run(run)
    resumed = record.existed if run.resume is not None else None
    return RunCreated(
        **run_out(record, names).model_dump(),
        resumed=resumed,
        previous_status=record.previous_status if resumed else None,
        previous_status_reason=record.previous_status_reason if resumed else None,
    )


@router.get("")
def list_runs(
    store: StoreDep,
    principal: PrincipalDep,
    names: RunNamesDep,
    project: str | None = None,
    tag: Annotated[
        list[Tag], Query(description="runs with every one of these tags (repeat the parameter)")
    ] = [],  # noqa: B006
    run_status: Annotated[
        list[RunStatus], Query(alias="status", description="runs in any of these states (repeatable)")
    ] = [],  # noqa: B006
    created_after: Annotated[
        datetime | None, Query(description="ISO 8601, e.g. 2026-11-29T08:00:00Z")
    ] = None,
    created_before: Annotated[datetime | None, Query(description="ISO 8601, exclusive")] = None,
    name: Annotated[str | None, Query(max_length=200, description="part of the run's name, any case")] = None,
    sort: Literal["created", "updated", "name", "last_step"] = "created",
    order: Literal["asc", "desc"] = "desc",
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> RunList:
    """Runs matching every given filter; newest first unless sort/order say otherwise."""
    filters = RunFilter(
        project=principal.only_project(project),
        tags=tuple(tag),
        statuses=tuple(run_status),
        created_after=None if created_after is None else _epoch(created_after),
        created_before=None if created_before is None else _epoch(created_before),
        name_contains=name,
        sort=sort,
        ascending=order == "asc",
    )
    records, total = store.list_runs(filters, limit, offset)
    return RunList(data=[run_out(r, names) for r in records], count=total)


def _epoch(moment: datetime) -> float:
    """Seconds since the epoch; a time without a zone is taken as UTC (what the API returns)."""
    if moment.tzinfo is None:
        from datetime import timezone

        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


@router.get("/{run_id}")
def get_run(
    run_id: str,
    store: StoreDep,
    principal: PrincipalDep,
    names: RunNamesDep,
    project: Annotated[
        str | None,
        Query(
            max_length=200,
            description="read the run this project calls run_id (what alert links carry): for a token "
            "for every project, where two projects use the same id; the answer's id is the caller's",
        ),
    ] = None,
) -> RunOut:
    run_id = authorize_run(store, principal, run_id, "read", project)
    return run_out(store.get_run(run_id), names)


@router.patch("/{run_id}")
def update_run(run_id: AdministeredRunId, patch: RunPatch, store: StoreDep, names: RunNamesDep) -> RunOut:
    """Rename a run or replace its tags."""
    return run_out(store.update_run(run_id, patch.name, patch.tags), names)


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_run(run_id: AdministeredRunId, store: StoreDep) -> Response:
    """Delete a run and all of its data."""
    store.delete_run(run_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/{run_id}/batches",
    dependencies=[Depends(charge_ingest)],  # ingest_limits
    responses=INGEST_REFUSALS,
    response_model=BatchAck,
)
def ingest_batch(
    run_id: IngestibleRunId,
    batch: BatchIn,
    store: StoreDep,
    principal: PrincipalDep,
    alerts: AlertsDep,
    guard: Annotated[
        bool,
        Query(description="answer the run's open incidents too (an agent whose guard acts on them)"),
    ] = False,
) -> JSONResponse:
    """Store one agent batch; a batch with a (rank, seq) seen before is acknowledged and ignored. With
    guard=true the acknowledgement also carries the run's open incidents, as judged after this batch."""
    # Replacing a finished run's steps (a resume below them) is an admin's; a job's token only adds.
    result = store.ingest(run_id, batch, may_rewrite_history=principal.open or "admin" in principal.scopes)
    # The acknowledgement as a ready response: validating and serialising a BatchAck for it cost
    # more than the three fields are worth, on every batch.
    ack: dict[str, object] = {"duplicate": result.duplicate, "points": result.points, "events": result.events}
    if result.superseded_from is not None:
        ack["superseded_from"] = result.superseded_from
    if result.second_writer:
        ack["second_writer"] = True
    if guard:
        ack["incidents"] = alerts.guard_incidents(run_id)
    return JSONResponse(ack)


@router.get("/{run_id}/keys")
def list_keys(
    run_id: ReadableRunId,
    store: StoreDep,
    kind: Literal["scalar", "vector", "histogram"] = "scalar",
) -> KeyList:
    """The keys a run has of one kind: scalar series, per-layer vectors or histograms."""
    return KeyList(data=store.keys(run_id, kind), kind=kind)


@router.get("/{run_id}/attempts")
def list_attempts(run_id: ReadableRunId, store: StoreDep) -> AttemptList:
    """What resumes took out of the run's default view, kept: one attempt per superseded stretch of a
    rank (and what a restore replaced), oldest first."""
    found = store.attempts(run_id)
    return AttemptList(data=[AttemptOut(**a) for a in found], count=len(found))


@router.get("/{run_id}/attempts/{attempt_id}")
def get_attempt(run_id: ReadableRunId, attempt_id: int, store: StoreDep) -> AttemptDataOut:
    """A kept attempt with its data, as batch documents of the ingest wire format."""
    return AttemptDataOut(**store.attempt(run_id, attempt_id))


@router.post("/{run_id}/attempts/{attempt_id}/restore")
def restore_attempt(run_id: AdministeredRunId, attempt_id: int, store: StoreDep) -> AttemptOut:
    """Put a kept attempt back in the run's default view: what the rank holds from its step on is kept
    as an attempt in turn, and the attempt's process is no longer cut by the resume that replaced it."""
    return AttemptOut(**store.restore_attempt(run_id, attempt_id))
