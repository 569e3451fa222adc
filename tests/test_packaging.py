"""The dependency direction of DESIGN.md, checked in fresh interpreters."""

import subprocess
import sys
import types

import gradwatch


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {line.split(".")[0] for line in out.stdout.splitlines()}


def test_agent_import_pulls_in_no_web_database_or_torch():
    loaded = _modules_after("import gradwatch")
    assert not loaded & {"torch", "fastapi", "sqlalchemy", "dash", "flask", "alembic", "uvicorn", "plotly"}


def test_server_import_pulls_in_neither_torch_nor_dash():
    loaded = _modules_after("import gradwatch.server")
    assert "fastapi" in loaded  # the check can fail: it sees what was imported
    assert not loaded & {"torch", "dash", "flask", "plotly"}


def test_public_names_match_all():
    public = {
        name
        for name, value in vars(gradwatch).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(gradwatch.__all__) - {"__version__"}
