"""A real PEFT LoRA fine-tune (peft's own get_peft_model on a tiny model built in the test, nothing
downloaded), in fp16 autocast with a real GradScaler on CPU: only the adapters are watched (the
frozen base weights have no gradient to report), they carry the user's layer names, and a healthy
LoRA run raises no alert, though LoRA's B starts at zero so every gradient of A is exactly zero at
first (the zero and underflow signals must not read that as a dead or underflowing layer)."""

import httpx
import pytest
import torch
from torch import nn

import gradwatch

peft = pytest.importorskip("peft", reason="peft is in the dev extra: pip install -e '.[dev]'")

# peft imports transformers, which still touches deprecated torch APIs on import (2.13).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


ADAPTERS = [
    "fc1.lora_A.default.weight",
    "fc1.lora_B.default.weight",
    "fc2.lora_A.default.weight",
    "fc2.lora_B.default.weight",
]


def test_a_lora_fine_tune_reports_its_adapters_by_name_and_raises_no_alert(sqlite_server):
    torch.manual_seed(0)
    model = peft.get_peft_model(Base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    with gradwatch.init(project="peft", name="lora", server=sqlite_server.url, flush_interval=0.05) as run:
        run.watch(model, optimizer, scaler=scaler)
        for _ in range(60):
            x = torch.randn(32, 16, generator=generator)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(dim=1))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            run.log({"loss": loss})
    with httpx.Client(base_url=sqlite_server.url) as client:
        norms = client.get(f"/api/v1/runs/{run.id}/vectors", params={"key": "grad/norm"}).json()
        zeros = client.get(f"/api/v1/runs/{run.id}/vectors", params={"key": "grad/zero_frac"}).json()
        alerts = client.get("/api/v1/alerts", params={"run_id": run.id}).json()
    assert norms["layers"] == ADAPTERS  # no base_model.model. prefix, no frozen base_layer weights
    first = dict(zip(zeros["layers"], zeros["values"][0], strict=True))
    assert zeros["steps"][0] == 0
    assert first["fc1.lora_A.default.weight"] == 1.0  # B is zero: A's gradient is exactly zero
    assert first["fc1.lora_B.default.weight"] < 1.0
    assert alerts["data"] == [], [a["title"] for a in alerts["data"]]
