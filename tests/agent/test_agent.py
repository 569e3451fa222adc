"""The agent on real CPU training loops: what it records, and its hard rules (DESIGN.md)."""

import math
import re
import warnings

import pytest
import torch
from training import HostSyncs, RecordingTransport, Reference, train

import gradwatch
from gradwatch import GradwatchWarning


def _run(transport=None, **options):
    return gradwatch.init(project="test", name="unit", transport=transport or RecordingTransport(), **options)


def test_parameters_are_bit_identical_with_and_without_the_agent_fp16():
    plain = train(30, overflow_steps=(5, 6, 17))
    transport = RecordingTransport()
    with _run(transport) as run:
        watched = train(30, run=run, overflow_steps=(5, 6, 17))
    for (name, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert transport.batches, "the agent recorded nothing: the comparison would prove nothing"


def test_parameters_are_bit_identical_bf16_without_scaler():
    plain = train(20, precision="bf16")
    with _run() as run:
        watched = train(20, run=run, precision="bf16")
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_scale_skips_and_unscaled_norms_match_the_reference():
    reference = Reference()
    transport = RecordingTransport()
    overflow = (4, 5, 6, 20)
    with _run(transport) as run:
        train(40, run=run, overflow_steps=overflow, reference=reference)

    scale = transport.series("amp/scale")
    assert list(scale) == list(range(40))  # first optimizer step is 0, skipped steps count
    assert list(scale.values()) == reference.scales_after
    skipped_steps = [s for s, v in transport.series("amp/skipped").items() if v == 1.0]
    assert skipped_steps == [i for i, s in enumerate(reference.skipped) if s]
    assert set(overflow) <= set(skipped_steps)

    skips = transport.events("skip")
    assert [e["step"] for e in skips] == skipped_steps
    for event in skips:
        data = event["data"]
        assert data["scale_after"] == data["scale_before"] / 2
        assert data["scale_after"] == reference.scales_after[event["step"]]
        assert data["non_finite_layers"] == reference.non_finite_layers[event["step"]]
        assert data["non_finite_layers"], "a skip names the layers whose gradients were not finite"

    norms = transport.series("grad/global_norm")
    for step, expected in enumerate(reference.global_norms):
        got = norms[step]
        if math.isfinite(expected):
            assert got == pytest.approx(expected, rel=1e-5), step
        else:
            assert isinstance(got, str), step  # non-finite travels as "NaN"/"Infinity"

    losses = transport.series("loss")
    assert list(losses) == list(range(40))  # log() before step() attaches to that step
    assert losses[0] == pytest.approx(reference.losses[0], rel=1e-6)


def test_learning_rate_and_step_time_are_recorded():
    transport = RecordingTransport()
    with _run(transport) as run:
        train(5, run=run)
    assert set(transport.series("lr").values()) == {1e-2}
    assert len(transport.series("perf/step_time")) == 4  # from the second step on
    assert all(v > 0 for v in transport.series("perf/step_time").values())


def test_no_host_sync_is_added_inside_the_step(monkeypatch):
    """On CPU every op is synchronous, so count the calls that would force a sync on a GPU."""
    syncs = HostSyncs(monkeypatch, phase="without")
    train(15, overflow_steps=(3,))
    syncs.phase = "with"
    run = _run()
    train(15, run=run, overflow_steps=(3,))
    syncs.phase = "finish"
    run.finish()
    assert syncs.counts["without"] > 0  # GradScaler itself syncs: the counter sees real calls
    assert syncs.counts["with"] == syncs.counts["without"]


def test_errors_inside_the_agent_never_reach_the_loop(monkeypatch):
    transport = RecordingTransport()
    run = _run(transport)

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(run.buffer, "add_tensor", broken)
    with pytest.warns(GradwatchWarning, match="step observation disabled after an internal error") as caught:
        model = train(10, run=run, overflow_steps=(2,))
    assert len(caught) == 1  # one warning, not one per step
    run.finish()
    plain = train(10, overflow_steps=(2,))
    for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert transport.series("loss"), "log() keeps working when step observation is disabled"


def test_a_failing_transport_never_reaches_the_loop():
    class Down:
        def create_run(self, run):
            raise OSError("connection refused")

        send_batch = create_run

    run = _run(Down(), flush_interval=0.01)
    train(10, run=run)
    run.finish(timeout=0.5)
    assert run.stats.last_error and "connection refused" in run.stats.last_error
    assert run.stats.sent_points == 0


def test_log_ignores_bad_values_with_a_warning_and_keeps_good_ones():
    transport = RecordingTransport()
    with _run(transport) as run, pytest.warns(GradwatchWarning, match="ignored 'text'"):
        run.log({"text": "hello", "acc": 0.5, "t": torch.tensor(2.0)}, step=3)
    assert transport.series("acc") == {3: 0.5}
    assert transport.series("t") == {3: 2.0}


def test_finish_is_idempotent_and_context_manager_marks_crashes():
    transport = RecordingTransport()
    with pytest.raises(ZeroDivisionError), _run(transport) as run:
        run.log({"x": 1.0})
        raise ZeroDivisionError
    run.finish()
    assert transport.batches[-1]["status"] == "crashed"


def test_init_reads_environment_fallbacks(monkeypatch):
    monkeypatch.setenv("GRADWATCH_PROJECT", "from-env")
    monkeypatch.setenv("GRADWATCH_RUN_ID", "shared-id")
    monkeypatch.setenv("RANK", "3")
    run = gradwatch.init(transport=RecordingTransport())
    assert (run.project, run.id, run.rank) == ("from-env", "shared-id", 3)
    run.finish()


def test_run_id_and_rank_are_checked_at_init():
    with pytest.raises(
        ValueError, match=re.escape("run_id must be 1-64 characters of A-Z a-z 0-9 _ . -, got 'a b'")
    ):
        gradwatch.init(project="p", run_id="a b", transport=RecordingTransport())
    with pytest.raises(ValueError, match="rank must be a whole number >= 0, got -1"):
        gradwatch.init(project="p", rank=-1, transport=RecordingTransport())


def test_misuse_at_setup_is_a_value_error_naming_the_value():
    with pytest.raises(ValueError, match="mode must be one of"):
        gradwatch.init(project="p", mode="sometimes", transport=RecordingTransport())
    run = _run()
    with pytest.raises(ValueError, match=re.escape("optimizer must be a torch.optim.Optimizer, got str")):
        run.watch(torch.nn.Linear(1, 1), "adam")
    run.finish()


def test_watch_removes_every_wrapper_on_finish():
    scaler = torch.amp.GradScaler("cpu")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = _run().watch(model, optimizer, scaler=scaler)
    wrapped = {"scale", "unscale_", "step", "update", "load_state_dict"}
    assert wrapped <= set(vars(scaler))
    run.finish()
    assert not wrapped & set(vars(scaler))


def test_offline_mode_writes_a_spool_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADWATCH_HOME", str(tmp_path))
    with gradwatch.init(project="p", mode="offline") as run:
        run.log({"x": 1.0})
    spool = tmp_path / "offline" / f"{run.id}-rank0.jsonl"
    lines = spool.read_text().splitlines()
    assert '"type": "run"' in lines[0] and '"x"' in lines[1]


def test_no_warnings_on_a_healthy_run():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _run() as run:
            train(5, run=run)


class RecordingSink:
    """A StepSink (agent/_sink.py) that keeps what a Watcher hands it: no Run, buffer or sender."""

    def __init__(self, rank=0, world_size=1):
        from gradwatch._distributed import ProcessIdentity
        from gradwatch._errors import FeatureSwitch

        self.step, self.rank = 0, rank
        self.identity = ProcessIdentity(rank, world_size, None, "host", "environment")
        self.features = FeatureSwitch()
        self.records, self.recorded_at, self.reports_rank = [], [], False

    def add_scalar(self, key, step, value):
        self.records.append((key, step))

    def add_tensor(self, key, step, tensor):
        self.records.append((key, step))

    def add_event(self, step, kind, data):
        self.records.append((kind, step))

    def advance_step(self):
        self.step += 1
        return self.step

    def step_recorded(self):
        self.recorded_at.append(self.step)

    def report_rank_at_finish(self):
        self.reports_rank = True


class _SinkRun:
    """What tests/training.train calls on a run (watch; log is not called with log_loss=False)."""

    def __init__(self, sink):
        self.sink = sink

    def watch(self, model, optimizer, scaler=None, **options):
        from gradwatch._watch import Watcher, WatchOptions

        self.watcher = Watcher(self.sink, model, optimizer, scaler, WatchOptions(**options))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_watcher_needs_only_a_step_sink(precision):
    sink = RecordingSink(rank=1, world_size=2)
    holder = _SinkRun(sink)
    train(
        4, run=holder, precision=precision, log_loss=False, overflow_steps=(2,) if precision == "fp16" else ()
    )
    holder.watcher.remove()
    assert sink.step == 4 and sink.recorded_at == [1, 2, 3, 4], "one advance, then one flush point, per step"
    assert sink.reports_rank and ("rank", 0) in sink.records

    def steps_of(key):
        return sorted(step for k, step in sink.records if k == key)

    assert steps_of("grad/global_norm") == [0, 1, 2, 3]
    if precision == "fp16":
        assert steps_of("amp/scale") == steps_of("amp/skipped") == [0, 1, 2, 3]
        assert sink.features.disabled == {}


def test_the_watcher_and_the_run_do_not_import_each_other_both_ways():
    import ast
    from pathlib import Path

    import gradwatch._watch

    tree = ast.parse(Path(gradwatch._watch.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    assert not {name for name in imported if name and name.rsplit(".", 1)[-1] == "_run"}, imported
