"""Parameters the optimizer does not hold (issue 29): layers that get a gradient on every step but are in
no param group, so they never change. Real CPU training loops; the healthy look-alikes (frozen layers,
a LoRA's frozen base, a second optimizer stepping the rest, an optimizer over flat copies of the weights
as DeepSpeed and FSDP1 hold them) must give no event, and the check adds no host sync to the step."""

import pytest
import torch
from torch import nn
from training import HostSyncs, RecordingTransport, backward_and_step

import gradwatch
from gradwatch._coverage import CONFIRM_AFTER_STEPS, DENSE_CHECK_EVERY


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _train(model, optimizers, steps, transport, watched=None, before_step=None, **watch_options):
    """A plain fp32 loop; `optimizers[0]` (or `watched`) is the one gradwatch watches. Returns the
    model's parameters as they were at the start."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(1)
    with gradwatch.init(project="coverage", transport=transport) as run:
        run.watch(model, watched or optimizers[0], **watch_options)
        for step in range(steps):
            if before_step is not None:
                before_step(step)
            x = torch.randn(16, 8, generator=generator)
            loss = nn.functional.cross_entropy(model(x), (x[:, :3]).argmax(dim=1))
            model.zero_grad(set_to_none=True)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
    return start


def _unchanged(model, start):
    return sorted(n for n, p in model.named_parameters() if torch.equal(p.detach(), start[n]))


def test_an_optimizer_over_the_head_only_names_the_layers_it_leaves_out_and_their_share():
    model = Backbone()
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    transport = RecordingTransport()
    start = _train(model, [optimizer], 40, transport)
    [event] = transport.events("params_not_in_optimizer")
    encoder = ["encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"]
    assert _unchanged(model, start) == sorted(encoder)  # the mechanism, measured with plain torch
    held = sum(p.numel() for p in model.head.parameters())
    left_out = sum(p.numel() for p in model.encoder.parameters())
    assert event["data"] == {
        "layers": encoder,
        "count": 4,
        "elements": left_out,
        "gradient_elements": held + left_out,
        "fraction": left_out / (held + left_out),
    }
    assert event["data"]["fraction"] > 0.9
    # Found on the first check, reported once its weights are confirmed unchanged (dense checks).
    assert event["step"] == -(-CONFIRM_AFTER_STEPS // DENSE_CHECK_EVERY) * DENSE_CHECK_EVERY


def test_a_backbone_unfrozen_after_the_optimizer_was_built_is_found_when_it_starts_getting_gradients():
    model = Backbone()
    model.encoder.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def unfreeze(step):
        if step == 100:
            model.encoder.requires_grad_(True)  # stage 2 of a fine-tune; the optimizer is not rebuilt

    transport = RecordingTransport()
    _train(model, [optimizer], 140, transport, before_step=unfreeze)
    [event] = transport.events("params_not_in_optimizer")
    assert event["data"]["count"] == 4
    assert 100 + CONFIRM_AFTER_STEPS <= event["step"] <= 100 + CONFIRM_AFTER_STEPS + 2 * DENSE_CHECK_EVERY


def test_add_param_group_before_the_comparison_clears_the_candidates():
    model = Backbone()
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-2)

    def add_backbone(step):
        if step == 2:
            optimizer.add_param_group({"params": list(model.encoder.parameters())})

    transport = RecordingTransport()
    start = _train(model, [optimizer], 40, transport, before_step=add_backbone)
    assert _unchanged(model, start) == []
    assert transport.events("params_not_in_optimizer") == []


def test_frozen_layers_and_a_lora_base_get_no_gradient_and_no_event():
    model = Backbone()
    model.encoder.requires_grad_(False)  # a backbone frozen on purpose
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    transport = RecordingTransport()
    _train(model, [optimizer], 40, transport)
    assert transport.events("params_not_in_optimizer") == []

    from pathologies import LoRALinear

    torch.manual_seed(0)
    lora = nn.Sequential(LoRALinear(8, 2, alpha=1.0, b_std=1e-2), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    transport = RecordingTransport()
    _train(lora, [optimizer], 40, transport)
    assert transport.events("params_not_in_optimizer") == []

    # The twin mistake: the same LoRA with its adapters' optimizer built before the base was unfrozen.
    lora[0].base.requires_grad_(True)
    transport = RecordingTransport()
    _train(lora, [optimizer], 40, transport)
    [event] = transport.events("params_not_in_optimizer")
    assert event["data"]["layers"] == ["0.base.weight", "0.base.bias"]


@pytest.mark.parametrize("second_optimizer_steps", [True, False], ids=["stepped", "forgotten"])
def test_parameters_a_second_optimizer_steps_are_left_alone(second_optimizer_steps):
    """SparseAdam for a sparse embedding beside AdamW for the rest (or a GAN's second optimizer): the
    watched optimizer does not hold the embedding, whose weights change all the same. The twin: the
    loop never steps the SparseAdam, and the embedding is reported."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500, 8, sparse=True), nn.Flatten(), nn.Linear(16, 3))
    dense = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    sparse = torch.optim.SparseAdam(model[0].parameters(), lr=1e-2)
    transport = RecordingTransport()
    generator = torch.Generator().manual_seed(2)
    start = model[0].weight.detach().clone()
    with gradwatch.init(project="coverage", transport=transport) as run:
        run.watch(model, dense)
        for _ in range(40):
            tokens = torch.randint(0, 500, (16, 2), generator=generator)
            loss = nn.functional.cross_entropy(model(tokens), tokens[:, 0] % 3)
            model.zero_grad(set_to_none=True)
            loss.backward()
            if second_optimizer_steps:
                sparse.step()
            dense.step()
    events = transport.events("params_not_in_optimizer")
    if second_optimizer_steps:
        assert not torch.equal(model[0].weight.detach(), start)
        assert events == []
    else:
        assert torch.equal(model[0].weight.detach(), start)
        assert [e["data"]["layers"] for e in events] == [["0.weight"]]


@pytest.mark.parametrize("copies", ["all", "encoder"])
def test_an_optimizer_over_parameters_the_model_does_not_own_is_not_judged(copies):
    """As DeepSpeed's and FSDP1's optimizers hold flat copies, not the module's parameters: the
    module's parameters get gradients and are in no param group, and nothing is said, even when the
    flat copy holds part of the model only (the head left out)."""
    model = Backbone()
    owned = model.parameters() if copies == "all" else model.encoder.parameters()
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in owned]))
    optimizer = torch.optim.SGD([flat], lr=0.1)

    def copy_gradients(step):
        if step:
            owned = model.parameters() if copies == "all" else model.encoder.parameters()
            grads = [p.grad.reshape(-1) for p in owned]
            flat.grad = torch.cat(grads)

    transport = RecordingTransport()
    _train(model, [optimizer], 40, transport, before_step=copy_gradients)
    assert transport.events("params_not_in_optimizer") == []


@pytest.mark.parametrize("scaler", [False, True], ids=["fp32", "fp16-scaler"])
def test_the_check_adds_no_host_sync_to_the_step(monkeypatch, scaler):
    model = Backbone()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    transport = RecordingTransport()
    x = torch.randn(16, 8)
    with gradwatch.init(project="coverage", transport=transport, flush_interval=3600) as run:
        run.watch(model, optimizer, scaler=grad_scaler)
        syncs = HostSyncs(monkeypatch, "step")
        for _ in range(30):
            model.zero_grad(set_to_none=True)
            backward_and_step(model(x).square().mean(), optimizer, grad_scaler)
        step_syncs = syncs.counts["step"]
        syncs.phase = "finish"
    assert step_syncs == (30 if scaler else 0)  # GradScaler.step's own found_inf read, not ours
    assert len(transport.events("params_not_in_optimizer")) == 1
