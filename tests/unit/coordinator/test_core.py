"""The shard core without Kafka or PostgreSQL: records in, a plan out (`ShardCore.step`).

Records are encoded as consumers encode them (`Codec`); the only port the core uses is a
`FakeTopicAdmin`. A hypothesis state machine drives random subscribes, publishes, acks,
releases, unsubscribes and time through `step` and checks what a user would: no entry leased
to two consumers at once, nothing delivered after its ack, and, once everyone acks, every
published record acked exactly once.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layer.coordinator.acks import MAX_FORWARD_HOPS
from layer.coordinator.catalog import Catalog
from layer.coordinator.core import Plan, QueueState, ShardCore
from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.output import Output
from layer.coordinator.ports import FakeTopicAdmin
from layer.coordinator.refused import Refused
from layer.coordinator.translate import wire_events
from layer.domain import events as ev
from layer.domain.definitions import QueueDefinition
from layer.domain.states import Bookmark
from layer.kafka import JournalRecord
from layer.protocol import (
    AcceptGroup,
    AcceptRecord,
    AckItem,
    AckRecord,
    AckResult,
    AckStatus,
    AckType,
    Codec,
    Event,
    EventType,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    TopicNames,
    Unsubscribe,
    forwarded_headers,
    forwarded_hops,
)
from layer.store.rows import ConsumerRow, EntryRow, QueueRecord
from tests.support.examples import examples

TOPICS = TopicNames("qt.")
CODEC = Codec()
JOURNAL = "work"


def _queue(name: str, shard: int, **extra: Any) -> QueueRecord:
    return QueueRecord(name=name, definition={"name": name, "underlying_topic": JOURNAL,
                                              **extra},
                       version=1, created_at=0.0, updated_at=0.0, shard=shard)


class Harness:
    """A core serving queue Work (shard 0), with the records consumers would write."""

    def __init__(self, *others: QueueRecord, lease_period: str = "30s",
                 payload_budget: int | None = None) -> None:
        work = _queue("Work", 0, lease_period=lease_period)
        self.catalog = Catalog.of(2, [work, *others], [], now=0.0)
        self.admin = FakeTopicAdmin({JOURNAL: 1, TOPICS.control: 2, TOPICS.ack: 2})
        counter = itertools.count()
        # The Python core, whose plans these tests read; the native one is held to it by
        # tests/unit/coordinator/test_native_core.py.
        options = CoordinatorOptions(owner_id="test", core="python") if payload_budget is None \
            else CoordinatorOptions(owner_id="test", core="python", payload_budget=payload_budget)
        self.core = ShardCore(0, options, topics=TOPICS,
                              catalog=lambda: self.catalog, admin=self.admin,
                              tokens=lambda: f"tok{next(counter)}", owner_id="test")
        self.core.epoch = 1
        self.core.add_queue(QueueState(QueueDefinition.from_mapping(work.definition), 1, [],
                                       {(JOURNAL, 0): 0}, {}, {}, {(JOURNAL, 0): 0}), [], 0.0)
        self.offsets: dict[str, int] = {}

    def _record(self, topic: str, value: bytes | None, key: bytes | None = None,
                headers: list[tuple[str, bytes | None]] | None = None,
                partition: int = 0) -> JournalRecord:
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        return JournalRecord(topic, partition, offset, key, value, 1, headers)

    def publish(self, n: int) -> list[JournalRecord]:
        start = self.offsets.get(JOURNAL, 0)
        return [self._record(JOURNAL, json.dumps({"n": start + i}).encode()) for i in range(n)]

    def subscribe(self, consumer: str, backlog: int = 2, queue: str = "Work",
                  regex: bool = False, filter: str | None = None) -> JournalRecord:
        return self._record(TOPICS.control, CODEC.encode_control(Subscribe(
            consumer_id=consumer, session_id=f"s-{consumer}", request_id="r", queue=queue,
            queue_is_regex=regex, max_backlog=backlog, filter=filter,
            delivery_topic=TOPICS.delivery(consumer), session_timeout_ms=600_000,
            client_name="test", client_version="0", sent_at_ms=0)), consumer.encode())

    def unsubscribe(self, consumer: str) -> JournalRecord:
        return self._record(TOPICS.control, CODEC.encode_control(Unsubscribe(
            consumer_id=consumer, session_id=f"s-{consumer}", sent_at_ms=0)), consumer.encode())

    def ack(self, consumer: str, leases: list[ev.EntryLeased], kind: AckType = AckType.ACCEPT,
            queue: str = "Work", hops: int = 0) -> JournalRecord:
        items = tuple(AckItem(queue=queue, bookmark=f"{d.bookmark.topic}/{d.bookmark.partition}/"
                              f"{d.bookmark.offset}", lease=d.token, type=kind) for d in leases)
        return self._record(TOPICS.ack, CODEC.encode_ack(AckRecord(
            consumer_id=consumer, session_id=f"s-{consumer}", sent_at_ms=0, items=items)),
            consumer.encode(), forwarded_headers(hops) if hops else None)

    def accept(self, consumer: str, leases: list[ev.EntryLeased], queue: str = "Work",
               topic: str = JOURNAL, token: str | None = None) -> JournalRecord:
        """ACCEPT of these leases as one AcceptRecord (protocol 3), per partition."""
        groups: dict[int, list[ev.EntryLeased]] = {}
        for d in leases:
            groups.setdefault(d.bookmark.partition, []).append(d)
        return self._record(TOPICS.ack, CODEC.encode_accept(AcceptRecord(
            consumer_id=consumer, session_id=f"s-{consumer}", sent_at_ms=0, groups=tuple(
                AcceptGroup(queue=queue, topic=topic, partition=p,
                            offsets=tuple(d.bookmark.offset for d in ds),
                            leases=tuple(token or d.token for d in ds))
                for p, ds in groups.items()))), consumer.encode())

    def held_elsewhere(self, consumer: str, queue: str, shard: int, now: float) -> None:
        """A catalog loaded at ``now`` in which another shard holds the consumer's session
        (its ack records are passed on there; those of sessions no shard has are dropped)."""
        self.catalog = Catalog.of(2, [*self.catalog.queues.values()], [ConsumerRow(
            consumer_id=consumer, session_id=f"s-{consumer}", queue=queue, is_regex=False,
            delivery_topic=TOPICS.delivery(consumer), session_timeout_ms=600_000,
            subscribed_at=now, last_heartbeat_at=now, shard=shard)], now=now)

    def step(self, records: list[JournalRecord], now: float) -> Plan:
        plan = self.core.step(records, now)
        self.core.settled(plan)
        return plan


def _lease(queue: str) -> ev.EntryLeased:
    return ev.EntryLeased(queue, Bookmark(JOURNAL, 0, 0), "c2", "d", "tok", 0.0, 1, 0.0)


def _replies(plan: Plan) -> list[object]:
    return [CODEC.decode_reply(r.value) for r in plan.replies if r.value is not None]


def _leases(plan: Plan) -> list[ev.EntryLeased]:
    return [d for d in plan.deliveries if isinstance(d, ev.EntryLeased)]


def test_subscribe_deliver_ack_is_one_plan_each_with_its_batch() -> None:
    h = Harness()
    plan = h.step([h.subscribe("c1", backlog=2), *h.publish(3)], 1.0)
    (reply,) = _replies(plan)
    assert isinstance(reply, SubscribeResult) and reply.status is SubscribeStatus.OK
    assert [g.queue for g in reply.queues] == ["Work"]
    # The reply says which shard answered: the consumer writes to that partition from now on.
    assert ("qlayer.shard", b"0") in list(plan.replies[0].headers or [])
    leased = _leases(plan)
    assert [d.bookmark.offset for d in leased] == [0, 1]  # backlog 2
    assert plan.batch.input_positions == {(TOPICS.control, 0): 1}
    acked = h.step([h.ack("c1", leased)], 2.0)
    assert [d.bookmark.offset for d in _leases(acked)] == [2]
    assert sorted(b.offset for b in acked.done) == [0, 1]
    assert acked.batch.recovery_points == {("Work", JOURNAL, 0): 2}
    assert _replies(acked) == []  # accepted acks are not answered


def test_a_filter_subscribed_after_records_passed_the_memory_window_gets_them() -> None:
    """Past the payload budget a record keeps only the fields the queues' expressions read
    when it arrived (none here). A filter subscribed later is not decided on null: the records
    are read again (the loop's I/O, `refresh_documents`) and then matched."""
    h = Harness(payload_budget=0)
    published = h.publish(5)
    h.step(published, 1.0)
    assert h.core.counters["documents_projected"] == 5
    plan = h.step([h.subscribe("c1", backlog=5, filter="/n >= 3")], 2.0)
    assert _leases(plan) == []
    assert plan.wanted_documents == [Bookmark(JOURNAL, 0, o) for o in range(5)]
    records = {Bookmark(r.topic, r.partition, r.offset): r for r in published}
    assert h.core.refresh_documents(records) == 5
    assert [d.bookmark.offset for d in _leases(h.step([], 3.0))] == [3, 4]
    assert h.core.counters["documents_reread"] == 5


def test_a_tombstone_in_the_journal_is_passed_over() -> None:
    """AMPS: "Only publish messages are added to the queue." A record with a null value (a
    Kafka tombstone, a delete) gets no entry and no event, and does not hold the queue's
    recovery point back."""
    h = Harness()
    records = [*h.publish(1), h._record(JOURNAL, None, b"k"), *h.publish(1)]
    plan = h.step([h.subscribe("c1", backlog=5), *records], 1.0)
    leased = _leases(plan)
    assert [d.bookmark.offset for d in leased] == [0, 2]
    enqueued = [o for e in plan.events if isinstance(e, ev.EntriesEnqueued) for o in e.offsets]
    assert enqueued == [0, 2]
    assert h.core.counters["deletes_passed_over"] == 1
    acked = h.step([h.ack("c1", leased)], 2.0)
    assert acked.batch.recovery_points == {("Work", JOURNAL, 0): 3}


def test_a_delivery_topic_kafka_refuses_makes_the_subscribe_refused() -> None:
    h = Harness()
    h.admin.refuse.add(TOPICS.delivery("c1"))
    plan = h.step([h.subscribe("c1"), *h.publish(1)], 1.0)
    (reply,) = _replies(plan)
    assert isinstance(reply, SubscribeResult)
    assert reply.status is SubscribeStatus.INVALID_REQUEST
    assert "cannot use delivery_topic" in (reply.message or "")
    assert plan.deliveries == [] and h.core.sessions == {}


def test_records_of_another_shard_are_passed_on_to_its_partition() -> None:
    h = Harness(_queue("Elsewhere", 1))
    plan = h.step([h.subscribe("c2", queue="Elsewhere")], 1.0)
    assert plan.replies == []
    (forwarded,) = plan.forwards
    assert (forwarded.topic, forwarded.partition) == (TOPICS.control, 1)
    assert forwarded_hops(forwarded.headers) == 1
    h.held_elsewhere("c2", "Elsewhere", 1, 1.5)  # shard 1 accepted it
    acks = h.step([h.ack("c2", [_lease("Elsewhere")], queue="Elsewhere")], 2.0)
    assert [(r.topic, r.partition) for r in acks.forwards] == [(TOPICS.ack, 1)]
    assert _replies(acks) == []  # shard 1 answers it, not this one


def test_an_ack_record_of_no_session_is_dropped_unread_once_the_catalog_is_fresh() -> None:
    h = Harness(_queue("Elsewhere", 1))
    record = h.ack("ghost", [_lease("Elsewhere")], queue="Elsewhere")
    waiting = h.step([record], 1.0)
    # The catalog was loaded before the record came: it waits for a fresher one, its
    # position not stored past it, and the process is asked for a load.
    assert waiting.forwards == [] and waiting.input_offsets == {}
    assert h.core.waiting and h.core.control.wants_catalog
    h.catalog = Catalog.of(2, [*h.catalog.queues.values()], [], now=1.5)
    plan = h.step([], 2.0)
    assert plan.forwards == [] and _replies(plan) == []
    assert plan.input_offsets == {(TOPICS.ack, 0): record.offset + 1}
    assert h.core.counters["identity_refused_ack_unknown_session"] == 1
    assert not h.core.waiting


def test_a_record_passed_on_too_often_is_answered_where_it_is() -> None:
    h = Harness(_queue("Elsewhere", 1))
    h.step([h.subscribe("c2")], 0.5)  # a session here: records of unknown ones are not acted on
    plan = h.step([h.ack("c2", [_lease("Elsewhere")], queue="Elsewhere",
                         hops=MAX_FORWARD_HOPS)], 1.0)
    assert plan.forwards == []
    (reply,) = _replies(plan)
    assert isinstance(reply, AckResult)
    assert [i.status for i in reply.items] == [AckStatus.UNKNOWN_ENTRY]


def test_a_regex_over_queues_of_two_shards_without_credit_is_refused() -> None:
    # A consumer of protocol 7 or earlier cannot hold one backlog over two shards.
    h = Harness(_queue("Worker", 1))
    plan = h.step([h.subscribe("c3", queue="Work.*", regex=True)], 1.0)
    (reply,) = _replies(plan)
    assert isinstance(reply, SubscribeResult)
    assert reply.status is SubscribeStatus.INVALID_REQUEST
    assert "protocol 8" in (reply.message or "")


def test_an_accept_record_settles_many_leases_and_answers_only_the_refused() -> None:
    h = Harness()
    plan = h.step([h.subscribe("c1", backlog=4), *h.publish(6)], 1.0)
    leased = _leases(plan)
    assert len(leased) == 4
    # Two accepted; one with a forged token (refused, still leased); one twice (DUPLICATE).
    good = h.step([h.accept("c1", leased[:2])], 2.0)
    assert sorted(b.offset for b in good.done) == [0, 1] and _replies(good) == []
    assert good.stats.ack_items == 2
    forged = h.step([h.accept("c1", [leased[2]], token="not-the-token"),
                     h.accept("c1", [leased[0]])], 3.0)
    statuses = [i.status for r in _replies(forged) if isinstance(r, AckResult) for i in r.items]
    assert statuses == [AckStatus.WRONG_TOKEN, AckStatus.DUPLICATE]
    assert forged.done == []
    assert h.core.counters["ack_ok"] == 2


def test_an_accept_record_the_fast_path_cannot_take_goes_the_general_way() -> None:
    h = Harness(_queue("Elsewhere", 1))
    plan = h.step([h.subscribe("c1", backlog=2), *h.publish(2)], 1.0)
    leased = _leases(plan)
    # A topic no Kafka topic could be named: each item INVALID, answered.
    bad = h.step([h.accept("c1", leased, topic="no/slashes")], 2.0)
    statuses = [i.status for r in _replies(bad) if isinstance(r, AckResult) for i in r.items]
    assert statuses == [AckStatus.INVALID, AckStatus.INVALID]
    # Another shard's queue: passed on, unchanged, to its partition.
    h.held_elsewhere("c2", "Elsewhere", 1, 2.5)
    away = h.step([h.accept("c2", [_lease("Elsewhere")], queue="Elsewhere")], 3.0)
    assert [(r.topic, r.partition) for r in away.forwards] == [(TOPICS.ack, 1)]
    assert CODEC.decode_ack_topic(away.forwards[0].value).items[0].queue == "Elsewhere"
    # And the leases are still there to accept properly.
    ok = h.step([h.accept("c1", leased)], 4.0)
    assert sorted(b.offset for b in ok.done) == [0, 1]


def _restored(offsets: list[int]) -> Harness:
    """A core restarted with leases on these offsets held by c1: its journal replay starts at
    offset 0 (nothing is done), so the leased entries are re-read last."""
    h = Harness()
    h.core.drop_queue("Work")
    row = ConsumerRow(consumer_id="c1", session_id="s-c1", queue="Work", is_regex=False,
                      delivery_topic=TOPICS.delivery("c1"), session_timeout_ms=600_000,
                      subscribed_at=0.0, last_heartbeat_at=0.0, max_backlog=5)
    entries = [EntryRow("Work", JOURNAL, 0, o, "LEASED", 1, 0, "c1", f"tok-{o}", 1e9)
               for o in offsets]
    work = QueueDefinition.from_mapping({"name": "Work", "underlying_topic": JOURNAL,
                                         "lease_period": "10m"})
    h.core.add_queue(QueueState(work, 1, entries, {(JOURNAL, 0): 0}, {}, {},
                                {(JOURNAL, 0): 0}), [row], 0.0)
    h.core.restore_sessions([row], 0.0)
    return h


def _held(offsets: list[int]) -> list[ev.EntryLeased]:
    return [ev.EntryLeased("Work", Bookmark(JOURNAL, 0, o), "c1", TOPICS.delivery("c1"),
                           f"tok-{o}", 1e9, 1, 0.0) for o in offsets]


def test_acks_read_before_the_replay_reaches_their_entries_wait_and_apply() -> None:
    # After a restart the ack partition is read with the journals: an ack for a restored lease
    # can come before the replay re-reads its entry. Refused, the consumer would lose its ack
    # and get the message again when the lease ran out; it waits for the replay instead.
    for ack in (Harness.ack, Harness.accept):  # protocol 2 items, protocol 3 AcceptRecords
        h = _restored([3, 4])
        early = h.step([ack(h, "c1", _held([3, 4]))], 1.0)
        assert _replies(early) == [] and early.done == []
        assert h.core.counters["acks_deferred_for_replay"] == 2
        # The ack partition's position is not stored past the waiting record (the next read
        # stays at it): a crash now reads it again.
        assert early.batch.input_positions[(TOPICS.ack, 0)] == 0
        first = h.step(h.publish(3), 2.0)  # offsets 0..2: not there yet
        assert first.done == [] and _replies(first) == []
        h.step(h.publish(2), 3.0)  # offsets 3 and 4 re-read: the acks apply at the next step
        replayed = h.step([], 3.1)
        assert sorted(b.offset for b in replayed.done) == [3, 4]
        assert _replies(replayed) == []
        assert h.core.counters["ack_ok"] == 2
        assert replayed.batch.input_positions.get((TOPICS.ack, 0)) == 1


def test_a_passed_on_ack_read_twice_before_the_replay_is_not_answered_duplicate() -> None:
    # A queue moved to this shard: the old shard passes the consumer's acks on, is fenced by
    # the move, rebuilds and passes the same record on again (it is written before the
    # position past it is stored). Both copies can arrive while this shard's replay has not
    # re-read the entries yet, so both wait; when they apply, the second copy's DUPLICATE is
    # not news to the consumer (it was seen in CI as "already-done" answers to held leases).
    h = _restored([3, 4])
    early = h.step([h.ack("c1", _held([3, 4]), hops=1), h.ack("c1", _held([3, 4]), hops=1)],
                   1.0)
    assert _replies(early) == [] and early.done == []
    assert h.core.counters["acks_deferred_for_replay"] == 4
    h.step(h.publish(5), 2.0)
    replayed = h.step([], 2.1)
    assert sorted(b.offset for b in replayed.done) == [3, 4]
    assert _replies(replayed) == []
    assert h.core.counters["ack_ok"] == 2
    assert h.core.counters["ack_duplicate_forwarded"] == 2
    # A consumer's own repeated ack (not passed on) that waited is still answered DUPLICATE.
    h2 = _restored([3])
    h2.step([h2.ack("c1", _held([3])), h2.ack("c1", _held([3]))], 1.0)
    h2.step(h2.publish(4), 2.0)
    statuses = [i.status for r in _replies(h2.step([], 2.1)) if isinstance(r, AckResult)
                for i in r.items]
    assert statuses == [AckStatus.DUPLICATE]


def _refusal_harness() -> tuple[Harness, dict[tuple[str, int], ev.EntryLeased]]:
    """Work (at-least-once) and Fast (at-most-once) over the same journal, each with a
    consumer, given three records: Work's takes them all, Fast's (backlog 2) the first two."""
    fast = _queue("Fast", 0, semantics="at-most-once")
    h = Harness(fast)
    h.core.add_queue(QueueState(QueueDefinition.from_mapping(fast.definition), 1, [],
                                {(JOURNAL, 0): 0}, {}, {}, {(JOURNAL, 0): 0}), [], 0.0)
    plan = h.step([h.subscribe("w", backlog=5), h.subscribe("f", backlog=2, queue="Fast"),
                   *h.publish(3)], 1.0)
    leases = {(d.queue, d.bookmark.offset): d for d in _leases(plan)}
    assert sorted(leases) == [("Fast", 0), ("Fast", 1), ("Work", 0), ("Work", 1), ("Work", 2)]
    return h, leases


def test_an_at_most_once_delivery_refused_as_too_large_is_dead_lettered_not_lost() -> None:
    """The entry left Fast when it was delivered (DELIVERED_AT_MOST_ONCE); the broker's refusal
    comes an iteration later. The record is dead-lettered (reason too-large) with one
    DEAD_LETTERED event and no second outcome; the consumer's backlog slot is free at once
    (it never got the message, so it cannot ack it), and Work's entry of the same record is
    not touched: Work's consumer still holds its lease."""
    h, leases = _refusal_harness()
    refused = leases[("Fast", 1)]
    h.core.too_large([Refused("Fast", refused.bookmark, refused.token, 1, False,
                              refused.delivery_topic)])
    plan = h.step([], 2.0)
    # The refusing delivery topic names the consumer: the dead letter's last_consumer.
    assert [(e.queue, e.bookmark.offset, type(e), e.consumer_id) for e in plan.expired] == [
        ("Fast", 1, ev.DeliveryRefused, "f")]
    # The slot is free: the third record goes to Fast's consumer in the same step.
    assert [(d.queue, d.bookmark.offset) for d in _leases(plan)] == [("Fast", 2)]
    batched, one_by_one = _batch_events(h, plan)
    fast_1 = [(e.type, e.reason) for e in batched
              if e.queue == "Fast" and e.bookmark is not None and e.bookmark.offset == 1]
    assert fast_1 == [(EventType.DEAD_LETTERED, "too_large")]
    assert sorted(map(repr, batched)) == sorted(map(repr, one_by_one))
    assert plan.batch.counters["Fast"]["dead_lettered"] == 1
    assert h.core.counters["too_large"] == 1
    # Work's leases of the same records are still good: their ACCEPTs are taken.
    work = [leases[("Work", o)] for o in range(3)]
    acked = h.step([h.ack("w", work)], 3.0)
    assert _replies(acked) == []
    assert sorted(b.offset for b in acked.done) == [0, 1, 2]


def test_an_at_least_once_delivery_refused_as_too_large_leaves_only_its_own_queue() -> None:
    h, leases = _refusal_harness()
    token = leases[("Work", 0)].token
    h.core.too_large([Refused("Work", Bookmark(JOURNAL, 0, 0), token, 1, False),
                      Refused("Gone", Bookmark(JOURNAL, 0, 0), token, 1, False)])
    plan = h.step([], 2.0)
    assert [(e.queue, e.bookmark.offset, e.reason, e.dead_letter, type(e))
            for e in plan.expired] == [("Work", 0, "too-large", True, ev.EntryExpired)]
    batched, _ = _batch_events(h, plan)
    assert [(e.type, e.queue) for e in batched] == [
        (EventType.DEAD_LETTERED, "Work"), (EventType.EXPIRED, "Work")]
    assert h.core.counters["too_large"] == 1


def test_a_barrier_refused_by_one_topic_is_counted_not_dead_lettered() -> None:
    h, _ = _refusal_harness()
    h.core.too_large([Refused("Work", Bookmark(JOURNAL, 0, 0), "t", 1, True)])
    plan = h.step([], 2.0)
    assert plan.expired == [] and h.core.counters["barrier_refused"] == 1


def _batch_events(h: Harness, plan: Plan) -> tuple[list[Event], list[Event]]:
    """The plan's events as the shard loop writes them (runs), read back by a reader; and
    the same events one by one, as `wire_events` makes them."""
    def record_time(b: Bookmark) -> int | None:
        r = plan.fresh.get(b)
        return r.timestamp_ms if r is not None and r.timestamp_ms > 0 else None

    one_by_one = [*wire_events(plan.events, "test", 1, session_of=h.core.session_id_of,
                               record_time_of=record_time), *h.core.pending_events]
    items = Output(h.core).event_records(plan.events, plan.fresh)
    return list(CODEC.decode_event_batch(CODEC.encode_event_batch(
        1, 0, CODEC.event_array(items))).events), one_by_one


def _by_entry(events: list[Event]) -> dict[object, list[str]]:
    out: dict[object, list[str]] = {}
    for e in events:
        out.setdefault(e.bookmark, []).append(str(e.type))
    return out


def test_event_runs_say_what_the_events_one_by_one_say() -> None:
    h = Harness()
    # Enqueued and leased in one iteration, to two consumers by turns (fairness interleaves
    # them); then acked, one refused, and a release that comes back in the next dispatch.
    plan = h.step([h.subscribe("c1", backlog=3), h.subscribe("c2", backlog=3),
                   *h.publish(8)], 1.0)
    batched, one_by_one = _batch_events(h, plan)
    assert sorted(map(repr, batched)) == sorted(map(repr, one_by_one))
    assert _by_entry(batched) == _by_entry(one_by_one)
    assert [e.type for e in batched].count(EventType.ENQUEUED) == 8
    leased = _leases(plan)
    acks = h.step([h.accept("c1", [d for d in leased if d.consumer_id == "c1"]),
                   h.ack("c2", [d for d in leased if d.consumer_id == "c2"][:1],
                         kind=AckType.RELEASE),
                   h.accept("c2", [d for d in leased if d.consumer_id == "c2"][1:2],
                            token="forged")], 2.0)
    batched, one_by_one = _batch_events(h, acks)
    assert sorted(map(repr, batched)) == sorted(map(repr, one_by_one))
    # Per entry, the same events in the same order (RELEASED before the new LEASED).
    assert _by_entry(batched) == _by_entry(one_by_one)
    assert len(batched) > len(Output(h.core).event_records(acks.events, acks.fresh))  # runs
    assert any(types[-2:] == ["RELEASED", "LEASED"] for types in _by_entry(batched).values())


class CoreMachine(RuleBasedStateMachine):
    """Random interleavings through `step`; the model is built from the plans alone."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(lease_period="5s")
        self.now = 1.0
        self.published = 0
        self.subscribed: set[str] = set()
        self.held: dict[int, tuple[str, ev.EntryLeased]] = {}
        self.acked: set[int] = set()

    def _step(self, records: list[JournalRecord]) -> Plan:
        plan = self.h.core.step(records, self.now)
        # The events as written (runs) say what they say one by one, per entry in order.
        batched, one_by_one = _batch_events(self.h, plan)
        assert sorted(map(repr, batched)) == sorted(map(repr, one_by_one))
        assert _by_entry(batched) == _by_entry(one_by_one)
        self.h.core.settled(plan)
        assert {id(d) for d in _leases(plan)} <= {id(e) for e in plan.events}
        for e in plan.events:  # in the order the engine decided them
            if isinstance(e, ev.EntryLeased):
                offset = e.bookmark.offset
                assert offset not in self.acked, f"entry {offset} delivered after its ack"
                holder = self.held.get(offset)
                assert holder is None or holder[0] == e.consumer_id, (
                    f"entry {offset} leased to {e.consumer_id} while {holder[0]} holds it")
                self.held[offset] = (e.consumer_id, e)
            elif isinstance(e, ev.EntryAcked):
                assert e.bookmark.offset not in self.acked, "acked twice"
                self.acked.add(e.bookmark.offset)
                self.held.pop(e.bookmark.offset, None)
            elif isinstance(e, ev.LeaseExpired | ev.LeaseBroken | ev.EntryReleased):
                self.held.pop(e.bookmark.offset, None)
        return plan

    @rule(n=st.integers(1, 4))
    def publish(self, n: int) -> None:
        self.published += n
        self._step(self.h.publish(n))

    @rule(consumer=st.sampled_from(["a", "b", "c"]), backlog=st.integers(1, 3))
    def subscribe(self, consumer: str, backlog: int) -> None:
        self.subscribed.add(consumer)
        self._step([self.h.subscribe(consumer, backlog)])

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), kind=st.sampled_from([AckType.ACCEPT, AckType.RELEASE]))
    def settle(self, data: st.DataObject, kind: AckType) -> None:
        offset = data.draw(st.sampled_from(sorted(self.held)))
        consumer, lease = self.held[offset]
        self._step([self.h.ack(consumer, [lease], kind)])

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def accept_many(self, data: st.DataObject) -> None:
        """An AcceptRecord (protocol 3) for some of one consumer's leases."""
        consumer = data.draw(st.sampled_from(sorted({c for c, _ in self.held.values()})))
        mine = [lease for c, lease in self.held.values() if c == consumer]
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique_by=id))
        self._step([self.h.accept(consumer, chosen)])

    @precondition(lambda self: bool(self.subscribed))
    @rule(data=st.data())
    def unsubscribe(self, data: st.DataObject) -> None:
        consumer = data.draw(st.sampled_from(sorted(self.subscribed)))
        self.subscribed.discard(consumer)
        self._step([self.h.unsubscribe(consumer)])

    @rule(seconds=st.sampled_from([0.5, 6.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self._step([])

    @invariant()
    def recovery_point_passes_only_acked_entries(self) -> None:
        for point in self.h.core.persisted_points.values():
            assert all(o in self.acked for o in range(max(point, 0)))

    def teardown(self) -> None:
        # The others leave; one consumer acks everything: every published record is acked
        # exactly once.
        self._step([self.h.unsubscribe(c) for c in sorted(self.subscribed)]
                   + [self.h.subscribe("closer", 3)])
        for _ in range(4 * self.published + 10):
            if len(self.acked) == self.published:
                break
            mine = [lease for consumer, lease in self.held.values() if consumer == "closer"]
            self.now += 6.0  # others' leases expire and come to the closer
            self._step([self.h.ack("closer", mine)] if mine else [])
        assert self.acked == set(range(self.published))


CoreMachine.TestCase.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestCoreMachine = CoreMachine.TestCase
