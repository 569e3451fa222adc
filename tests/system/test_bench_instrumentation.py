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


def test_the_early_warning_bench_stops_a_guarded_scenario_and_counts_its_wasted_steps(api_server):
    """bench/early_warning.py's end-to-end part: a pathology trained into a real server with a guard
    that raises TrainingHalted. lr_warmup_too_high's loss is NaN at step 12 (critical at once): the run
    (60 steps of ~1 ms) ends before a flush brings the answer, which the row says."""
    import sys

    sys.path.insert(0, str(BENCH.parent))
    try:
        early_warning = importlib.import_module("early_warning")
    finally:
        sys.path.remove(str(BENCH.parent))
    row = early_warning.guarded("lr_warmup_too_high", api_server.url)
    assert row.first_critical == 12 and row.first_alert == 12
    if row.stopped_at is None:
        assert row.steps == 60 and row.wasted == "47 (the run ended first)"
    else:
        assert 12 < row.stopped_at <= 60 and row.wasted == str(row.stopped_at - 13)
