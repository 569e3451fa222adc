"""The agent's overhead is quoted in one place, BENCHMARKS.md's current figures (issue 37, item 4): the
README and docs/ link there instead of copying a number that the next benchmark run makes stale."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "CHANGELOG.md")]
PERCENT = re.compile(r"\d\s*%")


def _paragraphs_on_the_agents_cost(page: Path) -> list[str]:
    paragraphs = page.read_text().split("\n\n")
    return [p for p in paragraphs if "agent-overhead" in p or "agent_overhead" in p or "wandb.watch" in p]


def test_the_agents_overhead_is_linked_not_quoted():
    cited = {page.name: _paragraphs_on_the_agents_cost(page) for page in PAGES}
    assert cited["README.md"] and cited["what-is-recorded.md"]  # both still say where the figures are
    for name, paragraphs in cited.items():
        for paragraph in paragraphs:
            assert not PERCENT.search(paragraph), f"{name} quotes an overhead figure:\n{paragraph}"
            assert "BENCHMARKS.md#current-figures" in paragraph, f"{name}:\n{paragraph}"
