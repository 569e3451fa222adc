"""Fair webhook delivery (issue 39, item 3): a project whose receivers do not answer delays only its own
deliveries. Deliveries go out concurrently, one at a time per webhook and at most two per project; the
others' go out meanwhile. Real receivers on 127.0.0.1 and a real server, SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time

import httpx
from conftest import free_port
from webhook_receiver import WebhookReceiver

from gradwatch.server.alerts.outbox import PER_PROJECT_IN_FLIGHT
from gradwatch.server.serve import BackgroundServer
from gradwatch.server.settings import Settings


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_receiver_that_does_not_answer_delays_only_its_own_project(database_url):
    settings = Settings(
        database_url=database_url,
        outbox_poll_interval_s=0.2,
        webhook_timeout_s=60.0,  # the slow receivers hold every request they get until released
        webhook_allow_private=True,
    )
    server = BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False).start()
    held = threading.Event()
    slow = [WebhookReceiver().start() for _ in range(3)]
    for receiver in slow:
        receiver.hold = held
    victim = WebhookReceiver().start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as api:

            def hook(url: str, project: str) -> int:
                made = api.post("/api/v1/webhooks", json={"url": url, "project": project})
                assert made.status_code == 201, made.text
                return int(made.json()["id"])

            slow_hooks = [hook(receiver.url, "slow") for receiver in slow]
            victim_hook = hook(victim.url, "victim")
            for hook_id in slow_hooks:  # the slow project's deliveries are due first, three each
                for _ in range(3):
                    assert api.post(f"/api/v1/webhooks/{hook_id}/test").status_code == 202
            assert api.post(f"/api/v1/webhooks/{victim_hook}/test").status_code == 202

            victim.wait_for(1, timeout=30)  # delivered while every slow receiver still holds its request
            assert not held.is_set()
            in_flight = sum(len(receiver.received) for receiver in slow)
            assert in_flight <= PER_PROJECT_IN_FLIGHT, in_flight  # the project's cap, one per webhook
            assert all(len(receiver.received) <= 1 for receiver in slow)
            held.set()  # the slow receivers answer now: every delivery goes out in the end
            _wait(lambda: sum(len(receiver.received) for receiver in slow) == 9)
            for hook_id in [*slow_hooks, victim_hook]:
                _wait(
                    lambda hook_id=hook_id: all(
                        d["status"] == "delivered"
                        for d in api.get(f"/api/v1/webhooks/{hook_id}/deliveries").json()["data"]
                    )
                )
    finally:
        held.set()
        for receiver in [*slow, victim]:
            receiver.stop()
        server.stop()
