"""Reading the notifications a gradwatch server sent about a run (the generic JSON webhook payload,
per incident) and judging them against a scenario's ground truth; tests/system/test_pathologies.py
and bench/diagnosis.py share it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .harness import Scenario

# A notification must name a step at most this many steps after the onset to count as a detection.
DETECTION_WINDOW = 30

FIRING_EVENTS = ("incident.firing", "incident.updated")  # what people are sent: an update names a new cause


@dataclass(frozen=True)
class Notification:
    """One firing notification (one incident) from a generic JSON webhook body."""

    event: str
    step: int | None
    kind: str  # the incident's cause key (else its cause, else its rules)
    layers: tuple[str, ...]
    body: dict[str, Any]


def _layers_in(value: Any) -> list[str]:
    """Every string listed under a "layers" key anywhere in `value` (evidence, findings…), in order."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "layers" and isinstance(item, list):
                found.extend(x for x in item if isinstance(x, str))
            else:
                found.extend(_layers_in(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(_layers_in(item))
    return list(dict.fromkeys(found))


def as_notification(body: Any) -> Notification | None:
    """The notification (firing, or an update naming a new cause) in a generic JSON webhook body
    ({"event": "incident.firing", "incident":
    {"first_step", "cause_key", "rules", "layers", "findings": [...]}}); None for resolutions and tests."""
    if (
        not isinstance(body, dict)
        or body.get("event") not in FIRING_EVENTS
        or not isinstance(body.get("incident"), dict)
    ):
        return None
    incident = body["incident"]
    step = incident.get("first_step")
    cause = incident.get("cause_key") or incident.get("cause")
    kind = cause if isinstance(cause, str) and cause else ",".join(map(str, incident.get("rules") or []))
    return Notification(
        body["event"],
        int(step) if isinstance(step, (int, float)) else None,
        kind,
        tuple(_layers_in(incident)),
        body,
    )


def notifications(bodies: list[Any]) -> list[Notification]:
    return [n for n in map(as_notification, bodies) if n is not None]


def names_layer(notified: tuple[str, ...] | list[str], affected: list[str]) -> bool:
    """Whether a notified layer is one of the affected parameters or a module holding one."""
    return any(layer == name or name.startswith(f"{layer}.") for layer in notified for name in affected)


@dataclass(frozen=True)
class Verdict:
    """How one tool's notifications about one scenario compare with its ground truth."""

    count: int
    first_step: int | None
    detected: bool  # a pathology: a notification at onset (or precursors_from) <= step <= onset + WINDOW
    latency: int | None  # first detecting step - onset (negative: a warning ahead of the divergence)
    layer_named: bool | None  # None where the scenario names no layers or nothing was detected

    @property
    def notified(self) -> bool:
        return self.count > 0


def judge(scenario: Scenario, notified: list[tuple[int | None, tuple[str, ...]]]) -> Verdict:
    """Compare (step, layers) notifications with the scenario's ground truth."""
    steps = [step for step, _ in notified if step is not None]
    first = min(steps) if steps else None
    if scenario.onset_step is None:
        return Verdict(len(notified), first, False, None, None)
    onset = scenario.onset_step
    earliest = min(onset, scenario.precursors_from) if scenario.precursors_from is not None else onset
    hits = [
        (step, layers)
        for step, layers in notified
        if step is not None and earliest <= step <= onset + DETECTION_WINDOW
    ]
    latency = min(step for step, _ in hits) - onset if hits else None
    layer_named = None
    if scenario.layers and hits:
        layer_named = any(names_layer(layers, scenario.layers) for _, layers in hits)
    return Verdict(len(notified), first, bool(hits), latency, layer_named)


def settled_notifications(
    api: Any,
    project: str,
    bodies: Callable[[], list[Any]],
    timeout: float = 30.0,
    settle: float = 1.5,
    poll: float = 0.1,
    webhook_id: int | None = None,
) -> list[Notification]:
    """Wait until the server has nothing left to deliver for `project` and `bodies()` (what the
    receiver got) has stayed the same for `settle` seconds; then its firing notifications.

    `api` is an httpx.Client on the server; webhook_id narrows the deliveries watched to one webhook.
    AssertionError at `timeout` with what was seen."""
    deadline = time.monotonic() + timeout
    last: tuple[int, int] | None = None
    stable_since = time.monotonic()
    while True:
        params = {"project": project, "limit": 100, **({"webhook_id": webhook_id} if webhook_id else {})}
        response = api.get("/api/v1/deliveries", params=params)
        response.raise_for_status()
        deliveries = response.json()["data"]
        waiting = [d for d in deliveries if d["status"] in ("pending", "sending")]
        received = bodies()
        delivered = sum(d["status"] == "delivered" for d in deliveries)
        state = (len(deliveries), len(received))
        now = time.monotonic()
        if state != last or waiting or len(received) < delivered:
            last, stable_since = state, now
        elif now - stable_since >= settle:
            return notifications(received)
        if now > deadline:
            raise AssertionError(
                f"deliveries for {project!r} did not settle within {timeout:.0f} s: "
                f"{len(waiting)} waiting, {delivered} delivered, {len(received)} received"
            )
        time.sleep(poll)
