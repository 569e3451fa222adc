"""Distributed jobs: which process this is, how the ranks agree on one run id, and how the watched
model's gradients are laid out across them.

Nothing here communicates with other ranks. torch.distributed is only asked what it already knows
(rank and world size of the default group, no collective), and only when the user's program has
imported and initialised it; otherwise the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) is read.

One run id for all ranks, without a collective: the id must come from something every rank already
shares. In order: run_id= passed to init(); GRADWATCH_RUN_ID; else, under torchrun / TorchElastic,
an id derived from TORCHELASTIC_RUN_ID (the rendezvous id: random per job with --standalone, the
user's --rdzv-id otherwise), the restart attempt, the project and the run name. An elastic restart
is therefore a new run: its step counter starts at 0 again and would overwrite the first attempt's
points. Without any of these a distributed process gets a random id of its own (one run per rank)
and init() says so in a warning.

Gradient layouts, which decide how the server combines the ranks' values (see server/storage/ranks.py):
    "sharded"     each rank holds a disjoint part of every gradient (FSDP2 fully_shard, FSDP1 with
                  FULL_SHARD/SHARD_GRAD_OP): a rank's norms are its shard's; the global norm is
                  sqrt(sum over ranks of norm^2) and histograms add up
    "replicated"  every rank holds the whole, identical gradient (DDP, FSDP1 NO_SHARD): norms are per
                  rank and equal, never summed
    "hybrid"      sharded within a group and replicated across groups (HSDP): not combined
    "local"       one process, or a layout gradwatch does not recognise
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SHARDED, REPLICATED, HYBRID, LOCAL = "sharded", "replicated", "hybrid", "local"
LAYOUTS = (SHARDED, REPLICATED, HYBRID, LOCAL)
# TorchElastic's rendezvous id when the user gave none to a static rendezvous: shared by unrelated jobs.
_NO_RENDEZVOUS_ID = ("", "none")


@dataclass(frozen=True)
class ProcessIdentity:
    """This process's place in its job: rank, world size, local rank (None: unknown) and host."""

    rank: int
    world_size: int
    local_rank: int | None
    host: str
    source: str  # "torch.distributed", "environment" or "default" (a single process)


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def _initialised_process_group() -> Any:
    """torch.distributed when the program has imported and initialised it, else None (no import)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # noqa: BLE001 - a broken install must not stop init()
        return None
    return None


def process_identity(environ: Mapping[str, str] | None = None) -> ProcessIdentity:
    """Rank, world size and local rank from torch.distributed when initialised, else from the
    launcher's RANK / WORLD_SIZE / LOCAL_RANK; a lone process is rank 0 of 1.

    ValueError names an environment variable that is not a whole number >= 0.
    """
    environ = os.environ if environ is None else environ
    host = socket.gethostname()
    local_rank = _env_int(environ, "LOCAL_RANK")
    dist = _initialised_process_group()
    if dist is not None:
        return ProcessIdentity(dist.get_rank(), dist.get_world_size(), local_rank, host, "torch.distributed")
    rank = _env_int(environ, "RANK")
    world_size = _env_int(environ, "WORLD_SIZE")
    if rank is None and world_size is None:
        return ProcessIdentity(0, 1, local_rank, host, "default")
    rank = rank or 0
    world_size = max(world_size or 1, rank + 1)
    return ProcessIdentity(rank, world_size, local_rank, host, "environment")


def shared_run_id(project: str, name: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The run id every rank of this job computes alike (see the module docstring), or None.

    GRADWATCH_RUN_ID is used as it is; a TorchElastic job's id is a hash of TORCHELASTIC_RUN_ID,
    TORCHELASTIC_RESTART_COUNT, `project` and `name` (32 hex digits, like a random run id).
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get("GRADWATCH_RUN_ID")
    if explicit:
        return explicit
    rendezvous = environ.get("TORCHELASTIC_RUN_ID", "")
    if rendezvous.strip().lower() in _NO_RENDEZVOUS_ID:
        return None
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    digest = hashlib.sha256("\0".join((rendezvous, attempt, project, name or "")).encode()).hexdigest()
    return digest[:32]


# -- gradient layout ---------------------------------------------------------------------------------


def dtensor_class() -> Any:
    """torch.distributed.tensor.DTensor if the program has loaded it, else None (no import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def gradient_layout(model: Any, params: list[Any]) -> tuple[str, str]:
    """(parallelism, layout) of a watched model: parallelism names the wrapper ("fsdp2", "fsdp",
    "ddp", "dtensor", "none"), layout is one of LAYOUTS (see the module docstring).

    Read from the parameters (DTensor placements) and the module tree; called once, at watch().
    """
    dtensor = dtensor_class()
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if dtensor is not None:
        placements = [p.placements for p in params if isinstance(p, dtensor)]
        if placements:
            kinds = {"replicate" if pl.is_replicate() else "shard" for group in placements for pl in group}
            fsdp2_module = getattr(fsdp, "FSDPModule", None)
            fsdp2 = fsdp2_module is not None and any(isinstance(m, fsdp2_module) for m in model.modules())
            parallelism = "fsdp2" if fsdp2 else "dtensor"
            if kinds == {"shard"}:
                return parallelism, SHARDED
            return parallelism, REPLICATED if kinds == {"replicate"} else HYBRID
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp1 is not None:
        strategies = {m.sharding_strategy.name for m in model.modules() if isinstance(m, fsdp1)}
        if strategies:
            if strategies <= {"NO_SHARD"}:
                return "fsdp", REPLICATED
            if any(s.startswith(("HYBRID", "_HYBRID")) for s in strategies):
                return "fsdp", HYBRID
            return "fsdp", SHARDED
    ddp = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    if ddp is not None and any(isinstance(m, ddp) for m in model.modules()):
        return "ddp", REPLICATED
    return "none", LOCAL


def local_tensor(tensor: Any, dtensor: Any) -> Any:
    """The part of `tensor` this rank holds: a DTensor's local shard (no communication), else itself."""
    if dtensor is not None and isinstance(tensor, dtensor):
        # The attribute to_local() returns outside autograd; read directly, it costs no dispatch.
        local = getattr(tensor, "_local_tensor", None)
        return local if local is not None else tensor.to_local()
    return tensor
