"""gradwatch.Api against a real server: a real fp16 training run (GradScaler, skipped steps) read back
exactly, with and without pandas; a 240,000-point series read past the series endpoint's page; runs
filters, events, alerts, tokens, errors, and export."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import subprocess
import sys
from datetime import datetime

import httpx
import pytest
from conftest import api_only_server, free_port
from training import Reference, same_stored, train

import gradwatch
from gradwatch import api as read_api
from gradwatch.api import Api, ApiError, ApiUnreachable

BIG_POINTS = 240_000  # more than two pages of the series endpoint (MAX_PAGE = 100,000)
BIG_BATCH = 80_000  # under the server's max_batch_points (100,000)


def _big_series() -> tuple[list[int], list[float]]:
    """Irregular steps (gaps of 1 and 2), distinct values with full float precision, and a few
    non-finite ones."""
    steps = [2 * i + (i % 3 == 0) for i in range(BIG_POINTS)]
    values = [i * 0.1 + 1 / (i + 3) for i in range(BIG_POINTS)]
    values[7] = math.nan
    values[150_001] = math.inf
    values[-1] = -math.inf
    return steps, values


def _wire(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    return value if math.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server (SQLite) with: a real fp16 run (project "read"), a crashed run, a run of another
    project, and "big": 240,000 points of "big/x", a sparse key and 30 "mark" events."""
    tmp = tmp_path_factory.mktemp("read-api")
    servers = api_only_server(f"sqlite:///{tmp / 'gradwatch.db'}")
    server = next(servers)
    reference = Reference()
    options = {"server": server.url, "flush_interval": 0.05, "spool_dir": tmp / "spool"}
    with gradwatch.init(
        project="read", name="fp16-run", tags=["baseline", "fp16"], config={"lr": 0.01}, **options
    ) as run:
        train(40, run=run, overflow_steps=(5, 6), reference=reference)
        for step in (9, 19, 29, 39):
            run.log({"eval/acc": step / 100}, step=step)
    assert run.stats.dropped_points == 0 and run.stats.last_error is None
    crashed = gradwatch.init(project="read", name="ablation", tags=["ablation"], **options)
    crashed.log({"loss": 2.5}, step=0)
    crashed.finish(status="crashed")
    with gradwatch.init(project="elsewhere", name="fp16-run", **options) as other:
        other.log({"loss": 1.0}, step=0)

    steps, values = _big_series()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        big = client.post("/api/v1/runs", json={"project": "read", "name": "big"}).json()["id"]
        for seq, first in enumerate(range(0, BIG_POINTS, BIG_BATCH)):
            batch = {
                "seq": seq,
                "scalars": [
                    {
                        "key": "big/x",
                        "steps": steps[first : first + BIG_BATCH],
                        "values": [_wire(v) for v in values[first : first + BIG_BATCH]],
                    }
                ],
            }
            if seq == 0:
                batch["scalars"].append(
                    {"key": "big/sparse", "steps": [3, 250_000, 480_003], "values": [1, 2, 3]}
                )
                # 30 events: 10 steps with 3 each
                batch["events"] = [
                    {"step": 100 * (i // 3), "kind": "mark", "data": {"i": i}} for i in range(30)
                ]
            answer = client.post(f"/api/v1/runs/{big}/batches", json=batch)
            assert answer.status_code == 200, answer.text
    yield {
        "url": server.url,
        "run": run,
        "reference": reference,
        "crashed": crashed,
        "other": other,
        "big": big,
    }
    next(servers, None)  # stops it


# -- history: exact, with and without pandas ---------------------------------------------------------


def test_history_rows_equal_what_the_training_loop_logged(served, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if pandas were not installed
    reference, run_id = served["reference"], served["run"].id
    run = Api(served["url"]).run(run_id)
    rows = run.history(["loss", "amp/scale", "eval/acc"])
    assert isinstance(rows, list) and [row["step"] for row in rows] == list(range(40))
    assert all(set(row) == {"step", "loss", "amp/scale", "eval/acc"} for row in rows)
    assert all(same_stored(row["loss"], loss) for row, loss in zip(rows, reference.losses, strict=True))
    assert math.isnan(rows[5]["loss"])  # the overflowing step's loss: a logged NaN stays NaN
    assert [row["amp/scale"] for row in rows] == reference.scales_after
    assert {row["step"]: row["eval/acc"] for row in rows if row["eval/acc"] is not None} == {
        9: 0.09,
        19: 0.19,
        29: 0.29,
        39: 0.39,
    }  # and None (no point) at every other step

    # the same values the series endpoint itself returns
    with httpx.Client(base_url=served["url"]) as client:
        direct = client.get(f"/api/v1/runs/{run_id}/series", params={"key": "grad/global_norm"}).json()
    norms = run.history("grad/global_norm", as_frame=False)
    assert [r["step"] for r in norms] == direct["steps"]
    assert all(
        same_stored(r["grad/global_norm"], read_api._number(v))
        for r, v in zip(norms, direct["values"], strict=True)
    )

    with pytest.raises(ImportError, match="pip install pandas"):
        run.history("loss", as_frame=True)


def test_history_is_a_dataframe_indexed_by_step_when_pandas_is_installed(served):
    pd = pytest.importorskip("pandas")
    reference = served["reference"]
    run = Api(served["url"]).run(served["run"].id)
    frame = run.history(["loss", "amp/scale", "eval/acc"])
    assert isinstance(frame, pd.DataFrame)
    assert frame.index.name == "step" and list(frame.index) == list(range(40))
    assert list(frame.columns) == ["loss", "amp/scale", "eval/acc"]
    assert frame["amp/scale"].tolist() == reference.scales_after
    assert all(same_stored(a, b) for a, b in zip(frame["loss"].tolist(), reference.losses, strict=True))
    assert frame["eval/acc"].dropna().to_dict() == {9: 0.09, 19: 0.19, 29: 0.29, 39: 0.39}
    rows = run.history(["loss", "amp/scale", "eval/acc"], as_frame=False)  # the same data either way
    for row in rows:
        for key in frame.columns:
            expected = math.nan if row[key] is None else row[key]  # no point: NaN in a DataFrame
            assert same_stored(float(frame.loc[row["step"], key]), expected)
    every_key = run.history()  # keys=None: every scalar key of the run
    assert list(every_key.columns) == run.keys() and "amp/scale" in every_key.columns
    by_rank = run.history("loss", rank="all")
    assert by_rank.index.names == ["step", "rank"] and len(by_rank) == 40
    assert pd.DataFrame(Api(served["url"]).runs(project="read")).shape[0] == 3  # dataclasses -> rows


def test_history_reads_every_point_past_the_series_page(served, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    steps, values = _big_series()
    run = Api(served["url"]).run(served["big"])
    pages = []
    original = Api._series_page

    def counting(self, *args):
        result = original(self, *args)
        pages.append(result[2])
        return result

    monkeypatch.setattr(Api, "_series_page", counting)
    rows = run.history("big/x")
    assert [row["step"] for row in rows] == steps
    assert all(same_stored(row["big/x"], value) for row, value in zip(rows, values, strict=True))
    assert any(pages) and not pages[-1]  # it did meet downsampled answers, and read past them
    assert len(pages) < 12

    # a range: [start, end)
    window = run.history("big/x", start=1000, end=300_001)
    assert [r["step"] for r in window] == [s for s in steps if 1000 <= s < 300_001]
    # a sparse key over the same long range, and two keys aligned on steps
    both = run.history(["big/sparse", "big/x"], start=0, end=10)
    expected = sorted([(s, None) for s in steps if s < 10] + [(3, 1.0)])
    assert [(r["step"], r["big/sparse"]) for r in both] == expected
    assert [r["big/x"] for r in both if r["step"] == 3] == [None]
    assert [r["big/sparse"] for r in run.history("big/sparse")] == [1.0, 2.0, 3.0]

    # max_points: the server's min/max downsampling, on request only
    thin = run.history("big/x", max_points=1000)
    assert 2 <= len(thin) <= 1000
    with pytest.raises(ValueError, match="max_points"):
        run.history("big/x", max_points=1)


def test_tiny_pages_read_the_same_points(served, monkeypatch):
    """The splitting itself, many levels deep: pages of 8 points over a 40-step run."""
    monkeypatch.setitem(sys.modules, "pandas", None)
    run = Api(served["url"]).run(served["run"].id)
    whole = run.history(["loss", "amp/scale", "eval/acc"])
    monkeypatch.setattr(read_api, "MAX_PAGE", 8)
    paged = run.history(["loss", "amp/scale", "eval/acc"])
    assert len(paged) == len(whole) == 40
    assert all(same_stored(a[k], b[k]) for a, b in zip(paged, whole, strict=True) for k in a)


def test_last_values(served):
    reference = served["reference"]
    run = Api(served["url"]).run(served["run"].id)
    last = run.last_values(["loss", "amp/scale", "eval/acc", "no/such"])
    assert last == {
        "loss": (39, reference.losses[39]),
        "amp/scale": (39, reference.scales_after[39]),
        "eval/acc": (39, 0.39),
    }
    big = Api(served["url"]).run(served["big"])
    assert big.last_values("big/sparse") == {"big/sparse": (480_003, 3.0)}
    steps, _ = _big_series()
    assert big.last_values("big/x") == {"big/x": (steps[-1], -math.inf)}  # past a downsampled answer


# -- runs --------------------------------------------------------------------------------------------


def test_runs_and_their_filters(served):
    api = Api(served["url"])
    read = api.runs(project="read")
    assert [r.name for r in read] == ["big", "ablation", "fp16-run"]  # newest first
    fp16 = read[-1]
    assert fp16.id == served["run"].id and fp16.project == "read" and fp16.status == "finished"
    assert fp16.tags == ("baseline", "fp16") and fp16.config == {"lr": 0.01} and fp16.last_step == 39
    assert fp16.summary["skips"] == sum(served["reference"].skipped)
    assert fp16.summary["scale"] == served["reference"].scales_after[-1]
    assert isinstance(fp16.created_at, datetime) and fp16.created_at.tzinfo is not None
    assert fp16.metadata["torch"] and fp16.raw["id"] == fp16.id
    assert fp16.url == f"{served['url']}/dashboard/runs/{fp16.id}?project=read"
    assert "metadata" not in repr(fp16) and "_api" not in dataclasses.asdict(fp16)

    assert [r.name for r in api.runs(project="read", status="crashed")] == ["ablation"]
    assert {r.name for r in api.runs(status=["crashed", "finished"])} == {"ablation", "fp16-run"}
    assert [r.name for r in api.runs(tags="baseline")] == ["fp16-run"]
    assert [r.name for r in api.runs(tags=["baseline", "fp16"])] == ["fp16-run"]
    assert {r.project for r in api.runs(name="FP16")} == {"read", "elsewhere"}  # part of the name, any case
    assert len(api.runs(limit=2)) == 2 and len(api.runs()) == 4
    assert [r.name for r in api.runs(project="read", sort="name", order="asc")] == [
        "ablation",
        "big",
        "fp16-run",
    ]
    assert api.runs(created_after=fp16.created_at.isoformat(), project="elsewhere")
    with pytest.raises(ValueError, match="limit"):
        api.runs(limit=0)


def test_runs_page_through_the_listing(served, monkeypatch):
    monkeypatch.setattr(read_api, "RUNS_PAGE", 1)
    api = Api(served["url"])
    assert [r.name for r in api.runs(project="read")] == ["big", "ablation", "fp16-run"]
    assert len(api.runs(limit=3)) == 3


def test_run_by_id_or_by_name(served):
    api = Api(served["url"])
    assert api.run(served["crashed"].id).name == "ablation"
    assert api.run("ablation").id == served["crashed"].id  # a unique name
    assert api.run("read/fp16-run").id == served["run"].id  # project/name
    with pytest.raises(ApiError, match="2 runs are named 'fp16-run'") as twice:
        api.run("fp16-run")
    assert served["run"].id in str(twice.value) and twice.value.status == 404
    with pytest.raises(ApiError) as missing:
        api.run("no-such-run")
    assert missing.value.status == 404 and "does not exist" in missing.value.detail


def test_a_name_is_looked_up_among_every_run_not_one_page(served, monkeypatch):
    # A page of one run: the name's second run is on the second page (a sweep's 600 runs whose names
    # contain the asked-for name once hid the exact one beyond the first page of 500).
    monkeypatch.setattr(read_api, "RUNS_PAGE", 1)
    api = Api(served["url"])
    with pytest.raises(ApiError, match="2 runs are named 'fp16-run'"):
        api.run("fp16-run")
    assert api.run("ablation").id == served["crashed"].id


# -- events and alerts -------------------------------------------------------------------------------


def test_events(served, monkeypatch):
    reference = served["reference"]
    api = Api(served["url"])
    run = api.run(served["run"].id)
    skipped = [step for step, skip in enumerate(reference.skipped) if skip]
    skips = run.events("skip")
    assert [e.step for e in skips] == skipped and {5, 6} <= set(skipped)
    assert all(e.kind == "skip" and e.rank == 0 and "scale_before" in e.data for e in skips)
    everything = run.events()
    assert [e.step for e in everything] == sorted(e.step for e in everything)
    assert {e.kind for e in everything} >= {"skip"}

    big = api.run(served["big"])
    marks = big.events("mark")
    assert [e.data["i"] for e in marks] == list(range(30))
    assert [e.step for e in big.events(["mark", "skip"], start=100, end=300)] == [100] * 3 + [200] * 3
    monkeypatch.setattr(read_api, "MAX_PAGE", 7)  # pages of 7 events; a page ends before its last step
    assert [e.data["i"] for e in big.events("mark")] == list(range(30))
    monkeypatch.setattr(read_api, "MAX_PAGE", 2)  # 3 events at one step cannot be paged by steps
    with pytest.raises(ApiError, match="more than 2 events at step 0"):
        big.events("mark")


def test_alerts(served):
    api = Api(served["url"])
    run = api.run(served["run"].id)
    alerts = run.alerts()
    assert alerts, "a NaN loss fires the default loss_non_finite rule"
    nan = next(a for a in alerts if a.type == "loss_non_finite")
    assert nan.run_id == run.id and nan.project == "read" and nan.status == "firing" and nan.step == 5
    assert nan.title and nan.severity and nan.raw["id"] == nan.id and isinstance(nan.created_at, datetime)
    assert [a.id for a in api.alerts(project="read", state="open")] == [
        a.id for a in api.alerts(project="read", state="firing")
    ]
    assert nan.id in {a.id for a in api.alerts(state="open")}
    assert nan.id not in {a.id for a in api.alerts(state="resolved")}
    assert {a.project for a in api.alerts(project="elsewhere")} <= {"elsewhere"}
    assert len(api.alerts(project="read", limit=1)) == 1
    assert [a.id for a in api.alerts(run=run)] == [a.id for a in alerts]
    with pytest.raises(ValueError, match="state"):
        api.alerts(state="closed")


# -- export ------------------------------------------------------------------------------------------


def test_export_csv_reads_back_exactly(served, tmp_path):
    run = Api(served["url"]).run(served["run"].id)
    keys = ["loss", "amp/scale", "eval/acc"]
    path = tmp_path / "run.csv"
    assert run.export(path, "csv", keys) == 40
    with open(path, newline="") as file:
        table = list(csv.reader(file))
    assert table[0] == ["step", *keys]
    rows = run.history(keys, as_frame=False)
    for cells, row in zip(table[1:], rows, strict=True):
        assert int(cells[0]) == row["step"]
        for cell, key in zip(cells[1:], keys, strict=True):
            assert same_stored(None if cell == "" else float(cell), row[key])
    assert "nan" in table[6]  # step 5's loss
    stream = io.StringIO()
    run.export(stream, "csv", keys)
    assert stream.getvalue() == path.read_text()
    with pytest.raises(ValueError, match="format"):
        run.export(tmp_path / "x", "xlsx")  # type: ignore[arg-type]


def test_export_parquet(served, tmp_path):
    run = Api(served["url"]).run(served["run"].id)
    try:
        from pyarrow import parquet
    except ImportError:
        with pytest.raises(ImportError, match="pip install pyarrow"):
            run.export(tmp_path / "run.parquet", "parquet")
        assert not (tmp_path / "run.parquet").exists()
        return
    keys = ["loss", "eval/acc"]
    assert run.export(tmp_path / "run.parquet", "parquet", keys) == 40
    table = parquet.read_table(tmp_path / "run.parquet").to_pydict()
    rows = run.history(keys, as_frame=False)
    assert table["step"] == [r["step"] for r in rows]
    assert all(same_stored(a, r["loss"]) for a, r in zip(table["loss"], rows, strict=True))
    assert table["eval/acc"] == [r["eval/acc"] for r in rows]  # missing values are nulls


# -- configuration, tokens, errors ----------------------------------------------------------------


def test_server_and_token_default_to_the_agents_environment(served, monkeypatch):
    monkeypatch.setenv("GRADWATCH_SERVER", served["url"])
    monkeypatch.setenv("GRADWATCH_TOKEN", "gw_from_the_environment")
    api = gradwatch.Api()
    assert api.server == served["url"] and api.token == "gw_from_the_environment"
    assert "gw_from" not in repr(api)
    assert {r.project for r in api.runs()} == {"read", "elsewhere"}  # an open server ignores stray tokens
    monkeypatch.delenv("GRADWATCH_SERVER")
    monkeypatch.delenv("GRADWATCH_TOKEN")
    assert Api().server == "http://127.0.0.1:8765" and Api().token is None
    assert Api("http://h:1/", "t").server == "http://h:1"
    with pytest.raises(ValueError, match="http"):
        Api("127.0.0.1:8765")


def test_tokens(sqlite_server, tmp_path):
    tokens = sqlite_server.server.config.app.state.tokens
    _, ingest = tokens.create("secure", "ingest")
    _, read = tokens.create("secure", "read")
    _, other = tokens.create("other", "read")
    with gradwatch.init(
        project="secure",
        name="t",
        server=sqlite_server.url,
        token=ingest,
        flush_interval=0.05,
        spool_dir=tmp_path,
    ) as run:
        train(5, run=run, precision="bf16", clip=None)
        run.log({"acc": 0.5}, step=4)
    assert run.stats.dropped_points == 0 and run.stats.last_error is None

    reader = gradwatch.Api(sqlite_server.url, read)
    assert [r.id for r in reader.runs()] == [run.id]
    assert reader.run(run.id).history("acc", as_frame=False) == [{"step": 4, "acc": 0.5}]

    with pytest.raises(ApiError) as anonymous:
        Api(sqlite_server.url).runs()
    assert anonymous.value.status == 401
    assert "requires a token" in anonymous.value.detail and "GRADWATCH_TOKEN" in str(anonymous.value)
    with pytest.raises(ApiError) as ingest_only:
        Api(sqlite_server.url, ingest).run(run.id).history("acc")
    assert ingest_only.value.status == 403 and "read scope" in ingest_only.value.detail
    with pytest.raises(ApiError) as elsewhere:
        Api(sqlite_server.url, other).run(run.id)  # another project's run: as if it did not exist
    assert elsewhere.value.status == 404
    with pytest.raises(ApiError) as bad:
        Api(sqlite_server.url, "gw_not_a_token").runs()
    assert bad.value.status == 401 and "not recognised" in bad.value.detail


def test_an_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ApiUnreachable) as caught:
        Api(url, timeout=5).runs()
    assert url in str(caught.value) and caught.value.status is None
    assert isinstance(caught.value, ApiError)


def test_importing_gradwatch_loads_neither_pandas_nor_pyarrow():
    heavy = "('pandas', 'pyarrow', 'httpx', 'numpy')"
    code = f"import sys, gradwatch; print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
