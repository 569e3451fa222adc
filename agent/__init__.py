"""gradwatch: training-health monitoring for PyTorch.

    run = gradwatch.init(project="llm", name="qlora-7b")
    run.watch(model, optimizer, scaler=scaler)
    ...            # training loop unchanged; run.log({"loss": loss}) for extras
    run.finish()

Importing this package loads neither torch nor any web or database library. Everything it raises is
a gradwatch.GradwatchError (the tree: gradwatch._errors).
"""

import os as _os
from typing import Any as _Any

from ._errors import GradwatchError, GradwatchWarning, ResumeError
from ._guard import Guard, TrainingHalted
from ._run import Run
from ._run import server_and_token as _server_and_token
from .api import Api, ApiError

__version__ = "0.2.0"
__all__ = [
    "Api",
    "ApiError",
    "GradwatchError",
    "GradwatchWarning",
    "Guard",
    "ResumeError",
    "Run",
    "TrainingHalted",
    "__version__",
    "init",
]


def init(
    project: str | None = None,
    name: str | None = None,
    server: str | None = None,
    token: str | None = None,
    config: dict[str, _Any] | None = None,
    mode: str | None = None,
    resume: str | None = None,
    **options: _Any,
) -> Run:
    """Start recording a run. Arguments left out fall back to GRADWATCH_PROJECT, GRADWATCH_SERVER,
    GRADWATCH_TOKEN and GRADWATCH_MODE (online|offline); the server defaults to http://127.0.0.1:8765.

    Distributed jobs, under any launcher (torchrun, mp.spawn, Lightning, Accelerate, DeepSpeed, srun):
    every rank calls init() and watch() and reports under its rank (from torch.distributed when it
    is initialised, else RANK / WORLD_SIZE / LOCAL_RANK), and all ranks share ONE run: run_id= if
    given, else GRADWATCH_RUN_ID, else under torchrun one derived from TORCHELASTIC_RUN_ID, else rank
    0's, which the other ranks read from the process group's store at init() (torch.distributed
    initialised) or at watch(); until then such a rank sends nothing. See gradwatch._distributed.

    Resuming from a checkpoint: store run.id and the step in the checkpoint; on restart pass
    run_id=<the stored id> and resume="allow" (continue it, or create it if the server has none),
    "must" (ResumeError from init() if the server answers it has no such run) or "never"
    (ResumeError if it has), then set run.step to the stored step. The server replaces the run's
    points from that step on and marks the resume on the charts. Env fallback: GRADWATCH_RESUME.
    See gradwatch._resume.
    """
    project = project or _os.environ.get("GRADWATCH_PROJECT") or "default"
    server, token = _server_and_token(server, token)
    return Run(
        project,
        name,
        server=server,
        token=token,
        config=config,
        mode=mode or _os.environ.get("GRADWATCH_MODE") or "online",
        resume=resume or _os.environ.get("GRADWATCH_RESUME") or None,
        **options,
    )
