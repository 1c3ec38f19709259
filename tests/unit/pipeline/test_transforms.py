"""The pipeline's transforms on small hand-built event and journal frames."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from layer.pipeline.transforms import (
    Outcome,
    StoreState,
    Violation,
    counters,
    lifecycle,
    reconcile,
    store_state,
    violations,
)
from tests.unit.pipeline.frames import T0, acked, ev, frame, journal, leased, store


def healthy() -> list[dict[str, Any]]:
    """Offsets 0..4: acked first time, redelivered then acked, dead-lettered after a reject,
    still leased (pending), expired by its deadline without a delivery."""
    return [
        ev("ENQUEUED", 0, 0), leased(10, 0, "a", 1), acked(50, 0, "a", 1),
        ev("ENQUEUED", 0, 1), leased(10, 1, "a", 1),
        ev("LEASE_EXPIRED", 1000, 1, consumer_id="a", delivery_count=1, reason="deadline"),
        leased(1010, 1, "b", 2), acked(1100, 1, "b", 2),
        ev("ENQUEUED", 0, 2), leased(20, 2, "b", 1),
        ev("REJECTED", 30, 2, consumer_id="b", delivery_count=1, reason="bad order"),
        ev("DEAD_LETTERED", 30, 2, delivery_count=1, reason="rejected"),
        ev("EXPIRED", 30, 2, delivery_count=1, reason="rejected"),
        ev("ENQUEUED", 0, 3), leased(40, 3, "a", 1),
        ev("ENQUEUED", 0, 4), ev("EXPIRED", 5000, 4, delivery_count=0, reason="expiration"),
    ]


def by_bookmark(frame: DataFrame) -> dict[int, dict[str, Any]]:
    return {row["offset"]: row.asDict(recursive=True) for row in frame.collect()}


def test_lifecycle_has_one_row_per_entry_with_its_deliveries_and_outcome(
    spark: SparkSession,
) -> None:
    rows = by_bookmark(lifecycle(frame(spark, healthy())))
    assert sorted(rows) == [0, 1, 2, 3, 4]
    first, redelivered, dead, pending, expired = (rows[i] for i in range(5))

    assert first["outcome"] == Outcome.ACKED
    assert first["outcome_consumer_id"] == "a"
    assert (first["enqueued_ms"], first["record_timestamp_ms"]) == (T0, T0 - 5)
    assert (first["time_in_queue_ms"], first["processing_time_ms"]) == (50, 40)

    assert [(d["consumer_id"], d["timestamp_ms"] - T0, d["delivery_count"])
            for d in redelivered["deliveries"]] == [("a", 10, 1), ("b", 1010, 2)]
    assert redelivered["delivery_count"] == 2
    assert (redelivered["time_in_queue_ms"], redelivered["processing_time_ms"]) == (1100, 90)

    assert (dead["outcome"], dead["outcome_reason"]) == (Outcome.DEAD_LETTERED, "rejected")
    assert (pending["outcome"], pending["outcome_ms"], pending["time_in_queue_ms"]) == (
        Outcome.PENDING, None, None)
    assert (expired["outcome"], expired["outcome_reason"]) == (Outcome.EXPIRED, "expiration")
    assert (expired["delivery_count"], expired["processing_time_ms"]) == (0, None)
    assert {r["outcome_count"] for r in rows.values()} == {0, 1}


def test_at_most_once_and_barrier_outcomes(spark: SparkSession) -> None:
    rows = by_bookmark(lifecycle(frame(spark, [
        ev("ENQUEUED", 0, 0), ev("DELIVERED_AT_MOST_ONCE", 7, 0, consumer_id="a"),
        ev("ENQUEUED", 0, 1), ev("BARRIER_DELIVERED", 9, 1),
    ])))
    assert (rows[0]["outcome"], rows[0]["delivery_count"], rows[0]["time_in_queue_ms"]) == (
        Outcome.AT_MOST_ONCE, 1, 7)
    assert rows[0]["deliveries"][0]["consumer_id"] == "a"
    assert (rows[1]["outcome"], rows[1]["delivery_count"]) == (Outcome.BARRIER, 0)


def test_an_at_most_once_delivery_refused_as_too_large_is_dead_lettered(
        spark: SparkSession) -> None:
    """The broker refused the delivery an iteration after the entry left the queue: one
    DEAD_LETTERED follows its DELIVERED_AT_MOST_ONCE, and no second outcome. The audit says
    dead-lettered (why: too_large), with nothing to report against it."""
    events = [ev("ENQUEUED", 0, 0), ev("DELIVERED_AT_MOST_ONCE", 7, 0, consumer_id="a",
                                       reason="delivery"),
              ev("DEAD_LETTERED", 20, 0, delivery_count=1, reason="too_large"),
              ev("ENQUEUED", 0, 1), ev("DELIVERED_AT_MOST_ONCE", 8, 1, consumer_id="a",
                                       reason="delivery")]
    rows = by_bookmark(lifecycle(frame(spark, events)))
    assert [(rows[o]["outcome"], rows[o]["outcome_reason"], rows[o]["outcome_count"])
            for o in (0, 1)] == [(Outcome.DEAD_LETTERED, "too_large", 1),
                                 (Outcome.AT_MOST_ONCE, "delivery", 1)]
    reconciled = by_bookmark(reconcile(frame(spark, events), journal(spark, range(2)), "Q"))
    assert [(r["status"], r["violations"]) for r in reconciled.values()] == [
        ("done", []), ("done", [])]
    totals = counters(frame(spark, events)).collect()[0].asDict()
    assert (totals["dead_lettered"], totals["expired"]) == (1, 0)


def test_a_repeated_enqueued_after_a_restart_counts_once(spark: SparkSession) -> None:
    events = [*healthy(), ev("ENQUEUED", 3000, 3, coordinator_epoch=2)]
    rows = by_bookmark(lifecycle(frame(spark, events)))
    assert rows[3]["enqueued_ms"] == T0
    reconciled = reconcile(frame(spark, events), journal(spark, range(5)), "Q")
    assert violations(reconciled).count() == 0
    totals = counters(frame(spark, events)).collect()[0].asDict()
    assert totals["enqueued"] == 5


def test_a_healthy_queue_reconciles_with_one_pending_entry(spark: SparkSession) -> None:
    reconciled = by_bookmark(reconcile(frame(spark, healthy()), journal(spark, range(5)), "Q"))
    assert {o: r["status"] for o, r in reconciled.items()} == {
        0: "done", 1: "done", 2: "done", 3: "pending", 4: "done"}
    assert all(r["violations"] == [] for r in reconciled.values())


@pytest.mark.parametrize(("injected", "offset", "violation"), [
    ([acked(60, 0, "a", 1)], 0, Violation.ACKED_TWICE),
    ([leased(2000, 1, "c", 3)], 1, Violation.DELIVERED_AFTER_ACK),
    ([ev("EXPIRED", 70, 0, reason="expiration")], 0, Violation.SEVERAL_OUTCOMES),
])
def test_an_injected_violation_is_found_and_named(
    spark: SparkSession, injected: list[dict[str, Any]], offset: int, violation: str,
) -> None:
    reconciled = reconcile(frame(spark, healthy() + injected), journal(spark, range(5)), "Q")
    found = [(r["offset"], r["violation"]) for r in violations(reconciled).collect()]
    assert found == [(offset, violation)]
    statuses = by_bookmark(reconciled)
    assert statuses[offset]["status"] == "violation"


def test_a_missing_outcome_is_found(spark: SparkSession) -> None:
    # Offset 2 without its EXPIRED: dead-lettered, so gone from the queue, yet no outcome.
    events = [e for e in healthy() if not (e["offset"] == 2 and e["type"] == "EXPIRED")]
    reconciled = reconcile(frame(spark, events), journal(spark, range(5)), "Q")
    assert [(r["offset"], r["violation"]) for r in violations(reconciled).collect()] == [
        (2, Violation.MISSING_OUTCOME)]


def test_an_entry_never_enqueued_is_found(spark: SparkSession) -> None:
    events = [e for e in healthy() if not (e["offset"] == 0 and e["type"] == "ENQUEUED")]
    reconciled = reconcile(frame(spark, events), journal(spark, range(5)), "Q")
    assert [(r["offset"], r["violation"]) for r in violations(reconciled).collect()] == [
        (0, Violation.MISSING_ENQUEUED)]


def test_reconcile_keeps_to_its_queue_and_journal_time_range(spark: SparkSession) -> None:
    other = [ev("ENQUEUED", 0, 0, queue="Other"), acked(5, 0, "x", 1) | {"queue": "Other"},
             acked(6, 0, "x", 1) | {"queue": "Other"}]
    records = journal(spark, range(3), at=0).unionByName(journal(spark, range(3, 5), at=10_000))
    reconciled = reconcile(frame(spark, healthy() + other), records, "Q",
                           start_ms=T0, end_ms=T0 + 10_000)
    # Other's double ack is not Q's; offsets 3 and 4 were journaled after the range.
    assert sorted(by_bookmark(reconciled)) == [0, 1, 2]
    assert violations(reconciled).count() == 0
    # Records the queue never admitted (no events: refused by its filter) are not its entries.
    assert reconcile(frame(spark, healthy()), journal(spark, range(9)), "Q").count() == 5


# healthy() as PostgreSQL keeps it: 0-2 done below the recovery point, 3 leased by a run
# (its ENQUEUED-time AVAILABLE row superseded), 4 an EXPIRED row.
CONSISTENT = (3, [(3, "AVAILABLE", 10), (3, "LEASED", 11), (4, "EXPIRED", 12)])


def three_way(spark: SparkSession, events: list[dict[str, Any]], recovery_point: int | None,
              rows: list[tuple[int, str, int]], offsets: range = range(5),
              **kwargs: Any) -> DataFrame:
    state = store_state(store(spark, recovery_point, rows))
    return reconcile(frame(spark, events), journal(spark, offsets), "Q", store=state,
                     queue_has_filter=False, **kwargs)


def found(reconciled: DataFrame) -> list[tuple[int, str]]:
    return sorted((r["offset"], r["violation"]) for r in violations(reconciled).collect())


def test_three_sources_that_agree_give_no_violation(spark: SparkSession) -> None:
    reconciled = by_bookmark(three_way(spark, healthy(), *CONSISTENT))
    assert {o: (r["status"], r["store_state"]) for o, r in reconciled.items()} == {
        0: ("done", StoreState.DONE), 1: ("done", StoreState.DONE),
        2: ("done", StoreState.DONE), 3: ("pending", StoreState.LEASED),
        4: ("done", StoreState.DONE)}
    assert all(r["violations"] == [] for r in reconciled.values())


@pytest.mark.parametrize(("recovery_point", "rows", "expected"), [
    # PostgreSQL acked 3 (a later write than its lease): no ACKED event says so.
    (3, [*CONSISTENT[1], (3, "ACKED", 20)], [(3, Violation.STORE_ACKED_NO_ACKED_EVENT)]),
    # The recovery point passed 3: done in PostgreSQL, no outcome in the events.
    (4, [(4, "EXPIRED", 12)], [(3, Violation.STORE_DONE_NO_OUTCOME)]),
    # 4 expired by the events, but PostgreSQL has no row for it above the recovery point.
    (3, [(3, "LEASED", 11)], [(4, Violation.OUTCOME_NOT_IN_STORE)]),
    # 3 released in PostgreSQL (the latest write), still leased by the events.
    (3, [*CONSISTENT[1], (3, "AVAILABLE", 30)], [(3, Violation.LEASE_DIFFERS)]),
])
def test_a_disagreement_with_postgresql_is_named(
    spark: SparkSession, recovery_point: int, rows: list[tuple[int, str, int]],
    expected: list[tuple[int, str]],
) -> None:
    assert found(three_way(spark, healthy(), recovery_point, rows)) == expected


def test_a_journal_record_the_queue_must_have_admitted_without_events_is_named(
    spark: SparkSession,
) -> None:
    # 5 and 6 have no event; 7 was admitted after them, so the queue read past them. 6 is a
    # delete (never an entry); 8, after the last admitted record, may not be read yet.
    events = [*healthy(), ev("ENQUEUED", 0, 7), acked(9, 7, "a", 0)]
    records = journal(spark, range(9), values={6: None})
    state = store_state(store(spark, *CONSISTENT))
    reconciled = reconcile(frame(spark, events), records, "Q", store=state,
                           queue_has_filter=False)
    assert found(reconciled) == [(5, Violation.NO_EVENTS), (7, Violation.OUTCOME_NOT_IN_STORE)]
    assert by_bookmark(reconciled)[5]["bookmark"] == "orders/0/5"
    # A filter may have turned 5 away: nothing to say about it.
    filtered = reconcile(frame(spark, events), records, "Q", store=state,
                         queue_has_filter=True)
    assert found(filtered) == [(7, Violation.OUTCOME_NOT_IN_STORE)]
    # PostgreSQL has a row for 8 (it was delivered): it must have events, filter or not.
    touched = store_state(store(spark, 3, [*CONSISTENT[1], (8, "LEASED", 40)]))
    assert found(reconcile(frame(spark, events), records, "Q", store=touched,
                           queue_has_filter=True)) == [
        (7, Violation.OUTCOME_NOT_IN_STORE), (8, Violation.NO_EVENTS)]


def test_events_for_a_record_that_never_existed_are_named(spark: SparkSession) -> None:
    forged = [ev("ENQUEUED", 0, 9), acked(5, 9, "a", 1)]
    gap = [e for e in healthy() if e["offset"] != 4] + [ev("ENQUEUED", 0, 4)]
    # Past the journal's end (read to its end): never written.
    assert found(three_way(spark, healthy() + forged, *CONSISTENT)) == [
        (9, Violation.UNKNOWN_RECORD)]
    # Inside the journal's span, where no record is (an aborted write, a control marker).
    reconciled = reconcile(frame(spark, gap), journal(spark, [0, 1, 2, 3, 5]), "Q")
    assert found(reconciled) == [(4, Violation.UNKNOWN_RECORD)]
    # After the end of a closed range: not this audit's to judge.
    ranged = reconcile(frame(spark, healthy() + forged), journal(spark, range(5)), "Q",
                       start_ms=T0, end_ms=T0 + 1)
    assert found(ranged) == []


def test_counters_recomputed_from_events(spark: SparkSession) -> None:
    totals = counters(frame(spark, healthy())).collect()[0].asDict()
    assert totals == {"queue": "Q", "enqueued": 5, "delivered": 5, "redelivered": 1,
                      "acked": 2, "released": 0, "lease_expired": 1, "rejected": 1,
                      "expired": 1, "dead_lettered": 1}


def test_a_repeated_enqueued_after_a_lease_leaves_the_entry_leased(spark: SparkSession) -> None:
    # A restarted coordinator announced 3 again at 3000, after its lease at 40: only the first
    # ENQUEUED counts, so the entry is still leased, as PostgreSQL says (no lease_differs),
    # and pending, its last event the lease (the per-entry aggregation's deduplication).
    events = [*healthy(), ev("ENQUEUED", 3000, 3, coordinator_epoch=2)]
    reconciled = reconcile(frame(spark, events), journal(spark, range(5)), "Q",
                           store=store_state(store(spark, *CONSISTENT)))
    assert found(reconciled) == []
    assert by_bookmark(reconciled)[3]["status"] == "pending"
    entries = by_bookmark(lifecycle(frame(spark, events)))
    assert (entries[3]["enqueued_ms"], entries[3]["outcome"]) == (T0, "pending")


def test_a_queue_of_several_parts_reconciles_as_one_queue(spark: SparkSession) -> None:
    """Issue 32: the parts of a queue (partition p is part p mod 2) are served by two
    coordinators, each writing the events of its part's partitions, interleaved in the
    events topic. Events name the queue, never the part: lifecycle and reconcile see one
    queue, and the audit balances."""
    from datetime import UTC, datetime

    def part_event(kind: str, at: int, partition: int, offset: int,
                   **fields: Any) -> dict[str, Any]:
        return ev(kind, at, offset, bookmark=f"orders/{partition}/{offset}",
                  partition=partition, coordinator_id=f"coordinator-{partition % 2}",
                  coordinator_epoch=3 + partition % 2, **fields)

    events = sorted(
        (e for p in range(4) for o in range(3) for e in (
            part_event("ENQUEUED", 10 * o + p, p, o),
            part_event("LEASED", 10 * o + p + 1, p, o, consumer_id="c", session_id="s",
                       delivery_count=1, lease_expires_ms=T0 + 60_000),
            part_event("ACKED", 10 * o + p + 2, p, o, consumer_id="c", delivery_count=1))),
        key=lambda e: e["timestamp_ms"])
    when = datetime.fromtimestamp(T0 / 1000, UTC)
    records = spark.createDataFrame(
        [("orders", p, o, when, b"{}") for p in range(4) for o in range(3)],
        "topic string, partition int, offset long, timestamp timestamp, value binary")
    reconciled = reconcile(frame(spark, events), records, "Q").collect()
    assert len(reconciled) == 12
    assert {r["status"] for r in reconciled} == {"done"}
    assert all(r["violations"] == [] for r in reconciled)
    assert counters(frame(spark, events)).collect()[0].asDict()["acked"] == 12
