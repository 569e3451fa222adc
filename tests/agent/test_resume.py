"""gradwatch.init(resume=...): the server's answer at init, where the resumed step counter comes from
(run.step, the first log(step=), the server's last step), what is held and renumbered until then, the
`resume` event; and the `crash` event that says how a run ended. Real CPU fp16 loops with a real
GradScaler; a transport that answers like the server (tests/system has the real one)."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest
import torch
from torch import nn
from training import RecordingTransport, TinyNet

import gradwatch
from gradwatch._transport import TransportError


class ResumingServer(RecordingTransport):
    """Answers POST /runs as the server does (resume="must" → 404, "never" → 409, `resumed`), keeps
    what is sent; `down_for_check`: the first create_run fails as an unreachable server's would."""

    def __init__(self, runs: dict[str, int | None] | None = None, down_for_check: bool = False) -> None:
        super().__init__()
        self.known = dict(runs or {})  # run id -> last step
        self.down_for_check = down_for_check

    def create_run(self, run: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        self.runs.append(run)
        if self.down_for_check:
            self.down_for_check = False
            raise TransportError("POST /api/v1/runs: ConnectionRefusedError", retryable=True)
        mode, exists = run.get("resume"), run["id"] in self.known
        if mode == "must" and not exists:
            raise TransportError("POST /api/v1/runs: HTTP 404: no such run", retryable=False, status=404)
        if mode == "never" and exists:
            raise TransportError("POST /api/v1/runs: HTTP 409: exists", retryable=False, status=409)
        self.known.setdefault(run["id"], None)
        answer = {"id": run["id"], "status": "running", "last_step": self.known[run["id"]]}
        if mode and exists:  # how the run stood before the resume set it running
            answer |= {"previous_status": "crashed", "previous_status_reason": "no heartbeat"}
        return answer | ({"resumed": exists} if mode else {})


def _init(transport: Any, **options: Any) -> gradwatch.Run:
    return gradwatch.init(project="resume", name="unit", transport=transport, flush_interval=0.01, **options)


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=20)


def _steps(
    run: Any, model: Any, optimizer: Any, scaler: Any, count: int, log_step: int | None = None
) -> None:
    """`count` fp16 optimizer steps; with log_step, each logs its loss after the step as step log_step + i."""
    generator = torch.Generator().manual_seed(7)
    for i in range(count):
        x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        if log_step is not None:
            run.log({"loss": loss}, step=log_step + i)


def _checkpoint(steps: int) -> dict[str, Any]:
    """A first attempt's state after `steps` optimizer steps (no gradwatch)."""
    model, optimizer, scaler = _setup()
    _steps(None, model, optimizer, scaler, steps)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}


def _gradwatch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("gradwatch")}


# -- the server's answer at init ------------------------------------------------------------------------


def test_must_raises_at_init_when_the_server_has_no_such_run_and_starts_nothing():
    server = ResumingServer()
    threads = _gradwatch_threads()
    with pytest.raises(gradwatch.ResumeError, match=r"cannot resume run 'gone'.*404"):
        _init(server, run_id="gone", resume="must")
    assert server.runs[0]["resume"] == "must"
    # No sender was started for it (threads of earlier tests may have ended meanwhile).
    assert not _gradwatch_threads() - threads


def test_never_raises_at_init_when_the_id_exists_and_starts_a_plain_run_otherwise():
    with pytest.raises(gradwatch.ResumeError, match="exists already"):
        _init(ResumingServer({"taken": 10}), run_id="taken", resume="never")
    server = ResumingServer()
    with _init(server, run_id="fresh", resume="never") as run:
        model, optimizer, scaler = _setup()
        run.watch(model, optimizer, scaler=scaler)
        _steps(run, model, optimizer, scaler, 3)
    assert run.step == 3 and list(server.series("amp/scale")) == [0, 1, 2]
    assert server.events("resume") == []
    assert "resume" not in server.runs[-1]  # the sender's own create is a plain one


def test_never_is_checked_by_rank_zero_only_the_other_ranks_share_its_run():
    server = ResumingServer({"job": None})  # rank 0 created it a moment ago
    with _init(server, run_id="job", resume="never", rank=1) as run:
        run.log({"loss": 1.0})
    assert run._resume is None and "resume" not in server.runs[0]


def test_allow_on_an_id_the_server_does_not_have_or_has_no_data_for_is_a_new_run():
    # The second: another rank of the job created the run a moment ago, or it died before sending.
    for server in (ResumingServer(), ResumingServer({"new": None})):
        with _init(server, run_id="new", resume="allow") as run:
            model, optimizer, scaler = _setup()
            run.watch(model, optimizer, scaler=scaler)
            _steps(run, model, optimizer, scaler, 3)
        assert list(server.series("amp/scale")) == [0, 1, 2] and server.events("resume") == []


def test_bad_arguments_are_refused_at_init(monkeypatch):
    for variable in ("GRADWATCH_RUN_ID", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ValueError, match="resume must be one of"):
        _init(ResumingServer(), run_id="r", resume="yes")
    with pytest.raises(ValueError, match="needs the id of the run"):
        _init(ResumingServer(), resume="must")
    with _init(ResumingServer(), resume="allow") as run:  # no id: nothing to resume, a new run
        pass
    assert run._resume is None
    with pytest.raises(ValueError, match="whole number"):
        run.step = -1


# -- where the resumed step comes from --------------------------------------------------------------------


def test_run_step_from_the_checkpoint_renumbers_what_came_before_and_marks_the_resume():
    server = ResumingServer({"ckpt": 37})  # the abandoned attempt reached step 37; the checkpoint is 30
    state = _checkpoint(30)
    run = _init(server, run_id="ckpt", resume="must")
    assert server.runs[0]["resume"] == "must"
    model, optimizer, scaler = _setup()
    run.watch(model, optimizer, scaler=scaler)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])  # before run.step: its event moves to the resumed step
    run.log({"epoch": 3})
    run.step = 30
    _steps(run, model, optimizer, scaler, 5)
    run.finish()

    assert list(server.series("amp/scale")) == [30, 31, 32, 33, 34]
    assert server.series("epoch") == {30: 3.0}
    [resume] = server.events("resume")
    assert resume["step"] == 30
    assert resume["data"] == {
        "mode": "must",
        "step_from": "run.step",
        "previous_status": "crashed",  # carried for the server: init() had set the run running
        "previous_status_reason": "no heartbeat",
    }
    [loaded] = server.events("scaler_state_loaded")
    assert loaded["step"] == 30 and loaded["data"] == {"scale": state["scaler"]["scale"]}
    first = server.batches[0]
    assert any(e["kind"] == "resume" for e in first["events"])  # nothing went out before it
    assert min(s for series in first["scalars"] for s in series["steps"]) >= 30


def test_the_first_log_with_a_step_sets_the_step_after_the_first_optimizer_step():
    server = ResumingServer({"logged": 80})
    run = _init(server, run_id="logged", resume="allow")
    model, optimizer, scaler = _setup()
    run.watch(model, optimizer, scaler=scaler)
    _steps(run, model, optimizer, scaler, 4, log_step=50)  # the loop logs after each step, as Lightning does
    run.finish()
    assert list(server.series("amp/scale")) == [50, 51, 52, 53]
    assert list(server.series("loss")) == [50, 51, 52, 53]
    [resume] = server.events("resume")
    assert resume["step"] == 50 and resume["data"]["step_from"] == "run.log(step=)"
    assert run.step == 54


def test_a_log_with_a_step_before_the_first_optimizer_step_is_the_current_step():
    server = ResumingServer({"early": 9})
    run = _init(server, run_id="early", resume="allow")
    model, optimizer, scaler = _setup()
    run.watch(model, optimizer, scaler=scaler)
    run.log({"lr_factor": 0.5}, step=5)
    _steps(run, model, optimizer, scaler, 2)
    run.finish()
    assert list(server.series("amp/scale")) == [5, 6]
    assert server.events("resume")[0]["step"] == 5


def test_without_a_step_the_run_continues_after_the_servers_last_step():
    server = ResumingServer({"cont": 37})
    run = _init(server, run_id="cont", resume="allow")
    model, optimizer, scaler = _setup()
    run.watch(model, optimizer, scaler=scaler)
    assert run.step == 38
    _steps(run, model, optimizer, scaler, 3)
    run.finish()
    assert list(server.series("amp/scale")) == [38, 39, 40]
    [resume] = server.events("resume")
    assert resume["step"] == 38 and resume["data"]["step_from"] == "server"


def test_a_run_stored_under_another_id_is_resumed_too():
    """Another project had the id first: the server stores the run under an id of its own, and a token
    for every project (or an open server) is answered that id. A resume of it is still a resume."""

    class Renaming(ResumingServer):
        def create_run(self, run: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
            return super().create_run(run) | {"id": "9f86d081884c7d659a2feaa0c55ad015"}

    server = Renaming({"taken": 37})
    run = _init(server, run_id="taken", resume="must")
    assert run.step == 38  # it continues after the stored run's last step
    run.log({"loss": 1.0})
    run.finish()
    [resume] = server.events("resume")
    assert resume["step"] == 38 and resume["data"]["step_from"] == "server"


def test_a_run_that_ends_before_its_step_is_known_still_sends_everything():
    server = ResumingServer({"short": 4})
    run = _init(server, run_id="short", resume="must")
    run.log({"x": 1.0})
    run.finish()
    assert server.series("x") == {5: 1.0} and server.events("resume")[0]["step"] == 5


def test_an_unreachable_server_at_init_resumes_anyway_with_a_warning(caplog):
    server = ResumingServer(down_for_check=True)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        run = _init(server, run_id="away", resume="must")
    assert "could not ask the server whether run away exists" in caplog.text
    model, optimizer, scaler = _setup()
    run.watch(model, optimizer, scaler=scaler)
    run.step = 12
    _steps(run, model, optimizer, scaler, 2)
    run.finish()
    assert list(server.series("amp/scale")) == [12, 13]
    assert server.events("resume")[0]["step"] == 12


def test_an_unknown_step_resumes_at_zero_with_a_warning(caplog):
    server = ResumingServer(down_for_check=True)
    run = _init(server, run_id="lost", resume="allow")
    model, optimizer, scaler = _setup()
    run.watch(model, optimizer, scaler=scaler)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        _steps(run, model, optimizer, scaler, 3)
    run.finish()
    assert "resumes at step 0" in caplog.text
    assert list(server.series("amp/scale")) == [0, 1, 2] and server.events("resume")[0]["step"] == 0


def test_offline_resume_goes_to_the_spool_file_for_the_server_to_apply_at_upload(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADWATCH_HOME", str(tmp_path))
    monkeypatch.setenv("GRADWATCH_RESUME", "must")  # the env fallback, as a job scheduler sets it
    run = gradwatch.init(project="resume", run_id="offline-run", mode="offline")
    run.step = 7
    run.log({"loss": 1.0})
    run.finish()
    [spool] = (tmp_path / "offline").glob("*.jsonl")
    lines = [json.loads(line.split(" ", 1)[1]) for line in spool.read_text().splitlines()]
    events = [e for line in lines if line["type"] == "batch" for e in line["batch"]["events"]]
    assert [(e["kind"], e["step"]) for e in events if e["kind"] == "resume"] == [("resume", 7)]


# -- how a run ends -----------------------------------------------------------------------------------


def test_an_exception_in_the_with_block_sends_a_crash_event_with_its_type():
    server = ResumingServer()
    with pytest.raises(ZeroDivisionError), _init(server, run_id="boom") as run:
        run.log({"loss": 1.0})
        run.step = 4
        1 / 0  # noqa: B018 - the training loop's bug
    last = server.batches[-1]
    assert last["status"] == "crashed"
    [crash] = server.events("crash")
    assert crash["step"] == 3
    assert crash["data"]["exception"] == "ZeroDivisionError"
    assert crash["data"]["message"] == "division by zero"
    assert crash["data"]["at"].startswith("test_resume.py:")


def test_sys_exit_zero_in_the_with_block_is_a_normal_end():
    server = ResumingServer()
    with pytest.raises(SystemExit), _init(server, run_id="exit") as run:
        run.log({"loss": 1.0})
        raise SystemExit(0)
    assert server.batches[-1]["status"] == "finished" and server.events("crash") == []


def test_sigterm_ends_every_live_run_crashed_and_says_so():
    from gradwatch import _run

    server = ResumingServer()
    run = _init(server, run_id="term")
    run.log({"loss": 1.0})
    _run._finish_live_runs("crashed", {"signal": "SIGTERM"})  # what the SIGTERM handler does first
    assert server.batches[-1]["status"] == "crashed"
    assert [e["data"] for e in server.events("crash")] == [{"signal": "SIGTERM"}]
