"""What one incident most likely is: a pure function of its findings and what the run showed around them.

An incident groups the findings of several rules (see incidents.py). diagnose() names the one cause
that explains them best, in one sentence, and the next steps with numbers: GradScaler settings from
the safe-scale band, the learning rate to go back to and the step to rewind to, the divisor a gradient
accumulation forgot. Causes are tried from the most specific to the most generic: a setup mistake the
agent saw explains everything after it; a NaN loss with no divergence before it is the data; an lr
jump explains a divergence that follows it; the scaler's own findings come after those.

No database, no clock here: the engine gathers a RunContext and the findings, tests pass plain values.

    diagnosis_context  RunContext and what the causes read: the lr's jumps and ramps, the safe-scale
                       band, onsets
    causes_precision   the causes in fp16's range and the GradScaler
    causes_training    the causes in the optimisation, the data and the setup
The next steps' texts are advice.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .causes_precision import _clip_before_unscale, _forward_overflow, _fp16_range, _scaler, _underflow
from .causes_training import (
    _bad_loss,
    _clipping,
    _dead,
    _divergence,
    _divergence_ahead,
    _params_not_in_optimizer,
    _ramp,
    _stalled,
    _transient,
    _update_ratio_outlier,
)
from .diagnosis_context import (
    SEVERITY_ORDER,
    RunContext,
    _layers,
    finding_onset,
    lr_jump_near,
    lr_ramp_near,
    scaler_settings,
)
from .evidence import MisuseEvidence

__all__ = [
    "SEVERITY_ORDER",
    "Diagnosis",
    "RunContext",
    "diagnose",
    "finding_onset",
    "lr_jump_near",
    "lr_ramp_near",
    "scaler_settings",
]


@dataclass
class Diagnosis:
    cause_key: str
    title: str  # a short headline
    cause: str  # one sentence: the most likely cause
    next_steps: list[str]
    severity: str
    layers: list[str] = field(default_factory=list)  # the layers it names, most likely first


def diagnose(findings: list[dict[str, Any]], context: RunContext) -> Diagnosis:
    """The incident's most likely cause. findings: [{"rule", "title", "step", "severity", "evidence"}]
    in step order (at least one)."""
    severity = max((f["severity"] for f in findings), key=lambda s: SEVERITY_ORDER.get(s, 0))
    by_rule: dict[str, dict[str, Any]] = {}
    for finding in sorted(findings, key=lambda f: f["step"]):
        by_rule.setdefault(finding["rule"], finding)
    first_step = min(f["step"] for f in findings)
    misuse = dict(context.misuse)
    if "misuse" in by_rule:
        evidence: MisuseEvidence = by_rule["misuse"]["evidence"]
        # Stored evidence: a document without hints (or a shorter list) names no hints, not an error.
        for kind, hint in zip(evidence.get("kinds") or [], evidence.get("hints") or [], strict=False):
            misuse.setdefault(kind, {"hint": hint})
    for diagnose_one in _CAUSES:
        result = diagnose_one(by_rule, findings, context, misuse, first_step)
        if result is not None:
            cause_key, title, cause, steps = result[:4]
            layers = result[4] if len(result) > 4 else _layers(findings)
            return Diagnosis(cause_key, title, cause, steps, severity, layers)
    first = findings[0]
    return Diagnosis(first["rule"], first["title"], first["title"], [], severity, _layers(findings))


# The order causes are tried in: the first that applies names the incident's cause.
_CAUSES = (
    _clip_before_unscale,
    _fp16_range,
    _params_not_in_optimizer,
    _transient,
    _ramp,
    _forward_overflow,
    _bad_loss,
    _update_ratio_outlier,
    _divergence_ahead,
    _divergence,
    _scaler,
    _underflow,
    _clipping,
    _dead,
    _stalled,
)
