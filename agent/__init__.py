"""gradwatch: training-health monitoring for PyTorch.

    run = gradwatch.init(project="llm", name="qlora-7b")
    run.watch(model, optimizer, scaler=scaler)
    ...            # training loop unchanged; run.log({"loss": loss}) for extras
    run.finish()

Importing this package loads neither torch nor any web or database library.
"""

import os as _os
from typing import Any as _Any

from ._errors import GradwatchWarning
from ._run import DEFAULT_SERVER as _DEFAULT_SERVER
from ._run import Run

__version__ = "0.1.0"
__all__ = ["GradwatchWarning", "Run", "init", "__version__"]


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

    Ranks of one distributed job share a run: set GRADWATCH_RUN_ID (or pass run_id=) to the same value
    on every rank; the rank is read from RANK.
    """
    project = project or _os.environ.get("GRADWATCH_PROJECT") or "default"
    options.setdefault("run_id", _os.environ.get("GRADWATCH_RUN_ID") or None)
    options.setdefault("rank", int(_os.environ.get("RANK", "0")))
    return Run(
        project,
        name,
        server=server or _os.environ.get("GRADWATCH_SERVER") or _DEFAULT_SERVER,
        token=token or _os.environ.get("GRADWATCH_TOKEN"),
        config=config,
        mode=mode or _os.environ.get("GRADWATCH_MODE") or "online",
        **options,
    )
