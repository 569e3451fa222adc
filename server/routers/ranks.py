"""The ranks of a distributed run and their values combined (see gradwatch.server.ranks)."""


from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from .. import ranks
from ..deps import PrincipalDep, StoreDep, authorize_run
from ..schemas import JsonFloat, json_float

router = APIRouter(prefix="/api/v1/runs", tags=["ranks"])

Combine = Literal["auto", "l2", "sum", "mean", "min", "max"]
COMBINE_DOC = (
    "l2: sqrt of the sum of squares (global norm of sharded gradients); sum; mean; min; max; "
    "auto: l2 for norm keys of a sharded run, else mean"
)


class RankOut(BaseModel):
    rank: int
    host: str | None
    local_rank: int | None
    world_size: int | None
    pid: int | None
    parallelism: str | None = Field(description="fsdp2, fsdp, ddp, dtensor or none")
    gradients: str | None = Field(description="sharded, replicated, hybrid or local")
    histograms: bool | None = Field(description="whether this rank takes gradient histograms")
    status: str | None = Field(description="how the rank ended (finished, crashed); null while running")
    batches: int
    last_seen: float | None = Field(description="seconds since the epoch of the rank's newest batch")


class RankList(BaseModel):
    data: list[RankOut]
    count: int
    world_size: int
    gradients: str = Field(description="the layout the ranks reported; mixed if they differ")


class CombinedSeriesOut(BaseModel):
    key: str
    combine: str = Field(description="the mode applied (auto resolved)")
    ranks: list[int]
    steps: list[int]
    values: list[JsonFloat]
    per_rank: dict[str, list[JsonFloat]] = Field(description="rank -> its value at each of steps")
    downsampled: bool


class CombinedVectorsOut(BaseModel):
    key: str
    combine: str
    ranks: list[int]
    layers: list[str]
    steps: list[int]
    values: list[list[JsonFloat]]
    downsampled: bool


class CombinedHistogramsOut(BaseModel):
    key: str
    layer: str
    combine: str
    ranks: list[int]
    exponents: list[int]
    steps: list[int]
    counts: list[list[int]]
    zeros: list[int]
    non_finite: list[int]


class DisagreementOut(BaseModel):
    step: int
    skipped_ranks: list[int]
    applied_ranks: list[int]
    layers: list[str]


class DisagreementList(BaseModel):
    data: list[DisagreementOut]
    count: int = Field(description="disagreeing steps in the range, before limit")


def _readable_run(run_id: str, store: StoreDep, principal: PrincipalDep) -> Iterator[Session]:
    """A session to read the run with, once the caller may read it (404 unknown run, 401/403 token)."""
    authorize_run(store, principal, run_id, "read")
    with Session(store.engine) as session:  # reads only: nothing to commit
        yield session


SessionDep = Annotated[Session, Depends(_readable_run)]


@router.get("/{run_id}/ranks")
def list_ranks(run_id: str, session: SessionDep) -> RankList:
    """The run's ranks: host, local rank, gradient layout, how each ended, batches received."""
    summary = ranks.rank_summary(session, run_id)
    return RankList(
        data=[RankOut(**vars(info)) for info in summary.ranks], count=len(summary.ranks),
        world_size=summary.world_size, gradients=summary.gradients,
    )


@router.get("/{run_id}/ranks/series")
def combined_series(
    run_id: str,
    session: SessionDep,
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. grad/global_norm")],
    combine: Annotated[Combine, Query(description=COMBINE_DOC)] = "auto",
    max_points: Annotated[int, Query(ge=2, le=100_000)] = 2000,
    start: Annotated[int | None, Query(ge=0, description="first step, inclusive")] = None,
    end: Annotated[int | None, Query(ge=0, description="last step, exclusive")] = None,
) -> CombinedSeriesOut:
    """One scalar key combined over the ranks at each step all of them reached, with each rank's value."""
    result = ranks.combined_series(session, run_id, key, combine, start, end, max_points)
    return CombinedSeriesOut(
        key=result.key, combine=result.combine, ranks=result.ranks, steps=result.steps,
        values=[json_float(v) for v in result.values],
        per_rank={str(rank): [json_float(v) for v in values] for rank, values in result.per_rank.items()},
        downsampled=result.downsampled,
    )


@router.get("/{run_id}/ranks/vectors")
def combined_vectors(
    run_id: str,
    session: SessionDep,
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. grad/norm")],
    combine: Annotated[Combine, Query(description=COMBINE_DOC)] = "auto",
    max_steps: Annotated[int, Query(ge=1, le=20_000)] = 500,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
) -> CombinedVectorsOut:
    """A per-layer key combined over the ranks, layer by layer (step x layer matrix)."""
    result = ranks.combined_vectors(session, run_id, key, combine, start, end, max_steps)
    return CombinedVectorsOut(
        key=result.key, combine=result.combine, ranks=result.ranks, layers=result.layers, steps=result.steps,
        values=[[json_float(v) for v in row] for row in result.values], downsampled=result.downsampled,
    )


@router.get("/{run_id}/ranks/histograms")
def combined_histograms(
    run_id: str,
    session: SessionDep,
    layer: Annotated[str, Query(min_length=1, max_length=500)],
    key: Annotated[str, Query(min_length=1, max_length=250)] = "grad/hist",
    combine: Annotated[Literal["auto", "sum", "first"], Query(
        description="sum: add the ranks' counts (sharded); first: the lowest rank's (replicated); auto: by layout"
    )] = "auto",
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 200,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
) -> CombinedHistogramsOut:
    """One layer's log2|g| histograms over the ranks (the whole gradient's, for sharded gradients)."""
    result = ranks.combined_histograms(session, run_id, layer, key, combine, start, end, max_steps)
    return CombinedHistogramsOut(**vars(result))


@router.get("/{run_id}/ranks/disagreements")
def list_disagreements(
    run_id: str,
    session: SessionDep,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> DisagreementList:
    """Steps skipped (amp/skipped) on some ranks but applied on others: their weights now differ."""
    found, total = ranks.disagreements(session, run_id, start, end, limit)
    return DisagreementList(data=[DisagreementOut(**vars(d)) for d in found], count=total)
