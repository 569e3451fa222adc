"""Webhook payloads as pure functions: the generic JSON, Slack and Discord bodies rendered from an
incident, and the signature and URL checks (deliveries end to end: test_alerts.py, test_webhook_ssrf.py).
"""

import json
import math

import pytest

from gradwatch.server.alerts.webhooks import render, sign, signature_headers, validate_url, verify


def _incident(**overrides):
    incident = {
        "id": 7,
        "project": "llm",
        "run_id": "r1",
        "run_name": "lora-7b",
        "status": "open",
        "severity": "critical",
        "family": "precision",
        "cause_key": "scale_collapse",
        "title": "the loss scale never settles: gradients overflow at any scale in attn.out.weight",
        "cause": (
            "Gradients overflow fp16 on (nearly) every step in attn.out.weight: the GradScaler keeps halving."
        ),
        "next_steps": [
            (
                "GradScaler(init_scale=2**7, growth_interval=2000): the gradients fit fp16 for loss scales "
                "between 2^3 and 2^12."
            ),
            "Keep attn.out.weight in fp32, or train in bf16.",
        ],
        "rules": ["scaler_calibration", "scale_floor"],
        "findings": [
            {
                "rule": "scaler_calibration",
                "title": "the loss scale never settles: 17 of 17 steps skipped",
                "step": 16,
                "severity": "critical",
                "evidence": {"values": [65536.0, 0.5], "ratio": 0.1 + 0.2, "layers": ["attn.out.weight"]},
            },
            {
                "rule": "scale_floor",
                "title": "loss scale 2^-1 is below the floor 1",
                "step": 16,
                "severity": "critical",
                "evidence": {"values": [0.5], "layers": ["attn.out.weight", "mlp.fc1.weight"], "floor": 1.0},
            },
        ],
        "first_step": 16,
        "last_step": 20,
        "resolved_step": None,
        "link": "http://gw.example/dashboard/runs/r1?step=16",
        "created_at": "2024-01-01T00:00:00+00:00",
        "updated_at": None,
        "resolved_at": None,
        "notified_at": None,
    }
    incident.update(overrides)
    return incident


def _strict_loads(text):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_payload_carries_the_event_headline_and_the_incident_document():
    incident = _incident()
    body = _strict_loads(render("json", "incident.firing", incident))
    assert body["event"] == "incident.firing" and body["incident"] == incident
    assert body["text"] == f"[CRITICAL] llm/lora-7b: {incident['title']} (steps 16-20)"


def test_slack_payload_has_the_cause_layers_evidence_next_steps_and_a_button():
    incident = _incident()
    body = _strict_loads(render("slack", "incident.firing", incident))
    assert body["text"].startswith("[CRITICAL] llm/lora-7b:") and "(steps 16-20)" in body["text"]
    texts = json.dumps(body["blocks"])
    assert incident["cause"] in texts and "GradScaler(init_scale=2**7" in texts
    assert "`attn.out.weight`" in texts and "`mlp.fc1.weight`" in texts
    assert "scaler_calibration (step 16)" in texts and "*Rules*" in texts
    assert body["blocks"][-1]["elements"][0]["url"] == incident["link"]


def test_discord_payload_has_the_cause_fields_and_the_link():
    incident = _incident()
    body = _strict_loads(render("discord", "incident.firing", incident))
    embed = body["embeds"][0]
    assert body["content"].startswith("[CRITICAL]") and embed["url"] == incident["link"]
    assert incident["cause"] in embed["description"] and embed["title"] == incident["title"]
    fields = {field["name"]: field["value"] for field in embed["fields"]}
    assert fields["Rules"] == "scaler_calibration, scale_floor" and fields["Where"] == "steps 16-20"
    assert "attn.out.weight" in fields["Layers"] and "GradScaler(init_scale=2**7" in fields["Next steps"]
    assert embed["color"] == 0xD63031


@pytest.mark.parametrize("fmt", ["json", "slack", "discord"])
def test_a_resolved_incident_says_resolved(fmt):
    incident = _incident(status="resolved", resolved_step=140)
    text = render(fmt, "incident.resolved", incident)
    body = _strict_loads(text)
    headline = {"json": body.get("text"), "slack": body.get("text"), "discord": body.get("content")}[fmt]
    assert headline.startswith("[RESOLVED] llm/lora-7b") and "resolved at step 140" in headline
    if fmt == "discord":
        assert body["embeds"][0]["color"] == 0x27AE60


@pytest.mark.parametrize("fmt", ["json", "slack", "discord"])
def test_the_test_event_renders_the_sample(fmt):
    sample = _incident(
        id=None,
        run_id=None,
        run_name="test",
        severity="info",
        family="test",
        cause_key="test",
        title="gradwatch test notification",
        next_steps=[],
        rules=[],
        findings=[],
        first_step=None,
        last_step=None,
    )
    body = _strict_loads(render(fmt, "test", sample))
    assert "this webhook works" in json.dumps(body)


@pytest.mark.parametrize("fmt", ["json", "slack", "discord"])
def test_payloads_are_standard_json_with_evidence_as_the_store_keeps_it(fmt):
    """Evidence reaches render() through the store's JSON (non-finite floats as strings): still standard
    JSON."""
    from gradwatch.server.storage.codecs import dump_json

    incident = _incident()
    incident["findings"][0]["evidence"].update({"values": [math.inf, math.nan, 1e-300], "ratio": -math.inf})
    stored = json.loads(dump_json(incident))
    body = _strict_loads(render(fmt, "incident.firing", stored))
    assert body


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown webhook format 'teams'"):
        render("teams", "incident.firing", _incident())


def test_signature_round_trip_and_url_validation():
    body = b'{"a":1}'
    headers = signature_headers("s3cret", 1_700_000_000, body)
    assert headers["X-Gradwatch-Signature"] == sign("s3cret", "1700000000", body)
    assert verify("s3cret", headers, body, now=1_700_000_010)
    assert not verify("s3cret", headers, body + b" ", now=1_700_000_010)
    assert not verify("s3cret", headers, body, now=1_700_009_999)  # too old
    with pytest.raises(ValueError, match="http:// or https://"):
        validate_url("ftp://example.com/x")
    with pytest.raises(ValueError, match="not allowed"):
        validate_url("https://evil.example/x", ("hooks.slack.com",))


def test_slack_and_discord_payloads_cannot_ping_or_disguise_links():
    import json

    incident = {
        "id": 1,
        "project": "p",
        "run_id": "r",
        "run_name": "<!channel> @everyone <https://evil.example|Click here>",
        "status": "open",
        "severity": "critical",
        "title": "t",
        "cause": "c <@U123>",
        "next_steps": [],
        "rules": [],
        "findings": [],
        "first_step": 3,
        "last_step": 3,
        "resolved_step": None,
        "link": "http://x/dashboard/runs/r",
    }
    slack = json.loads(render("slack", "incident.firing", incident))
    text = json.dumps(slack)
    assert "<!channel>" not in text and "<https://evil" not in text and "<@U123>" not in text
    assert "&lt;!channel&gt;" in slack["text"]
    discord = json.loads(render("discord", "incident.firing", incident))
    assert discord["allowed_mentions"] == {"parse": []}


def test_slack_sections_stay_within_slacks_limits_once_escaped():
    # Text full of characters that escaping lengthens (& -> &amp;: 5x): cut after escaping, so every
    # section fits Slack's 3000 characters (fields 2000), and never inside an escape.
    ampersands = "&<>" * 4000
    incident = _incident(
        cause=ampersands,
        next_steps=[ampersands],
        rules=["r" + "&" * 3000],
        findings=[{"rule": "x", "step": 1, "title": ampersands}],
    )
    blocks = json.loads(render("slack", "incident.firing", incident))["blocks"]
    texts = [b["text"]["text"] for b in blocks if b.get("type") == "section" and "text" in b]
    fields = [f["text"] for b in blocks for f in b.get("fields", [])]
    assert len(texts) == 4 and all(len(t) <= 3000 for t in texts) and all(len(f) <= 2000 for f in fields)
    for text in texts + fields:
        assert "<" not in text and ">" not in text  # still escaped
        tail = text[text.rfind("&") :]
        assert tail.startswith(("&amp;", "&lt;", "&gt;")) or tail == text[-1:], tail  # no broken escape
    assert any(t.endswith("…") for t in texts)
