"""Distributed training: real gloo process groups on CPU (FSDP2, FSDP1, DDP; torch.multiprocessing and
torchrun) → agent on every rank → one run on a real server → ranks combined at query time."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from training import RecordingTransport, reference_steps, spawn_ranks

import gradwatch
from gradwatch import GradwatchWarning
from gradwatch._distributed import process_identity, shared_run_id
from gradwatch.server.serve import BackgroundServer

TESTS = Path(__file__).resolve().parents[1] / "support"  # training.py, for spawned ranks


@pytest.fixture
def api(sqlite_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sqlite_server.url, timeout=30) as client:
        yield client


def _job(server: BackgroundServer, tmp_path: Path, **job) -> dict:
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    return {"server": server.url, "spool_dir": str(spool), **job}


def _get(api: httpx.Client, path: str, **params) -> dict:
    response = api.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _relative_error(got: float, expected: float) -> float:
    return abs(got - expected) / abs(expected)


# -- identity and the shared run id (no processes) ---------------------------------------------------


def test_identity_comes_from_the_launcher_environment():
    identity = process_identity({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (identity.rank, identity.world_size, identity.local_rank, identity.source) == (
        3,
        8,
        1,
        "environment",
    )
    assert identity.host
    assert process_identity({}).world_size == 1
    with pytest.raises(ValueError, match="WORLD_SIZE must be a whole number, got 'eight'"):
        process_identity({"RANK": "0", "WORLD_SIZE": "eight"})


def test_ranks_of_a_torchrun_job_derive_the_same_run_id_and_restarts_get_a_new_one():
    env = {"TORCHELASTIC_RUN_ID": "b1946ac9-2fd5-4d4c-a4a1-6ba5a0d4a2d4", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = shared_run_id("llm", "qlora", env)
    assert first == shared_run_id("llm", "qlora", dict(env))  # every rank computes it alike
    assert len(first) == 32
    assert first != shared_run_id("other-project", "qlora", env)
    assert first != shared_run_id("llm", "qlora", {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    # A static rendezvous without --rdzv-id is "none" for every job: not an id to share.
    assert shared_run_id("llm", None, {"TORCHELASTIC_RUN_ID": "none"}) is None
    assert shared_run_id("llm", None, {**env, "GRADWATCH_RUN_ID": "mine"}) == "mine"


def test_a_rank_without_a_shared_run_id_is_warned(monkeypatch):
    """Settled (here at finish(), with no watch()) while torch.distributed was never initialised: the id
    cannot have come from rank 0."""
    for name in ("GRADWATCH_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = gradwatch.init(project="p", transport=RecordingTransport())
    with pytest.warns(GradwatchWarning, match="set GRADWATCH_RUN_ID to one value on every rank"):
        run.finish()
    assert (run.rank, run.identity.world_size) == (1, 2)


def test_a_distributed_rank_announces_itself_and_how_it_ended(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    transport = RecordingTransport()
    with gradwatch.init(project="p", run_id="job", transport=transport) as run:
        model = torch.nn.Linear(2, 2)
        run.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    announced, ended = transport.events("rank")
    assert announced["data"]["rank"] == 1 and announced["data"]["local_rank"] == 1
    assert announced["data"]["world_size"] == 2 and announced["data"]["gradients"] == "local"
    assert ended["data"] == {"rank": 1, "status": "finished"}
    assert {b["rank"] for b in transport.batches} == {1}


def test_histogram_ranks_option_is_validated():
    from gradwatch._watch import WatchOptions

    assert WatchOptions().takes_histograms(0, "replicated")
    assert not WatchOptions().takes_histograms(1, "replicated")
    assert WatchOptions().takes_histograms(1, "sharded")
    assert WatchOptions(histogram_ranks="all").takes_histograms(1, "replicated")
    assert WatchOptions(histogram_ranks=[1, 2]).takes_histograms(2, "replicated")
    with pytest.raises(
        ValueError, match="histogram_ranks must be 'auto', 'all' or a collection of ranks, got 'some'"
    ):
        WatchOptions(histogram_ranks="some")
    with pytest.raises(ValueError, match="histogram_ranks must hold whole numbers >= 0"):
        WatchOptions(histogram_ranks=[-1])


# -- combination at query time (batches posted by hand) ----------------------------------------------


def _post(api: httpx.Client, run_id: str, rank: int, seq: int, **batch) -> None:
    response = api.post(f"/api/v1/runs/{run_id}/batches", json={"rank": rank, "seq": seq, **batch})
    assert response.status_code == 200, response.text


def _rank_event(rank: int, gradients: str) -> dict:
    return {
        "step": 0,
        "kind": "rank",
        "data": {
            "rank": rank,
            "world_size": 2,
            "host": f"node{rank}",
            "gradients": gradients,
            "parallelism": "fsdp2",
        },
    }


def test_combined_series_l2_mean_and_incomplete_steps(api):
    run_id = api.post("/api/v1/runs", json={"project": "combine", "id": "sharded-job"}).json()["id"]
    norms = {0: [3.0, 1.0, "NaN", 2.0], 1: [4.0, 1.0, 1.0]}  # rank 1 has not sent step 3 yet
    for rank, values in norms.items():
        _post(
            api,
            run_id,
            rank,
            0,
            events=[_rank_event(rank, "sharded")],
            scalars=[{"key": "grad/global_norm", "steps": list(range(len(values))), "values": values}],
        )
    auto = _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="grad/global_norm")
    assert auto["combine"] == "l2" and auto["ranks"] == [0, 1]
    assert auto["steps"] == [0, 1, 2]  # step 3 waits for rank 1
    assert auto["values"][:2] == [5.0, pytest.approx(math.sqrt(2))]
    assert auto["values"][2] == "NaN"
    assert auto["per_rank"] == {"0": [3.0, 1.0, "NaN"], "1": [4.0, 1.0, 1.0]}
    mean = _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="grad/global_norm", combine="mean")
    assert mean["values"][:2] == [3.5, 1.0]
    bad = api.get(
        f"/api/v1/runs/{run_id}/ranks/series", params={"key": "grad/global_norm", "combine": "median"}
    )
    assert bad.status_code == 422

    ranks = _get(api, f"/api/v1/runs/{run_id}/ranks")
    assert ranks["count"] == 2 and ranks["world_size"] == 2 and ranks["gradients"] == "sharded"
    assert [r["host"] for r in ranks["data"]] == ["node0", "node1"]
    assert all(r["batches"] == 1 and r["last_seen"] for r in ranks["data"])


def test_shards_are_summed_only_when_every_rank_of_the_job_reported(api):
    run_id = api.post("/api/v1/runs", json={"project": "combine", "id": "lost-rank"}).json()["id"]
    for rank in (0, 1):  # rank 2 of 3 never reported: the global norm cannot be known
        event = _rank_event(rank, "sharded")
        event["data"]["world_size"] = 3
        _post(
            api,
            run_id,
            rank,
            0,
            events=[event],
            scalars=[{"key": "grad/global_norm", "steps": [0], "values": [1.0]}],
        )
    assert _get(api, f"/api/v1/runs/{run_id}/ranks")["world_size"] == 3
    l2 = _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="grad/global_norm")
    assert (l2["combine"], l2["ranks"], l2["steps"]) == ("l2", [0, 1], [])
    assert _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="grad/global_norm", combine="max")[
        "values"
    ] == [1.0]


def test_combined_series_downsampling_keeps_the_extremes(api):
    run_id = api.post("/api/v1/runs", json={"project": "combine", "id": "long-job"}).json()["id"]
    steps = list(range(1000))
    for rank in (0, 1):
        values = [1.0] * 1000
        values[777] = 100.0 if rank == 1 else 1.0
        _post(
            api,
            run_id,
            rank,
            0,
            events=[_rank_event(rank, "sharded")],
            scalars=[{"key": "grad/global_norm", "steps": steps, "values": values}],
        )
    result = _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="grad/global_norm", max_points=100)
    assert result["downsampled"] and len(result["steps"]) <= 100
    peak = result["steps"].index(777)
    assert result["values"][peak] == pytest.approx(math.hypot(100.0, 1.0))
    assert result["per_rank"]["1"][peak] == 100.0


def test_vectors_and_disagreements(api):
    run_id = api.post("/api/v1/runs", json={"project": "combine", "id": "vector-job"}).json()["id"]
    for rank in (0, 1):
        _post(
            api,
            run_id,
            rank,
            0,
            layers=["a", "b"],
            events=[_rank_event(rank, "sharded")],
            vectors=[{"key": "grad/norm", "steps": [0, 20], "values": [[3.0, 0.0], [1.0, "Infinity"]]}],
            scalars=[{"key": "amp/skipped", "steps": [0, 1, 2], "values": [0.0, float(rank == 1), 1.0]}],
        )
    vectors = _get(api, f"/api/v1/runs/{run_id}/ranks/vectors", key="grad/norm")
    assert vectors["combine"] == "l2" and vectors["layers"] == ["a", "b"]
    assert vectors["values"] == [
        [pytest.approx(math.sqrt(18)), 0.0],
        [pytest.approx(math.sqrt(2)), "Infinity"],
    ]
    found = _get(api, f"/api/v1/runs/{run_id}/ranks/disagreements")
    assert found["count"] == 1
    assert found["data"] == [{"step": 1, "skipped_ranks": [1], "applied_ranks": [0], "layers": []}]
    assert api.get("/api/v1/runs/nope/ranks").status_code == 404


def test_rank_endpoints_need_a_read_token_of_the_project(api, sqlite_url):
    """Another project's token gets 404, as for a run that does not exist."""
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine

    engine = make_engine(sqlite_url)
    tokens = Tokens(engine)
    write = tokens.create("alpha", "ingest")[1]
    read, other = tokens.create("alpha", "read")[1], tokens.create("beta", "read")[1]
    engine.dispose()
    run_id = api.post(
        "/api/v1/runs", json={"project": "alpha"}, headers={"Authorization": f"Bearer {write}"}
    ).json()["id"]
    paths = [
        ("ranks", {}),
        ("ranks/series", {"key": "loss"}),
        ("ranks/vectors", {"key": "grad/norm"}),
        ("ranks/disagreements", {}),
        ("ranks/histograms", {"layer": "x"}),
    ]
    for path, params in paths:
        url = f"/api/v1/runs/{run_id}/{path}"
        assert api.get(url, params=params).status_code == 401, path
        assert api.get(url, params=params, headers={"Authorization": f"Bearer {other}"}).status_code == 404, (
            path
        )
        allowed = api.get(url, params=params, headers={"Authorization": f"Bearer {read}"})
        assert allowed.status_code == (404 if path == "ranks/histograms" else 200), (
            path,
            allowed.text,
        )  # no layer x


# -- real process groups -----------------------------------------------------------------------------


def test_fsdp2_combined_norms_equal_the_unsharded_reference(sqlite_server, api, tmp_path):
    """Three ranks so that one layer's shard is empty on a rank (out.bias has 4 rows: 2 + 2 + 0)."""
    world_size, steps = 3, 4
    watch = {"layer_norms_every": 1, "param_norms_every": 1, "histograms_every": 1, "update_ratio_every": 0}
    job = _job(
        sqlite_server,
        tmp_path,
        project="fsdp2",
        parallel="fsdp2",
        steps=steps,
        clip=1.0,
        watch=watch,
        compare_plain=True,
        init={"run_id": "fsdp2-job"},
    )
    results = spawn_ranks(world_size, job, tmp_path)
    assert all(r["bit_identical"] for r in results), "watching changed a rank's parameters"
    assert all(r["stats"]["dropped"] == 0 and r["stats"]["spooled"] == 0 for r in results)
    reference = reference_steps(steps, world_size, clip=1.0)
    run_id = "fsdp2-job"

    ranks = _get(api, f"/api/v1/runs/{run_id}/ranks")
    assert [r["rank"] for r in ranks["data"]] == [0, 1, 2]
    assert ranks["gradients"] == "sharded" and ranks["world_size"] == 3
    assert {r["parallelism"] for r in ranks["data"]} == {"fsdp2"}
    assert all(r["histograms"] and r["status"] == "finished" for r in ranks["data"])

    errors = []
    combined = _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="grad/global_norm")
    assert combined["combine"] == "l2" and combined["steps"] == list(range(steps))
    for step, value in zip(combined["steps"], combined["values"], strict=True):
        errors.append(_relative_error(value, reference[step].global_norm))
    per_rank = combined["per_rank"]
    assert all(0 < per_rank[str(r)][0] < combined["values"][0] for r in range(world_size)), (
        "shards' norms kept"
    )

    for key, expected in (("grad/norm", "layer_norms"), ("param/norm", "param_norms")):
        vectors = _get(api, f"/api/v1/runs/{run_id}/ranks/vectors", key=key)
        assert vectors["steps"] == list(range(steps))
        for step, row in zip(vectors["steps"], vectors["values"], strict=True):
            wanted = getattr(reference[step], expected)
            for layer, value in zip(vectors["layers"], row, strict=True):
                errors.append(_relative_error(value, wanted[layer]))
    worst = max(errors)
    print(f"FSDP2 x{world_size}: max relative error of combined norms vs unsharded reference: {worst:.2e}")
    assert worst < 1e-5

    # Histograms add up across the shards: every element of the whole gradient counted once.
    for layer, numel in (("out.bias", 4), ("inp.weight", 16 * 32)):
        hist = _get(api, f"/api/v1/runs/{run_id}/ranks/histograms", layer=layer)
        assert hist["combine"] == "sum" and hist["steps"] == list(range(steps))
        for step, counts, zeros, non_finite in zip(
            hist["steps"], hist["counts"], hist["zeros"], hist["non_finite"], strict=True
        ):
            assert sum(counts) + zeros + non_finite == numel
            wanted = reference[step].histograms[layer]
            # The reference row ends with the zeros and non-finite columns, which the API returns apart
            # (above): zip stops at the exponent bins. Rounding may move a value across 2^k.
            assert sum(abs(a - b) for a, b in zip(counts, wanted, strict=False)) <= 2


def test_ddp_under_torchrun_shares_one_run_with_equal_per_rank_norms(sqlite_server, api, tmp_path):
    """torchrun --standalone: no run id given; the ranks derive it from TORCHELASTIC_RUN_ID."""
    job = _job(
        sqlite_server,
        tmp_path,
        project="ddp-torchrun",
        parallel="ddp",
        steps=6,
        fp16=True,
        watch={"layer_norms_every": 1, "histograms_every": 2, "dense_start_steps": 0},
        out=str(tmp_path),
    )
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from training import rank_main
        rank_main(-1, -1, "", {job!r})
    """)
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("GRADWATCH_", "TORCHELASTIC_"))}
    environment["GLOO_SOCKET_IFNAME"] = "lo"
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    run_ids = {Path(tmp_path, f"rank{r}.json").read_text() for r in (0, 1)}
    runs = _get(api, "/api/v1/runs", project="ddp-torchrun")
    assert runs["count"] == 1, "the ranks must share one run"
    run_id = runs["data"][0]["id"]
    assert all(run_id in text for text in run_ids)

    ranks = _get(api, f"/api/v1/runs/{run_id}/ranks")
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in ranks["data"]] == [(0, 0, 2), (1, 1, 2)]
    assert ranks["gradients"] == "replicated" and all(r["host"] for r in ranks["data"])
    assert [r["histograms"] for r in ranks["data"]] == [True, False]

    combined = _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="grad/global_norm")
    assert combined["combine"] == "mean"  # replicated norms are never summed
    assert combined["per_rank"]["0"] == combined["per_rank"]["1"] == combined["values"]
    assert len(combined["steps"]) == 6
    # Histograms on rank 0 only (DDP's default); the combined view takes that rank's counts.
    rank1 = _get(api, f"/api/v1/runs/{run_id}/histograms", layer="inp.weight", rank=1)
    assert rank1["steps"] == []
    hist = _get(api, f"/api/v1/runs/{run_id}/ranks/histograms", layer="inp.weight")
    assert hist["combine"] == "first" and hist["ranks"] == [0] and hist["steps"] == [0, 2, 4]


def test_a_step_skipped_on_one_shard_is_a_rank_disagreement_alert(sqlite_server, api, tmp_path):
    """FSDP1 with a plain GradScaler per rank: each rank checks only its own shard for inf. Rank 1's
    batch gives the trap parameter an inf gradient; the reduce-scatter puts it in rank 0's shard:
    rank 0 skips the step, rank 1 applies it."""
    job = _job(
        sqlite_server,
        tmp_path,
        project="fsdp1",
        parallel="fsdp1",
        steps=8,
        fp16=True,
        poison_steps=[3],
        poison_rank=1,
        init={"run_id": "fsdp1-job"},
    )
    spawn_ranks(2, job, tmp_path)
    run_id = "fsdp1-job"
    skips = _get(api, f"/api/v1/runs/{run_id}/events", kind="skip")["data"]
    assert [(e["step"], e["rank"]) for e in skips] == [(3, 0)]
    assert skips[0]["data"]["non_finite_layers"] == ["_flat_param"]

    found = _get(api, f"/api/v1/runs/{run_id}/ranks/disagreements")
    assert found["data"] == [
        {
            "step": 3,
            "skipped_ranks": [0],
            "applied_ranks": [1],
            "layers": ["_flat_param"],
        }
    ]
    alerts = _get(api, "/api/v1/alerts", run_id=run_id)["data"]
    [alert] = [a for a in alerts if a["type"] == "rank_disagreement"]
    assert alert["step"] == 3 and alert["severity"] == "critical"
    assert alert["evidence"]["skipped_ranks"] == [0] and alert["evidence"]["applied_ranks"] == [1]
    ranks = _get(api, f"/api/v1/runs/{run_id}/ranks")
    assert ranks["gradients"] == "sharded" and {r["parallelism"] for r in ranks["data"]} == {"fsdp"}
