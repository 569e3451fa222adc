"""Reads are one snapshot (issue 39, item 10): a multi-statement read (a runs list with its count, a series
with its rollups, a run with its summary) sees the same commits in every statement, on SQLite as on
PostgreSQL, while batches commit beside it. Real SQLite files and a real PostgreSQL."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from gradwatch.server.database import make_engine, prepare_schema
from gradwatch.server.models import Run
from gradwatch.server.schemas import BatchIn, RunIn
from gradwatch.server.storage import RunFilter, Store


def _store(database_url: str) -> Store:
    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    return Store(engine)


def test_a_read_sees_one_state_while_another_connection_commits(database_url):
    store = _store(database_url)
    try:
        store.create_run(RunIn(project="p", name="first"))
        with store._transaction.reading() as session:
            before = session.scalar(select(func.count()).select_from(Run))
            # Another connection commits a run (and a batch) in the middle of the read.
            done = threading.Thread(target=lambda: store.create_run(RunIn(project="p", name="second")))
            done.start()
            done.join(30)
            assert not done.is_alive()
            after = session.scalar(select(func.count()).select_from(Run))
            assert before == after == 1  # the read's own snapshot
        assert store.list_runs(RunFilter(), 100, 0)[1] == 2  # the next read sees the commit
    finally:
        store.engine.dispose()


def test_the_runs_list_and_a_series_stay_consistent_while_batches_commit(database_url):
    """A writer creates runs and stores batches back to back; every runs list has as many rows as its
    count says, and every series read is whole (its steps a prefix of what the writer stored)."""
    store = _store(database_url)
    stop = threading.Event()
    failures: list[BaseException] = []
    try:
        run_id = store.create_run(RunIn(project="p", name="series")).id

        def write() -> None:
            try:
                seq = 0
                while not stop.is_set():
                    store.create_run(RunIn(project="p"))
                    steps = list(range(seq * 50, seq * 50 + 50))
                    batch = {"seq": seq, "scalars": [{"key": "loss", "steps": steps, "values": [1.0] * 50}]}
                    store.ingest(run_id, BatchIn.model_validate(batch))
                    seq += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        for _ in range(30):
            rows, total = store.list_runs(RunFilter(), 10_000, 0)
            assert len(rows) == total
            series = store.series(run_id, "loss", 0, None, None, 100_000)
            assert series.steps == list(range(len(series.steps))), "a series read mixed two states"
        stop.set()
        writer.join(30)
        assert failures == []
    finally:
        stop.set()
        store.engine.dispose()
