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

from .egress import check_literal

__all__ = ["FORMATS", "render", "sign", "signature_headers", "validate_url", "verify"]

FORMATS = ("json", "slack", "discord")
SIGNATURE_HEADER = "X-Gradwatch-Signature"
TIMESTAMP_HEADER = "X-Gradwatch-Timestamp"
_COLORS = {"critical": 0xD63031, "warning": 0xF39C12, "resolved": 0x27AE60, "info": 0x3498DB}


def validate_url(
    url: str, allowed_hosts: tuple[str, ...] | None = None, *, allow_private: bool = False
) -> str:
    """The URL if it is http(s) with a host (and the host allowed, and unless allow_private not an address
    literal in a refused range: egress.check_literal); ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"webhook url must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"webhook url {url!r} has no host")
    if allowed_hosts is not None and parts.hostname not in allowed_hosts:
        raise ValueError(
            f"webhook host {parts.hostname!r} is not allowed (allowed: {', '.join(allowed_hosts) or 'none'})"
        )
    if not allow_private:
        check_literal(parts.hostname)
    return url


def _headline(event: str, incident: dict[str, Any]) -> str:
    if event == "test":
        return "gradwatch test notification: this webhook works"
    state = "RESOLVED" if event == "incident.resolved" else str(incident["severity"]).upper()
    if event == "incident.updated":
        state = f"UPDATE, {state}"  # the same incident, its cause named anew
    return (
        f"[{state}] {incident['project']}/{incident['run_name']}: {incident['title']} "
        f"({_step_text(incident)})"
    )


def render(fmt: str, event: str, incident: dict[str, Any]) -> str:
    """The request body (JSON text) for one event about one incident (a plain dict, as the API shows it):
    the headline, the one-sentence cause, the evidence with numbers and layers, the next steps, the link."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown webhook format {fmt!r}; use one of {', '.join(FORMATS)}")
    headline = _headline(event, incident)
    if fmt == "json":
        body: dict[str, Any] = {"event": event, "text": headline, "incident": incident}
    elif fmt == "slack":
        body = {"text": _slack_escape(headline), "blocks": _slack_blocks(event, headline, incident)}
    else:
        # Run names and layers are user text: no @everyone / @here / role pings from them, ever.
        body = {
            "content": headline[:2000],
            "embeds": [_discord_embed(event, incident)],
            "allowed_mentions": {"parse": []},
        }
    return json.dumps(body, allow_nan=False, separators=(",", ":"))


def _step_text(incident: dict[str, Any]) -> str:
    first, last = incident.get("first_step"), incident.get("last_step")
    if first is None:
        return "no step"
    where = f"step {first}" if last in (None, first) else f"steps {first}-{last}"
    if incident.get("status") == "resolved" and incident.get("resolved_step") is not None:
        where += f", resolved at step {incident['resolved_step']}"
    return where


def _layers(incident: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for finding in incident.get("findings") or []:
        for name in (finding.get("evidence") or {}).get("layers") or []:
            if name not in names:
                names.append(str(name))
    return names


def _evidence_lines(incident: dict[str, Any], most: int = 6) -> list[str]:
    return [f"{f['rule']} (step {f['step']}): {f['title']}" for f in (incident.get("findings") or [])[:most]]


def _slack_escape(text: str) -> str:
    """Slack's mrkdwn control characters escaped, so user text (run names, layers) cannot write
    <!channel>, <@user> or a <https://link|disguised link>."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# Slack's limits on a section's text and on each of its fields (characters, as sent: escaped).
SLACK_SECTION_TEXT = 3000
SLACK_FIELD_TEXT = 2000


def _slack_fit(text: str, limit: int) -> str:
    """Escaped `text` cut to `limit` characters (with an ellipsis), never inside an escape (&amp;):
    escaping after the cut could make a text of `limit` characters twice as long or more."""
    escaped = _slack_escape(text)
    if len(escaped) <= limit:
        return escaped
    cut = escaped[: limit - 1]
    ampersand = cut.rfind("&", max(0, len(cut) - 5))
    if ampersand >= 0 and ";" not in cut[ampersand:]:
        cut = cut[:ampersand]
    return cut + "…"


def _slack_blocks(event: str, headline: str, incident: dict[str, Any]) -> list[dict[str, Any]]:
    blocks = _slack_blocks_raw(event, headline, incident)
    for block in blocks:
        text = block.get("text")
        if isinstance(text, dict) and text.get("type") == "mrkdwn":
            text["text"] = _slack_fit(text["text"], SLACK_SECTION_TEXT)
        for field in block.get("fields", []):
            if field.get("type") == "mrkdwn":
                field["text"] = _slack_fit(field["text"], SLACK_FIELD_TEXT)
    return blocks


def _slack_blocks_raw(event: str, headline: str, incident: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": f"*{headline}*"}}]
    if event == "test":
        return blocks
    blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": incident["cause"]}})
    fields = [
        {"type": "mrkdwn", "text": "*Rules*\n" + ", ".join(incident.get("rules") or [])},
        {"type": "mrkdwn", "text": f"*Where*\n{_step_text(incident)}"},
    ]
    layers = _layers(incident)
    if layers:
        fields.append(
            {"type": "mrkdwn", "text": "*Layers*\n" + ", ".join(f"`{name}`" for name in layers[:5])}
        )
    blocks.append({"type": "section", "fields": fields})
    evidence = _evidence_lines(incident)
    if evidence:
        blocks.append(
            {
                "type": "section",
                "text": {
                    "type": "mrkdwn",
                    "text": "*Evidence*\n" + "\n".join(f"• {line}" for line in evidence),
                },
            }
        )
    steps = incident.get("next_steps") or []
    if steps:
        blocks.append(
            {
                "type": "section",
                "text": {
                    "type": "mrkdwn",
                    "text": "*Next steps*\n" + "\n".join(f"• {step}" for step in steps),
                },
            }
        )
    blocks.append(
        {
            "type": "actions",
            "elements": [
                {
                    "type": "button",
                    "text": {"type": "plain_text", "text": "Open run"},
                    "url": incident["link"],
                }
            ],
        }
    )
    return blocks


def _discord_embed(event: str, incident: dict[str, Any]) -> dict[str, Any]:
    if event == "test":
        return {
            "title": "gradwatch test",
            "description": "This webhook receives gradwatch alerts.",
            "color": _COLORS["info"],
        }
    color = (
        _COLORS["resolved"]
        if event == "incident.resolved"
        else _COLORS.get(incident["severity"], _COLORS["warning"])
    )
    fields = [
        {"name": "Rules", "value": (", ".join(incident.get("rules") or []) or "-")[:1024], "inline": True},
        {"name": "Where", "value": _step_text(incident), "inline": True},
    ]
    layers = _layers(incident)
    if layers:
        fields.append({"name": "Layers", "value": ", ".join(layers[:5])[:1024], "inline": False})
    evidence = _evidence_lines(incident)
    if evidence:
        fields.append({"name": "Evidence", "value": "\n".join(evidence)[:1024], "inline": False})
    steps = incident.get("next_steps") or []
    if steps:
        fields.append(
            {"name": "Next steps", "value": "\n".join(f"• {step}" for step in steps)[:1024], "inline": False}
        )
    return {
        "title": incident["title"][:256],
        "url": incident["link"],
        "description": f"{incident['project']} / {incident['run_name']}: {incident['cause']}"[:4096],
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
