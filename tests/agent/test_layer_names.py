"""Layer names as the user wrote the model: wrappers (torch.compile's `_orig_mod.`, DDP's `module.`,
FSDP1's and checkpointing's wrapped-module components) are not part of them, in the agent's batches
and in what the server answers."""

import httpx
import pytest
import torch
from torch import nn

import gradwatch
from gradwatch._names import user_layer_names

# Importing torch.compile's stack on CPU runs torch.jit.script_method inside torch itself (2.13).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.module = nn.Linear(8, 8)  # a user's own submodule called `module` keeps its name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(torch.relu(self.attn(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.head(x)


EAGER = [name for name, _ in Net().named_parameters()]


def test_compiled_and_wrapped_names_are_the_eager_ones():
    net = Net()
    compiled = torch.compile(net)
    names = [n for n, _ in compiled.named_parameters()]
    assert names[0].startswith("_orig_mod.")
    assert user_layer_names(compiled, names) == EAGER
    assert "h.0.module.weight" in EAGER  # the user's `module` is not a wrapper's
    # Components only wrappers insert, at any depth (FSDP1, activation checkpointing):
    wrapped = [
        "_fsdp_wrapped_module.h.0._checkpoint_wrapped_module.attn.weight",
        "_fsdp_wrapped_module.head.bias",
    ]
    assert user_layer_names(net, wrapped) == ["h.0.attn.weight", "head.bias"]
    # A leading `module.` only where a DDP / DataParallel wrapper put it:
    parallel = nn.DataParallel(torch.compile(Net()))
    names = [n for n, _ in parallel.named_parameters()]
    assert names[0].startswith("module._orig_mod.")
    assert user_layer_names(parallel, names) == EAGER
    assert user_layer_names(net, ["module.weight"]) == ["module.weight"]


def test_names_that_would_collide_stay_as_torch_has_them():
    names = ["_orig_mod.a.weight", "a.weight"]
    assert user_layer_names(object(), names) == names


@pytest.mark.timeout(300)
def test_a_compiled_model_trains_unchanged_and_reports_its_layers_by_their_names(sqlite_server):
    """A real torch.compile'd model on CPU (fp32), watched: the same losses as without gradwatch, and
    the server's layers are the eager names."""

    def losses(run: object | None) -> list[float]:
        torch.manual_seed(0)
        model = torch.compile(Net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if run is not None:
            run.watch(model, optimizer)
        generator = torch.Generator().manual_seed(1)
        out = []
        for _ in range(6):
            x = torch.randn(16, 8, generator=generator)
            loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if run is not None:
                run.log({"loss": loss.item()})
            out.append(loss.item())
        return out

    plain = losses(None)
    with gradwatch.init(
        project="names", name="compiled", server=sqlite_server.url, flush_interval=0.05
    ) as run:
        watched = losses(run)
    assert watched == plain
    with httpx.Client(base_url=sqlite_server.url) as client:
        ranks = client.get(f"/api/v1/runs/{run.id}/ranks").json()
        heatmap = client.get(f"/api/v1/runs/{run.id}/vectors", params={"key": "grad/norm"}).json()
    layers = heatmap["layers"]
    assert layers == EAGER, layers
    assert not any("_orig_mod" in str(rank) for rank in ranks)
