"""Chunked point storage (server/storage/chunked_points.py) on real SQLite and PostgreSQL databases:
every write path (append, top-up of a small tail, appends merged every few batches, overwrite, gap
filling, resume cut) keeps exactly
the points a row-per-point table would hold, and migration 0011 moves stored points both ways."""

from __future__ import annotations

import math
import random
from itertools import pairwise

import pytest
from alembic import command
from sqlalchemy import text

from gradwatch.server.database import _alembic_config, make_engine, prepare_schema
from gradwatch.server.schemas import BatchIn, RunIn
from gradwatch.server.storage import Store, chunked_points
from gradwatch.server.storage.chunked_points import MAX_CHUNK_POINTS, TOP_UP_BELOW, Points


@pytest.fixture
def engine(database_url):
    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    yield engine
    engine.dispose()


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check(connection, truth: dict[tuple[int, int], dict[int, float]]) -> None:
    """What is stored equals `truth` exactly, and the chunk invariants hold."""
    for (sid, rank), expected in truth.items():
        found = chunked_points.read(connection, sid, [rank]).get(rank, Points.empty())
        assert found.steps.tolist() == sorted(expected)
        assert all(
            _same(v, expected[s]) for s, v in zip(found.steps.tolist(), found.values.tolist(), strict=True)
        )
        rows = connection.execute(
            text(
                "SELECT first_step, last_step, count FROM point_chunks WHERE series_id = :s AND rank = :r"
                " ORDER BY first_step"
            ),
            {"s": sid, "r": rank},
        ).all()
        assert sum(row.count for row in rows) == len(expected)
        assert all(a.last_step < b.first_step for a, b in pairwise(rows))  # disjoint
        assert all(row.count <= MAX_CHUNK_POINTS for row in rows)


def test_writes_of_every_kind_keep_exactly_the_latest_value_per_step(engine):
    rng = random.Random(7)
    truth: dict[tuple[int, int], dict[int, float]] = {}

    def write(connection, rank: int, new: dict[int, dict[int, float]]) -> set[int]:
        for sid, points in new.items():
            truth.setdefault((sid, rank), {}).update(points)
        return chunked_points.write(
            connection, rank, {sid: Points.of(list(p), list(p.values())) for sid, p in new.items()}
        )

    with engine.begin() as connection:
        # Appends of every size: single points (topped up), a batch, one bigger than a chunk.
        for step in range(700):
            assert write(connection, 0, {1: {step: rng.random()}}) == set()
        assert write(connection, 0, {1: {s: rng.random() for s in range(700, 10_000)}}) == set()
        # Non-finite values and a NaN keep what they are.
        assert write(connection, 0, {1: {10_000: math.nan, 10_001: math.inf, 10_002: -math.inf}}) == set()
        # A resumed run re-logs steps: values replaced, across chunk boundaries.
        assert write(connection, 0, {1: {s: -1.0 for s in range(4000, 4200)}}) == {1}
        # Points between stored ones (a sparse key filled in later), another rank, another series.
        write(connection, 0, {2: {s: 1.0 for s in range(0, 1000, 10)}})
        assert write(connection, 0, {2: {s: 2.0 for s in range(5, 1000, 10)}}) == {2}
        write(connection, 3, {1: {s: float(s) for s in range(50)}})
        _check(connection, truth)
        # Small batches end up in chunks of hundreds of points, not rows of one.
        small = connection.execute(
            text("SELECT count(*) FROM point_chunks WHERE series_id = 1 AND rank = 0 AND last_step < 700")
        ).scalar()
        assert small <= 700 // TOP_UP_BELOW + 1


def test_appends_with_loose_chunks_keep_exactly_the_points_and_a_short_small_tail(engine):
    """Ingest's mode: batches appended as chunks of their own, small tail chunks merged every few
    batches of a series; mixed with single points, a bigger batch, a rewrite and a resume cut."""
    rng = random.Random(11)
    loose = chunked_points.LooseChunks(every=4)
    truth: dict[tuple[int, int], dict[int, float]] = {}

    def write(connection, rank: int, new: dict[int, dict[int, float]]) -> set[int]:
        for sid, points in new.items():
            truth.setdefault((sid, rank), {}).update(points)
        return chunked_points.write(
            connection, rank, {sid: Points.of(list(p), list(p.values())) for sid, p in new.items()}, loose
        )

    def small_tail(connection, sid: int, rank: int) -> int:
        """How many chunks smaller than TOP_UP_BELOW follow the series' last bigger one."""
        counts = connection.execute(
            text("SELECT count FROM point_chunks WHERE series_id = :s AND rank = :r ORDER BY first_step"),
            {"s": sid, "r": rank},
        ).scalars()
        tail = 0
        for count in counts:
            tail = tail + 1 if count < TOP_UP_BELOW else 0
        return tail

    with engine.begin() as connection:
        step = 0
        for batch in range(300):  # 20-step batches of two series, one of them only every third batch
            new = {1: {s: rng.random() for s in range(step, step + 20)}}
            if batch % 3 == 0:
                new[2] = {s: rng.random() for s in range(step, step + 20, 5)}
            assert write(connection, 0, new) == set()
            step += 20
            assert small_tail(connection, 1, 0) <= loose.every
        for _ in range(100):  # single points
            assert write(connection, 0, {1: {step: rng.random()}, 2: {step: -1.0}}) == set()
            step += 1
        assert write(connection, 0, {1: {s: 0.5 for s in range(step, step + 3000)}}) == set()
        assert small_tail(connection, 1, 0) == 0  # a bigger batch takes the small chunks before it
        step += 3000
        for s in range(step, step + 7):
            write(connection, 0, {1: {s: math.nan if s % 2 else math.inf}})
        # A resumed run re-logs steps across appended chunks; then its old tail is cut.
        assert write(connection, 0, {1: {s: -2.0 for s in range(5_990, 6_050)}}) == {1}
        write(connection, 1, {1: {s: float(s) for s in range(40)}})
        _check(connection, truth)
        chunked_points.delete_from(connection, [1], 0, step + 3)
        truth[(1, 0)] = {s: v for s, v in truth[(1, 0)].items() if s < step + 3}
        write(connection, 0, {1: {s: 7.0 for s in range(step + 3, step + 30)}})
        _check(connection, truth)
        chunks = connection.execute(
            text("SELECT count(*) FROM point_chunks WHERE series_id = 1 AND rank = 0")
        ).scalar()
        assert chunks <= 10_000 // TOP_UP_BELOW + 2 * loose.every  # not one row per batch
    with pytest.raises(ValueError, match="at least 1"):
        chunked_points.LooseChunks(every=0)


def test_store_ingest_appends_small_batches_and_reads_them_back_exactly(engine):
    """The Store's ingest path (LooseChunks): 100 batches of 20 steps, then 30 steps from 1,510 written
    again (as a resumed run re-logs them); every point reads back as last written, in far fewer rows
    than batches."""
    store = Store(engine)
    run = store.create_run(RunIn(project="chunks", name="small batches"))
    expected: dict[int, float] = {}
    for seq in range(100):
        steps = list(range(seq * 20, seq * 20 + 20))
        values = [math.sin(step) if step % 97 else math.nan for step in steps]
        expected.update(zip(steps, values, strict=True))
        batch = {"seq": seq, "rank": 0, "scalars": [{"key": "loss", "steps": steps, "values": values}]}
        assert store.ingest(run.id, BatchIn.model_validate(batch)).points == 20
    steps = list(range(1_510, 1_540))
    expected.update(dict.fromkeys(steps, -1.0))
    batch = {"seq": 100, "rank": 0, "scalars": [{"key": "loss", "steps": steps, "values": [-1.0] * 30}]}
    store.ingest(run.id, BatchIn.model_validate(batch))
    got = store.series(run.id, "loss", 0, None, None, 10_000)
    assert got.steps == sorted(expected) and not got.downsampled
    assert all(_same(v, expected[s]) for s, v in zip(got.steps, got.values, strict=True))
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT count(*) FROM point_chunks")).scalar()
    assert rows <= 100 // chunked_points.COMPACT_EVERY + chunked_points.COMPACT_EVERY + 2


def test_reads_by_range_latest_extent_and_cursor(engine):
    with engine.begin() as connection:
        steps = list(range(0, 30_000, 3))
        chunked_points.write(connection, 0, {5: Points.of(steps, [s * 0.5 for s in steps])})
        assert chunked_points.extent(connection, 5, 0, None, None) == (0, 29_997)
        assert chunked_points.extent(connection, 5, 0, 1, 8) == (3, 6)
        assert chunked_points.extent(connection, 5, 0, 1, 3) is None  # a gap inside one chunk
        assert chunked_points.latest(connection, 5, 0, 12_289) == (12_288, 6144.0)
        assert chunked_points.last_step(connection, 5, 0) == 29_997
        part = chunked_points.read(connection, 5, [0], 12_000, 12_010)[0]
        assert part.steps.tolist() == [12_000, 12_003, 12_006, 12_009]
        first = chunked_points.read_first(connection, 5, 0, 100, None, 5)
        assert first.steps.tolist() == [102, 105, 108, 111, 114]
        found, more = chunked_points.read_after(connection, {(5, 0): 29_990}, limit=10)
        assert found[(5, 0)].steps.tolist() == [29_991, 29_994, 29_997] and not more
        found, more = chunked_points.read_after(connection, {(5, 0): 0}, limit=10)
        assert len(found[(5, 0)]) == 10 and more
        assert chunked_points.count_and_max_before(connection, 5, 0, 9) == (3, 3.0)


def test_resume_cut_keeps_only_the_steps_before(engine):
    with engine.begin() as connection:
        chunked_points.write(connection, 0, {7: Points.of(list(range(10_000)), [1.0] * 10_000)})
        chunked_points.write(connection, 1, {7: Points.of(list(range(10_000)), [2.0] * 10_000)})
        chunked_points.delete_from(connection, [7], 0, 5_001)
        _check(
            connection,
            {(7, 0): dict.fromkeys(range(5_001), 1.0), (7, 1): dict.fromkeys(range(10_000), 2.0)},
        )


def test_migration_0011_moves_points_into_chunks_and_back(database_url):
    engine = make_engine(database_url)
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0010")
    rows = [
        (1, 0, step, None if step == 77 else step * 0.25, 1 if step == 77 else 0) for step in range(5_000)
    ]
    rows += [(1, 2, step, 1.5, 0) for step in range(0, 300, 7)]
    with engine.begin() as connection:
        connection.execute(
            text("INSERT INTO points (series_id, rank, step, value, flag) VALUES (:a, :b, :c, :d, :e)"),
            [dict(zip("abcde", row, strict=True)) for row in rows],
        )
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0011")
        expected = {(1, 0): {s: (math.nan if s == 77 else s * 0.25) for s in range(5_000)}}
        expected[(1, 2)] = dict.fromkeys(range(0, 300, 7), 1.5)
        _check(connection, expected)
        rolled_up = connection.execute(
            text("SELECT count(*) FROM point_rollups WHERE series_id = 1")
        ).scalar()
        assert rolled_up > 0  # 0004 left scalar rollups to 0011: points from before 0004 get theirs
        command.downgrade(config, "0010")
        back = connection.execute(
            text("SELECT series_id, rank, step, value, flag FROM points ORDER BY 1, 2, 3")
        ).all()
    assert sorted(tuple(r) for r in back) == sorted(rows)
    engine.dispose()
