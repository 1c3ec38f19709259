"""A session's parts on several shards, each holding the credit its consumer granted
(protocol 8), through `ShardCore.step` without Kafka or PostgreSQL."""

from __future__ import annotations

from layer.coordinator.catalog import Catalog
from layer.coordinator.core import Plan
from layer.domain.states import Bookmark
from layer.kafka import JournalRecord
from layer.protocol import Replace, SubscribeResult, SubscribeStatus
from layer.protocol.headers import CREDIT, header_value, parse_credit_report
from layer.store.rows import ConsumerRow
from tests.unit.coordinator.test_core import CODEC, TOPICS, Harness, _leases, _queue


def _credit(record: JournalRecord, home: int) -> JournalRecord:
    return JournalRecord(record.topic, record.partition, record.offset, record.key,
                         record.value, 1, [(CREDIT, str(home).encode())])


def _answers(plan: Plan) -> list[SubscribeResult]:
    return [r for r in (CODEC.decode_reply(o.value) for o in plan.replies
                        if header_value(o.headers, "qlayer.batch") is None and o.value)
            if isinstance(r, SubscribeResult)]


def _reports(plan: Plan) -> list[tuple[int, int, int] | None]:
    """The credit reports of a plan's replies and notices, in order."""
    return [parse_credit_report(o.headers) for o in plan.replies]


def test_the_home_part_takes_its_grant_reports_it_and_tells_what_changed() -> None:
    h = Harness(_queue("Worker", 1))
    sub = _credit(h.subscribe("c1", backlog=2, queue="Work.*", regex=True), home=0)
    plan = h.step([sub, *h.publish(3)], 1.0)
    (answer,) = _answers(plan)
    assert answer.status is SubscribeStatus.OK  # served, though Worker is on shard 1
    assert [g.queue for g in answer.queues] == ["Work"]
    # The answer: nothing held yet, grant 2, nothing waiting when it was decided; then,
    # after the deliveries, a notice: 2 held, 1 waiting.
    assert _reports(plan) == [(0, 2, 0), (2, 2, 1)]
    assert len(_leases(plan)) == 2
    notice = plan.replies[-1]
    assert header_value(notice.headers, "qlayer.batch") == b"1"
    assert header_value(notice.headers, "qlayer.shard") == b"0"
    # Nothing changed: nothing is said.
    assert _reports(h.step([], 2.0)) == []
    # One settled: the third is leased in the same step, and the notice says so.
    settled = h.step([h.ack("c1", _leases(plan)[:1])], 3.0)
    assert _reports(settled) == [(2, 2, 0)]


def test_a_lowered_grant_leases_nothing_more_until_the_leases_settle_below_it() -> None:
    h = Harness(_queue("Worker", 1))
    sub = _credit(h.subscribe("c1", backlog=2, queue="Work.*", regex=True), home=0)
    first = h.step([sub, *h.publish(4)], 1.0)
    leased = _leases(first)
    lower = h._record(TOPICS.control, CODEC.encode_control(Replace(
        consumer_id="c1", session_id="s-c1", request_id="lower", queue="Work.*",
        queue_is_regex=True, max_backlog=0, filter=None, delivery_topic=TOPICS.delivery("c1"),
        sent_at_ms=0)), b"c1")
    plan = h.step([lower], 2.0)
    (answer,) = _answers(plan)
    assert answer.status is SubscribeStatus.OK and answer.request_id == "lower"
    assert _reports(plan) == [(2, 0, 2)]
    settled = h.step([h.ack("c1", leased)], 3.0)
    assert _leases(settled) == []
    assert _reports(settled) == [(0, 0, 2)]  # the credit is back: the consumer may move it


def _home_row(consumer: str, shard: int, now: float) -> ConsumerRow:
    return ConsumerRow(consumer_id=consumer, session_id=f"s-{consumer}", queue="Work.*",
                       is_regex=True, delivery_topic=TOPICS.delivery(consumer),
                       session_timeout_ms=600_000, subscribed_at=now, last_heartbeat_at=now,
                       shard=shard, credit_home=shard)


def test_a_part_joins_only_a_session_its_home_shard_holds() -> None:
    h = Harness(_queue("Worker", 1))
    sub = _credit(h.subscribe("c1", backlog=1, queue="Work.*", regex=True), home=1)
    # The catalog predates the record: it waits for a fresher one rather than refusing.
    held = h.step([sub], 1.0)
    assert _answers(held) == [] and h.core.control.held
    h.catalog = Catalog.of(2, [*h.catalog.queues.values()], [], now=2.0)
    refused = h.step([], 2.5)
    (answer,) = _answers(refused)
    assert answer.status is SubscribeStatus.INVALID_REQUEST
    assert "home shard 1" in (answer.message or "")
    # Once the home shard holds the session, a part on this shard joins it, stored as a part.
    h.catalog = Catalog.of(2, [*h.catalog.queues.values()], [_home_row("c2", 1, 3.0)], now=3.0)
    plan = h.step([_credit(h.subscribe("c2", backlog=1, queue="Work.*", regex=True), home=1),
                   *h.publish(1)], 4.0)
    (answer,) = _answers(plan)
    assert answer.status is SubscribeStatus.OK
    assert list(plan.batch.spans) == ["c2"] and plan.batch.consumers == {}
    row = plan.batch.spans["c2"]
    assert (row.shard, row.credit_home, row.max_backlog) == (0, 1, 1)
    assert len(_leases(plan)) == 1
    # Its heartbeats and its end write the part's row, never the home's.
    end = h.step([h.unsubscribe("c2")], 5.0)
    assert end.batch.span_deletes == {"c2": (0, "s-c2")}
    assert end.batch.session_deletes == {} and end.batch.consumer_deletes == set()


def test_a_restored_lease_counts_as_held_before_the_replay_reaches_it() -> None:
    """After a restart or takeover, a lease restored from PostgreSQL is the engine's only once
    the journal's replay reaches its record; reported free meanwhile, its credit would be
    granted to another shard too (seen in the SIGKILL test before this was counted)."""
    from layer.coordinator.core import QueueState, ShardCore
    from layer.coordinator.options import CoordinatorOptions
    from layer.coordinator.ports import FakeTopicAdmin
    from layer.domain.definitions import QueueDefinition
    from layer.store.rows import EntryRow
    from tests.unit.coordinator.test_core import JOURNAL

    work = _queue("Work", 0)
    row = _home_row("c1", 0, 1.0)
    core = ShardCore(0, CoordinatorOptions(owner_id="t", core="python"), topics=TOPICS,
                     catalog=lambda: Catalog.of(2, [work], [row], now=1.0),
                     admin=FakeTopicAdmin({JOURNAL: 1, TOPICS.control: 2, TOPICS.ack: 2}),
                     tokens=lambda: "new", owner_id="t")
    core.epoch = 1
    lease = EntryRow(queue="Work", topic=JOURNAL, partition=0, offset=0, state="LEASED",
                     delivery_count=1, lease_consumer="c1", lease_token="tok",
                     lease_deadline=100.0)
    core.add_queue(QueueState(QueueDefinition.from_mapping(work.definition), 1, [lease],
                              {(JOURNAL, 0): 0}, {}, {}, {(JOURNAL, 0): 0}), [row], 2.0)
    core.restore_sessions([row], 2.0)
    session = core.sessions["c1"]
    lease_bookmark = Bookmark(JOURNAL, 0, 0)
    assert core.engines["Work"].restoring(lease_bookmark)
    assert core.control.credit.report(session)[0] == 1
    replay = JournalRecord(JOURNAL, 0, 0, None, b'{"n": 0}', 1, None)
    plan = core.step([replay], 3.0)
    core.settled(plan)
    assert not core.engines["Work"].restoring(lease_bookmark)
    assert core.control.credit.report(session)[0] == 1  # the engine's now, counted once



def test_a_part_whose_filter_refuses_what_waits_reports_nothing_waiting() -> None:
    """`waiting` is after the consumer's filter: entries it can never take draw no credit to
    this shard (with one credit over two shards, the credit would have stayed here while the
    other shard's entries for it waited forever)."""
    h = Harness(_queue("Worker", 1))
    sub = _credit(h.subscribe("c1", backlog=1, queue="Work.*", regex=True,
                              filter="/n >= 3"), home=0)
    plan = h.step([sub, *h.publish(3)], 1.0)  # n = 0, 1, 2: none of them its own
    assert _leases(plan) == []
    assert _reports(plan) == [(0, 1, 0)]  # the answer; nothing changed after it
    # One of its own comes: leased at once (it has the credit), and nothing more waits for
    # it, whatever else is available.
    mine = h.step(h.publish(1), 2.0)
    (leased,) = _leases(mine)
    assert leased.bookmark.offset == 3
    assert _reports(mine) == []
    # Another of its own while it holds its one credit: work waits for it, it is told.
    more = h.step(h.publish(1), 3.0)
    assert _leases(more) == [] and _reports(more) == [(1, 1, 4)]
