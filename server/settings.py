"""Server settings: one immutable object built from arguments and environment, passed to create_app()."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
# Largest request body accepted on any endpoint (bytes). A batch of one flush interval is far smaller.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def gradwatch_home() -> Path:
    """The folder for gradwatch's local state: GRADWATCH_HOME, default ~/.gradwatch."""
    return Path(os.environ.get("GRADWATCH_HOME") or Path.home() / ".gradwatch")


def default_database_url() -> str:
    """GRADWATCH_DATABASE_URL if set, else a SQLite file under gradwatch_home()."""
    url = os.environ.get("GRADWATCH_DATABASE_URL")
    if url:
        return url
    return f"sqlite:///{gradwatch_home() / 'gradwatch.db'}"


@dataclass(frozen=True)
class Settings:
    """What the server needs to know; nothing is read from the environment after this is built."""

    database_url: str = field(default_factory=default_database_url)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Public base URL of the dashboard, used in links (alerts, CLI output).
    public_url: str = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
