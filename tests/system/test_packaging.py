"""The dependency direction of DESIGN.md, checked in fresh interpreters."""

import os
import subprocess
import sys
import tarfile
import types
import zipfile
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


def test_sdist_and_wheel_build_clean_and_pass_twine_check(tmp_path):
    """What a user who depends on gradwatch installs: `python -m build` makes an sdist and a wheel with
    no warning, `twine check --strict` passes, the wheel is typed (py.typed) and carries its assets, and
    the version is gradwatch.__version__ (its one place)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(root)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-3000:]
    noisy = [line for line in output.splitlines() if "warn" in line.lower() or "deprecat" in line.lower()]
    assert noisy == [], noisy
    version = gradwatch.__version__
    wheel = tmp_path / f"gradwatch-{version}-py3-none-any.whl"
    sdist = tmp_path / f"gradwatch-{version}.tar.gz"
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"gradwatch/py.typed", "gradwatch/dashboard/assets/style.css", "gradwatch/cli.py"} <= names
    assert f"gradwatch-{version}.dist-info/entry_points.txt" in names
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    assert {"README.md", "pyproject.toml", "agent/py.typed", "migrations/script.py.mako"} <= members
