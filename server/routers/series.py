"""The series API: one run's scalar and per-layer values over steps, downsampled for the dashboard."""

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ..deps import PrincipalDep, ReadableRunId, StoreDep, authorize_run
from ..errors import InvalidRequest
from ..http_errors import model_json
from ..schemas import (
    CompareOut,
    CompareSeries,
    EventList,
    EventOut,
    HistogramsOut,
    SeriesOut,
    VectorsOut,
    json_float,
)
from ..storage.events import EventReads

router = APIRouter(prefix="/api/v1/runs", tags=["series"])
compare_router = APIRouter(prefix="/api/v1/compare", tags=["series"])
MAX_COMPARED_RUNS = 50


class EventPageOut(EventList):
    """GET /runs/{id}/events: the events, how many match, and the cursor to read on from."""

    last_id: int | None = Field(
        default=None,
        description="pass as after_id to get only the events stored after these; null when limit cut "
        "a list in step order short",
    )


@compare_router.get("", response_model=CompareOut)
def compare_runs(
    store: StoreDep,
    principal: PrincipalDep,
    run: Annotated[
        list[str], Query(min_length=1, description="run ids (repeat the parameter), in display order")
    ],
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. loss, amp/scale")],
    max_points: Annotated[int, Query(ge=2, le=100_000, description="per run")] = 2000,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
    rank: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    """One key of several runs in one call, each downsampled like /series, aligned by step."""
    if len(run) > MAX_COMPARED_RUNS:
        raise InvalidRequest(f"at most {MAX_COMPARED_RUNS} runs per comparison, got {len(run)}")
    data = []
    for run_id in dict.fromkeys(run):  # each run once, first occurrence's order
        stored = authorize_run(store, principal, run_id, "read")  # 404: unknown, or another project's
        record = store.get_run(stored)
        result = store.series(stored, key, rank, start, end, max_points)
        data.append(
            CompareSeries(
                run_id=run_id,  # as the caller named it
                name=record.name,
                project=record.project,
                steps=result.steps,
                values=[json_float(v) for v in result.values],
                downsampled=result.downsampled,
            )
        )
    return model_json(CompareOut(key=key, rank=rank, data=data))


@router.get("/{run_id}/series", response_model=SeriesOut)
def get_series(
    run_id: ReadableRunId,
    store: StoreDep,
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. amp/scale, loss")],
    max_points: Annotated[int, Query(ge=2, le=100_000)] = 2000,
    start: Annotated[int | None, Query(ge=0, description="first step, inclusive")] = None,
    end: Annotated[int | None, Query(ge=0, description="last step, exclusive")] = None,
    rank: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    """One scalar series over [start, end); exact up to max_points points, min/max-downsampled beyond."""
    result = store.series(run_id, key, rank, start, end, max_points)
    return model_json(
        SeriesOut(
            key=key,
            rank=rank,
            steps=result.steps,
            values=[json_float(v) for v in result.values],
            downsampled=result.downsampled,
        )
    )


class PackedVectorsOut(BaseModel):
    """GET /runs/{id}/vectors?encoding=f64: the matrix as one base64 string instead of JSON lists."""

    key: str
    rank: int
    layers: list[str]
    steps: list[int] = Field(description="first step of each (possibly downsampled) column")
    values_f64: str = Field(
        description="base64 of little-endian float64, one row per step, one value per layer (NaN/Inf as "
        "such): ~5 times less to encode and decode than JSON lists for a 500 x 200 matrix"
    )
    downsampled: bool = Field(description="true when steps were merged (max per layer, non-finite kept)")


@router.get("/{run_id}/vectors", response_model=VectorsOut | PackedVectorsOut)
def get_vectors(
    run_id: ReadableRunId,
    store: StoreDep,
    key: Annotated[str, Query(min_length=1, max_length=250, description="e.g. grad/norm, update/ratio")],
    max_steps: Annotated[int, Query(ge=1, le=20_000)] = 500,
    start: Annotated[int | None, Query(ge=0, description="first step, inclusive")] = None,
    end: Annotated[int | None, Query(ge=0, description="last step, exclusive")] = None,
    rank: Annotated[int, Query(ge=0)] = 0,
    encoding: Annotated[
        Literal["json", "f64"],
        Query(description="f64: the values as `values_f64` (PackedVectorsOut), unless rows differ in length"),
    ] = "json",
) -> Response:
    """A per-layer quantity as a step x layer matrix (for heatmaps), in the model's layer order."""
    result = store.vectors(run_id, key, rank, start, end, max_steps)
    if encoding == "f64" and all(len(row) == len(result.layers) for row in result.values):
        matrix = np.asarray(result.values, dtype="<f8").reshape(len(result.steps), len(result.layers))
        return model_json(
            PackedVectorsOut(
                key=key,
                rank=rank,
                layers=result.layers,
                steps=result.steps,
                values_f64=base64.b64encode(matrix.tobytes()).decode("ascii"),
                downsampled=result.downsampled,
            )
        )
    return model_json(
        VectorsOut(
            key=key,
            rank=rank,
            layers=result.layers,
            steps=result.steps,
            values=[[json_float(v) for v in row] for row in result.values],
            downsampled=result.downsampled,
        )
    )


@router.get("/{run_id}/histograms", response_model=HistogramsOut)
def get_histograms(
    run_id: ReadableRunId,
    store: StoreDep,
    layer: Annotated[str, Query(min_length=1, max_length=500, description="a layer name")],
    key: Annotated[str, Query(min_length=1, max_length=250)] = "grad/hist",
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 200,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
    rank: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    """One layer's log2|g| histograms over steps: counts per power of two, zeros, NaN/Inf."""
    result = store.histograms(run_id, key, layer, rank, start, end, max_steps)
    return model_json(
        HistogramsOut(
            key=key,
            rank=rank,
            layer=layer,
            exponents=result.exponents,
            steps=result.steps,
            counts=result.counts,
            zeros=result.zeros,
            non_finite=result.non_finite,
        )
    )


@router.get("/{run_id}/events")
def list_events(
    run_id: ReadableRunId,
    store: StoreDep,
    kind: str | None = None,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    after_id: Annotated[
        int | None,
        Query(
            ge=0,
            description="only the events stored after the one with this id (a previous answer's "
            "last_id), in the order they were stored; count still counts every match",
        ),
    ] = None,
) -> EventPageOut:
    """Events in step order (e.g. kind=skip for skipped optimizer steps); with after_id, only those
    stored after a previous answer's (live pages)."""
    page = EventReads(store.engine).page(run_id, kind, start, end, limit, after_id)
    return EventPageOut(
        data=[EventOut(step=e.step, kind=e.kind, rank=e.rank, data=e.data) for e in page.events],
        count=page.count,
        last_id=page.last_id,
    )
