"""ScalerView (agent/_scaler.py), the one reader of GradScaler internals: against a real
torch.amp.GradScaler on CPU, enabled and disabled, and against look-alikes without the private fields."""

import math

import pytest
import torch
from torch import nn
from training import RecordingTransport, TinyNet, train

import gradwatch
from gradwatch import GradwatchWarning
from gradwatch._scaler import FOUND_INF, GROWTH_TRACKER, SCALE, SIGNALS, UNSCALE_STAGE, ScalerView


def _backward(model, scaler, poison=False):
    loss = model(torch.ones(2, 16)).float().sum()
    scaler.scale(loss).backward()
    if poison:
        with torch.no_grad():
            model.hidden.weight.grad[0, 0] = math.inf


def _recorder():
    calls = []
    return calls, lambda signal, exc: calls.append((signal, type(exc)))


def test_enabled_scaler_before_the_first_scale_call_has_no_readings_yet():
    calls, on_missing = _recorder()
    view = ScalerView(torch.amp.GradScaler("cpu"), on_missing=on_missing)
    assert view.enabled
    assert view.scale() is None and view.growth_tracker() is None  # created lazily by scale()
    assert calls == [] and view.missing == set()


def test_a_clean_step_reads_scale_tracker_and_stages_without_touching_the_scaler():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    view = ScalerView(scaler)
    _backward(model, scaler)
    assert view.unscaled(optimizer) is False
    assert id(optimizer) not in scaler._per_optimizer_states  # read with .get: no entry created
    scale = view.scale()
    assert scale.dtype == torch.float32 and scale.shape == () and scale.device.type == "cpu"
    assert scale.item() == 1024.0 and view.growth_tracker().item() == 0
    scaler.unscale_(optimizer)
    assert view.unscaled(optimizer) is True
    assert view.found_inf(optimizer).item() == 0.0
    scaler.step(optimizer)
    assert view.unscaled(optimizer) is True  # stepped counts as unscaled too
    scaler.update()
    assert scale.item() == 1024.0, "a reading is a copy: update() changes the scaler's tensor in place"
    assert view.scale().item() == 1024.0 and view.growth_tracker().item() == 1
    assert view.unscaled(optimizer) is False  # update() starts the next iteration


def test_an_overflow_step_reports_the_skip_and_the_lowered_scale():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, backoff_factor=0.5)
    view = ScalerView(scaler)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, scaler, poison=True)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    assert view.found_inf(optimizer).item() == 1.0
    scaler.update()
    assert view.scale().item() == 2.0**15 and view.growth_tracker().item() == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), (
        "the step was skipped"
    )


def test_a_fused_optimizer_s_skip_is_seen_on_the_device():
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    view = ScalerView(scaler)
    _backward(model, scaler, poison=True)
    scaler.step(optimizer)  # fused: the kernel takes found_inf; the step call itself always runs
    skipped = view.found_inf(optimizer)
    assert skipped.device.type == "cpu" and skipped.item() == 1.0
    scaler.update()
    assert view.scale().item() == 128.0


def test_a_disabled_scaler_has_no_readings_and_reports_nothing():
    calls, on_missing = _recorder()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    view = ScalerView(scaler, on_missing=on_missing)
    _backward(model, scaler)
    scaler.step(optimizer)
    assert not view.enabled
    readings = (view.scale(), view.growth_tracker(), view.found_inf(optimizer), view.unscaled(optimizer))
    assert readings == (None, None, None, None)
    assert calls == [] and view.missing == set()


class LookAlike:
    """A scaler without GradScaler's private fields (another torch, or a framework's own scaler)."""

    def is_enabled(self):
        return True


def test_a_look_alike_without_the_fields_gives_absent_signals_and_never_raises():
    calls, on_missing = _recorder()
    view = ScalerView(LookAlike(), on_missing=on_missing)
    optimizer = object()
    for _ in range(3):
        readings = (view.scale(), view.growth_tracker(), view.found_inf(optimizer), view.unscaled(optimizer))
        assert readings == (None, None, None, None)
    assert calls == [
        (SCALE, AttributeError),
        (GROWTH_TRACKER, AttributeError),
        (FOUND_INF, AttributeError),
        (UNSCALE_STAGE, AttributeError),
    ], "once per signal"
    assert view.missing == set(SIGNALS)


def test_fields_of_another_shape_and_a_failing_callback_do_not_raise():
    class OddScaler(LookAlike):
        _scale = "not a tensor"
        _growth_tracker = 3
        _per_optimizer_states = ()  # a sequence: no .get

    def on_missing(signal, exc):
        raise RuntimeError("the callback fails too")

    view = ScalerView(OddScaler(), on_missing=on_missing)
    assert (view.scale(), view.growth_tracker(), view.found_inf(1), view.unscaled(1)) == (None,) * 4

    class Broken:
        def is_enabled(self):
            raise RuntimeError("cannot say")

    assert ScalerView(Broken()).enabled is False


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"scale": 1024.0, "_growth_tracker": 3}, 1024.0),
        ({"scale": 8}, 8.0),
        ({}, None),
        ({"scale": True}, None),
        ({"scale": "big"}, None),
        (None, None),
    ],
)
def test_the_scale_of_a_loaded_state_dict(state, expected):
    assert ScalerView.loaded_scale(state) == expected


class DelegatingScaler:
    """A wrapper some frameworks put around a GradScaler: the public methods, none of the fields."""

    def __init__(self, inner):
        self.inner = inner

    def is_enabled(self):
        return self.inner.is_enabled()

    def scale(self, outputs):
        return self.inner.scale(outputs)

    def unscale_(self, optimizer):
        return self.inner.unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        return self.inner.step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        return self.inner.update(new_scale)

    def load_state_dict(self, state):
        return self.inner.load_state_dict(state)


def _train_with_look_alike(transport, steps=4, overflow_step=2):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DelegatingScaler(torch.amp.GradScaler("cpu", init_scale=2.0**16))
    with gradwatch.init(project="test", name="look-alike", transport=transport) as run:
        run.watch(model, optimizer, scaler=scaler, histograms_every=1)
        for step in range(steps):
            model.blowup = 1e6 if step == overflow_step else 1.0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(torch.randn(8, 16)).float(), torch.zeros(8).long())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    return run


def test_a_watched_run_with_a_look_alike_scaler_records_the_rest_and_warns_once_per_signal():
    transport = RecordingTransport()
    with pytest.warns(GradwatchWarning) as warned:
        run = _train_with_look_alike(transport)
    messages = [str(w.message) for w in warned]
    assert sum("amp/scale from the GradScaler" in m for m in messages) == 1
    assert sum("amp/growth_tracker from the GradScaler" in m for m in messages) == 1
    assert transport.series("amp/scale") == {} and transport.series("amp/growth_tracker") == {}
    assert transport.series("amp/skipped") == {0: 0.0, 1: 0.0, 2: 1.0, 3: 0.0}  # known on the host
    assert sorted(transport.series("grad/global_norm")) == [0, 1, 2, 3]
    assert [e["step"] for e in transport.events("skip")] == [2]
    assert transport.vectors("grad/zero_frac") and not transport.vectors("grad/underflow_frac")
    assert "step observation" not in run.features.disabled


def test_with_a_real_scaler_every_signal_is_read_and_nothing_warns():
    transport = RecordingTransport()
    with gradwatch.init(project="test", name="real", transport=transport) as run:
        train(6, run=run, overflow_steps=(3,), init_scale=2.0**10)
    assert run.features.disabled == {}
    scales = transport.series("amp/scale")
    assert scales[2] == 2.0**10 and scales[3] == 2.0**9
    assert sorted(transport.series("amp/growth_tracker")) == list(range(6))
    assert transport.series("amp/skipped")[3] == 1.0
