"""The agent installed alone (`pip install gradwatch`, no [server] extra): the server's commands say what
to install instead of ending in a ModuleNotFoundError traceback (issue 30, a newcomer's papercut)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The server's packages made unimportable, as on a machine where only the agent was installed.
WITHOUT_SERVER = """
import sys
for name in ("fastapi", "uvicorn", "sqlalchemy", "alembic", "dash"):
    sys.modules[name] = None
from gradwatch.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [["server"], ["demo", "--steps", "1", "--exit"], ["db", "upgrade"]])
def test_server_commands_say_what_to_install(command, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_SERVER, *command],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'gradwatch[server]'" in done.stderr and "is not installed" in done.stderr
    assert "Traceback" not in done.stderr
