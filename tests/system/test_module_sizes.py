"""No source module over 600 lines (issue 30): a module that grows past it is split by what it does."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def test_no_source_module_is_over_600_lines():
    modules = [
        path
        for folder in ("agent", "server", "dashboard", "migrations")
        for path in (ROOT / folder).rglob("*.py")
    ]
    assert len(modules) > 50  # the tree was found
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in modules}
    assert {path: lines for path, lines in sizes.items() if lines > MAX_LINES} == {}
