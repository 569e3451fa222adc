"""Response bodies of a run's kept attempts (gradwatch.server.storage.attempts): what resumes took out
of the run's default view, readable and restorable."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class AttemptOut(BaseModel):
    id: int
    rank: int
    from_step: int = Field(description="the resume's step: the attempt's data is at this step and after")
    last_step: int | None
    reason: str = Field(
        description='"resume" (a later process took over) or "restore" (what a restore replaced)'
    )
    points: int = Field(description="scalar points, per-layer vector rows and histograms kept")
    events: int
    late_batches: int = Field(description="batches of the superseded process that arrived after the resume")
    second_writer: bool = Field(description="that process still wrote the rank long after the resume")
    created_at: str | None
    second_writer_at: str | None
    restored_at: str | None


class AttemptList(BaseModel):
    data: list[AttemptOut]
    count: int


class AttemptDataOut(AttemptOut):
    batches: list[dict[str, Any]] = Field(
        description="the kept data as batch documents of the ingest wire format (POST .../batches)"
    )
