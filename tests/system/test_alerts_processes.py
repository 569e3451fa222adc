"""Webhook deliveries across server processes: `gradwatch server` subprocesses on one database, a
real HTTP receiver, real fp16 training runs. A delivery pending at shutdown is sent after a restart,
exactly once; two servers on one PostgreSQL deliver each notification once."""

from __future__ import annotations

import time

import httpx
from conftest import free_port, server_process
from training import train
from webhook_receiver import WebhookReceiver

import gradwatch

HTTP_TIMEOUT_S = 30  # httpx's default (5 s) is short for a loaded 2-core CI machine


def _deliveries(url: str) -> list[dict]:
    return httpx.get(f"{url}/api/v1/deliveries", params={"limit": 1000}, timeout=HTTP_TIMEOUT_S).json()[
        "data"
    ]


def _settled_deliveries(url: str, count: int, timeout: float = 30.0) -> list[dict]:
    """The delivery log once it holds `count` deliveries, all delivered (the outbox records one after
    the receiver answered), or as it is after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        log = _deliveries(url)
        if (
            len(log) == count and {d["status"] for d in log} == {"delivered"}
        ) or time.monotonic() >= deadline:
            return log
        time.sleep(0.05)


def test_a_delivery_pending_at_shutdown_is_sent_after_restart_exactly_once(database_url, tmp_path):
    receiver = WebhookReceiver(port=free_port())  # not started yet: the receiver is down
    with server_process(database_url, tmp_path) as url:
        httpx.post(
            f"{url}/api/v1/webhooks", json={"url": receiver.url, "project": "restart"}, timeout=HTTP_TIMEOUT_S
        ).raise_for_status()
        with gradwatch.init(project="restart", server=url, flush_interval=0.05) as run:
            train(20, run=run, overflow_steps=(10, 11, 12))
        deadline = time.monotonic() + 30
        # Until the first attempt is recorded: claimed ("sending", attempts 1) comes before its failure,
        # and a sender thread records the failure a moment later.
        while not (pending := _deliveries(url)) or any(
            d["attempts"] == 0 or d["status"] == "sending" for d in pending
        ):
            assert time.monotonic() < deadline, pending
            time.sleep(0.05)
        assert len(pending) == 1 and {d["status"] for d in pending} == {"pending"}  # one incident
        assert all(d["last_error"].startswith("no HTTP response") for d in pending)

    with receiver, server_process(database_url, tmp_path) as url:
        [received] = receiver.wait_for(1, timeout=60)  # after the 5 s backoff of the first failure
        log = _settled_deliveries(url, 1)
        time.sleep(0.5)  # a second copy would have been sent by now
        assert len(receiver.received) == 1
        assert received.json["event"] == "incident.firing" and received.json["incident"]["run_id"] == run.id
        assert set(received.json["incident"]["rules"]) == {"loss_non_finite", "scale_drop"}
        assert {d["status"] for d in log} == {"delivered"} and {d["attempts"] for d in log} == {2}, log


def test_two_servers_on_one_postgres_deliver_each_notification_once(postgres_url, tmp_path):
    with (
        WebhookReceiver() as receiver,
        server_process(postgres_url, tmp_path) as first,
        server_process(postgres_url, tmp_path) as second,
    ):
        for name in ("a", "b", "c"):
            body = {"url": f"{receiver.url}/{name}", "project": "pair"}
            httpx.post(f"{first}/api/v1/webhooks", json=body, timeout=HTTP_TIMEOUT_S).raise_for_status()
        hooks = [
            h["id"] for h in httpx.get(f"{second}/api/v1/webhooks", timeout=HTTP_TIMEOUT_S).json()["data"]
        ]
        for _ in range(5):  # test notifications queued on both servers: both workers compete for them
            for url in (first, second):
                for hook in hooks:
                    httpx.post(
                        f"{url}/api/v1/webhooks/{hook}/test", timeout=HTTP_TIMEOUT_S
                    ).raise_for_status()
        run_ids = []
        for url in (first, second):
            with gradwatch.init(project="pair", server=url, flush_interval=0.05) as run:
                train(16, run=run, overflow_steps=(10, 11, 12))
            run_ids.append(run.id)
        expected = 5 * 2 * 3 + 2 * 1 * 3  # tests + (2 runs x 1 incident x 3 webhooks)
        receiver.wait_for(expected, timeout=60)
        log = _settled_deliveries(first, expected)
        time.sleep(0.5)  # a second copy of any delivery would have been sent by now
        ids = [r.headers["X-Gradwatch-Delivery"] for r in receiver.received]
        assert len(ids) == expected and len(set(ids)) == expected
        assert len(log) == expected
        assert {d["status"] for d in log} == {"delivered"} and {d["attempts"] for d in log} == {1}
        alerts = httpx.get(
            f"{second}/api/v1/alerts", params={"project": "pair"}, timeout=HTTP_TIMEOUT_S
        ).json()["data"]
        assert sorted(a["run_id"] for a in alerts) == sorted(run_ids * 2)
