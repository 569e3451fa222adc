"""The metadata of a run document: where and how the process runs (host, pid, Python, argv, git
commit, rank and world size, and torch/CUDA/device when torch is loaded). Collected once, at init();
kept apart from _run because it reads the environment (a git subprocess, torch's version and device)
rather than anything of the run's.

Only the first rank to reach the server creates the run, so the per-rank part of a distributed run
is also sent as its "rank" event."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any

from ._distributed import ProcessIdentity


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _environment_metadata(identity: ProcessIdentity) -> dict[str, Any]:
    """The run document's metadata. Only the first rank to reach the server creates the run, so the
    per-rank part (host, pid, rank) of a distributed run is also sent as its "rank" event."""
    meta: dict[str, Any] = {
        "hostname": identity.host,
        "pid": os.getpid(),
        "python": platform.python_version(),
        "argv": sys.argv[:20],
        "git_commit": _git_commit(),
        "world_size": identity.world_size,
        "rank": identity.rank,
        "local_rank": identity.local_rank,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        meta["torch"] = torch.__version__
        meta["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            meta["device"] = torch.cuda.get_device_name()
    return meta
