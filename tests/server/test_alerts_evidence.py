"""The evidence of findings (gradwatch.server.alerts.evidence): each rule type writes its own TypedDict
key for key and in order (the stored JSON and the API keep that shape), and diagnose() still reads
evidence stored without some of those keys (by an older server, or written by hand)."""

import json
import typing

import pytest
from rule_steps import feed, findings_of
from test_alerts_rules_signals import _rich_run  # one run that makes most rules fire

from gradwatch.server.alerts.diagnosis import Diagnosis, RunContext, diagnose
from gradwatch.server.alerts.evidence import EVIDENCE_TYPES
from gradwatch.server.alerts.rules import RULE_TYPES, Finding, make_rule


def test_every_rule_type_has_an_evidence_type():
    assert set(EVIDENCE_TYPES) == set(RULE_TYPES)


def _findings(rule_type):
    return [finding for _, finding in findings_of(feed(make_rule(rule_type), _rich_run())[0])]


def test_the_rich_run_makes_most_rules_write_evidence():
    firing = {name for name in RULE_TYPES if _findings(name)}
    assert len(firing) >= 10, firing


@pytest.mark.parametrize("rule_type", sorted(set(RULE_TYPES) - {"heartbeat"}))
def test_a_rules_evidence_has_its_types_keys_in_their_order(rule_type):
    evidence_type = EVIDENCE_TYPES[rule_type]
    keys = list(typing.get_type_hints(evidence_type))
    for finding in _findings(rule_type):
        written = list(finding.evidence)
        assert set(evidence_type.__required_keys__) <= set(written) <= set(keys), (written, keys)
        assert written == [key for key in keys if key in written]
        assert json.loads(json.dumps(finding.evidence)) == finding.evidence  # JSON-ready as it is


def _document(rule_type, finding: Finding, evidence):
    return {
        "rule": rule_type,
        "title": finding.title,
        "step": finding.step,
        "severity": "warning",
        "evidence": evidence,
    }


@pytest.mark.parametrize("rule_type", sorted(set(RULE_TYPES) - {"heartbeat"}))
def test_evidence_stored_without_some_of_its_keys_still_reads(rule_type):
    """Each key left out in turn, and all of them: a diagnosis, never an exception."""
    contexts = [RunContext(), RunContext(fp16_scaler=True, reached_step=10_000, safe_scale=(2.0**4, 2.0**20))]
    for finding in _findings(rule_type)[:3]:
        stored = json.loads(json.dumps(finding.evidence))
        for left_out in [*stored, None]:
            evidence = {k: v for k, v in stored.items() if k != left_out} if left_out else {}
            for context in contexts:
                assert isinstance(diagnose([_document(rule_type, finding, evidence)], context), Diagnosis)
