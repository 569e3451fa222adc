"""The dependency direction of DESIGN.md, checked in fresh interpreters."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

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


def test_every_source_package_is_in_the_wheel():
    """pyproject.toml lists packages one by one: a new folder (dashboard/pages, …) left out installs
    fine in editable mode and breaks in a wheel or the Docker image."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {Path(folder): name for name, folder in config["package-dir"].items()}
    expected = set()
    for top in ("agent", "server", "dashboard", "migrations"):
        for init in (root / top).rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            base = next(p for p in [relative, *relative.parents] if p in folders)
            rest = relative.relative_to(base).parts
            expected.add(".".join([folders[base], *rest]))
    assert expected - set(config["packages"]) == set()
