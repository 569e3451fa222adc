"""Alerts people can trust (issue 13): realistic runs that go wrong, judged by the notifications a real
server sends to a real webhook receiver, against ground truth measured without gradwatch.

Every scenario of tests/support/pathologies/ trains once (cached for the module) under gradwatch against
one real uvicorn server on 127.0.0.1 with a SQLite file and the project's DEFAULT rules (what a user
gets), with a generic-JSON webhook subscribed for the scenario's own project. Done when:
- each pathology notifies with a step within DETECTION_WINDOW steps after its onset, naming one of
  the affected layers where the scenario has any;
- each pathology is notified once (one incident), or at most once per distinct cause;
- each healthy control sends no notification at all.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pathologies
import pytest
from conftest import free_port
from pathologies import DETECTION_WINDOW, Notification, Scenario
from webhook_receiver import WebhookReceiver

import gradwatch
from gradwatch.server.serve import BackgroundServer
from gradwatch.server.settings import Settings

# The mechanism's onset, pinned: a change here means the scenario no longer does what it says.
EXPECTED_ONSETS = {
    "lr_jump": 250,
    "clip_before_unscale": 0,
    "adapter_underflow": 0,
    "nan_loss_bad_sample": 150,
    "bf16_weights_stall": 0,
    "stray_detach": 0,
    "grad_accum_no_divide": 0,
    "overflow_layer": 0,
    "lr_zero_scheduler": 100,
    "lr_too_high_fp32": 148,
    "optimizer_subset": 0,
    "unfrozen_after_optimizer": 100,
    "embedding_lr_typo": 0,
    "transient_overflow_burst": 150,
    "lr_warmup_too_high": 9,
    "no_zero_grad": 31,
    "nanogpt_undivided": 0,
    "lr_restart_100x": 150,
}
# The cause the notification must name (its incident's cause_key), where pinned.
EXPECTED_CAUSES = {
    "optimizer_subset": "params_not_in_optimizer",
    "unfrozen_after_optimizer": "params_not_in_optimizer",
    "embedding_lr_typo": "update_ratio_outlier",
    "transient_overflow_burst": "transient_burst",
    "lr_warmup_too_high": "lr_ramp",
    "no_zero_grad": "overflow_at_any_scale",
    "nanogpt_undivided": "clip_saturation_accumulation",
}


def fast_outbox_settings(**overrides: object) -> Settings:
    """Settings for a test server whose outbox retries quickly."""
    return Settings(
        outbox_poll_interval_s=0.1, outbox_backoff_base_s=0.2, outbox_backoff_max_s=1.0, **overrides
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[BackgroundServer]:
    database = tmp_path_factory.mktemp("pathologies") / "gradwatch.db"
    server = BackgroundServer(
        fast_outbox_settings(database_url=f"sqlite:///{database}"),
        "127.0.0.1",
        free_port(),
        with_dashboard=False,
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


@dataclass
class Outcome:
    scenario: Scenario
    notifications: list[Notification]

    def judged(self) -> pathologies.Verdict:
        return pathologies.judge(self.scenario, [(n.step, n.layers) for n in self.notifications])

    def describe(self) -> str:
        shown = [(n.event, n.kind, n.step, list(n.layers)[:4]) for n in self.notifications]
        return (
            f"{self.scenario.name}: onset {self.scenario.onset_step}, layers {self.scenario.layers}; "
            f"{len(shown)} notification(s) (event, kind, step, layers): {shown}"
        )


@pytest.fixture(scope="module")
def outcomes(server, api, receiver) -> dict[str, Outcome]:
    return {}


def run_scenario(
    name: str,
    outcomes: dict[str, Outcome],
    server: BackgroundServer,
    api: httpx.Client,
    receiver: WebhookReceiver,
) -> Outcome:
    """Train `name` under gradwatch once per module, wait until its run is ingested and its
    notifications delivered, and keep what the receiver got for it."""
    if name in outcomes:
        return outcomes[name]
    project = f"pathology-{name}"
    hook = api.post(
        "/api/v1/webhooks", json={"url": f"{receiver.url}/{name}", "format": "json", "project": project}
    )
    assert hook.status_code == 201, hook.text
    new_run = functools.partial(gradwatch.init, project=project, server=server.url, flush_interval=0.05)
    scenario = pathologies.SCENARIOS[name](new_run)

    for stats in scenario.agent_stats:  # everything the agent recorded reached the server
        assert stats["queued"] == stats["spooled"] == stats["dropped"] == 0, stats
        assert stats["last_error"] is None, stats
    for run_id in set(scenario.run_ids):
        run = api.get(f"/api/v1/runs/{run_id}").json()
        assert run["status"] == "finished", run

    def bodies() -> list[object]:
        return [r.json for r in list(receiver.received) if r.path == f"/hook/{name}"]

    notified = pathologies.settled_notifications(
        api, project, bodies, settle=2.0, webhook_id=hook.json()["id"]
    )
    run_ids = set(scenario.run_ids)
    notified = [n for n in notified if n.body["incident"].get("run_id") in run_ids]
    outcomes[name] = Outcome(scenario, notified)
    return outcomes[name]


PATHOLOGY_NAMES = [f.__name__ for f in pathologies.PATHOLOGIES]
HEALTHY_NAMES = [f.__name__ for f in pathologies.HEALTHY]
WITH_LAYERS = [
    "adapter_underflow",
    "bf16_weights_stall",
    "stray_detach",
    "overflow_layer",
    "optimizer_subset",
    "unfrozen_after_optimizer",
    "embedding_lr_typo",
]


def test_scenario_catalogue_is_complete():
    assert len(PATHOLOGY_NAMES) >= 8 and len(HEALTHY_NAMES) >= 5
    assert set(EXPECTED_ONSETS) == set(PATHOLOGY_NAMES)


@pytest.mark.parametrize("name", PATHOLOGY_NAMES)
def test_pathology_is_notified_within_the_window_after_its_onset(name, outcomes, server, api, receiver):
    outcome = run_scenario(name, outcomes, server, api, receiver)
    scenario = outcome.scenario
    assert scenario.onset_step == EXPECTED_ONSETS[name], scenario.facts
    verdict = outcome.judged()
    assert verdict.notified, f"no notification: {outcome.describe()}"
    assert verdict.detected, (
        f"no notification at a step in [{scenario.onset_step}, {scenario.onset_step + DETECTION_WINDOW}]: "
        f"{outcome.describe()}"
    )


@pytest.mark.parametrize("name", WITH_LAYERS)
def test_pathology_notification_names_an_affected_layer(name, outcomes, server, api, receiver):
    outcome = run_scenario(name, outcomes, server, api, receiver)
    assert outcome.scenario.layers
    verdict = outcome.judged()
    assert verdict.detected, f"not detected: {outcome.describe()}"
    assert verdict.layer_named, f"none of {outcome.scenario.layers} named: {outcome.describe()}"


@pytest.mark.parametrize("name", sorted(EXPECTED_CAUSES))
def test_pathology_notification_names_its_mechanism(name, outcomes, server, api, receiver):
    outcome = run_scenario(name, outcomes, server, api, receiver)
    assert outcome.notifications, f"no notification: {outcome.describe()}"
    assert outcome.scenario.cause == EXPECTED_CAUSES[name]
    if name == "transient_overflow_burst":
        # Notified as what it looked like at its group wait, then updated once every rule cleared.
        first, last = outcome.notifications[0], outcome.notifications[-1]
        assert first.event == "incident.firing" and first.kind != "transient_burst", outcome.describe()
        assert last.event == "incident.updated" and last.kind == "transient_burst", outcome.describe()
        assert last.body["incident"]["title"].startswith("a transient burst at steps 150-"), (
            outcome.describe()
        )
        return
    first = outcome.notifications[0]
    assert first.kind == EXPECTED_CAUSES[name], outcome.describe()
    title = first.body["incident"]["title"]
    if EXPECTED_CAUSES[name] == "lr_ramp":
        assert title.startswith("the learning rate ramped ") and "to 50 by step" in title, title
    elif EXPECTED_CAUSES[name] == "overflow_at_any_scale":
        assert ".grad" in title and "zero_grad" in first.body["incident"]["next_steps"][0], title
    elif EXPECTED_CAUSES[name] == "clip_saturation_accumulation":
        assert "the loss is summed over 8 micro-batches" in title, title
    elif EXPECTED_CAUSES[name] == "params_not_in_optimizer":
        share = outcome.scenario.facts["frozen_by_mistake_share"]
        assert title == (
            f"4 layers ({share:.0%} of the weights) get gradients but are not in the optimizer: "
            "encoder.0.weight, encoder.0.bias, encoder.2.weight…"
        ), title
    else:
        assert title.startswith("the update ratio of embed.weight is "), title


@pytest.mark.parametrize("name", PATHOLOGY_NAMES)
def test_pathology_is_one_incident(name, outcomes, server, api, receiver):
    outcome = run_scenario(name, outcomes, server, api, receiver)
    assert outcome.notifications, f"no notification: {outcome.describe()}"
    repeated = [kind for kind, count in Counter(n.kind for n in outcome.notifications).items() if count > 1]
    assert len(outcome.notifications) == 1 or not repeated, (
        f"{len(outcome.notifications)} notifications, {repeated} notified more than once: "
        f"{outcome.describe()}"
    )


@pytest.mark.parametrize("name", HEALTHY_NAMES)
def test_healthy_control_sends_no_notification(name, outcomes, server, api, receiver):
    outcome = run_scenario(name, outcomes, server, api, receiver)
    assert outcome.notifications == [], outcome.describe()


def test_notification_accessor_reads_incident_payloads():
    incident = {
        "event": "incident.firing",
        "incident": {
            "first_step": 40,
            "rules": ["grad_norm_spike", "loss_spike"],
            "cause_key": "lr_jump",
            "cause": "the lr jumped",
            "findings": [{"rule": "grad_norm_spike", "evidence": {"layers": ["out.weight"]}}],
        },
    }
    [i] = pathologies.notifications(
        [incident, {"event": "incident.resolved", "incident": {}}, {"event": "test"}]
    )
    assert (i.kind, i.step, i.layers) == ("lr_jump", 40, ("out.weight",))
    assert pathologies.names_layer(("encoder",), ["encoder.0.weight"])
    assert not pathologies.names_layer(("enc",), ["encoder.0.weight"])
