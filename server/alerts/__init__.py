"""Alerts: rules evaluated on ingest, alerts with evidence and hints, webhooks through an outbox.

rules      pure incremental evaluators (one class per rule type, a module per kind of rule) and
           the registry of rule types with the default rule set
evidence   the evidence of a finding, one type per rule type (what rules write, diagnosis reads)
steps      a batch's points as the whole steps the rules are fed
engine     AlertEngine: runs the rules inside Store.ingest's transaction, opens/resolves alerts,
           enqueues deliveries; heartbeat checks on the clock
incidents  alerts grouped into incidents (one cause, one notification)
diagnosis  an incident's most likely cause (diagnosis_context, causes_precision, causes_training)
advice     every text of advice: alerts' hints, incidents' next steps
webhooks   payload formats (json, slack, discord) and HMAC-SHA256 signing
outbox     OutboxWorker: the delivery thread (claims, retries with backoff)
service    AlertService: the API's reads and writes of rules, alerts, webhooks, deliveries
Their SQL is gradwatch.server.storage.alerts'.
"""

from .engine import AlertEngine
from .outbox import OutboxWorker
from .service import AlertService

__all__ = ["AlertEngine", "AlertService", "OutboxWorker"]
