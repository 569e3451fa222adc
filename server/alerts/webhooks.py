"""Webhook payloads (generic JSON, Slack, Discord) and HMAC-SHA256 request signing.

Signature: X-Gradwatch-Timestamp is the send time (Unix seconds) and
    X-Gradwatch-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + raw body)>
so a receiver verifies the body and rejects old replays by the timestamp.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FORMATS", "render", "sign", "signature_headers", "validate_url", "verify"]

FORMATS = ("json", "slack", "discord")
SIGNATURE_HEADER = "X-Gradwatch-Signature"
TIMESTAMP_HEADER = "X-Gradwatch-Timestamp"
_COLORS = {"critical": 0xD63031, "warning": 0xF39C12, "resolved": 0x27AE60, "info": 0x3498DB}


def validate_url(url: str, allowed_hosts: tuple[str, ...] | None = None) -> str:
    """The URL if it is http(s) with a host (and the host allowed); ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"webhook url must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"webhook url {url!r} has no host")
    if allowed_hosts is not None and parts.hostname not in allowed_hosts:
        raise ValueError(
            f"webhook host {parts.hostname!r} is not allowed (allowed: {', '.join(allowed_hosts) or 'none'})"
        )
    return url


def _headline(event: str, alert: dict[str, Any]) -> str:
    if event == "test":
        return "gradwatch test notification: this webhook works"
    state = "RESOLVED" if event == "alert.resolved" else alert["severity"].upper()
    return f"[{state}] {alert['project']}/{alert['run_name']}: {alert['title']}"


def render(fmt: str, event: str, alert: dict[str, Any]) -> str:
    """The request body (JSON text) for one event about one alert (a plain dict, as the API shows it)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown webhook format {fmt!r}; use one of {', '.join(FORMATS)}")
    headline = _headline(event, alert)
    if fmt == "json":
        body: dict[str, Any] = {"event": event, "text": headline, "alert": alert}
    elif fmt == "slack":
        body = {"text": headline, "blocks": _slack_blocks(event, headline, alert)}
    else:
        body = {"content": headline[:2000], "embeds": [_discord_embed(event, alert)]}
    return json.dumps(body, allow_nan=False, separators=(",", ":"))


def _step_text(alert: dict[str, Any]) -> str:
    if alert.get("status") == "resolved" and alert.get("resolved_step") is not None:
        return f"step {alert['step']} → resolved at step {alert['resolved_step']}"
    return f"step {alert['step']}" if alert.get("step") is not None else "no step"


def _slack_blocks(event: str, headline: str, alert: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": f"*{headline}*"}}]
    if event == "test":
        return blocks
    layers = alert.get("evidence", {}).get("layers") or []
    fields = [
        {"type": "mrkdwn", "text": f"*Rule*\n{alert['type']}"},
        {"type": "mrkdwn", "text": f"*Where*\n{_step_text(alert)}"},
    ]
    if layers:
        fields.append({"type": "mrkdwn", "text": "*Layers*\n" + ", ".join(f"`{name}`" for name in layers[:5])})
    blocks.append({"type": "section", "fields": fields})
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"What to try: {alert['hint']}"}]})
    blocks.append({
        "type": "actions",
        "elements": [{"type": "button", "text": {"type": "plain_text", "text": "Open run"}, "url": alert["link"]}],
    })
    return blocks


def _discord_embed(event: str, alert: dict[str, Any]) -> dict[str, Any]:
    if event == "test":
        return {"title": "gradwatch test", "description": "This webhook receives gradwatch alerts.", "color": _COLORS["info"]}
    color = _COLORS["resolved"] if event == "alert.resolved" else _COLORS.get(alert["severity"], _COLORS["warning"])
    layers = alert.get("evidence", {}).get("layers") or []
    fields = [
        {"name": "Rule", "value": alert["type"], "inline": True},
        {"name": "Where", "value": _step_text(alert), "inline": True},
    ]
    if layers:
        fields.append({"name": "Layers", "value": ", ".join(layers[:5])[:1024], "inline": False})
    fields.append({"name": "What to try", "value": alert["hint"][:1024], "inline": False})
    return {
        "title": alert["title"][:256],
        "url": alert["link"],
        "description": f"{alert['project']} / {alert['run_name']}",
        "color": color,
        "fields": fields,
    }


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header's value: "sha256=" + hex HMAC-SHA256 over timestamp + "." + body."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def signature_headers(secret: str | None, timestamp: float, body: bytes) -> dict[str, str]:
    """Headers for one attempt: the timestamp always, the signature when the webhook has a secret."""
    stamp = str(int(timestamp))
    headers = {TIMESTAMP_HEADER: stamp}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, stamp, body)
    return headers


def verify(secret: str, headers: dict[str, str], body: bytes, now: float, tolerance_s: float = 300.0) -> bool:
    """What a receiver does: recompute the signature and check the timestamp is recent."""
    lowered = {k.lower(): v for k, v in headers.items()}
    stamp = lowered.get(TIMESTAMP_HEADER.lower(), "")
    given = lowered.get(SIGNATURE_HEADER.lower(), "")
    if not stamp.isdigit() or abs(now - int(stamp)) > tolerance_s:
        return False
    return hmac.compare_digest(given, sign(secret, stamp, body))
