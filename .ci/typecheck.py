"""Run mypy on `gradwatch` as laid out in this checkout: python .ci/typecheck.py [mypy options].

pyproject.toml maps the one package onto several folders (agent/ is `gradwatch`, server/ is
`gradwatch.server`, dashboard/ is `gradwatch.dashboard`, ...). The editable install resolves that
with an import hook that type checkers cannot follow, so this script mirrors the mapping with
symlinks in TREE (the `mypy_path` of pyproject's [tool.mypy]): the root package is a real folder
with a link per file of agent/, every sub-package that lives elsewhere is a link to its folder. The
tree is rebuilt on every run, so files added to or removed from agent/ are picked up.

mypy then checks `-p gradwatch` (the `packages` of [tool.mypy]) and names the files it reads from
the tree; the script rewrites those names to the checkout's own paths (agent/_run.py, not
.venv/gradwatch-typecheck/gradwatch/_run.py), so editors and humans can jump to them. The exit
status is mypy's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy itself depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".venv" / "gradwatch-typecheck"
PACKAGE = "gradwatch"


def build_tree(root: Path = ROOT, tree: Path = TREE) -> None:
    """Recreate `tree` from the [tool.setuptools] package-dir mapping of root/pyproject.toml."""
    with open(root / "pyproject.toml", "rb") as file:
        package_dir: dict[str, str] = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    if tree.exists():
        shutil.rmtree(tree)
    top = tree / PACKAGE
    top.mkdir(parents=True)
    for entry in sorted((root / package_dir[PACKAGE]).iterdir()):
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in sorted(package_dir.items()):
        if name == PACKAGE:
            continue
        parent, _, leaf = name.rpartition(".")
        if Path(package_dir.get(parent, "")) / leaf == Path(folder):
            continue  # an ordinary sub-folder of its parent's folder: already inside the tree
        if parent != PACKAGE:
            raise SystemExit(f"{name} = {folder!r}: only sub-packages of {PACKAGE} may be mapped elsewhere")
        link = top / leaf
        if link.is_symlink():
            link.unlink()  # agent/ has an entry of that name; the mapping wins, as for the install
        link.symlink_to(root / folder, target_is_directory=True)


def checkout_path(match: re.Match[str]) -> str:
    """The path, relative to the working directory, of the checkout's file that mypy named via TREE."""
    return os.path.relpath(os.path.realpath(TREE / match.group("module_file")))


def main(argv: list[str]) -> int:
    build_tree()
    # mypy names a file by its absolute path, or relative to the working directory when inside it
    tree_prefixes = "|".join(re.escape(str(path) + os.sep) for path in (TREE, Path(os.path.relpath(TREE))))
    tree_file = re.compile(
        rf"(?:{tree_prefixes})(?P<module_file>{PACKAGE}{re.escape(os.sep)}\S+?\.pyi?)(?=:)"
    )
    mypy = subprocess.Popen(
        [sys.executable, "-m", "mypy", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert mypy.stdout is not None
    for line in mypy.stdout:
        line = tree_file.sub(checkout_path, line)
        sys.stdout.write(line)
    return mypy.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
