"""The delivery worker: a thread in each server process that claims due deliveries from the outbox
table, POSTs them, and records the outcome, retrying failures with exponential backoff.

Fair and concurrent: up to DELIVERY_THREADS deliveries are in flight at once, each on a thread of a
pool, at most one per webhook (across processes: a claimed row's lease holds its webhook) and at most
PER_PROJECT_IN_FLIGHT per project (in this process); among the rest the oldest due goes first. A
receiver that drips its answer may only delay its own webhook's deliveries: one at a time, each cut at
webhook_timeout_s. Sent one at a time, oldest first across all projects, one project's slow receiver
delayed another project's delivery by 59 s.

A claim is one atomic UPDATE … WHERE id = (SELECT … LIMIT 1 [FOR UPDATE SKIP LOCKED]) that moves a
row from pending to sending with a lease (claimed_until) and a fresh claim_token: on PostgreSQL two
processes never claim the same row, on SQLite the single writer makes the UPDATE atomic. A row whose
lease ran out (its worker died mid-send) is claimable again. Only the token holder may finish a row.

Requests go through egress.PinnedTransport: a host that is or resolves to a loopback, private or
link-local address is refused (unless Settings.webhook_allow_private), permanently: no retries.
"""

from __future__ import annotations

import http
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..database import Transactions
from ..models import Webhook
from ..settings import Settings
from ..storage import alerts as alert_tables
from .egress import HostNotPublic, PinnedTransport
from .webhooks import signature_headers, validate_url

__all__ = ["DELIVERY_THREADS", "PER_PROJECT_IN_FLIGHT", "OutboxWorker", "backoff_delay"]

DELIVERY_THREADS = 8
PER_PROJECT_IN_FLIGHT = 2

logger = logging.getLogger("gradwatch.alerts")
_PHRASES = {status.value: status.phrase for status in http.HTTPStatus}


def backoff_delay(attempts: int, base_s: float, max_s: float) -> float:
    """Seconds before retry number `attempts` (1, 2, …): base, 2·base, 4·base, … capped at max_s."""
    return min(max_s, base_s * 2.0 ** max(0, attempts - 1))


@dataclass
class _Periodic:
    """A task run every `interval` seconds on the worker's thread; `last`: when it last ran."""

    interval: float
    task: Callable[[Session, float], object]
    last: float = 0.0


@dataclass(frozen=True)
class Claimed:
    id: int
    token: str
    attempts: int
    url: str
    secret: str | None
    payload: str
    webhook_id: int
    project: str


class OutboxWorker:
    """Delivers the outbox. start() / stop() (idempotent); wake() after enqueuing to skip the poll wait.

    periodic: (interval seconds, callable(session, now)) tasks run on the same thread, e.g. heartbeats."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        *,
        client: httpx.Client | None = None,
        periodic: tuple[tuple[float, Callable[[Session, float], object]], ...] = (),
    ) -> None:
        self.engine = engine
        self.settings = settings
        self._transaction = Transactions(engine)  # commit on success, roll back on any error
        self._client = client  # given (tests): shared by every delivery; else one per delivery
        self._periodic = [_Periodic(interval, task) for interval, task in periodic]
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._senders: ThreadPoolExecutor | None = None
        self._in_flight: dict[int, Claimed] = {}  # delivery id -> what a sender thread is sending
        self._in_flight_lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------------

    def _new_client(self) -> httpx.Client:
        return httpx.Client(
            transport=PinnedTransport(self.settings.webhook_allow_private),
            timeout=self.settings.webhook_timeout_s,
            follow_redirects=False,
        )

    def start(self) -> OutboxWorker:
        if self._thread is None:
            self._senders = ThreadPoolExecutor(DELIVERY_THREADS, thread_name_prefix="gradwatch-outbox-send")
            self._thread = threading.Thread(target=self._loop, name="gradwatch-outbox", daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        self._wakeup.set()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._wakeup.set()
        wait = timeout if timeout is not None else self.settings.webhook_timeout_s + 5
        deadline = time.monotonic() + wait
        if self._thread is not None:
            self._thread.join(wait)
            self._thread = None
        while self._in_flight and time.monotonic() < deadline:  # sends end within webhook_timeout_s
            time.sleep(0.05)
        if self._senders is not None:
            self._senders.shutdown(wait=False, cancel_futures=True)
            self._senders = None

    def _loop(self) -> None:
        while not self._stopping.is_set():
            delivered_any = False
            try:
                self._run_periodic()
                delivered_any = self.deliver_due()
            except Exception:  # never let the worker die silently: log and retry after the poll interval
                logger.exception("gradwatch: the outbox worker failed; retrying")
            if not delivered_any:
                self._wakeup.wait(self.settings.outbox_poll_interval_s)
                self._wakeup.clear()

    def _run_periodic(self) -> None:
        now = time.time()
        for entry in self._periodic:
            if now - entry.last >= entry.interval:
                entry.last = now
                with self._transaction() as session:
                    entry.task(session, now)

    # -- one pass ---------------------------------------------------------------------------------

    def deliver_due(self, limit: int = 100) -> bool:
        """Claim due deliveries (up to limit) while a sender thread is free, each handed to one; True
        when any was claimed. A sender that finishes wakes the loop for the next."""
        attempted = False
        for _ in range(limit):
            if self._stopping.is_set() or self._senders is None:
                break
            with self._in_flight_lock:
                if len(self._in_flight) >= DELIVERY_THREADS:
                    break
                busy_webhooks = {c.webhook_id for c in self._in_flight.values()}
                per_project = Counter(c.project for c in self._in_flight.values())
            busy_projects = {p for p, n in per_project.items() if n >= PER_PROJECT_IN_FLIGHT}
            claimed = self.claim(busy_webhooks, busy_projects)
            if claimed is None:
                break
            attempted = True
            with self._in_flight_lock:
                self._in_flight[claimed.id] = claimed
            self._senders.submit(self._send_and_release, claimed)
        return attempted

    def _send_and_release(self, claimed: Claimed) -> None:
        try:
            self._send(claimed)
        except Exception:  # a sender thread must not end silently: the lease makes the row claimable again
            logger.exception("gradwatch: webhook delivery %d failed in its sender", claimed.id)
        finally:
            with self._in_flight_lock:
                self._in_flight.pop(claimed.id, None)
            self._wakeup.set()

    def claim(
        self, busy_webhooks: Collection[int] = (), busy_projects: Collection[str] = ()
    ) -> Claimed | None:
        """Atomically take the oldest due delivery (or one whose lease expired) of a webhook that is
        not busy (see storage.alerts.claim_delivery) for this worker."""
        now = time.time()
        token = uuid.uuid4().hex
        with self._transaction() as session:
            row = alert_tables.claim_delivery(
                session, now, token, now + self.settings.outbox_lease_s, busy_webhooks, busy_projects
            )
            if row is None:
                return None
            webhook = session.get(Webhook, row.webhook_id)
            if webhook is None:
                return None
            return Claimed(
                row.id,
                token,
                row.attempts,
                webhook.url,
                webhook.secret,
                row.payload,
                webhook.id,
                webhook.project,
            )

    def _send(self, claimed: Claimed) -> None:
        body = claimed.payload.encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "gradwatch-webhooks/1",
            "X-Gradwatch-Delivery": str(claimed.id),
        } | signature_headers(claimed.secret, time.time(), body)
        status: int | None = None
        error: str | None = None
        try:  # the allow-list or webhook_allow_private may have changed since the webhook was created
            validate_url(
                claimed.url,
                self.settings.webhook_allowed_hosts,
                allow_private=self.settings.webhook_allow_private,
            )
            status, location = self._post(claimed.url, body, headers)
            if (
                location is not None
            ):  # never followed: a redirect could lead anywhere, e.g. inside the network
                error = (
                    f"HTTP {status} redirect to {location!r} not followed; point the webhook at the final URL"
                )
            elif not 200 <= status < 300:
                # The status code only: the receiver's body is never kept (a delivery log that showed it
                # would let anyone with a webhook read what internal services answer).
                error = f"HTTP {status}" + (f" {_PHRASES[status]}" if status in _PHRASES else "")
        except ValueError as exc:  # validate_url, or egress.EgressRefused (a private target): permanent
            self._finish(claimed, None, str(exc), final=True)
            return
        except httpx.InvalidURL as exc:  # e.g. 0177.0.0.1 under webhook_allow_private: permanent too
            self._finish(claimed, None, f"webhook url cannot be sent: {exc}", final=True)
            return
        except HostNotPublic as exc:  # retried: a name that does not resolve now may later
            error = str(exc)
        except httpx.HTTPError:
            # One message for every transport failure: closed and open ports must not be told apart.
            error = "no HTTP response from the receiver (refused, unreachable or timed out)"
        self._finish(claimed, status, error)

    def _post(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str | None]:
        """POST within webhook_timeout_s for the whole exchange; (status, Location of a redirect).

        httpx's timeout bounds each read, so a receiver that drips a byte every few seconds would hold
        the outbox, every project's deliveries, for as long as it likes: the request runs on a thread
        of its own, and past the deadline its connection is closed and the delivery counts as timed
        out. The answer's body is never read (nothing of it is kept), however large. Each delivery has
        a client of its own (closed after it: a timed-out one's socket with it), unless one was given."""
        answer: dict[str, Any] = {}
        client = self._client if self._client is not None else self._new_client()

        def attempt() -> None:
            try:
                with client.stream("POST", url, content=body, headers=headers) as response:
                    location = response.headers.get("location", "?") if response.is_redirect else None
                    answer["result"] = (response.status_code, location)
            except BaseException as exc:  # noqa: BLE001 - handed to the outbox thread
                answer["error"] = exc

        thread = threading.Thread(target=attempt, name="gradwatch-outbox-post", daemon=True)
        thread.start()
        thread.join(self.settings.webhook_timeout_s)
        if client is not self._client:
            client.close()  # a timed-out request's socket closes with it
        if thread.is_alive():
            raise httpx.TimeoutException(f"no complete answer within {self.settings.webhook_timeout_s:g} s")
        if "error" in answer:
            raise answer["error"]
        result: tuple[int, str | None] = answer["result"]
        return result

    def _finish(self, claimed: Claimed, status: int | None, error: str | None, final: bool = False) -> None:
        now = time.time()
        settings = self.settings
        if error is None:
            values: dict[str, object] = {"status": "delivered", "delivered_at": now, "last_error": None}
        elif final or claimed.attempts >= settings.outbox_max_attempts:
            values = {"status": "failed", "last_error": error}
        else:
            delay = backoff_delay(
                claimed.attempts, settings.outbox_backoff_base_s, settings.outbox_backoff_max_s
            )
            values = {"status": "pending", "next_attempt_at": now + delay, "last_error": error}
        with self._transaction() as session:
            alert_tables.finish_delivery(session, claimed.id, claimed.token, status, values)
        if error is not None:
            logger.warning(
                "gradwatch: webhook delivery %d attempt %d failed: %s", claimed.id, claimed.attempts, error
            )
