"""bench/agent_overhead.py times gradwatch's own functions by name: a renamed one must fail here, in
CI, not in the next benchmark run (it did: two names had gone)."""

import ast
import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "agent_overhead.py"


def test_every_function_the_overhead_benchmark_times_exists():
    tree = ast.parse(BENCH.read_text())
    [entries] = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "INSTRUMENTED" for t in node.targets)
    ]
    named = [(e.elts[0].value, e.elts[1].value) for e in entries.elts]
    assert len(named) > 10
    missing = []
    for owner, attribute in named:
        module, *rest = owner.split(".")
        target = importlib.import_module(f"gradwatch._{module}")
        for part in rest:
            target = getattr(target, part)
        if not hasattr(target, attribute):
            missing.append(f"{owner}.{attribute}")
    assert missing == []
