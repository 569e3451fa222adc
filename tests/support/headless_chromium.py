"""Debian's Chromium, headless, with nothing that would reach beyond 127.0.0.1: the one way the tests,
the browser benchmarks (bench/) and docs/make_screenshots.py start it (issue 41, item 7)."""

from __future__ import annotations

import os
import shutil
from typing import Any

CHROMIUM = os.environ.get("GRADWATCH_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

__all__ = ["CHROMIUM", "CHROMIUM_ARGS", "chromium_path", "launch"]


def chromium_path() -> str | None:
    """Where the Chromium binary is (CHROMIUM on PATH or as a path), None when it is not installed."""
    return shutil.which(CHROMIUM) or (CHROMIUM if os.path.exists(CHROMIUM) else None)


def launch(playwright: Any, executable_path: str | None = None) -> Any:
    """A Playwright browser: headless Chromium with CHROMIUM_ARGS."""
    return playwright.chromium.launch(executable_path=executable_path or CHROMIUM, args=CHROMIUM_ARGS)
