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


def allowed_hosts_from_env() -> tuple[str, ...] | None:
    """GRADWATCH_WEBHOOK_ALLOWED_HOSTS as a tuple of host names (None when unset)."""
    value = os.environ.get("GRADWATCH_WEBHOOK_ALLOWED_HOSTS")
    if value is None:
        return None
    return tuple(host.strip().lower() for host in value.split(",") if host.strip())


@dataclass(frozen=True)
class Settings:
    """What the server needs to know; nothing is read from the environment after this is built."""

    database_url: str = field(default_factory=default_database_url)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Public base URL of the dashboard, used in links (alerts, CLI output).
    public_url: str = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    # A server that has had tokens keeps requiring them after all are revoked, unless this is set.
    open_after_revocation: bool = False
    # Alerts and webhooks (see gradwatch.server.alerts).
    alert_worker: bool = True  # run the outbox/heartbeat worker thread in this process
    webhook_timeout_s: float = 10.0  # per POST
    # None: any http(s) host. GRADWATCH_WEBHOOK_ALLOWED_HOSTS="hooks.slack.com,discord.com" limits them.
    webhook_allowed_hosts: tuple[str, ...] | None = field(default_factory=lambda: allowed_hosts_from_env())
    outbox_poll_interval_s: float = 1.0  # idle wait between outbox scans (an enqueue wakes it at once)
    outbox_lease_s: float = 60.0  # a claimed delivery not finished by then is claimable again
    outbox_max_attempts: int = 10  # then the delivery is marked failed
    outbox_backoff_base_s: float = 5.0  # retry n waits base * 2^(n-1) seconds…
    outbox_backoff_max_s: float = 1800.0  # …at most this
    heartbeat_check_interval_s: float = 30.0
    # Incidents (alerts.incidents): findings that arrive while the run advances this many steps past an
    # incident's first step, or within this many seconds, join its one notification.
    incident_group_wait_steps: int = 10
    incident_group_wait_s: float = 5.0
    incident_check_interval_s: float = 1.0
