"""Packed values on the wire (values_f64): used only with a server that announced it when the run was
created, exact for every float (NaN and ±Inf included), and undone where a sealed batch is cut again
(a 413)."""

from __future__ import annotations

import math
from typing import Any

from training import RecordingTransport

import gradwatch
from gradwatch._transport import TransportError
from gradwatch._wire import (
    STEPS_I64,
    VALUES_F64,
    batch_points,
    batch_steps,
    last_step,
    pack_values,
    unpack_values,
)


def test_pack_and_unpack_keep_every_value_and_leave_short_series_alone():
    values: list[Any] = [0.1 * i for i in range(20)]
    values[2:5] = ["NaN", "Infinity", "-Infinity"]  # as Resolved.wire_fields writes non-finite values
    batch = {
        "seq": 1,
        "scalars": [
            {"key": "loss", "steps": list(range(20)), "values": values},
            {"key": "lr", "steps": [0, 1], "values": [1e-3, 1e-3]},
        ],
    }
    packed = pack_values(batch)
    assert VALUES_F64 in packed["scalars"][0] and "values" not in packed["scalars"][0]
    assert packed["scalars"][1] == batch["scalars"][1]
    assert unpack_values(packed) == batch
    assert batch["scalars"][0]["values"] is values  # the batch itself is left as it was
    both = pack_values(batch, steps=True)
    assert STEPS_I64 in both["scalars"][0] and "steps" not in both["scalars"][0]
    assert both["scalars"][1] == batch["scalars"][1]
    assert unpack_values(both) == batch
    assert batch_points(both) == batch_points(batch) == 22
    assert last_step(both) == 19 and batch_steps(both) == set(range(20))


class _Server(RecordingTransport):
    """A server that says, or does not say, it reads values_f64; optionally refuses the first batch
    with more than `too_large` points as too large (413)."""

    def __init__(self, features: list[str] | None, too_large: int | None = None) -> None:
        super().__init__()
        self.features, self.too_large, self.refused = features, too_large, 0

    def create_run(self, run: dict[str, Any]) -> dict[str, Any]:
        super().create_run(run)
        return (
            {"id": run["id"]} if self.features is None else {"id": run["id"], "wire_features": self.features}
        )

    def send_batch(self, run_id: str, batch: dict[str, Any]) -> None:
        points = sum(len(s["steps"]) for s in unpack_values(batch).get("scalars", ()))
        if self.too_large is not None and points > self.too_large and not self.refused:
            self.refused += 1
            raise TransportError("HTTP 413: too large", False, 413)
        super().send_batch(run_id, unpack_values(batch) if self.features else batch)
        self.raw = [*getattr(self, "raw", []), batch]


def _log(transport: _Server, steps: int = 300) -> gradwatch.Run:
    run = gradwatch.init(project="p", transport=transport, flush_every_steps=10_000, flush_interval=60)
    for step in range(steps):
        run.log({"loss": math.nan if step == 7 else 1.0 / (step + 1), "lr": 1e-3}, step=step)
    run.finish()
    assert run.stats.sent == 2 * steps, run.stats
    return run


def test_a_server_that_announces_values_f64_gets_them_and_one_that_does_not_gets_lists():
    new, old = _Server(["values_f64"]), _Server(None)
    _log(new), _log(old)
    assert any(VALUES_F64 in s for batch in new.raw for s in batch["scalars"])
    assert not any(VALUES_F64 in s for batch in old.raw for s in batch["scalars"])
    for server in (new, old):
        loss = server.series("loss")
        assert sorted(loss) == list(range(300)) and loss[7] == "NaN"
        assert all(loss[s] == 1.0 / (s + 1) for s in loss if s != 7)


def test_a_packed_batch_the_server_finds_too_large_is_split_and_nothing_is_lost():
    for features in (["values_f64"], ["values_f64", "steps_i64"]):
        server = _Server(features, too_large=100)
        _log(server)
        assert server.refused == 1
        assert sorted(server.series("loss")) == list(range(300))
        assert server.series("lr") == dict.fromkeys(range(300), 1e-3)


def test_a_server_that_announces_steps_i64_gets_packed_steps():
    server = _Server(["values_f64", "steps_i64"])
    _log(server)
    assert any(STEPS_I64 in s and "steps" not in s for batch in server.raw for s in batch["scalars"])
    loss = server.series("loss")
    assert sorted(loss) == list(range(300)) and loss[7] == "NaN"
