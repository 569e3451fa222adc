"""Regenerate the README's screenshots: `make screenshots` (or .venv/bin/python docs/make_screenshots.py).

Runs a small fp16 training (two runs) into a fresh SQLite file behind a real server (watched often enough for
the per-layer heatmaps and histograms to have many columns), opens the dashboard in headless Chromium
(/usr/bin/chromium or GRADWATCH_TEST_CHROMIUM) and saves docs/run-page.png, docs/runs-list.png,
docs/compare.png and docs/alerts.png. For the Alerts page, a rule and a webhook are made through the UI
before training (the webhook points at a receiver on 127.0.0.1 started here, and its "Send test" is
pressed), so the page shows the alerts the overflow burst raises, one of them acknowledged.
"""

from __future__ import annotations

import socket
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent / "tests" / "support"))
from headless_chromium import launch  # noqa: E402  (shared with the tests and bench/)

# Denser than the defaults (10/100/100 steps) so a 400-step demo fills the per-layer views.
WATCH_OPTIONS = {"layer_norms_every": 5, "histograms_every": 20, "update_ratio_every": 20}
SCREENSHOTS = ("run-page.png", "runs-list.png", "compare.png", "alerts.png")
RUN_PAGE_GRAPHS = (
    "loss-graph",
    "scale-graph",
    "grad-norm-graph",
    "lr-graph",
    "grad-norm-heatmap",
    "update-ratio-heatmap",
    "underflow-heatmap",
    "hist-graph",
    "hist-time-graph",
)


def train_mlp(
    run, *, steps: int = 400, lr: float = 3e-3, overflow_at: int | None = 150, seed: int = 0
) -> None:
    """A small fp16 (autocast on CPU) + GradScaler + AdamW + clipping loop over a 6-block MLP (26 parameter
    tensors: enough rows for the heatmaps), fast enough for a shared CPU; a burst of blown-up
    activations at overflow_at makes four skipped steps."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(6)]
    model = nn.Sequential(nn.Linear(32, 64), *blocks, nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", growth_interval=100)
    run.watch(model, optimizer, scaler=scaler, **WATCH_OPTIONS)
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 10, generator=generator)
    for step in range(steps):
        x = torch.randn(64, 32, generator=generator)
        y = (x @ teacher).argmax(dim=1)
        blowup = 1e5 if overflow_at is not None and overflow_at <= step < overflow_at + 4 else 1.0
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x * blowup).float(), y)
        optimizer.zero_grad(set_to_none=True)
        run.log({"loss": loss, "lr": lr})
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


class _Receiver(BaseHTTPRequestHandler):
    """Answers every webhook POST with 200, quietly."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _make_rule_and_webhook(page, dashboard: str, receiver_url: str) -> None:
    """Through the Alerts page: a grad_norm_spike rule with a lower z than its default, and a Slack
    webhook for the project."""
    page.goto(f"{dashboard}/alerts")
    page.locator("#rule-project").fill("demo")
    page.locator("#rule-type").click()
    page.get_by_role("option", name="grad_norm_spike (warning)", exact=True).click()
    page.locator("#rules-card .param").filter(has=page.get_by_text("z", exact=True)).locator("input").fill(
        "4"
    )
    page.locator("#rule-name").fill("gradient spike (z ≥ 4)")
    page.locator("#rule-create").click()
    page.locator("#rule-form-message .form-ok").wait_for(timeout=30_000)
    page.locator("#webhook-project").fill("demo")
    page.locator("#webhook-url").fill(receiver_url)
    page.locator("#webhook-format").get_by_text("Slack", exact=True).click()
    page.locator("#webhook-create").click()
    page.locator("#webhooks-table tr").filter(has_text=receiver_url).wait_for(timeout=30_000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    from playwright.sync_api import sync_playwright

    import gradwatch
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    receiver_url = f"http://127.0.0.1:{receiver.server_address[1]}/slack-hook"
    with tempfile.TemporaryDirectory() as home, sync_playwright() as playwright:
        # The screenshot's "Slack" receiver is on 127.0.0.1: a private target, allowed on purpose.
        settings = Settings(database_url=f"sqlite:///{home}/gradwatch.db", webhook_allow_private=True)
        server = BackgroundServer(settings, "127.0.0.1", _free_port()).start()
        browser = launch(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _make_rule_and_webhook(page, f"{server.url}/dashboard", receiver_url)
            config = {"model": "mlp-6x64", "steps": 400, "lr": 3e-3, "precision": "fp16"}
            with gradwatch.init(project="demo", name="mlp-fp16", server=server.url, config=config) as run:
                train_mlp(run)
            with gradwatch.init(
                project="demo", name="mlp-fp16-lr1e-3", server=server.url, config={**config, "lr": 1e-3}
            ) as other:
                train_mlp(other, lr=1e-3, overflow_at=None)
            # Overflows near its end: its alerts are still open when the screenshots are taken.
            with gradwatch.init(
                project="demo",
                name="mlp-fp16-lr1e-2",
                server=server.url,
                config={**config, "lr": 1e-2, "steps": 200},
            ) as late:
                train_mlp(late, steps=200, lr=1e-2, overflow_at=180)

            page.goto(f"{server.url}/dashboard/runs/{run.id}")
            page.wait_for_function(
                "() => { const g = document.querySelector('#scale-graph .js-plotly-plot');"
                " return g && g.data && g.data.some(t => t.name === 'skipped step'); }",
                timeout=30_000,
            )
            for graph_id in RUN_PAGE_GRAPHS:  # every graph drawn with data, not a placeholder
                page.wait_for_function(
                    f"() => {{ const g = document.querySelector('#{graph_id} .js-plotly-plot');"
                    " return g && g.data && g.data.length > 0; }",
                    timeout=30_000,
                )
            page.locator("#events-table tr.alert-row").first.wait_for(timeout=30_000)
            page.wait_for_timeout(500)  # let Plotly finish its transition
            page.screenshot(path=str(DOCS / "run-page.png"), full_page=True)

            page.goto(f"{server.url}/dashboard/")
            page.get_by_text("mlp-fp16").first.wait_for(timeout=30_000)
            page.locator("#runs-table .alerts-badge").first.wait_for(timeout=30_000)
            for name in ("mlp-fp16", "mlp-fp16-lr1e-3"):
                row = page.locator("tr").filter(has=page.get_by_role("link", name=name, exact=True))
                row.locator("input[type=checkbox]").check()
            page.locator("#compare-link").wait_for(timeout=30_000)
            page.screenshot(path=str(DOCS / "runs-list.png"))
            page.locator("#compare-link").click()
            page.wait_for_function(
                "() => { const g = document.querySelector('#compare-graph .js-plotly-plot');"
                " return g && g.data && g.data.length === 2; }",
                timeout=30_000,
            )
            page.wait_for_timeout(500)
            page.screenshot(path=str(DOCS / "compare.png"))

            page.get_by_role("link", name="Alerts", exact=True).click()
            open_alerts = page.locator("#alerts-table tr.alert-open")
            open_alerts.first.wait_for(timeout=30_000)
            if open_alerts.count() > 1:  # show each state: acknowledge the oldest open alert
                open_alerts.last.get_by_role("button", name="Acknowledge", exact=True).click()
                page.locator("#alerts-table tr.alert-acknowledged").wait_for(timeout=30_000)
            webhook = page.locator("#webhooks-table tr").filter(has_text=receiver_url)
            webhook.get_by_role("button", name="Send test", exact=True).click()
            webhook.locator(".test-ok").wait_for(timeout=30_000)
            page.wait_for_timeout(300)
            page.screenshot(path=str(DOCS / "alerts.png"), full_page=True)
            browser.close()
        finally:
            server.stop()
            receiver.shutdown()
    print(f"wrote {', '.join(str(DOCS / name) for name in SCREENSHOTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
