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


def allowed_hosts_from_env(variable: str = "GRADWATCH_WEBHOOK_ALLOWED_HOSTS") -> tuple[str, ...] | None:
    """A comma-separated environment variable as a tuple of host names (None when unset)."""
    value = os.environ.get(variable)
    if value is None:
        return None
    return tuple(host.strip().lower() for host in value.split(",") if host.strip())


def allow_private_from_env() -> bool:
    """GRADWATCH_WEBHOOK_ALLOW_PRIVATE is "1" or "true" (any case): webhooks may target private addresses."""
    return os.environ.get("GRADWATCH_WEBHOOK_ALLOW_PRIVATE", "").strip().lower() in ("1", "true")


def limit_from_env(variable: str, default: float) -> float:
    """An ingest limit from the environment: a number >= 0 (0: off), `default` when unset; ValueError
    naming a bad value."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:
        raise ValueError(f"{variable} must be a number >= 0 (0: no limit), got {value!r}")
    return int(number) if number.is_integer() else number


def ipv6_prefix_length_from_env(variable: str, default: int) -> int:
    """An IPv6 prefix length from the environment: a whole number from 1 to 128; ValueError naming a
    bad value."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    if not value.isdigit() or not 1 <= int(value) <= 128:
        raise ValueError(
            f"{variable} must be a whole number from 1 to 128 (bits of an IPv6 address), got {value!r}"
        )
    return int(value)


@dataclass(frozen=True)
class Settings:
    """What the server needs to know; nothing is read from the environment after this is built."""

    database_url: str = field(default_factory=default_database_url)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A process a resume superseded that still sends this long after its first late batch is a second
    # writer of the rank (storage.attempts): its data is kept, the run gets an event, its agent is told.
    second_writer_after_s: float = 30.0
    # Ingest limits (server.ingest_limits), per token, or per client address on an open server; 0: off.
    # Points as the agent counts them: scalar points, vector rows, histograms. Env: the names shown.
    max_batch_points: int = field(
        default_factory=lambda: int(limit_from_env("GRADWATCH_MAX_BATCH_POINTS", 100_000))
    )
    max_batch_values: int = field(
        default_factory=lambda: int(limit_from_env("GRADWATCH_MAX_BATCH_VALUES", 1_000_000))
    )
    ingest_concurrency: int = field(
        default_factory=lambda: int(limit_from_env("GRADWATCH_INGEST_CONCURRENCY", 2))
    )
    ingest_points_per_s: float = field(
        default_factory=lambda: limit_from_env("GRADWATCH_INGEST_POINTS_PER_S", 20_000)
    )
    ingest_burst_points: float = field(
        default_factory=lambda: limit_from_env("GRADWATCH_INGEST_BURST_POINTS", 100_000)
    )
    # Connections one client address may hold open at once (server.listener; as nginx.conf's limit_conn);
    # addresses trusted as proxies (uvicorn's FORWARDED_ALLOW_IPS, default loopback) are not capped.
    # Raise it for many ranks behind one NAT address; 0: no cap. Env: GRADWATCH_CONNECTIONS_PER_ADDRESS.
    connections_per_address: int = field(
        default_factory=lambda: int(limit_from_env("GRADWATCH_CONNECTIONS_PER_ADDRESS", 256))
    )
    # How much of an IPv6 client's address the per-client caps count it by (server.client_address): its
    # /64 by default (one host holds one); 128 for each address. Env: GRADWATCH_IPV6_PREFIX_LENGTH.
    ipv6_prefix_length: int = field(
        default_factory=lambda: ipv6_prefix_length_from_env("GRADWATCH_IPV6_PREFIX_LENGTH", 64)
    )
    # Public base URL of the dashboard, used in links (alerts, CLI output).
    public_url: str = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    # Host names answered besides loopback names, IP addresses, public_url's host and the listening host
    # (server.web_security: DNS rebinding, Origin checks). GRADWATCH_ALLOWED_HOSTS="gw.corp,gw"; "*": any.
    allowed_hosts: tuple[str, ...] | None = field(
        default_factory=lambda: allowed_hosts_from_env("GRADWATCH_ALLOWED_HOSTS")
    )
    # A server that has had tokens keeps requiring them after all are revoked, unless this is set.
    open_after_revocation: bool = False
    # Alerts and webhooks (see gradwatch.server.alerts).
    alert_worker: bool = True  # run the outbox/heartbeat worker thread in this process
    webhook_timeout_s: float = 10.0  # per POST
    # None: any http(s) host. GRADWATCH_WEBHOOK_ALLOWED_HOSTS="hooks.slack.com,discord.com" limits them.
    webhook_allowed_hosts: tuple[str, ...] | None = field(default_factory=lambda: allowed_hosts_from_env())
    # Webhooks to loopback, private and link-local addresses are refused (alerts.egress) unless this is
    # set: GRADWATCH_WEBHOOK_ALLOW_PRIVATE=1 or --webhook-allow-private, for a receiver on your own network.
    webhook_allow_private: bool = field(default_factory=allow_private_from_env)
    outbox_poll_interval_s: float = 1.0  # idle wait between outbox scans (an enqueue wakes it at once)
    outbox_lease_s: float = 60.0  # a claimed delivery not finished by then is claimable again
    outbox_max_attempts: int = 10  # then the delivery is marked failed
    outbox_backoff_base_s: float = 5.0  # retry n waits base * 2^(n-1) seconds…
    outbox_backoff_max_s: float = 1800.0  # …at most this
    heartbeat_check_interval_s: float = 30.0
    # A running run none of whose ranks has sent anything for this long is marked "crashed" with the
    # reason "no heartbeat" (a SIGKILLed or hung job), checked every heartbeat_check_interval_s; data
    # arriving again sets it back to "running". 0: never. Env GRADWATCH_CRASHED_AFTER_S.
    crashed_after_s: float = field(default_factory=lambda: limit_from_env("GRADWATCH_CRASHED_AFTER_S", 300.0))
    # Incidents (alerts.incidents): findings that arrive while the run advances this many steps past an
    # incident's first step, or within this many seconds, join its one notification.
    incident_group_wait_steps: int = 10
    incident_group_wait_s: float = 5.0
    incident_check_interval_s: float = 1.0
