"""Hugging Face Trainer and PyTorch Lightning callbacks on tiny models built in code (no downloads)."""

import pytest
import torch
from training import RecordingTransport

import gradwatch
from gradwatch import Guard

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def test_hugging_face_trainer_callback(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradwatch.integrations.huggingface import GradwatchCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    tokens = torch.randint(0, 64, (32, 16))
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_grad_norm=1.0,
        learning_rate=1e-3,
    )
    transport = RecordingTransport()
    run = gradwatch.init(project="hf", transport=transport)
    logged = []

    class Capture(GradwatchCallback.__mro__[1]):  # a plain TrainerCallback that keeps the logs
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        callbacks=[GradwatchCallback(run=run, watch_options={"layer_norms_every": 1}), Capture()],
    )
    trainer.train()
    run.finish()

    norms = transport.series("grad/global_norm")
    assert list(norms) == list(range(6))
    hf_norms = [entry["grad_norm"] for entry in logged if "grad_norm" in entry]
    assert [norms[s] for s in range(6)] == pytest.approx(hf_norms, rel=1e-5)  # the clip's own norm, reused
    # The Trainer's logs land at the step they describe (its grad_norm is that step's grad/global_norm),
    # the loss also as `loss`, which the loss charts and alerts read.
    assert transport.series("hf/grad_norm") == {s: pytest.approx(norms[s], rel=1e-5) for s in range(6)}
    hf_losses = [entry["loss"] for entry in logged if "loss" in entry]
    assert transport.series("loss") == {s: pytest.approx(hf_losses[s]) for s in range(6)}
    assert transport.series("hf/loss") == transport.series("loss") and transport.series("lr")
    layers = transport.layers()
    assert "transformer.h.0.attn.c_attn.weight" in layers
    assert len(transport.vectors("grad/norm")[0]) == len(layers)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback(tmp_path, accumulate):
    """Lightning steps through optimizer.step(closure): the clip inside the closure is still seen (the
    post-clip norm, max_norm); with accumulation each step's loss is the mean of its micro-batches'."""
    import lightning.pytorch as pl

    from gradwatch.integrations.lightning import GradwatchCallback

    losses: list[float] = []

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch, _index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8), 10 * torch.randn(128, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    transport = RecordingTransport()
    run = gradwatch.init(project="lightning", transport=transport)
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=0.5,
        accumulate_grad_batches=accumulate,
        default_root_dir=str(tmp_path),
        callbacks=[GradwatchCallback(run=run)],
    )
    trainer.fit(Tiny(), loader)
    run.finish()
    recorded = transport.series("loss")
    assert list(recorded) == list(range(6))
    for step, loss in recorded.items():  # bf16: the loss as the model computed it, to bf16's precision
        mean = sum(losses[step * accumulate : (step + 1) * accumulate]) / accumulate
        assert loss == pytest.approx(mean, rel=1e-2)
    assert list(transport.series("grad/global_norm")) == list(range(6))
    assert transport.series("amp/micro_batches") == dict.fromkeys(range(6), float(accumulate))
    assert transport.series("grad/global_norm_post_clip") == {
        s: pytest.approx(0.5, rel=1e-3) for s in range(6)
    }
    thresholds = transport.series("grad/clip_max_norm")
    assert thresholds and all(value == pytest.approx(0.5, rel=1e-5) for value in thresholds.values())
    assert transport.series("lr")[0] == pytest.approx(1e-2)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_accelerate_tracker_records_config_logs_and_gradients(sqlite_server, precision):
    """Accelerator(log_with=[GradwatchTracker]) on one CPU process, fp32 and bf16 autocast (the mixed
    precision a CPU runs; Accelerate gives fp16 on CPU no GradScaler): the config from init_trackers,
    accelerator.log's numbers at their steps (text left out), the prepared model's gradients, and the
    run finished by end_training."""
    import httpx
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch import nn

    from gradwatch.integrations.accelerate import GradwatchTracker

    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator config per process
    tracker = GradwatchTracker(
        project="accelerate", name=precision, server=sqlite_server.url, flush_interval=0.05
    )
    accelerator = Accelerator(cpu=True, mixed_precision=precision, log_with=[tracker])
    accelerator.init_trackers("accelerate", config={"lr": 0.05, "precision": precision})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    run = tracker.watch(accelerator, model, optimizer, layer_norms_every=1)
    generator = torch.Generator().manual_seed(1)
    clip_norms = []
    for step in range(5):
        x = torch.randn(8, 8, generator=generator)
        with accelerator.autocast():
            loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        optimizer.zero_grad()
        accelerator.backward(loss)
        # Accelerate >= 1.x clips in two parts (get_total_norm, clip_grads_with_norm_), never
        # through clip_grad_norm_: what is recorded must still be the norm before the clip.
        clip_norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.01).item())
        optimizer.step()
        accelerator.log({"loss": loss.item(), "phase": "train"}, step=step)
    assert tracker.tracker is run
    accelerator.end_training()
    AcceleratorState._reset_state(reset_partial_state=True)
    with httpx.Client(base_url=sqlite_server.url) as client:
        record = client.get(f"/api/v1/runs/{run.id}").json()
        keys = client.get(f"/api/v1/runs/{run.id}/keys").json()["data"]
        loss = client.get(f"/api/v1/runs/{run.id}/series", params={"key": "loss"}).json()
        norms = client.get(f"/api/v1/runs/{run.id}/vectors", params={"key": "grad/norm"}).json()
        global_norm = client.get(f"/api/v1/runs/{run.id}/series", params={"key": "grad/global_norm"}).json()
        post_clip = client.get(
            f"/api/v1/runs/{run.id}/series", params={"key": "grad/global_norm_post_clip"}
        ).json()
    assert record["status"] == "finished" and record["config"] == {"lr": 0.05, "precision": precision}
    assert post_clip["steps"] == [0, 1, 2, 3, 4]  # every clipped step, at max_norm
    assert post_clip["values"] == pytest.approx([0.01] * 5, rel=1e-3)
    assert global_norm["steps"] == [0, 1, 2, 3, 4]
    assert global_norm["values"] == pytest.approx(clip_norms, rel=1e-5) and min(clip_norms) > 0.1
    assert loss["steps"] == [0, 1, 2, 3, 4] and "phase" not in keys and "grad/global_norm" in keys
    assert norms["layers"] == ["0.weight", "0.bias", "2.weight", "2.bias"] and len(norms["steps"]) == 5


CRITICAL = {"id": 7, "status": "open", "severity": "critical", "cause_key": "loss_divergence", "title": "t"}


def test_hugging_face_trainer_stops_when_the_guard_does(tmp_path):
    """An incident arriving after step 2 (as a batch's acknowledgement hands it to the guard) stops the
    Trainer at the next step boundary: control.should_training_stop, no further step."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from gradwatch.integrations.huggingface import GradwatchCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    tokens = torch.randint(0, 32, (64, 8))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    run = gradwatch.init(project="hf", transport=RecordingTransport())

    class Arrives(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                run.guard.receive([CRITICAL])

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
        callbacks=[Arrives(), GradwatchCallback(run=run, watch_options={"guard": True})],
    )
    trainer.train()
    run.finish()
    assert run.should_stop and run.guard.stopped_by["id"] == 7
    assert trainer.state.global_step == 3  # step 3 ended at the boundary that took the incident


def test_lightning_trainer_stops_when_the_guard_does(tmp_path):
    import lightning.pytorch as pl

    from gradwatch.integrations.lightning import GradwatchCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, index):
            if self.global_step == 2 and run.guard is not None:
                run.guard.receive([CRITICAL])  # arrives while step 2 trains
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    run = gradwatch.init(project="lightning", transport=RecordingTransport())
    trainer = pl.Trainer(
        max_steps=20,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[GradwatchCallback(run=run, watch_options={"guard": Guard()})],
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    run.finish()
    assert run.should_stop and trainer.global_step == 3


def test_accelerate_stops_every_process_through_its_trigger():
    """tracker.stop_requested(accelerator): the guard's stop set as the Accelerator's trigger and read
    back with check_trigger, the same answer on every process (one process here)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch import nn

    from gradwatch.integrations.accelerate import GradwatchTracker

    AcceleratorState._reset_state(reset_partial_state=True)
    tracker = GradwatchTracker(project="accelerate", transport=RecordingTransport())
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model, optimizer = accelerator.prepare(
        nn.Linear(8, 1), torch.optim.SGD(nn.Linear(8, 1).parameters(), 0.1)
    )
    run = tracker.watch(accelerator, model, optimizer, guard=True)
    steps = 0
    for step in range(20):
        if tracker.stop_requested(accelerator):
            break
        if step == 2:
            run.guard.receive([CRITICAL])  # arrives during step 2
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        steps += 1
    tracker.finish()
    AcceleratorState._reset_state(reset_partial_state=True)
    assert steps == 3 and run.should_stop
