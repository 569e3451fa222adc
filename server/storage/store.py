"""The Store: runs, ingest and the series queries; it owns their transactions (commit on success,
rollback and translate otherwise).

Routers call Store methods with validated schemas and get frozen dataclasses back; no SQLAlchemy
object leaves the storage package. The read models of the ranks (store.ranks) and of live streams
(store.live) open their own sessions the same way. The series queries are SeriesReads'
(series_reads), run in the Store's transactions; the run's records are in run_records, the UPDATE of
a run's row after each batch in run_updates.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Engine, and_, delete, func, or_, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..database import Transactions
from ..errors import Conflict, NotFound
from ..models import (
    AgentBatch,
    Event,
    HistogramPoint,
    PointChunk,
    PointRollup,
    Run,
    RunAttempt,
    RunAttemptPart,
    RunResume,
    RunTag,
    Series,
    VectorPoint,
    VectorRollup,
)
from ..schemas import BatchIn, RunIn
from . import attempts, bulk, chunked_points, queries, resumes
from .batch_writes import BatchWriter, PackedLayerData
from .codecs import dump_json
from .live import LiveReads
from .ranks import RankReads
from .run_records import _SORT_COLUMNS, RunFilter, RunRecord
from .run_updates import _status_sql, _update_run
from .series_reads import HistogramsResult, SeriesReads, SeriesResult, VectorsResult

SCALE_KEY = "amp/scale"


@dataclass(frozen=True)
class IngestResult:
    duplicate: bool
    points: int
    events: int
    superseded_from: int | None = None  # a later process resumed at this step: the batch was cut there
    second_writer: bool = False  # the cut process still sends long after the resume (storage.attempts)


@dataclass(frozen=True)
class EventRecord:
    step: int
    kind: str
    rank: int
    data: dict[str, Any]


class Store:
    """Runs and their data (create, list, ingest, series, vectors, histograms, events), on SQLite or
    PostgreSQL."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._transaction = Transactions(engine)  # commit on success, roll back on any error
        dialect = engine.dialect.name
        self._insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        self.ranks = RankReads(engine)  # the ranks of distributed runs, combined at query time
        self.live = LiveReads(engine)  # what is new for a live stream's subscriber
        self._reads = SeriesReads(self._transaction.reading)  # series, per-layer vectors, histograms
        # Ingest appends each batch's points as chunks and merges a series' small ones every few batches.
        self._writer = BatchWriter(chunked_points.LooseChunks())
        # A superseded process still sending this long after its first late batch is a second writer.
        self.second_writer_after_s = attempts.SECOND_WRITER_AFTER_S
        # Called with (session, run_id, batch) for each newly stored batch, inside its transaction
        # (the alert engine): evaluation happens exactly once per batch, or not at all if ingest fails.
        self.after_ingest: list[Callable[[Session, str, BatchIn], None]] = []
        # Called with (session, run, batch) for each batch before its transaction, in one that writes
        # nothing (the alert engine refuses a batch its rules cannot evaluate in time: TooLarge).
        self.before_ingest: list[Callable[[Session, Run, BatchIn], None]] = []
        # Called with (run_id, batch) after a newly stored batch has committed (live streams):
        # must be quick and must not raise; the data is already durable.
        self.after_commit: list[Callable[[str, BatchIn], None]] = []

    def ping(self) -> str:
        """The database's dialect name ("sqlite", "postgresql") once a trivial query has run on it
        (liveness checks); the driver's error when the database cannot be reached."""
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return self.engine.dialect.name

    # -- runs -------------------------------------------------------------------------------------

    def create_run(self, run: RunIn) -> RunRecord:
        """Create a run, or return the existing one with the same id in the same project (agents retry;
        ranks share ids). An id that is another project's already is not refused (that would let one
        project squat another's ids and make its agents drop data): the run is stored under a fresh id,
        with the id asked for as its requested_id, which find_run resolves within the project (so the
        project's tokens keep calling it by the id it asked for, and learn nothing of the other's).

        run.resume (gradwatch.init(resume=...)): "must" raises NotFound when the project has no such
        run, "never" raises Conflict when it has; "allow" and "must" set an existing run "running"
        again (its crash reason cleared). The record's `existed` says whether the run was there.
        run.created_at (a run uploaded after it ran) is the new run's creation time, else now."""
        requested = run.id or uuid.uuid4().hex
        for _ in range(3):  # each pass loses at most one race to a concurrent create of the same id
            with self._transaction() as session:
                where, order = _named_in_project(run.project, requested)
                existing = session.scalar(select(Run).where(where).order_by(order).limit(1))
                existed = existing is not None
                before = (existing.status, existing.status_reason) if existing is not None else (None, None)
                if existing is not None and run.resume == "never":
                    raise Conflict(
                        f"run {requested!r} exists already in project {run.project!r} and resume='never' "
                        "starts a new run only: choose another id, or pass resume='allow'"
                    )
                if existing is not None and run.resume in ("allow", "must"):
                    existing.status = "running"
                    existing.status_reason = None
                    existing.updated_at = time.time()
                    session.flush()
                if existing is None and run.resume == "must":
                    raise NotFound(
                        f"run {requested!r} does not exist in project {run.project!r}, and resume='must' "
                        "continues an existing run only (resume='allow' creates it)"
                    )
                if existing is None:
                    now = time.time()
                    owner = session.scalar(select(Run.project).where(Run.id == requested))
                    if owner == run.project:
                        continue  # created since our read by another rank of the job: look again
                    taken = owner is not None
                    run_id = uuid.uuid4().hex if taken else requested
                    values = {
                        "id": run_id,
                        "project": run.project,
                        "name": run.name or requested[:8],
                        "status": "running",
                        "requested_id": requested if taken else None,
                        "config_json": dump_json(run.config),
                        "metadata_json": dump_json(run.metadata),
                        # A run uploaded after it ran (gradwatch sync) carries when it started.
                        "created_at": now if run.created_at is None else run.created_at.timestamp(),
                        "updated_at": now,
                    }
                    conflict = ["project", "requested_id"] if taken else ["id"]
                    session.execute(
                        self._insert(Run).values(**values).on_conflict_do_nothing(index_elements=conflict)
                    )
                    existing = session.scalar(select(Run).where(Run.id == run_id, Run.project == run.project))
                if existing is None:
                    continue  # another project took the id between our read and our insert: look again
                if run.tags:  # a retried create (or another rank) adds its tags to the run's
                    bulk.upsert(
                        session,
                        RunTag.__table__,
                        ("run_id", "tag"),
                        ("run_id", "tag"),
                        [(existing.id, tag) for tag in sorted(set(run.tags))],
                    )
                return dataclasses.replace(
                    self._run_record(session, existing),
                    existed=existed,
                    previous_status=before[0],
                    previous_status_reason=before[1],
                )
        raise Conflict(f"run id {requested!r} is contended; retry, or choose another id")

    def update_run(self, run_id: str, name: str | None, tags: list[str] | None) -> RunRecord:
        with self._transaction() as session:
            run = queries.require_run(session, run_id)
            if name is not None:
                run.name = name
            if tags is not None:
                session.execute(delete(RunTag).where(RunTag.run_id == run_id))
                bulk.upsert(
                    session,
                    RunTag.__table__,
                    ("run_id", "tag"),
                    ("run_id", "tag"),
                    [(run_id, tag) for tag in sorted(set(tags))],
                )
            run.updated_at = time.time()
            session.flush()
            return self._run_record(session, run)

    def find_run(self, run_id: str, project: str | None = None) -> tuple[str, str]:
        """(the run's stored id, its project) for an id as a caller names it; NotFound when none.

        Run ids are a project's own: two projects may each have a run "exp-1" (create_run stores the
        second under a fresh id, with the name asked for as requested_id). Named within `project`, an
        id finds that project's run of the name asked for, or of that stored id; without a project
        (an open server, a token for every project) it is the stored id, unique on the server."""
        with self._transaction() as session:
            if project is None:
                found = session.execute(select(Run.id, Run.project).where(Run.id == run_id)).first()
            else:
                where, order = _named_in_project(project, run_id)
                query = select(Run.id, Run.project).where(where).order_by(order).limit(1)
                found = session.execute(query).first()
        if found is None:
            raise NotFound(f"run {run_id!r} does not exist")
        return found[0], found[1]

    def requested_ids(self, run_ids: Iterable[str]) -> dict[str, str]:
        """{stored id: the id its project asked for} for those of the runs stored under another id
        (find_run): what a token of that project calls them."""
        wanted = sorted(set(run_ids))
        found: dict[str, str] = {}
        with self._transaction() as session:
            for start in range(0, len(wanted), 500):
                rows = session.execute(
                    select(Run.id, Run.requested_id).where(
                        Run.id.in_(wanted[start : start + 500]), Run.requested_id.is_not(None)
                    )
                )
                found.update({stored: str(requested) for stored, requested in rows})
        return found

    def get_run(self, run_id: str) -> RunRecord:
        with self._transaction.reading() as session:
            return self._run_record(session, queries.require_run(session, run_id))

    def list_runs(self, filters: RunFilter, limit: int, offset: int) -> tuple[list[RunRecord], int]:
        """Runs matching every given filter, in the requested order, and how many match before
        limit/offset."""
        with self._transaction.reading() as session:  # the count and the rows of one state
            query = select(Run)
            if filters.project is not None:
                query = query.where(Run.project == filters.project)
            for tag in filters.tags:  # every tag must be present
                query = query.where(Run.id.in_(select(RunTag.run_id).where(RunTag.tag == tag)))
            if filters.statuses:
                query = query.where(Run.status.in_(filters.statuses))
            if filters.created_after is not None:
                query = query.where(Run.created_at >= filters.created_after)
            if filters.created_before is not None:
                query = query.where(Run.created_at < filters.created_before)
            if filters.name_contains:
                query = query.where(
                    func.lower(Run.name).contains(filters.name_contains.lower(), autoescape=True)
                )
            total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
            column = _SORT_COLUMNS[filters.sort]
            order = (column.asc() if filters.ascending else column.desc()).nulls_last()
            # Ties are broken by the id the run's project asked for: the stored id would tell a token
            # which of its runs have a name another project had first (find_run).
            tie = func.coalesce(Run.requested_id, Run.id)
            rows = session.scalars(query.order_by(order, tie, Run.id).limit(limit).offset(offset)).all()
            return [self._run_record(session, run) for run in rows], total

    def delete_run(self, run_id: str) -> None:
        with self._transaction() as session:
            # FOR UPDATE waits for ingests in flight (they hold KEY SHARE on the row) and holds off new
            # ones: no point can be written for a series being deleted (no foreign keys: models.py).
            if session.get(Run, run_id, with_for_update=True) is None:
                raise NotFound(f"run {run_id!r} does not exist")
            series_ids = select(Series.id).where(Series.run_id == run_id)
            for table in (PointChunk, VectorPoint, HistogramPoint, PointRollup, VectorRollup):
                session.execute(delete(table).where(table.series_id.in_(series_ids)))
            attempt_ids = select(RunAttempt.id).where(RunAttempt.run_id == run_id)
            session.execute(delete(RunAttemptPart).where(RunAttemptPart.attempt_id.in_(attempt_ids)))
            for model in (Series, Event, AgentBatch, RunTag, RunResume, RunAttempt):
                session.execute(delete(model).where(model.run_id == run_id))
            session.execute(delete(Run).where(Run.id == run_id))

    # -- attempts kept by resumes (storage.attempts) ----------------------------------------------

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        """The run's kept attempts (what resumes took out of its default view), oldest first."""
        with self._transaction.reading() as session:
            queries.require_run(session, run_id)
            return attempts.list_attempts(session, run_id)

    def attempt(self, run_id: str, attempt_id: int) -> dict[str, Any]:
        """One kept attempt with its data as batch documents of the wire format."""
        with self._transaction.reading() as session:
            queries.require_run(session, run_id)
            found = attempts.attempt_documents(session, run_id, attempt_id)
            if found is None:
                raise NotFound(f"run {run_id!r} has no attempt {attempt_id}")
            return found

    def restore_attempt(self, run_id: str, attempt_id: int) -> dict[str, Any]:
        """Put a kept attempt back in the run's default view (an admin's act): what the rank holds now
        from the attempt's step on is kept as an attempt in turn (reason "restore"), the kept data is
        written as ingest writes it, and its process's later batches are no longer cut."""
        with self._transaction() as session:
            run = queries.require_run(session, run_id, for_update=True)
            attempt = session.get(RunAttempt, attempt_id)
            if attempt is None or attempt.run_id != run_id:
                raise NotFound(f"run {run_id!r} has no attempt {attempt_id}")
            if attempt.restored_at is not None:
                raise Conflict(f"attempt {attempt_id} of run {run_id!r} was restored already")
            resumes.supersede(session, run_id, attempt.rank, attempt.from_step, None, reason="restore")
            last_step = -1
            for document in attempts.part_batches(session, attempt.id):
                batch = BatchIn.model_validate(document)
                _, last = self._writer.write(session, run_id, batch, PackedLayerData.of(batch))
                last_step = max(last_step, last)
            attempts.stop_cutting(session, attempt)
            attempt.restored_at = time.time()
            if last_step >= 0:
                _update_run(session, run, time.time(), None, ("raise", last_step), None)
            session.flush()
            return attempts.attempt_summary(attempt)

    # -- ingest -----------------------------------------------------------------------------------

    def ingest(self, run_id: str, batch: BatchIn, may_rewrite_history: bool = True) -> IngestResult:
        """Store one agent batch in one transaction, exactly once per (run, rank, seq).
        may_rewrite_history: whether a resume may replace steps of a run that finished (admin)."""
        if self.before_ingest:
            # In a transaction of its own that writes nothing (but a new project's default rules): on
            # SQLite the write lock every other tenant waits for is not taken for a batch refused here.
            with self._transaction() as session:
                run = session.get(Run, run_id)
                if run is not None:  # else _ingest says it does not exist
                    for check in self.before_ingest:
                        check(session, run, batch)
        # Packed before the transaction: on SQLite every other tenant's write waits while it is open
        # (a batch of 2,000,000 per-layer numbers spent ~30 ms of it packing).
        packed = PackedLayerData.of(batch)
        try:
            return self._ingest(run_id, batch, may_rewrite_history, packed)
        except IntegrityError:
            # SQLite reads the run before its first write takes the database lock: a run deleted in
            # between fails the batch's foreign key to runs. Say what happened instead of a 500.
            with self._transaction() as session:
                if session.get(Run, run_id) is None:
                    raise NotFound(f"run {run_id!r} does not exist (it was deleted)") from None
            raise

    def _ingest(
        self, run_id: str, batch: BatchIn, may_rewrite_history: bool, packed: PackedLayerData
    ) -> IngestResult:
        now = time.time()
        # A resume rewrites the rank's data: it waits for batches in flight and holds off new ones.
        resuming = any(event.kind == resumes.RESUME_EVENT for event in batch.events)
        if resuming:
            resumes.check_resume_seq(batch.seq, now)
        with self._transaction() as session:
            run = queries.require_run(session, run_id, lock=True, for_update=resuming)
            claimed = bulk.execute(  # plain SQL: statements of every batch skip the ORM
                session,
                "INSERT INTO agent_batches (run_id, rank, seq, received_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING RETURNING seq",
                [run_id, batch.rank, batch.seq, now],
            )
            if not claimed:
                return IngestResult(duplicate=True, points=0, events=0)
            # A batch of a process that a later one resumed from: only its steps before the resume count.
            cutoff = resumes.superseding_step(session, run_id, batch.rank, batch.seq)
            superseded_from, second_writer = None, False
            if cutoff is not None:
                clipped = resumes.clip(batch, cutoff)
                if clipped != batch.model_copy(update={"status": None}):
                    superseded_from = cutoff  # something of it was cut: the sender is told
                    # ... and what was cut is kept with the attempt the resume took out of view
                    second_writer = attempts.keep_late(
                        session, run_id, batch, cutoff, now, self.second_writer_after_s
                    )
                batch = clipped
            resume = resumes.resume_event(batch)
            if resume is not None:
                resumes.record(session, self._insert, run_id, batch.rank, batch.seq, resume.step)
            if resume is not None and cutoff is not None:
                # The resume of a process that a later one resumed from, arriving after it: it still cuts
                # older processes' late batches (recorded above) but must not delete the later data.
                batch, resume = resumes.without(batch, resume), None
            elif resume is not None:
                resumes.check_history(run, resume.step, may_rewrite_history)
                # How the run stood before: as init(resume=...) found it (the agent carries that, as the
                # check set the run running again), else as it is now.
                told = "previous_status" in resume.data
                facts = {
                    "previous_last_step": resumes.supersede(
                        session, run_id, batch.rank, resume.step, resumes.seq_floor(batch.seq)
                    ),
                    "previous_status": resume.data["previous_status"] if told else run.status,
                    "previous_status_reason": resume.data.get("previous_status_reason")
                    if told
                    else run.status_reason,
                }
                batch = resumes.with_resume_facts(batch, resume, facts)

            point_count, last_step = self._writer.write(session, run_id, batch, packed)
            reached_step: tuple[str, int | None] | None = None
            if resume is not None:  # the steps after the resume are gone (or were never there)
                reached = max(last_step, resume.step - 1)
                reached_step = ("set", reached if reached >= 0 else None)
            elif last_step >= 0:
                reached_step = ("raise", last_step)
            # A superseded process's batch (cutoff) says nothing about how the run stands.
            status = _status_sql(batch, resume is not None) if cutoff is None else None
            _update_run(session, run, now, batch.layers, reached_step, status)
            if batch.status == "finished" and status is not None:
                # What the run leaves as history (runs.finished_step): a resume below it needs admin.
                bulk.execute(
                    session,
                    "UPDATE runs SET finished_step = last_step WHERE id = ? AND status = 'finished'",
                    [run_id],
                )
            for hook in self.after_ingest:
                hook(session, run_id, batch)
            result = IngestResult(
                duplicate=False,
                points=point_count,
                events=len(batch.events),
                superseded_from=superseded_from,
                second_writer=second_writer,
            )
        for notify in self.after_commit:
            notify(run_id, batch)
        return result

    # -- queries (SeriesReads) ----------------------------------------------------------------------

    def keys(self, run_id: str, kind: str = "scalar") -> list[str]:
        return self._reads.keys(run_id, kind)

    def vectors(
        self, run_id: str, key: str, rank: int, start: int | None, end: int | None, max_steps: int
    ) -> VectorsResult:
        """Per-layer rows of one key with start <= step < end (SeriesReads.vectors)."""
        return self._reads.vectors(run_id, key, rank, start, end, max_steps)

    def histograms(
        self, run_id: str, key: str, layer: str, rank: int, start: int | None, end: int | None, max_steps: int
    ) -> HistogramsResult:
        """One layer's log2 histograms over steps (SeriesReads.histograms)."""
        return self._reads.histograms(run_id, key, layer, rank, start, end, max_steps)

    def series(
        self, run_id: str, key: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> SeriesResult:
        """Points of one key with start <= step < end (SeriesReads.series)."""
        return self._reads.series(run_id, key, rank, start, end, max_points)

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _run_record(session: Session, run: Run) -> RunRecord:
        skips = session.scalar(select(func.count()).where(Event.run_id == run.id, Event.kind == "skip")) or 0
        scale_id = queries.series_id(session, run.id, SCALE_KEY)
        scale = None if scale_id is None else chunked_points.latest(session, scale_id, 0, 2**62)
        return RunRecord(
            id=run.id,
            project=run.project,
            name=run.name,
            status=run.status,
            created_at=run.created_at,
            updated_at=run.updated_at,
            last_step=run.last_step,
            tags=list(
                session.scalars(select(RunTag.tag).where(RunTag.run_id == run.id).order_by(RunTag.tag))
            ),
            config=json.loads(run.config_json),
            metadata=json.loads(run.metadata_json),
            skips=skips,
            scale=None if scale is None else scale[1],
            status_reason=run.status_reason,
            requested_id=run.requested_id,
        )


def _named_in_project(project: str, run_id: str) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    """(where, order by) for the project's run called run_id: stored under that id, or under a fresh
    one with run_id as the name the project asked for (Store.create_run). Two such runs exist only
    after a race of creates with another project's delete; in this order, create_run and find_run
    pick the same one."""
    return (
        and_(Run.project == project, or_(Run.id == run_id, Run.requested_id == run_id)),
        Run.requested_id.is_not(None),
    )
