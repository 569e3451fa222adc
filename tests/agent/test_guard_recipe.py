"""docs/guard.md's rewind recipe, run as it is written there against a real server: the guard stops a
run whose corrupt shard makes the loss NaN, and the job rewinds to a checkpoint before the incident's
last healthy step, skips the suspect batches and trains to the end, healthy (issue 38, item 3)."""

from __future__ import annotations

import re
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "docs" / "guard.md"


def test_the_rewind_recipe_in_the_docs_runs_as_written(api_server, capsys):
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.DOTALL)
    recipe = next(block for block in blocks if "rewind_to" in block)
    namespace: dict = {"SERVER": api_server.url}
    exec(compile(recipe, str(RECIPE), "exec"), namespace)  # noqa: S102 - our own docs, run as written
    incident, rewind_to, suspects = namespace["incident"], namespace["rewind_to"], namespace["suspects"]
    assert incident["severity"] == "critical" and incident["first_step"] == 60
    assert incident["last_healthy_step"] == 59 and rewind_to == 40
    assert set(range(60, 64)) <= suspects  # the corrupt shard is among the batches skipped
    assert "rewinding to position 40" in capsys.readouterr().out
    assert namespace["end"] == 300 and not namespace["retry"].should_stop
