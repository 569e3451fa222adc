"""Regenerate the README's screenshots: `make screenshots` (or .venv/bin/python docs/make_screenshots.py).

Runs the demo training into a fresh SQLite file behind a real server, opens the dashboard in headless
Chromium (/usr/bin/chromium or GRADWATCH_TEST_CHROMIUM) and saves docs/run-page.png and docs/runs-list.png.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("GRADWATCH_TEST_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    from playwright.sync_api import sync_playwright

    import gradwatch
    from gradwatch.demo import DemoConfig, train
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    with tempfile.TemporaryDirectory() as home:
        settings = Settings(database_url=f"sqlite:///{home}/gradwatch.db")
        server = BackgroundServer(settings, "127.0.0.1", _free_port()).start()
        try:
            cfg = DemoConfig(steps=400)
            with gradwatch.init(project="demo", name="tiny-lm-fp16", server=server.url, config=vars(cfg)) as run:
                train(run, cfg, log=lambda line: None)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{server.url}/dashboard/runs/{run.id}")
                page.wait_for_function(
                    "() => { const g = document.querySelector('#scale-graph .js-plotly-plot');"
                    " return g && g.data && g.data.some(t => t.name === 'skipped step'); }",
                    timeout=30_000,
                )
                page.wait_for_timeout(500)  # let Plotly finish its transition
                page.screenshot(path=str(DOCS / "run-page.png"), full_page=True)
                page.goto(f"{server.url}/dashboard/")
                page.get_by_text("tiny-lm-fp16").first.wait_for(timeout=30_000)
                page.screenshot(path=str(DOCS / "runs-list.png"))
                browser.close()
        finally:
            server.stop()
    print(f"wrote {DOCS / 'run-page.png'} and {DOCS / 'runs-list.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
