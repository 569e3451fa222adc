"""gradwatch.integrations.deepspeed against real DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo), one and
two ranks (torch.multiprocessing spawn), a real server: what a watched engine records equals what the
engine itself says at every optimizer step (loss scale, skipped steps, global grad norm), overflow
steps are `skip` events, and training is bit-identical with and without watching.

Each job runs in fresh processes: DeepSpeed keeps process-wide state (its communication backend, the
accelerator) that must not leak into the rest of the suite. The model is tiny and the steps few: fp16
and bf16 math is slow on CPUs without native support.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port, unavailable

STEPS = 12  # optimizer steps
ACCUMULATION = 2  # micro-batches per optimizer step: engine.step() runs twice per optimizer step
OVERFLOW_STEPS = (3, 4, 9)  # optimizer steps whose first micro-batch is blown up to inf / NaN
# DeepSpeed 0.19.8's own calls of APIs torch 2.13 deprecates (at import and with ZeRO on 2 ranks).
DEEPSPEED_WARNINGS = [
    (r"`torch\.jit\.script_method` is deprecated", DeprecationWarning),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
]
LAYERS = ["0.weight", "0.bias", "2.weight", "2.bias"]
pytestmark = [  # the same, where this process imports DeepSpeed (test_watch_rejects_...)
    pytest.mark.filterwarnings(f"ignore:{message}:{category.__name__}")
    for message, category in DEEPSPEED_WARNINGS
] + [pytest.mark.timeout(300)]  # a job takes 3-30 s: a hung rank fails in minutes, not the suite's 10


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_installed() -> None:
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: see the module docstring
        unavailable("deepspeed is not installed (pip install -e '.[dev]')")


def _config(precision: str, stage: int, clipping: float) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clipping,
        "steps_per_print": 10_000,
    }
    if precision == "fp16":
        # A short window so that the scale also grows within the test.
        config["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 1}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _train(engine, params, *, overflow: bool, before_step=None) -> list[dict]:
    """STEPS optimizer steps of a tiny regression; returns what the engine says after each one."""
    from torch import nn

    generator = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    dtype = params[0].dtype
    seen = []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            x = torch.randn(4, 8, generator=generator)
            if overflow and step in OVERFLOW_STEPS and micro == 0:
                x = x * 1e30  # inf in fp16; its square overflows in float32 under bf16 and fp32
            loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), x[:, :2].float())
            engine.backward(loss)
            reference = before_step() if before_step is not None and micro == ACCUMULATION - 1 else None
            engine.step()
        norm = engine.get_global_grad_norm()
        seen.append(
            {
                "scale": float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None,
                "skipped": not engine.was_step_applied(),
                "norm": None if norm is None else float(norm),
                "pre_clip_norm": reference,
            }
        )
    return seen


def _visible_grad_norm(params) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params])))


def _job(rank: int, world_size: int, job: dict) -> None:
    """One rank: train unwatched, then the same again watched by gradwatch; write what it saw."""
    # What DeepSpeed's launcher would set (DeepSpeed asserts LOCAL_RANK), on one host.
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["port"]),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    # As pytest's filterwarnings = error, in the ranks too, but for what DeepSpeed itself sets off.
    warnings.simplefilter("error")
    for message, category in DEEPSPEED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # Collectives through gloo alone. DeepSpeed's CPU backend would JIT-compile its shared-memory
    # all-reduce op into ~/.cache/torch_extensions under a lock file: a rank killed while building
    # leaves the lock, and every later job on the machine waits on it forever (CI hung 6 x 600 s).
    # (The module by name: the package's attribute `torch` is PyTorch, star-imported.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    accelerator = get_accelerator()
    if job["precision"] == "fp16" and not accelerator.is_fp16_supported():
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (CPUs without
        # AVX512-FP16 or AMX-FP16, e.g. AMD EPYC), though torch runs fp16 there with its generic
        # kernels (slowly: the model is tiny). What is tested, DeepSpeed's loss scaling and skipped
        # steps, is the same either way.
        type(accelerator).is_fp16_supported = lambda self: True

    import gradwatch
    from gradwatch.integrations.deepspeed import watch

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        config = _config(job["precision"], job["stage"], job["clipping"])
        built, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
        )
        return built, [p for p in built.module.parameters()]

    overflow = job["precision"] != "fp32" or job["stage"] > 0  # DeepSpeed's own optimizers check
    plain, plain_params = engine()
    _train(plain, plain_params, overflow=overflow)
    watched, params = engine()
    run = gradwatch.init(
        project=job["project"], server=job["server"], flush_interval=0.05, spool_dir=job["spool_dir"]
    )
    watch(run, watched, layer_norms_every=1, histograms_every=1, update_ratio_every=1, param_norms_every=1)
    reference = (lambda: _visible_grad_norm(params)) if job["clipping"] and job["stage"] == 0 else None
    seen = _train(watched, params, overflow=overflow, before_step=reference)
    run.finish()
    identical = all(torch.equal(a, b) for a, b in zip(plain_params, params, strict=True))
    result = {
        "run_id": run.id,
        "rank": run.rank,
        "seen": seen,
        "identical": identical,
        "disabled": dict(run.features.disabled),
        "step_wrapped": "step" in watched.__dict__,
    }
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def _run_job(tmp_path: Path, server, world_size: int, **job) -> list[dict]:
    import torch.multiprocessing as mp

    job.update(
        project=f"deepspeed-{job['precision']}-zero{job['stage']}-{world_size}",
        server=server.url,
        spool_dir=str(tmp_path / "spool"),
        out=str(tmp_path),
        port=free_port(),
    )
    mp.spawn(_job, args=(world_size, job), nprocs=world_size, join=True)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _series(client: httpx.Client, run_id: str, key: str, rank: int) -> dict[int, float]:
    response = client.get(f"/api/v1/runs/{run_id}/series", params={"key": key, "rank": rank})
    assert response.status_code == 200, response.text
    body = response.json()
    return dict(zip(body["steps"], body["values"], strict=True))


def _keys(client: httpx.Client, run_id: str, kind: str) -> list[str]:
    return client.get(f"/api/v1/runs/{run_id}/keys", params={"kind": kind}).json()["data"]


def _check(server, results: list[dict], precision: str, stage: int) -> None:
    assert len({r["run_id"] for r in results}) == 1, "one job, one run"
    run_id = results[0]["run_id"]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        events = client.get(f"/api/v1/runs/{run_id}/events").json()["data"]
        keys = client.get(f"/api/v1/runs/{run_id}/keys").json()["data"]
        for result in results:
            rank, seen = result["rank"], result["seen"]
            assert result["identical"], "watching changed training"
            assert result["disabled"] == {}, result["disabled"]
            assert not result["step_wrapped"], "engine.step still wrapped after run.finish()"
            steps = list(range(STEPS))
            skipped = _series(client, run_id, "amp/skipped", rank)
            if precision == "fp32" and stage == 0:
                assert skipped == {}  # a plain torch optimizer: DeepSpeed checks nothing
            else:
                assert skipped == {s: float(seen[s]["skipped"]) for s in steps}
                assert [s for s in steps if seen[s]["skipped"]] == list(OVERFLOW_STEPS)
            rank_skips = [e for e in events if e["kind"] == "skip" and e["rank"] == rank]
            assert sorted({e["step"] for e in rank_skips}) == [s for s in steps if seen[s]["skipped"]]
            scale = _series(client, run_id, "amp/scale", rank)
            if precision == "fp16":
                assert scale == {s: seen[s]["scale"] for s in steps}  # DeepSpeed's cur_scale, step by step
                assert len(set(scale.values())) > 2, "the scale backed off and grew again"
                for event in rank_skips:
                    step = event["step"]
                    before = seen[step - 1]["scale"] if step else 2.0**10
                    assert (event["data"]["scale_before"], event["data"]["scale_after"]) == (
                        before,
                        seen[step]["scale"],
                    )
            else:
                assert scale == {}
            norms = _series(client, run_id, "grad/global_norm", rank)
            for s in steps:
                expected = seen[s]["pre_clip_norm"] if seen[s]["norm"] is None else seen[s]["norm"]
                if seen[s]["skipped"]:
                    assert norms[s] in ("Infinity", "NaN", None), (s, norms[s])
                else:
                    assert norms[s] == pytest.approx(expected, rel=1e-6), (s, norms[s], expected)
            if seen[0]["pre_clip_norm"] is not None:  # clipping: the norm recorded is the pre-clip one
                assert any(seen[s]["pre_clip_norm"] > 2 * 0.05 for s in steps)
        vector_keys = set(client.get(f"/api/v1/runs/{run_id}/keys", params={"kind": "vector"}).json()["data"])
        histogram_keys = client.get(f"/api/v1/runs/{run_id}/keys", params={"kind": "histogram"}).json()[
            "data"
        ]
        ratios = client.get(f"/api/v1/runs/{run_id}/vectors", params={"key": "update/ratio"}).json()
        layer_norms = client.get(f"/api/v1/runs/{run_id}/vectors", params={"key": "grad/norm"}).json()
    assert "lr" in keys and {"update/ratio", "param/norm"} <= vector_keys
    assert ratios["layers"] == LAYERS
    seen = results[0]["seen"]
    assert ratios["steps"] == [s for s in range(STEPS) if not seen[s]["skipped"]]  # skipped: nothing applied
    if stage == 0:
        assert "grad/norm" in vector_keys and histogram_keys == ["grad/hist"]
        assert not [e for e in events if e["kind"] == "no_gradient"]
        assert layer_norms["layers"] == LAYERS and layer_norms["steps"] == list(range(STEPS))
        for step, row in zip(layer_norms["steps"], layer_norms["values"], strict=True):
            if not seen[step]["skipped"]:  # the layers' norms add up to the engine's global norm
                expected = seen[step]["pre_clip_norm"] or seen[step]["norm"]
                assert sum(v * v for v in row) ** 0.5 == pytest.approx(expected, rel=1e-5)
    else:  # ZeRO 1/2: the gradients live in DeepSpeed's partitions, not on the parameters
        assert "grad/norm" not in vector_keys and histogram_keys == []


@pytest.mark.parametrize(
    ("precision", "stage", "clipping"),
    [("fp16", 0, 1.0), ("fp16", 2, 1.0), ("bf16", 1, 1.0), ("fp32", 0, 0.05)],
    ids=["fp16-zero0", "fp16-zero2", "bf16-zero1", "fp32-zero0-clipped"],
)
def test_one_rank_records_the_engines_scale_skips_and_global_norm(
    sqlite_server, tmp_path, precision, stage, clipping
):
    results = _run_job(tmp_path, sqlite_server, 1, precision=precision, stage=stage, clipping=clipping)
    _check(sqlite_server, results, precision, stage)


@pytest.mark.parametrize(("precision", "stage"), [("fp16", 2), ("bf16", 0)], ids=["fp16-zero2", "bf16-zero0"])
def test_two_ranks_are_one_run_each_reporting_the_engines_signals(sqlite_server, tmp_path, precision, stage):
    results = _run_job(tmp_path, sqlite_server, 2, precision=precision, stage=stage, clipping=1.0)
    _check(sqlite_server, results, precision, stage)
    # DeepSpeed's global norm is the global one: the same on both ranks.
    assert [s["norm"] for s in results[0]["seen"]] == pytest.approx([s["norm"] for s in results[1]["seen"]])


def test_watch_rejects_what_is_not_an_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADWATCH_HOME", str(tmp_path))
    import gradwatch
    from gradwatch.integrations.deepspeed import watch

    run = gradwatch.init(project="deepspeed-misuse", mode="offline")
    with pytest.raises(ValueError, match="DeepSpeedEngine"):
        watch(run, torch.nn.Linear(2, 2))
    run.finish()
