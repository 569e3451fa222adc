"""The ranks of a distributed run and their values combined (see gradwatch.server.storage.ranks)."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from ..deps import ReadableRunId, StoreDep
from ..schemas import (
    CombinedHistogramsOut,
    CombinedSeriesOut,
    CombinedVectorsOut,
    DisagreementList,
    DisagreementOut,
    RankList,
    RankOut,
    json_float,
)

router = APIRouter(prefix="/api/v1/runs", tags=["ranks"])

Combine = Literal["auto", "l2", "sum", "mean", "min", "max"]
COMBINE_DOC = (
    "l2: sqrt of the sum of squares (global norm of sharded gradients); sum; mean; min; max; "
    "auto: l2 for norm keys of a sharded run, else mean"
)


@router.get("/{run_id}/ranks")
def list_ranks(run_id: ReadableRunId, store: StoreDep) -> RankList:
    """The run's ranks: host, local rank, gradient layout, how each ended, batches received."""
    summary = store.ranks.rank_summary(run_id)
    return RankList(
        data=[RankOut.model_validate(info) for info in summary.ranks],
        count=len(summary.ranks),
        world_size=summary.world_size,
        gradients=summary.gradients,
    )


@router.get("/{run_id}/ranks/series")
def combined_series(
    run_id: ReadableRunId,
    store: StoreDep,
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. grad/global_norm")],
    combine: Annotated[Combine, Query(description=COMBINE_DOC)] = "auto",
    max_points: Annotated[int, Query(ge=2, le=100_000)] = 2000,
    start: Annotated[int | None, Query(ge=0, description="first step, inclusive")] = None,
    end: Annotated[int | None, Query(ge=0, description="last step, exclusive")] = None,
) -> CombinedSeriesOut:
    """One scalar key combined over the ranks at each step all of them reached, with each rank's value."""
    result = store.ranks.combined_series(run_id, key, combine, start, end, max_points)
    return CombinedSeriesOut(
        key=result.key,
        combine=result.combine,
        ranks=result.ranks,
        steps=result.steps,
        values=[json_float(v) for v in result.values],
        per_rank={str(rank): [json_float(v) for v in values] for rank, values in result.per_rank.items()},
        downsampled=result.downsampled,
    )


@router.get("/{run_id}/ranks/vectors")
def combined_vectors(
    run_id: ReadableRunId,
    store: StoreDep,
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. grad/norm")],
    combine: Annotated[Combine, Query(description=COMBINE_DOC)] = "auto",
    max_steps: Annotated[int, Query(ge=1, le=20_000)] = 500,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
) -> CombinedVectorsOut:
    """A per-layer key combined over the ranks, layer by layer (step x layer matrix)."""
    result = store.ranks.combined_vectors(run_id, key, combine, start, end, max_steps)
    return CombinedVectorsOut(
        key=result.key,
        combine=result.combine,
        ranks=result.ranks,
        layers=result.layers,
        steps=result.steps,
        values=[[json_float(v) for v in row] for row in result.values],
        downsampled=result.downsampled,
    )


@router.get("/{run_id}/ranks/histograms")
def combined_histograms(
    run_id: ReadableRunId,
    store: StoreDep,
    layer: Annotated[str, Query(min_length=1, max_length=500)],
    key: Annotated[str, Query(min_length=1, max_length=250)] = "grad/hist",
    combine: Annotated[
        Literal["auto", "sum", "first"],
        Query(
            description="sum: add the ranks' counts (sharded); first: the lowest rank's (replicated); auto: "
            "by layout"
        ),
    ] = "auto",
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 200,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
) -> CombinedHistogramsOut:
    """One layer's log2|g| histograms over the ranks (the whole gradient's, for sharded gradients)."""
    result = store.ranks.combined_histograms(run_id, layer, key, combine, start, end, max_steps)
    return CombinedHistogramsOut.model_validate(result)


@router.get("/{run_id}/ranks/disagreements")
def list_disagreements(
    run_id: ReadableRunId,
    store: StoreDep,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> DisagreementList:
    """Steps skipped (amp/skipped) on some ranks but applied on others: their weights now differ."""
    found, total = store.ranks.disagreements(run_id, start, end, limit)
    return DisagreementList(data=[DisagreementOut.model_validate(d) for d in found], count=total)
