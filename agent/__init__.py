"""gradwatch: training-health monitoring for PyTorch.

    run = gradwatch.init(project="llm", name="qlora-7b")
    run.watch(model, optimizer, scaler=scaler)
    ...            # training loop unchanged; run.log({"loss": loss}) for extras
    run.finish()

Importing this package loads neither torch nor any web or database library.
"""

import os as _os
import warnings as _warnings
from typing import Any as _Any

from ._errors import GradwatchWarning
from ._run import DEFAULT_SERVER as _DEFAULT_SERVER
from ._run import Run

__version__ = "0.1.0"
__all__ = ["GradwatchWarning", "Run", "__version__", "init"]


def init(
    project: str | None = None,
    name: str | None = None,
    server: str | None = None,
    token: str | None = None,
    config: dict[str, _Any] | None = None,
    mode: str | None = None,
    **options: _Any,
) -> Run:
    """Start recording a run. Arguments left out fall back to GRADWATCH_PROJECT, GRADWATCH_SERVER,
    GRADWATCH_TOKEN and GRADWATCH_MODE (online|offline); the server defaults to http://127.0.0.1:8765.

    Distributed jobs: every rank calls init() and reports under its rank (from torch.distributed when
    it is initialised, else RANK / WORLD_SIZE / LOCAL_RANK); all ranks share ONE run, whose id they
    agree on without communicating: run_id= if given, else GRADWATCH_RUN_ID, else (under torchrun)
    one derived from TORCHELASTIC_RUN_ID, the restart attempt, the project and the name. Without any
    of these each rank would start a run of its own, and a GradwatchWarning says so.
    """
    from . import _distributed

    project = project or _os.environ.get("GRADWATCH_PROJECT") or "default"
    if options.get("run_id") is None:
        options["run_id"] = _distributed.shared_run_id(project, name)
    if options.get("run_id") is None:
        identity = _distributed.process_identity()
        if identity.world_size > 1:
            _warnings.warn(
                f"gradwatch: rank {identity.rank} of {identity.world_size} has no run id shared with the "
                "other ranks, so each rank records a run of its own; set GRADWATCH_RUN_ID to one value on "
                "every rank (or pass run_id=), or launch with torchrun",
                GradwatchWarning,
                stacklevel=2,
            )
    return Run(
        project,
        name,
        server=server or _os.environ.get("GRADWATCH_SERVER") or _DEFAULT_SERVER,
        token=token or _os.environ.get("GRADWATCH_TOKEN"),
        config=config,
        mode=mode or _os.environ.get("GRADWATCH_MODE") or "online",
        **options,
    )
