"""Distributed jobs: which process this is, how the ranks agree on one run id, and how the watched
model's gradients are laid out across them.

torch.distributed is only asked what it already knows (rank and world size of the default group) and
only when the user's program has imported and initialised it; otherwise the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK) is read. The one exchange between ranks is the run id's, below.

One job, one run, under any launcher. In order:
1. run_id= passed to init(), else GRADWATCH_RUN_ID: used as given on every rank.
2. Under torchrun / TorchElastic with a rendezvous id: a hash of TORCHELASTIC_RUN_ID (random per job
   with --standalone, the user's --rdzv-id otherwise), the restart attempt, the project, the name and
   how many runs of that project and name this process started before. An elastic restart is a new run.
3. Otherwise, once torch.distributed is initialised, rank 0's id: rank 0 writes its (random) id into
   the process group's key-value store (the one init_process_group made: TCPStore, FileStore...) and
   every other rank reads it (agree_on_run_id). This happens in init() when the group is already up,
   else in run.watch() (DDP and FSDP need the group before the model is wrapped, so watch() comes
   after it), never in the training step. It is no collective: rank 0 never waits, a rank that is
   not rank 0 waits for rank 0's key (AGREE_TIMEOUT at most, then keeps its own id with a warning),
   nothing is matched against the training's own collectives (a rank 0 that runs gradwatch while the
   others do not changes nothing), and it needs no device, so it is the same for gloo and nccl.
4. A process that may be one rank of a job (may_become_distributed: launcher variables, or a
   torch.multiprocessing child) but whose group is not up at init() keeps its run on hold: nothing is
   sent, and the run is not created on the server, until watch() settles the id and the rank (3.), or
   finish(). Settled without rank 0's word while the job has several ranks (watch() before
   init_process_group, or no watch() at all), the id comes from the launcher's environment
   (launcher_run_id): SLURM_JOB_ID + SLURM_STEP_ID (+ SLURM_RESTART_COUNT), the same on every node of
   an srun step; else this host's launcher process (the parent: pid and start time, with MASTER_ADDR /
   MASTER_PORT), which the ranks started by one mp.spawn, Lightning ddp_spawn, Accelerate
   notebook_launcher or DeepSpeed launcher on one host share, but ranks on other hosts do not (a
   warning says so). A process that turns out to be alone gets a random id.

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
import logging
import os
import re
import socket
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

logger = logging.getLogger("gradwatch")

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


def _hash_id(*parts: str) -> str:
    """32 hex digits (like a random run id) from `parts`."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def shared_run_id(
    project: str, name: str | None, environ: Mapping[str, str] | None = None, occurrence: int = 0
) -> str | None:
    """The run id every rank of this job computes alike without any exchange, or None (see the module
    docstring, 1. and 2.).

    GRADWATCH_RUN_ID is used as it is; a TorchElastic job's id is a hash of TORCHELASTIC_RUN_ID,
    TORCHELASTIC_RESTART_COUNT, `project` and `name` (32 hex digits, like a random run id), and of
    `occurrence` when it is not 0 (the process's second run of that project and name is another run).
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get("GRADWATCH_RUN_ID")
    if explicit:
        return explicit
    rendezvous = environ.get("TORCHELASTIC_RUN_ID", "")
    if rendezvous.strip().lower() in _NO_RENDEZVOUS_ID:
        return None
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    parts = (rendezvous, attempt, project, name or "") + ((str(occurrence),) if occurrence else ())
    return _hash_id(*parts)


_occurrences: Counter[tuple[str, str]] = Counter()
_key_occurrences: Counter[tuple[str, str]] = Counter()  # per project only (next_run_id_key)
_occurrences_lock = threading.Lock()


def next_occurrence(project: str, name: str | None, counts: Counter[tuple[str, str]] | None = None) -> int:
    """How many runs of `project` and `name` this process started before this one (0 for the first):
    the ranks of a job start theirs in the same order, so the n-th run of one rank is the n-th of all."""
    counts = _occurrences if counts is None else counts
    with _occurrences_lock:
        key = (project, name or "")
        occurrence = counts[key]
        counts[key] += 1
        return occurrence


# Variables that launchers set in every rank's environment (torchrun, mp.spawn scripts, Lightning,
# Accelerate, DeepSpeed, SLURM, Open MPI, MPICH / Intel MPI): a number above 1 is a job of several ranks.
_WORLD_SIZE_VARIABLES = (
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "CROSS_SIZE",  # DeepSpeed's launcher: the number of nodes
)


def _number(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ.get(name, ""))
    except ValueError:
        return None


def _is_multiprocessing_child() -> bool:
    """Started by multiprocessing (torch.multiprocessing.spawn, Lightning ddp_spawn, TorchElastic and
    Accelerate's notebook_launcher workers). Such a child has imported multiprocessing already."""
    module = sys.modules.get("multiprocessing")
    try:
        return module is not None and module.parent_process() is not None
    except Exception:  # noqa: BLE001 - an odd multiprocessing must not stop init()
        return False


def may_become_distributed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process may be (or become) one rank of a job although torch.distributed is not
    initialised yet: a launcher's variables (a world size above 1, a rank above 0, MASTER_ADDR or
    MASTER_PORT), or a multiprocessing child."""
    environ = os.environ if environ is None else environ
    if any((_number(environ, name) or 0) > 1 for name in _WORLD_SIZE_VARIABLES):
        return True
    if (_number(environ, "RANK") or 0) > 0 or environ.get("MASTER_ADDR") or environ.get("MASTER_PORT"):
        return True
    return _is_multiprocessing_child()


def _launcher_process() -> list[str]:
    """This host's launcher process: the parent's pid and start time (in clock ticks since boot, and
    the boot's id: Linux), which the ranks one launcher started on this host share."""
    ppid = os.getppid()
    parts = [str(ppid)]
    try:
        stat = Path(f"/proc/{ppid}/stat").read_text()
        parts.append(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except (OSError, IndexError, ValueError):
        pass
    return parts


def launcher_run_id(
    project: str, name: str | None, occurrence: int = 0, environ: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """(run id, source) from the launcher's environment alone, for a job whose ranks could not hear
    from rank 0 (module docstring, 4.). source "slurm": SLURM_JOB_ID + SLURM_STEP_ID (+
    SLURM_RESTART_COUNT), the same on every node of the step; source "host": this host's launcher
    process, shared only by the ranks it started here."""
    environ = os.environ if environ is None else environ
    tail = (
        environ.get("MASTER_ADDR", ""),
        environ.get("MASTER_PORT", ""),
        project,
        name or "",
        str(occurrence),
    )
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if job and step:
        return _hash_id("slurm", job, step, environ.get("SLURM_RESTART_COUNT", "0"), *tail), "slurm"
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return _hash_id("host", socket.gethostname(), *_launcher_process(), attempt, *tail), "host"


# How long a rank other than rank 0 waits for rank 0's run id (seconds). Ranks reach init()/watch()
# together (wrapping a model in DDP or FSDP synchronises them), so this is only spent when rank 0 is
# far behind, or runs without gradwatch.
AGREE_TIMEOUT = 300.0
AGREE_NOTICE = 10.0  # after this long a waiting rank says what it waits for
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def next_run_id_key(project: str, environ: Mapping[str, str] | None = None) -> str:
    """The store key under which rank 0 leaves the id of this process's next run of `project`: the
    ranks pair their runs by project and order, not by name (ranks that name their runs apart still
    find each other), per TorchElastic attempt (an agent's store can outlive a restart of the workers)."""
    environ = os.environ if environ is None else environ
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"gradwatch/run_id/{attempt}/{project}/{next_occurrence(project, None, _key_occurrences)}"


def exchange_run_id(
    store: Any, rank: int, own: str, key: str, *, follow: bool, timeout: float | None = None
) -> str:
    """Rank 0 leaves `own` under `key` in `store` and keeps it; another rank returns rank 0's id (waiting
    for it at most `timeout` seconds, default AGREE_TIMEOUT) when `follow`, else keeps `own` without
    waiting.

    Raises what the store raises (a timeout, a store that is gone) and ValueError for a value that
    is no run id."""
    if rank == 0:
        store.set(key, own)
        return own
    if not follow:
        return own
    timeout = AGREE_TIMEOUT if timeout is None else timeout
    patience = min(AGREE_NOTICE, timeout)
    try:
        store.wait([key], timedelta(seconds=patience))
    except Exception:  # not there yet (the store's timeout error): say so, wait on
        if timeout <= patience:
            raise
        logger.warning(
            "gradwatch: rank %d has waited %.0f s for rank 0's run id; waiting up to %.0f s more "
            "(rank 0 must call gradwatch.init() and run.watch() too)",
            rank,
            patience,
            timeout - patience,
        )
        store.wait([key], timedelta(seconds=timeout - patience))
    value = store.get(key)
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    if not _RUN_ID.fullmatch(text):
        raise ValueError(f"rank 0 left {text[:80]!r} under {key}, which is not a run id")
    return text


def agree_on_run_id(own: str, key: str, *, follow: bool, timeout: float | None = None) -> str | None:
    """Rank 0's run id through the default process group's store (exchange_run_id), or None when
    torch.distributed is not initialised or the group has a single rank. Call it only outside the
    training step (init(), watch()): a rank that is not rank 0 may wait for rank 0."""
    dist = _initialised_process_group()
    if dist is None or dist.get_world_size() <= 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    return exchange_run_id(store, dist.get_rank(), own, key, follow=follow, timeout=timeout)


def is_initialised() -> bool:
    """Whether the program has initialised torch.distributed (no import)."""
    return _initialised_process_group() is not None


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
