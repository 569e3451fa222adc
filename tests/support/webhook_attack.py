"""A project whose webhook receivers drip their answers, while another project waits for its own
delivery: bench/ingest_isolation.py's slow_webhooks attack (tests/server/test_webhook_fairness.py
proves the same mechanism on a smaller scale)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ingest_attack import Sample, Summary, post
from webhook_receiver import MisbehavingReceiver, WebhookReceiver


@dataclass
class WebhookResult:
    baseline: Summary
    attack: Summary
    hostile_statuses: Counter[int]


def slow_webhook_scenario(
    url: str, victim_admin: str, hostile_admin: str, baseline_s: float, attack_s: float, hooks: int = 8
) -> WebhookResult:
    """The victim's webhook delivery latency (its test delivery asked for -> received by its receiver),
    alone for baseline_s, then for attack_s while the hostile project's `hooks` webhooks point at
    receivers that drip their answer a byte every 4 s and it asks for test deliveries to them back to
    back (each is retried with backoff, so its pending deliveries pile up). The server must allow
    loopback receivers (webhook_allow_private)."""

    def request(method: str, path: str, token: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        status, _, answer = post(url, path, data, token, method=method)
        return status, json.loads(answer) if answer[:1] in (b"{", b"[") else answer

    receiver = WebhookReceiver().start()
    drips = [MisbehavingReceiver("drip", drip_s=4.0) for _ in range(hooks)]
    try:
        status, made = request(
            "POST", "/api/v1/webhooks", victim_admin, {"url": receiver.url, "project": "victim"}
        )
        assert status == 201, made
        victim_hook = made["id"]
        hostile_hooks = []
        for drip in drips:
            status, made = request(
                "POST", "/api/v1/webhooks", hostile_admin, {"url": drip.url, "project": "hostile"}
            )
            assert status == 201, made
            hostile_hooks.append(made["id"])

        samples: list[Sample] = []
        started = time.monotonic()

        def probe(until: float) -> None:
            while time.monotonic() < until:
                seen = len(receiver.received)
                began = time.monotonic()
                status, _ = request("POST", f"/api/v1/webhooks/{victim_hook}/test", victim_admin)
                error = None if status == 202 else f"HTTP {status}"
                while error is None and len(receiver.received) <= seen:
                    if time.monotonic() - began > 120:
                        error = "not delivered within 120 s"
                    time.sleep(0.005)
                samples.append(
                    Sample(began - started, time.monotonic() - began, 200 if error is None else status, error)
                )
                time.sleep(0.25)

        probe(started + baseline_s)
        attack_start = time.monotonic() - started
        statuses: Counter[int] = Counter()
        stop = threading.Event()

        def hostile() -> None:
            while not stop.is_set():
                for hook in hostile_hooks:
                    statuses[request("POST", f"/api/v1/webhooks/{hook}/test", hostile_admin)[0]] += 1
                stop.wait(0.1)

        attackers = [threading.Thread(target=hostile, daemon=True) for _ in range(2)]
        for thread in attackers:
            thread.start()
        time.sleep(2.0)  # the hostile's deliveries are pending (and stuck) before the victim asks
        probe(started + attack_start + attack_s)
        stop.set()
        for thread in attackers:
            thread.join(30)
        return WebhookResult(
            Summary.of([s for s in samples if s.at < attack_start]),
            Summary.of([s for s in samples if s.at >= attack_start]),
            statuses,
        )
    finally:
        receiver.stop()
        for drip in drips:
            drip.close()
