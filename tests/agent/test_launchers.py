"""One job, one run, under any launcher: the ranks of a job agree on rank 0's run id (through the
process group's store, at init() or watch()), and a rank that cannot know it yet sends nothing until
it does. Real processes (gloo on CPU) against a real server; the launchers' programs are in
tests/support/launch_jobs.py. The environment-only fallback is tested without processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import free_port, unavailable
from training import RecordingTransport

import gradwatch
from gradwatch import GradwatchWarning, _distributed
from gradwatch._distributed import exchange_run_id, launcher_run_id, may_become_distributed

TESTS = Path(__file__).resolve().parents[1]
SUPPORT = TESTS / "support"
# What a launcher puts in a rank's environment: none of it may leak from the test's own.
_LAUNCHER_PREFIXES = ("GRADWATCH_", "TORCHELASTIC_", "SLURM_", "MASTER_", "OMPI_", "PMI_", "ACCELERATE_")
_LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK"}


@pytest.fixture
def api(sqlite_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sqlite_server.url, timeout=30) as client:
        yield client


@pytest.fixture
def clean_environment(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES) or name in _LAUNCHER_VARIABLES:
            monkeypatch.delenv(name)


def _job(server, tmp_path: Path, project: str, **job) -> dict:
    out, spool = tmp_path / "out", tmp_path / "spool"
    out.mkdir(exist_ok=True)
    spool.mkdir(exist_ok=True)
    return {"server": server.url, "spool_dir": str(spool), "project": project, "out": str(out), **job}


def _environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_VARIABLES
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(SUPPORT), str(TESTS)]),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        **extra,
    )
    return env


def _launch(commands: list[list[str]], tmp_path: Path, timeout: float = 120, **env: str) -> None:
    """Run the launchers side by side (each in a session of its own) and fail with their output
    unless all exit 0 within `timeout` s; every process they started is killed at the end."""
    processes = []
    logs = []
    try:
        for index, command in enumerate(commands):
            log = open(tmp_path / f"launcher{index}.log", "w+b")  # noqa: SIM115 - closed below
            logs.append(log)
            processes.append(
                subprocess.Popen(
                    command,
                    env=_environment(**env),
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if codes != [0] * len(processes):
            output = []
            for log in logs:
                log.seek(0)
                output.append(log.read().decode(errors="replace")[-3000:])
            pytest.fail(
                f"launchers exited with {codes} (None: still running after {timeout:.0f} s):\n"
                + "\n".join(output)
            )
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the launcher's whole session: no rank left behind
            except ProcessLookupError:
                pass
            process.wait()
        for log in logs:
            log.close()


def _python(command: str, job: dict) -> list[str]:
    return [sys.executable, "-m", "launch_jobs", command, json.dumps(job)]


def _get(api: httpx.Client, path: str, **params) -> dict:
    response = api.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _one_run(api: httpx.Client, job: dict, world_size: int) -> tuple[str, list[dict]]:
    """The job's project holds exactly one run, in which every rank reported, all sent and nothing lost;
    returns its id and its ranks."""
    runs = _get(api, "/api/v1/runs", project=job["project"])
    assert runs["count"] == 1, f"one job, one run: got {[r['id'] for r in runs['data']]}"
    run_id = runs["data"][0]["id"]
    seen = [json.loads((Path(job["out"]) / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert [(s["run_id"], s["run_rank"]) for s in seen] == [(run_id, r) for r in range(world_size)]
    assert all(s["dropped"] == 0 and s["spooled"] == 0 for s in seen), seen
    ranks = _get(api, f"/api/v1/runs/{run_id}/ranks")
    assert [r["rank"] for r in ranks["data"]] == list(range(world_size))
    assert ranks["world_size"] == world_size
    assert all(r["status"] == "finished" for r in ranks["data"])
    return run_id, ranks["data"]


def _sent_before_the_group(api: httpx.Client, run_id: str, world_size: int) -> None:
    """What every rank logged before its run id was settled reached the run, under its rank."""
    before = _get(api, f"/api/v1/runs/{run_id}/ranks/series", key="before_group")
    assert before["per_rank"] == {str(r): [1.0] for r in range(world_size)}


# -- without processes: the environment's ids, the store exchange, the hold --------------------------


def test_the_ranks_of_an_srun_step_derive_one_id_on_every_node(monkeypatch):
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "MASTER_ADDR": "node-0", "MASTER_PORT": "29500"}
    found = set()
    for host, parent in (("node-0", 4100), ("node-0", 4100), ("node-1", 977)):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        monkeypatch.setattr(os, "getppid", lambda parent=parent: parent)
        found.add(launcher_run_id("llm", "qlora", 0, env))
    [(run_id, source)] = found
    assert source == "slurm" and len(run_id) == 32
    others = [
        launcher_run_id("llm", "qlora", 0, {**env, "SLURM_STEP_ID": "1"}),  # the next srun
        launcher_run_id("llm", "qlora", 0, {**env, "SLURM_RESTART_COUNT": "1"}),  # requeued
        launcher_run_id("llm", "qlora", 1, env),  # this process's second run of llm/qlora
        launcher_run_id("other", "qlora", 0, env),
    ]
    assert len({run_id, *(other for other, _ in others)}) == 5

    # Without SLURM: the ranks one launcher started on this host share an id; other hosts do not.
    plain = {"MASTER_ADDR": "node-0", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4"}
    by_host = {}
    for host, parent in (("node-0", 4100), ("node-1", 977)):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        monkeypatch.setattr(os, "getppid", lambda parent=parent: parent)
        by_host[host] = launcher_run_id("llm", "qlora", 0, plain)
        assert by_host[host] == launcher_run_id("llm", "qlora", 0, {**plain, "RANK": "2"})
    assert {source for _, source in by_host.values()} == {"host"}
    assert by_host["node-0"] != by_host["node-1"]


def test_which_processes_may_be_ranks_of_a_job():
    assert not may_become_distributed({})
    assert not may_become_distributed({"WORLD_SIZE": "1", "RANK": "0", "SLURM_NTASKS": "1"})
    for env in (
        {"WORLD_SIZE": "2"},
        {"RANK": "3"},
        {"MASTER_ADDR": "127.0.0.1"},
        {"MASTER_PORT": "29500"},
        {"SLURM_STEP_NUM_TASKS": "8"},
        {"OMPI_COMM_WORLD_SIZE": "4"},
        {"PMI_SIZE": "2"},
        {"CROSS_SIZE": "2"},  # DeepSpeed's launcher, two nodes
    ):
        assert may_become_distributed(env), env


def test_the_other_ranks_take_rank_0s_id_from_the_store():
    store = torch.distributed.HashStore()
    key = "gradwatch/run_id/0/p/0"
    assert exchange_run_id(store, 0, "rank0-id", key, follow=True) == "rank0-id"
    assert exchange_run_id(store, 1, "rank1-id", key, follow=True) == "rank0-id"
    assert exchange_run_id(store, 1, "given-id", key, follow=False) == "given-id"  # run_id= is kept
    with pytest.raises(torch.distributed.DistStoreError):  # rank 0 never left an id under this key
        exchange_run_id(store, 1, "rank1-id", "gradwatch/run_id/0/p/1", follow=True, timeout=0.2)
    store.set("bad", "not a run id!")
    with pytest.raises(ValueError, match="which is not a run id"):
        exchange_run_id(store, 1, "rank1-id", "bad", follow=True)


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_rank_on_hold_sends_nothing_until_watch_settles_its_id(monkeypatch, clean_environment):
    """torch.distributed never initialised here: watch() settles the id from the srun step."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"}.items():
        monkeypatch.setenv(name, value)
    transport = RecordingTransport()
    run = gradwatch.init(project="held", transport=transport, flush_interval=0.01)
    provisional = run.id
    for _ in range(5):
        run.log({"loss": 2.0})
        time.sleep(0.02)
    time.sleep(0.3)
    assert transport.runs == [] and transport.batches == [], "nothing may go out under a provisional id"
    model = torch.nn.Linear(2, 2)
    run.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    expected = launcher_run_id("held", None, run._occurrence)
    assert (run.id, "slurm") == expected and run.id != provisional
    assert run.name == run.id[:8]
    assert _wait_for(lambda: transport.runs)
    [document] = transport.runs
    assert document["id"] == run.id and document["name"] == run.name
    assert (document["metadata"]["rank"], document["metadata"]["world_size"]) == (1, 2)
    run.finish()
    assert transport.series("loss") == {0: 2.0}
    assert {batch["rank"] for batch in transport.batches} == {1}


def test_a_rank_on_hold_in_offline_mode_writes_its_file_under_the_settled_id(
    monkeypatch, clean_environment, tmp_path
):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "SLURM_JOB_ID": "78", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(name, value)
    run = gradwatch.init(project="held", mode="offline", spool_dir=tmp_path, flush_interval=0.01)
    run.log({"loss": 1.0})
    time.sleep(1.5)  # longer than the offline collector's spill delay: still nothing on disk
    assert list(tmp_path.iterdir()) == []
    run.finish()
    assert [p.name for p in tmp_path.iterdir()] == [f"{run.id}-rank1.jsonl"]
    assert run.id == launcher_run_id("held", None, run._occurrence)[0]


def test_a_multiprocessing_child_that_is_no_rank_keeps_a_run_of_its_own(monkeypatch, clean_environment):
    """E.g. a Pool worker of a sweep: held until watch(), which finds no process group and no launcher."""
    monkeypatch.setattr(_distributed, "_is_multiprocessing_child", lambda: True)
    transport = RecordingTransport()
    run = gradwatch.init(project="sweep", transport=transport, flush_interval=0.01)
    provisional = run.id
    run.log({"loss": 1.0})
    model = torch.nn.Linear(2, 2)
    run.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))  # no warning: filterwarnings=error
    run.finish()
    assert run.id == provisional and (run.rank, run.identity.world_size) == (0, 1)
    assert [r["id"] for r in transport.runs] == [provisional]


def test_a_lone_process_is_never_on_hold(clean_environment):
    transport = RecordingTransport()
    run = gradwatch.init(project="alone", transport=transport, flush_interval=0.01)
    run.log({"loss": 1.0})
    time.sleep(0.05)
    run.log({"loss": 1.0})  # flushes: the interval has passed
    assert _wait_for(lambda: transport.batches), "a single process sends from init() on"
    run.finish()


class _Group:
    """What gradwatch asks of an initialised torch.distributed: rank, world size, the default store."""

    def __init__(self, rank: int, world_size: int, store) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.distributed_c10d = SimpleNamespace(_get_default_store=lambda: self.store)

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size


def _init_before_the_group(monkeypatch, project: str) -> tuple[object, RecordingTransport]:
    """A multiprocessing child (mp.spawn's) with nothing in its environment calls init(): on hold."""
    monkeypatch.setattr(_distributed, "_is_multiprocessing_child", lambda: True)
    transport = RecordingTransport()
    run = gradwatch.init(project=project, transport=transport, flush_interval=0.01)
    run.log({"before_group": 1.0})
    return run, transport


def _watch(run) -> None:
    model = torch.nn.Linear(2, 2)
    run.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_watch_takes_rank_and_run_id_from_the_group_once_it_is_up(monkeypatch, clean_environment):
    run, transport = _init_before_the_group(monkeypatch, "group-later")
    assert (run.rank, run.identity.world_size) == (0, 1)  # all init() could know
    store = torch.distributed.HashStore()
    store.set(run._id_key, "rank0-run")  # rank 0's watch() came first
    monkeypatch.setattr(_distributed, "_initialised_process_group", lambda: _Group(1, 2, store))
    _watch(run)
    assert (run.id, run.rank, run.identity.world_size) == ("rank0-run", 1, 2)
    run.finish()
    [document] = transport.runs
    assert document["id"] == "rank0-run" and document["name"] == "rank0-ru"
    assert (document["metadata"]["rank"], document["metadata"]["world_size"]) == (1, 2)
    assert {b["rank"] for b in transport.batches} == {1}
    assert transport.series("before_group") == {0: 1.0}
    ranks = transport.events("rank")
    assert ranks[0]["data"]["rank"] == 1 and ranks[0]["data"]["world_size"] == 2


def test_rank_0_leaves_its_id_in_the_store(monkeypatch, clean_environment):
    run, transport = _init_before_the_group(monkeypatch, "group-rank0")
    store = torch.distributed.HashStore()
    monkeypatch.setattr(_distributed, "_initialised_process_group", lambda: _Group(0, 2, store))
    _watch(run)
    assert store.get(run._id_key).decode() == run.id
    run.finish()
    assert [r["id"] for r in transport.runs] == [run.id]


def test_a_rank_whose_rank_0_never_answers_warns_and_keeps_training(monkeypatch, clean_environment):
    monkeypatch.setattr(_distributed, "AGREE_TIMEOUT", 0.2)
    run, transport = _init_before_the_group(monkeypatch, "group-silent")
    store = torch.distributed.HashStore()
    monkeypatch.setattr(_distributed, "_initialised_process_group", lambda: _Group(1, 2, store))
    with pytest.warns(GradwatchWarning, match="could not learn rank 0's run id"):
        _watch(run)
    assert (run.id, "host") == launcher_run_id("group-silent", None, run._occurrence)
    run.finish()
    assert [r["id"] for r in transport.runs] == [run.id]


# -- real launchers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("init_first", [False, True], ids=["init-after-group", "init-before-group"])
def test_mp_spawn_ddp_is_one_run_with_two_ranks(sqlite_server, api, tmp_path, init_first):
    """torch.multiprocessing spawn, gloo, a file rendezvous, nothing in the ranks' environment."""
    job = _job(
        sqlite_server,
        tmp_path,
        f"spawn-{init_first}",
        per_node=2,
        world_size=2,
        init_first=init_first,
        init_method=f"file://{tmp_path / 'rendezvous'}",
    )
    _launch([_python("spawn", job)], tmp_path)
    run_id, ranks = _one_run(api, job, 2)
    assert {r["gradients"] for r in ranks} == {"replicated"}
    if init_first:
        _sent_before_the_group(api, run_id, 2)


@pytest.mark.parametrize("rendezvous", ["standalone", "static"])
def test_torchrun_is_one_run(sqlite_server, api, tmp_path, rendezvous):
    """--standalone (TORCHELASTIC_RUN_ID random per job) and a static rendezvous (run id "none", so the
    ranks agree through the store); gradwatch.init() before init_process_group in both."""
    job = _job(sqlite_server, tmp_path, f"torchrun-{rendezvous}", init_first=True)
    options = (
        ["--standalone"]
        if rendezvous == "standalone"
        else ["--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--node-rank", "0"]
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    _launch([[*command, *options, "-m", "launch_jobs", "worker", json.dumps(job)]], tmp_path)
    run_id, ranks = _one_run(api, job, 2)
    assert [r["local_rank"] for r in ranks] == [0, 1]
    _sent_before_the_group(api, run_id, 2)


def test_two_simulated_nodes_are_one_run_with_four_ranks(sqlite_server, api, tmp_path):
    """Two "nodes" (launchers whose ranks report host names node-0 and node-1), each starting two
    ranks as DeepSpeed's launcher does (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* in the environment),
    one gloo group of four through env://; gradwatch.init() before init_process_group. The nodes'
    launchers share nothing the ranks could derive one id from: only rank 0's word makes one run."""
    port = str(free_port())
    jobs = [
        _job(
            sqlite_server,
            tmp_path,
            "two-nodes",
            node=node,
            per_node=2,
            world_size=4,
            host=f"node-{node}",
            init_first=True,
        )
        for node in (0, 1)
    ]
    _launch([_python("node", job) for job in jobs], tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    run_id, ranks = _one_run(api, jobs[0], 4)
    assert [(r["rank"], r["host"], r["local_rank"]) for r in ranks] == [
        (0, "node-0", 0),
        (1, "node-0", 1),
        (2, "node-1", 0),
        (3, "node-1", 1),
    ]
    _sent_before_the_group(api, run_id, 4)


def test_lightning_ddp_spawn_on_cpu_is_one_run(sqlite_server, api, tmp_path):
    try:
        import lightning  # noqa: F401
    except ImportError:
        unavailable("lightning is not installed (pip install -e '.[dev]')")
    job = _job(sqlite_server, tmp_path, "lightning-ddp-spawn", steps=3)
    _launch([_python("lightning", job)], tmp_path, timeout=180)
    _one_run(api, job, 2)


def test_gradwatch_as_an_accelerate_tracker_on_two_processes_is_one_run(sqlite_server, api, tmp_path):
    """Accelerator(log_with=[GradwatchTracker(...)]) on 2 CPU processes: one run with both ranks, the
    config from init_trackers, accelerator.log's numbers (strings left out), the gradients watched
    through the prepared model and optimizer; end_training finishes rank 0 (Accelerate calls it on the
    main process only) and multiprocessing's exit hook rank 1 (atexit never runs in its children)."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        unavailable("accelerate is not installed (pip install -e '.[dev]')")
    job = _job(sqlite_server, tmp_path, "accelerate-tracker", port=free_port(), steps=4)
    _launch([_python("accelerate-tracker", job)], tmp_path)
    run_id, _ = _one_run(api, job, 2)
    run = _get(api, f"/api/v1/runs/{run_id}")
    assert run["config"] == {"lr": 0.1, "world": 2} and run["status"] == "finished"
    assert _get(api, f"/api/v1/runs/{run_id}/keys")["data"].count("note") == 0
    # Accelerate calls trackers' log() on the main process only; every rank's gradients are watched.
    loss = _get(api, f"/api/v1/runs/{run_id}/series", key="loss", rank=0)
    assert loss["steps"] == [0, 1, 2, 3], loss
    for rank in (0, 1):
        norms = _get(api, f"/api/v1/runs/{run_id}/series", key="grad/global_norm", rank=rank)
        assert norms["steps"] == [0, 1, 2, 3], (rank, norms)


def test_accelerate_notebook_launcher_on_cpu_is_one_run(sqlite_server, api, tmp_path):
    """notebook_launcher's workers: TorchElastic with a static rendezvous (run id "none");
    gradwatch.init() before Accelerator() initialises the process group."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        unavailable("accelerate is not installed (pip install -e '.[dev]')")
    job = _job(sqlite_server, tmp_path, "accelerate-notebook", port=free_port())
    _launch([_python("accelerate", job)], tmp_path)
    run_id, _ = _one_run(api, job, 2)
    _sent_before_the_group(api, run_id, 2)


def test_the_guard_stops_every_ddp_rank_at_the_same_step(sqlite_server, api, tmp_path):
    """Two gloo ranks, rank 0's data turns NaN at step 30: each rank learns of the critical incident
    from its own batches' answers, at different moments; the ranks agree every sync_every steps, so
    both loops stop at one step and neither is left waiting in a collective (the job exits)."""
    job = _job(
        sqlite_server,
        tmp_path,
        "guard-ddp",
        init_method=f"file://{tmp_path / 'rendezvous'}",
        steps=2000,
        nan_at=30,
        sync_every=5,
    )
    _launch([_python("guard", job)], tmp_path, timeout=180)
    results = [json.loads(Path(job["out"], f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["stopped"] == results[1]["stopped"], results
    stopped = results[0]["stopped"]
    assert stopped is not None and 30 < stopped < 2000 and stopped % 5 == 0, results
    assert results[0]["incident"] is not None  # rank 0 (or both) knew which incident
