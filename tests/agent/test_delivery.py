"""The batch life cycle (gradwatch._delivery) on its own: no threads, no clock, no I/O.

Every transition of the Delivery state machine, and every class of answer classify() knows. Time is
whatever number the test passes as `now`.
"""

from __future__ import annotations

import pytest

from gradwatch._delivery import (
    REFUSAL_TRIES,
    SERVER_ERROR_TRIES,
    Action,
    Decision,
    Delivery,
    Kind,
    Seal,
    classify,
    progress_line,
)

# -- classify: the one status policy ------------------------------------------------------------------


@pytest.mark.parametrize("status", [408, 429, 502, 503, 504])
def test_an_away_or_busy_server_is_waited_for(status):
    verdict = classify(status)
    assert verdict.kind is Kind.UNAVAILABLE
    assert verdict.waits
    assert verdict.retryable


def test_no_answer_is_waited_for_when_the_transport_says_it_can_succeed_later():
    assert classify(None).kind is Kind.UNAVAILABLE
    assert classify(None).retryable
    refused = classify(None, retryable=False)
    assert refused.kind is Kind.REFUSED
    assert not refused.retryable
    assert not refused.waits


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_waits_and_is_never_the_batchs_fault(status):
    verdict = classify(status)
    assert verdict.kind is Kind.AUTH
    assert verdict.waits
    assert not verdict.retryable  # `gradwatch sync` stops: the same request fails until the token changes


def test_a_lost_run_is_created_again_and_waited_for():
    verdict = classify(404)
    assert verdict.kind is Kind.LOST_RUN
    assert verdict.waits
    assert not verdict.retryable


def test_too_large_is_split():
    verdict = classify(413)
    assert verdict.kind is Kind.TOO_LARGE
    assert not verdict.waits
    assert not verdict.retryable


@pytest.mark.parametrize("status", [500, 501, 505, 507, 599])
def test_other_server_errors_are_ambiguous(status):
    verdict = classify(status)
    assert verdict.kind is Kind.SERVER_ERROR
    assert verdict.retryable
    assert not verdict.waits


def test_a_custom_transports_own_exception_is_an_ambiguous_server_error():
    assert classify(None, transport_error=False).kind is Kind.SERVER_ERROR
    assert classify(400, transport_error=False).kind is Kind.SERVER_ERROR


@pytest.mark.parametrize("status", [300, 302, 400, 402, 405, 409, 410, 415, 422, 451])
def test_other_answers_refuse_the_batch(status):
    verdict = classify(status)
    assert verdict.kind is Kind.REFUSED
    assert not verdict.retryable
    assert not verdict.waits


@pytest.mark.parametrize("status", [None, 400, 401, 404, 408, 413, 500, 502, 504])
def test_retry_after_is_honoured_on_429_and_503_only(status):
    assert not classify(status).honours_retry_after
    assert classify(429).honours_retry_after
    assert classify(503).honours_retry_after


# -- pending -> sealed ----------------------------------------------------------------------------------


def fragment(step: int) -> dict:
    return {"scalars": [{"key": "loss", "steps": [step], "values": [1.0]}]}


def test_pending_fragments_wait_while_the_uploader_keeps_up():
    delivery = Delivery(spill_after=1.0, max_batch_points=100)
    assert delivery.seal_due(0.0, queued=0, closing=False) is None  # nothing pending
    delivery.add(fragment(0), 1, now=10.0)
    delivery.add(fragment(1), 1, now=10.5)
    assert delivery.pending_points == 2
    assert delivery.pending_since == 10.0  # the oldest fragment's
    assert delivery.seal_due(100.0, queued=0, closing=False) is None  # no backlog: the uploader seals
    assert delivery.seal_to_send(queued=0, collector_done=False) == Seal(persist=False)
    assert delivery.seal(11.0) == [fragment(0), fragment(1)]
    assert (delivery.pending, delivery.pending_points, delivery.sealed_at) == ([], 0, 11.0)


def test_a_full_batch_is_sealed_at_once():
    delivery = Delivery(max_batch_points=10)
    delivery.add(fragment(0), 10, now=0.0)
    assert delivery.seal_due(0.0, queued=0, closing=False) == Seal(persist=False)


def test_pending_data_behind_a_backlog_is_sealed_once_it_aged():
    delivery = Delivery(spill_after=1.0)
    delivery.add(fragment(0), 1, now=5.0)
    assert delivery.seal_due(5.9, queued=3, closing=False) is None
    assert delivery.seal_due(6.0, queued=3, closing=False) == Seal(persist=False)
    assert delivery.seal_to_send(queued=3, collector_done=False) is None  # the queue goes first


def test_a_closing_run_seals_its_final_counters_once_everything_is_stored():
    delivery = Delivery()
    assert not delivery.final_counters_due(closing=True, collector_done=True, queued=0)  # never sent
    delivery.add(fragment(0), 1, now=0.0)
    delivery.seal(1.0)
    assert not delivery.final_counters_due(closing=False, collector_done=True, queued=0)  # not finishing
    assert not delivery.final_counters_due(closing=True, collector_done=True, queued=1)  # one to send
    assert not delivery.final_counters_due(closing=True, collector_done=False, queued=0)
    assert delivery.final_counters_due(closing=True, collector_done=True, queued=0)
    assert not delivery.final_counters_due(closing=True, collector_done=True, queued=0)  # once
    assert not Delivery(online=False).final_counters_due(closing=True, collector_done=True, queued=0)


def test_nothing_is_sealed_on_hold():
    delivery = Delivery(max_batch_points=1)
    delivery.add(fragment(0), 5, now=0.0)
    assert delivery.seal_due(9.0, queued=0, closing=True, released=False) is None


def test_offline_pending_data_is_sealed_and_written_when_aged_or_closing():
    delivery = Delivery(online=False, spill_after=1.0)
    delivery.add(fragment(0), 1, now=0.0)
    assert delivery.seal_due(0.5, queued=0, closing=False) is None
    assert delivery.seal_due(0.5, queued=0, closing=True) == Seal(persist=True)
    assert delivery.seal_due(1.0, queued=0, closing=False) == Seal(persist=True)


def test_while_the_server_fails_pending_data_is_spooled_not_sent():
    delivery = failing_delivery()
    delivery.add(fragment(0), 1, now=0.0)
    assert delivery.seal_to_send(queued=0, collector_done=False) is None  # merged until spill_after
    assert delivery.seal_due(1.0, queued=0, closing=False) == Seal(persist=True)
    assert delivery.seal_to_send(queued=0, collector_done=True) == Seal(persist=True)  # nobody else will


def test_a_quiet_run_seals_a_keep_alive():
    delivery = Delivery()
    assert not delivery.keep_alive_due(1000.0, 60.0, queued=0)  # never sent anything yet
    delivery.add(fragment(0), 1, now=0.0)
    delivery.seal(0.0)
    assert not delivery.keep_alive_due(59.0, 60.0, queued=0)
    assert delivery.keep_alive_due(60.0, 60.0, queued=0)
    assert not delivery.keep_alive_due(60.0, 60.0, queued=1)
    assert not delivery.keep_alive_due(60.0, 60.0, queued=0, released=False)
    assert not Delivery(online=False, now=0.0).keep_alive_due(60.0, 60.0, queued=0)
    delivery.add(fragment(1), 1, now=60.0)
    assert not delivery.keep_alive_due(60.0, 60.0, queued=0)


# -- sealed -> in flight -> stored / split / dead-lettered / retried ------------------------------------


def failing_delivery(**options) -> Delivery:
    delivery = Delivery(**options)
    delivery.failed(1, classify(503))
    return delivery


def test_stored_leaves_the_queue_and_counts():
    delivery = Delivery(now=0.0)
    delivery.sending(7)
    assert delivery.in_flight == 7
    assert delivery.stored(7, 40, now=3.0) is False  # no outage ended
    assert (delivery.in_flight, delivery.sent_points, delivery.sent_batches) == (None, 40, 1)
    assert delivery.progress_at == 3.0


def test_a_failure_starts_spooling_once_and_a_store_ends_the_outage():
    delivery = Delivery()
    first = delivery.failed(1, classify(None))
    assert first == Decision(Action.RETRY, spool=True, backoff=True, reason="server error")
    assert delivery.failing
    assert delivery.failed(1, classify(502)).spool is False  # spooling already
    assert delivery.stored(1, 5, now=1.0) is True  # the server is back
    assert not delivery.failing


def test_retry_after_is_the_least_wait():
    delivery = Delivery()
    assert delivery.failed(1, classify(429), retry_after=12.0).at_least == 12.0
    assert delivery.failed(1, classify(503), retry_after=None).at_least == 0.0


@pytest.mark.parametrize("status", [None, 401, 403, 404, 408, 429, 502, 503, 504])
def test_waiting_never_ends_a_batch(status):
    delivery = Delivery()
    for _ in range(10 * (SERVER_ERROR_TRIES + REFUSAL_TRIES)):
        decision = delivery.failed(1, classify(status))
        assert decision.action is Action.RETRY
        assert decision.backoff


def test_a_too_large_batch_is_split():
    delivery = Delivery(now=0.0)
    delivery.sending(1)
    decision = delivery.failed(1, classify(413))
    assert decision == Decision(Action.SPLIT, reason="HTTP 413")
    assert not delivery.failing  # not the server's trouble: no spooling, no backoff
    delivery.split(now=2.0)
    assert delivery.progress_at == 2.0


def test_a_refused_batch_is_dead_lettered_after_its_tries():
    delivery = Delivery(now=0.0)
    for _ in range(REFUSAL_TRIES - 1):
        assert delivery.failed(1, classify(422)).action is Action.RETRY
    assert delivery.failed(1, classify(422)) == Decision(Action.DEAD_LETTER, reason="refused")
    assert delivery.dead_lettered(1, now=4.0) is False  # a real batch: to the file, a notice follows
    assert delivery.progress_at == 4.0
    delivery.notice_queued(2)
    assert delivery.notices == {2}


def test_the_tries_count_one_batch_in_a_row():
    delivery = Delivery(refusal_tries=2)
    assert delivery.failed(1, classify(422)).action is Action.RETRY
    assert delivery.failed(2, classify(422)).action is Action.RETRY  # another batch: counts anew
    assert delivery.failed(2, classify(422)).action is Action.DEAD_LETTER
    delivery.dead_lettered(2, now=0.0)
    assert delivery.failed(2, classify(422)).action is Action.RETRY  # restarted


def test_a_store_restarts_the_count():
    delivery = Delivery(refusal_tries=2)
    delivery.failed(1, classify(422))
    delivery.stored(1, 1, now=0.0)
    assert delivery.failed(1, classify(422)).action is Action.RETRY


def test_server_errors_probe_after_their_tries_and_a_stored_probe_dead_letters():
    delivery = Delivery()
    for _ in range(SERVER_ERROR_TRIES - 1):
        assert delivery.failed(1, classify(500)).action is Action.RETRY
    decision = delivery.failed(1, classify(500), retry_after=3.0)
    assert decision.action is Action.PROBE
    assert decision.backoff and decision.at_least == 3.0  # the wait, should the probe fail
    assert delivery.probed(1, stored=True) == Decision(Action.DEAD_LETTER)
    assert not delivery.failing  # the server takes batches
    assert delivery.sent_batches == 1  # the notice
    assert delivery.dead_lettered(1, now=0.0) is False


def test_a_failed_probe_keeps_the_batch_and_restarts_its_count():
    delivery = Delivery(server_error_tries=2)
    delivery.failed(1, classify(500))
    assert delivery.failed(1, classify(500)).action is Action.PROBE
    assert delivery.probed(1, stored=False) == Decision(Action.RETRY)
    assert delivery.failing
    assert delivery.failed(1, classify(500)).action is Action.RETRY  # counts anew
    assert delivery.failed(1, classify(500)).action is Action.PROBE


def test_a_notice_the_server_fails_is_dropped_not_probed():
    delivery = Delivery(server_error_tries=1)
    delivery.notice_queued(9)
    decision = delivery.failed(9, classify(500))
    assert decision.action is Action.DEAD_LETTER
    assert decision.backoff  # the failure counts toward the backoff all the same
    assert delivery.dead_lettered(9, now=0.0) is True  # a notice: only removed
    assert delivery.notices == set()


def test_a_stored_notice_is_forgotten():
    delivery = Delivery()
    delivery.notice_queued(9)
    delivery.stored(9, 0, now=0.0)
    assert delivery.notices == set()


def test_an_auth_or_unavailable_answer_never_counts_toward_dead_letters():
    delivery = Delivery(server_error_tries=1, refusal_tries=1)
    for status in (401, 503, 404, None):
        assert delivery.failed(1, classify(status)).action is Action.RETRY
    assert delivery.failed(1, classify(500)).action is Action.PROBE


def test_tries_below_one_are_refused():
    with pytest.raises(ValueError, match="server_error_tries and refusal_tries"):
        Delivery(server_error_tries=0)
    with pytest.raises(ValueError, match="refusal_tries"):
        Delivery(refusal_tries=0)


def test_progress_moves_with_packets_taken():
    delivery = Delivery(now=0.0)
    delivery.moved(5.0)
    assert delivery.progress_at == 5.0


def test_the_progress_line():
    assert progress_line("r", 10, 0, None, 30.0, None) is None  # nothing left
    assert (
        progress_line("r", 250, 750, None, 30.0, "HTTP 503")
        == "gradwatch: run r: uploading 1,000 points, 25%"
    )
    quiet = progress_line("r", 0, 10, 4.2, 30.0, "HTTP 503: busy")
    assert quiet == (
        "gradwatch: run r: uploading 10 points, 0%; the server has taken nothing for 4 s (HTTP 503: busy); "
        "giving up after 30 s"
    )
    assert progress_line("r", 0, 10, 4.0, 30.0, None) == (
        "gradwatch: run r: uploading 10 points, 0%; the server has taken nothing for 4 s; "
        "giving up after 30 s"
    )
