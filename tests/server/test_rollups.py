"""Rollups answer exactly like a brute-force min/max downsampling of the raw points, on SQLite and
PostgreSQL: over random ranges and sizes, with NaN/±Inf, sparse keys, steps written again (a resumed
run), several ranks, per-layer vectors, and data stored before the rollup migration existed."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
from sqlalchemy import text

from gradwatch.server.database import make_engine, prepare_schema, upgrade
from gradwatch.server.schemas import BatchIn, RunIn
from gradwatch.server.storage import Store, rollups


def _key(value: float) -> tuple:
    return (0,) if not math.isfinite(value) else (1, value)


def reference_series(points: dict[int, float], start: int | None, end: int | None, max_points: int):
    """The expected (steps, values, downsampled) of Store.series from the raw points alone."""
    inside = sorted(
        (s, v) for s, v in points.items() if (start is None or s >= start) and (end is None or s < end)
    )
    if not inside:
        return [], [], False
    first, last = inside[0][0], inside[-1][0]
    if last - first + 1 <= max_points or len(inside) <= max_points:
        return [s for s, _ in inside], [v for _, v in inside], False
    _, bucket_width = rollups.plan(first, last, max_points // 2)
    buckets = defaultdict(list)
    for step, value in inside:
        buckets[step // bucket_width].append((step, value))
    kept = {}
    for members in buckets.values():
        low = min(members, key=lambda p: (0, p[0]) if not math.isfinite(p[1]) else (1, p[1], p[0]))
        finite = [p for p in members if math.isfinite(p[1])]
        high = max(finite, key=lambda p: (p[1], p[0])) if finite else low
        kept[low[0]] = low[1]
        kept.setdefault(high[0], high[1])
    steps = sorted(kept)
    return steps, [kept[s] for s in steps], True


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        (x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def store(database_url):
    engine = make_engine(database_url)
    prepare_schema(engine, database_url)
    yield Store(engine)
    engine.dispose()


def _random_value(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.002:
        return rng.choice([math.nan, math.inf, -math.inf])
    if roll < 0.01:
        return rng.uniform(-1e6, 1e6)  # a spike
    return rng.gauss(0, 1)


def test_series_queries_equal_brute_force_downsampling(store):
    rng = random.Random(5)
    run = store.create_run(RunIn(project="p"))
    truth: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    # Dense keys in steps 0..70k in batches of 700 steps; a sparse key every 97 steps; two ranks;
    # then a "resume from checkpoint" that writes steps 30k..31.5k again with different values.
    batches = [(rank, lo, lo + 700) for lo in range(0, 70_000, 700) for rank in (0, 1)]
    batches.append((0, 30_000, 31_500))
    for seq, (rank, lo, hi) in enumerate(batches):
        scalars = []
        for key in ("loss", "amp/scale"):
            steps = list(range(lo, hi))
            values = [_random_value(rng) for _ in steps]
            scalars.append({"key": key, "steps": steps, "values": values})
            truth[key, rank].update(zip(steps, values, strict=True))
        sparse = [s for s in range(lo, hi) if s % 97 == 0]
        if sparse:
            values = [_random_value(rng) for _ in sparse]
            scalars.append({"key": "sparse", "steps": sparse, "values": values})
            truth["sparse", rank].update(zip(sparse, values, strict=True))
        store.ingest(run.id, BatchIn.model_validate({"seq": seq, "rank": rank, "scalars": scalars}))

    cases = [
        (None, None, 2000),
        (None, None, 100),
        (None, None, 3),
        (None, None, 2),
        (29_000, 33_000, 500),
        (0, 32, 10),
        (31, 65_537, 777),
        (69_990, None, 4),
    ]
    cases += [
        (lo, lo + rng.randint(1, 40_000), rng.randint(2, 3000))
        for lo in (rng.randint(0, 69_000) for _ in range(25))
    ]
    for (key, rank), points in truth.items():
        for start, end, max_points in cases:
            got = store.series(run.id, key, rank, start, end, max_points)
            steps, values, downsampled = reference_series(points, start, end, max_points)
            assert got.steps == steps, (key, rank, start, end, max_points)
            assert _same(got.values, values), (key, rank, start, end, max_points)
            assert got.downsampled == downsampled and len(got.steps) <= max(max_points, len(steps))
            assert len(got.steps) <= max_points


def test_vectors_equal_brute_force_merging(store):
    rng = random.Random(7)
    run = store.create_run(RunIn(project="p"))
    layers = [f"l{i}" for i in range(5)]
    truth: dict[int, list[float]] = {}
    for seq, lo in enumerate(range(0, 20_000, 1_000)):
        steps = list(range(lo, lo + 1_000, 3))
        rows = [[_random_value(rng) for _ in layers] for _ in steps]
        truth.update(zip(steps, rows, strict=True))
        store.ingest(
            run.id,
            BatchIn.model_validate(
                {
                    "seq": seq,
                    "layers": layers,
                    "vectors": [{"key": "grad/norm", "steps": steps, "values": rows}],
                }
            ),
        )
    for start, end, max_steps in [
        (None, None, 500),
        (None, None, 7),
        (1_000, 9_000, 100),
        (5, 6_000, 10_000),
    ]:
        got = store.vectors(run.id, "grad/norm", 0, start, end, max_steps)
        inside = sorted(s for s in truth if (start is None or s >= start) and (end is None or s < end))
        assert len(got.steps) <= max_steps
        if len(inside) <= max_steps:
            assert got.steps == inside and not got.downsampled
            continue
        _, bucket_width = rollups.plan(inside[0], inside[-1], max_steps)
        groups = defaultdict(list)
        for s in inside:
            groups[s // bucket_width].append(s)
        expected_steps = [members[0] for _, members in sorted(groups.items())]
        assert got.downsampled and got.steps == expected_steps
        for row, (_, members) in zip(got.values, sorted(groups.items()), strict=True):
            for column in range(len(layers)):
                cells = [truth[s][column] for s in members]
                bad = [c for c in cells if not math.isfinite(c)]
                nans = [c for c in bad if math.isnan(c)]  # a NaN first: it must not hide behind a +inf
                expected = nans[0] if nans else bad[0] if bad else max(cells)
                assert _same([row[column]], [expected])


def test_deleting_a_run_deletes_its_rollups(store):
    run = store.create_run(RunIn(project="p"))
    store.ingest(
        run.id,
        BatchIn.model_validate(
            {"seq": 0, "scalars": [{"key": "loss", "steps": list(range(5000)), "values": [1.0] * 5000}]}
        ),
    )
    store.delete_run(run.id)
    with store.engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM point_rollups")).scalar() == 0


def test_upgrade_rolls_up_data_stored_before_rollups_existed(database_url):
    """A database at revision 0003 with stored points: after `upgrade` queries are answered from rollups."""
    engine = make_engine(database_url)
    upgrade(engine, "0003")
    rng = random.Random(3)
    points = {step: _random_value(rng) for step in range(0, 50_000, 2)}
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO runs (id, project, name, status, config_json, metadata_json, created_at,"
                " updated_at, layers_json) VALUES ('r', 'p', 'r', 'finished', '{}', '{}', 0, 0, '[]')"
            )
        )
        connection.execute(text("INSERT INTO series (run_id, key, kind) VALUES ('r', 'loss', 'scalar')"))
        series_id = connection.execute(text("SELECT id FROM series")).scalar()
        rows = []
        for step, value in points.items():
            finite = math.isfinite(value)
            flag = 0 if finite else (1 if math.isnan(value) else (2 if value > 0 else 3))
            rows.append({"s": series_id, "step": step, "v": value if finite else None, "f": flag})
        connection.execute(
            text("INSERT INTO points (series_id, rank, step, value, flag) VALUES (:s, 0, :step, :v, :f)"),
            rows,
        )
    upgrade(engine)
    store = Store(engine)
    for start, end, max_points in [(None, None, 2000), (1_001, 40_000, 300)]:
        got = store.series("r", "loss", 0, start, end, max_points)
        steps, values, downsampled = reference_series(points, start, end, max_points)
        assert got.downsampled and downsampled
        assert got.steps == steps and _same(got.values, values)
    engine.dispose()


def test_rollups_folded_in_batch_by_batch_equal_ones_rebuilt_from_the_data(store):
    """Appending batches take the fold-in path (no re-read of points); rewriting batches recompute.
    Either way the stored pyramid must equal one built from scratch."""
    rng = random.Random(11)
    run = store.create_run(RunIn(project="p"))
    for seq, lo in enumerate(range(0, 40_000, 333)):  # batch edges fall inside buckets at every level
        steps = list(range(lo, lo + 333))
        store.ingest(
            run.id,
            BatchIn.model_validate(
                {
                    "seq": seq,
                    "scalars": [
                        {"key": "loss", "steps": steps, "values": [_random_value(rng) for _ in steps]},
                        {
                            "key": "sparse",
                            "steps": steps[::50],
                            "values": [_random_value(rng) for _ in steps[::50]],
                        },
                    ],
                }
            ),
        )
    rewrite = list(range(10_000, 10_500))  # a resumed run writes old steps again
    store.ingest(
        run.id,
        BatchIn.model_validate(
            {"seq": 10_000, "scalars": [{"key": "loss", "steps": rewrite, "values": [0.5] * len(rewrite)}]}
        ),
    )

    def pyramid() -> list[tuple]:
        with store.engine.connect() as connection:
            return [
                tuple(row)
                for row in connection.execute(
                    text(
                        "SELECT series_id, rank, level, bucket, count, low_step, low_value, low_flag,"
                        " high_step, high_value, high_flag FROM point_rollups"
                        " ORDER BY series_id, rank, level, bucket"
                    )
                )
            ]

    incremental = pyramid()
    with store.engine.begin() as connection:
        connection.execute(text("DELETE FROM point_rollups"))
        rollups.rebuild_all(connection)
    rebuilt = pyramid()
    assert len(incremental) == len(rebuilt) > 1000
    assert incremental == rebuilt  # non-finite values are stored as NULL + flag: plain equality holds


def test_folding_a_batch_with_numpy_equals_combining_its_points_one_by_one():
    """merge_new_points summarises a batch's buckets at every level with numpy (_Spans): the same
    summaries as combine() over the points, ties, NaN/±Inf and buckets with nothing finite included."""
    import numpy as np

    from gradwatch.server.storage import chunked_points

    rng = random.Random(18)
    for _ in range(40):
        new = {}
        for sid in rng.sample(range(1, 50), rng.randint(1, 6)):
            steps = sorted(rng.sample(range(rng.randint(0, 5000), 40_000), rng.randint(1, 400)))
            values = [
                rng.choice([math.nan, math.inf, -math.inf, 1.0, 2.0])
                if rng.random() < 0.15
                else float(rng.randint(-3, 3))  # few distinct values: ties everywhere
                for _ in steps
            ]
            new[sid] = chunked_points.Points(np.asarray(steps, np.int64), np.asarray(values, np.float64))
        spans = rollups._Spans.of_points(new)
        for level in range(1, rollups.LEVELS + 1):
            spans = spans.coarser()
            keys = zip(spans.series.tolist(), spans.bucket.tolist(), strict=True)
            got = dict(zip(keys, spans.rows(), strict=True))
            expected = {}
            for sid, points in new.items():
                members = defaultdict(list)
                for step, value in zip(points.steps.tolist(), points.values.tolist(), strict=True):
                    flag = 0 if math.isfinite(value) else 1 if math.isnan(value) else 2 if value > 0 else 3
                    stored = value if flag == 0 else None
                    members[step // rollups.width(level)].append(rollups.Summary.of_point(step, stored, flag))
                for bucket, parts in members.items():
                    expected[sid, bucket] = tuple(rollups.combine([tuple(p) for p in parts]))
            assert got == expected
