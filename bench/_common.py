"""What the bench scripts share: how they start `gradwatch server` as a child process.

    server_command   the argv of `gradwatch server` on a port, with a database URL
    server_env       the child's environment: ours, with its own GRADWATCH_HOME and, to run another
                     checkout of gradwatch, a PYTHONPATH entry ahead of ours

The scripts run as `python bench/NAME.py`, which puts bench/ first on sys.path: `from _common import ...`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CLI_MODULE", "server_command", "server_env"]

# `gradwatch` run as a module of this interpreter: the installed (or PYTHONPATH's) gradwatch.cli
CLI_MODULE = (sys.executable, "-m", "gradwatch.cli")


def server_command(
    port: int,
    database_url: str,
    *extra: str,
    launcher: Sequence[str] = CLI_MODULE,
    host: str | None = "127.0.0.1",
) -> list[str]:
    """`launcher server [--host HOST] --port PORT --database-url URL EXTRA...`; host None leaves
    --host out (the CLI's default, 127.0.0.1)."""
    command = [*launcher, "server"]
    if host is not None:
        command += ["--host", host]
    return [*command, "--port", str(port), "--database-url", database_url, *extra]


def server_env(home: Path, pythonpath: Path | None = None) -> dict[str, str]:
    """This process's environment with GRADWATCH_HOME=home; with `pythonpath`, that entry first on
    PYTHONPATH (ahead of any already set), so it imports ahead of the installed gradwatch."""
    env = dict(os.environ, GRADWATCH_HOME=str(home))
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return env
