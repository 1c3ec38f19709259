"""One backlog over two real shard cores (protocol 8), without Kafka or PostgreSQL.

Two `ShardCore`s, shard 0 serving queue A and shard 1 queue B, and a model consumer that does
what the SDK does: it subscribes a regex over both with credit (home part first), keeps a
`CreditLedger`, acks what it holds, and moves credit with Replace records on the shards'
reports. Each shard reads its control and ack records in its own order; its output (deliveries,
answers, credit notices) reaches the consumer in order per shard and interleaved across shards.
The consumer may replace its filter over both parts; a shard's process may die between two
steps and a new owner take the shard over from what the steps stored (entry rows, recovery
point, the part's row), reading the journal again; queue B may move to shard 0 (`qlayer queue
move`), its leases along, and the consumer follows as the SDK does (acks to shard 0, the part on
shard 1 left). After every step: the leases the two cores hold for the consumer never exceed
the backlog, and, until a move, each holds no more than the ledger reserves for it. No entry
is delivered under two lease tokens (no lease is ever broken here). At the end, everything
published that the subscription's filter (if it has one) takes is delivered and acked: credit
never gets stuck, not even on a shard whose waiting entries the filter refuses.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layer.coordinator.catalog import Catalog
from layer.coordinator.core import Plan, QueueState, ShardCore
from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.ports import FakeTopicAdmin
from layer.domain import events as ev
from layer.domain.definitions import QueueDefinition
from layer.kafka import JournalRecord, OutgoingRecord
from layer.protocol import (
    AcceptGroup,
    AcceptRecord,
    AckResult,
    Codec,
    Replace,
    SessionEnded,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    TopicNames,
    Unsubscribe,
)
from layer.protocol.headers import CREDIT, header_value, parse_credit_report, reply_shard
from layer.sdk.credit import CreditLedger, CreditReport
from layer.store.rows import ConsumerRow, EntryKey, EntryRow, PartitionKey, QueueRecord

TOPICS = TopicNames("qc.")
CODEC = Codec()
JOURNALS = {"A": "journal-a", "B": "journal-b"}
CONSUMER = "c1"
SESSION = "s1"


def _record(queue: str, shard: int) -> QueueRecord:
    return QueueRecord(name=queue, definition={"name": queue, "underlying_topic": JOURNALS[queue],
                                               "max_per_subscription_backlog": 100},
                       version=1, created_at=0.0, updated_at=0.0, shard=shard)


@dataclass
class Shard:
    core: ShardCore
    control: deque[JournalRecord] = field(default_factory=deque)
    acks: deque[JournalRecord] = field(default_factory=deque)
    out: deque[OutgoingRecord | ev.EntryLeased] = field(default_factory=deque)
    #: Every control and ack record written to this shard's partitions, and where the shard
    #: stored that it reads them on from (its input positions): a new owner reads on from
    #: there, so a record whose position was held back (an ack that waited for the journal
    #: replay) is read again after a restart, as from Kafka.
    history: list[JournalRecord] = field(default_factory=list)
    positions: dict[tuple[str, int], int] = field(default_factory=dict)

    def receive(self, record: JournalRecord) -> None:
        self.history.append(record)
        (self.acks if record.topic == TOPICS.ack else self.control).append(record)

    def read_again(self) -> None:
        """A new owner's inputs: every record at or past the stored positions."""
        self.control, self.acks = deque(), deque()
        for record in self.history:
            if record.offset >= self.positions.get((record.topic, record.partition), 0):
                (self.acks if record.topic == TOPICS.ack else self.control).append(record)


@dataclass
class Stored:
    """One queue as PostgreSQL and its journal hold it (every step commits whole)."""

    #: Every journal record published, for a replay after a restart or a move.
    history: list[JournalRecord] = field(default_factory=list)
    #: Records not read yet by the shard that serves the queue.
    journal: list[JournalRecord] = field(default_factory=list)
    entries: dict[EntryKey, EntryRow] = field(default_factory=dict)
    recovery_point: int = 0
    admitted: int | None = None


class TwoShards(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1.0
        self.placement = {"A": 0, "B": 1}
        self.catalog = Catalog.of(2, [_record(q, s) for q, s in self.placement.items()], [],
                                  now=0.0)
        self.admin = FakeTopicAdmin({"journal-a": 1, "journal-b": 1, TOPICS.control: 2,
                                     TOPICS.ack: 2})
        self.tokens = itertools.count()
        self.sessions: dict[int, ConsumerRow] = {}  # the stored row of each shard's part
        self.stored = {queue: Stored() for queue in JOURNALS}
        self.shards = {shard: Shard(self._core(shard)) for shard in (0, 1)}
        self.seen: set[str] = set()  # lease tokens the consumer got (repeats are dropped)
        #: The lease tokens each entry was delivered under: one each, as no lease is ever
        #: broken here (no expiry, no timeout), restarts and moves included.
        self.tokens_of: dict[tuple[str, int], set[str]] = {}
        self.restarts = 0
        self.moved = False
        self.offsets: dict[str, int] = {}
        self.ledger: CreditLedger | None = None
        self.requests: dict[str, int] = {}
        #: The consumer's view: the shard each queue's acks go to.
        self.queue_shard = dict(self.placement)
        self.holding: dict[str, list[ev.EntryLeased]] = {q: [] for q in JOURNALS}
        self.published: dict[tuple[str, int], bool] = {}  # (queue, offset) -> mine
        self.filter: str | None = None
        self.acked: set[tuple[str, int]] = set()
        self.active = False
        self.ids = itertools.count()

    def _core(self, shard: int, epoch: int = 1) -> ShardCore:
        """A shard core serving the queues placed on it from what PostgreSQL holds of them,
        with the sessions stored for it."""
        core = ShardCore(shard, CoordinatorOptions(owner_id=f"o{shard}", core="python"),
                         topics=TOPICS, catalog=lambda: self.catalog, admin=self.admin,
                         tokens=lambda: f"t{next(self.tokens)}", owner_id=f"o{shard}")
        core.epoch = epoch
        rows = [self.sessions[shard]] if shard in self.sessions else []
        for queue, placed in self.placement.items():
            if placed == shard:
                self._add(core, queue, rows)
        core.restore_sessions(rows, self.now)
        return core

    def _add(self, core: ShardCore, queue: str, rows: list[ConsumerRow]) -> None:
        """`QueueLoader.add`: the queue from its stored state; its journal read again from its
        recovery point."""
        stored, journal = self.stored[queue], JOURNALS[queue]
        key = PartitionKey(queue, journal, 0)
        definition = QueueDefinition.from_mapping(_record(queue, 0).definition)
        core.add_queue(QueueState(
            definition, 1, list(stored.entries.values()), {(journal, 0): stored.recovery_point},
            {key: stored.recovery_point} if stored.recovery_point else {},
            {key: stored.admitted} if stored.admitted is not None else {},
            {(journal, 0): 0}), rows, self.now)
        stored.journal = [r for r in stored.history if r.offset >= stored.recovery_point]

    # --- the records a consumer writes ------------------------------------------------------

    def _next(self, topic: str) -> int:
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        return offset

    def _control(self, shard: int, message: Subscribe | Replace | Unsubscribe) -> None:
        record = JournalRecord(TOPICS.control, shard, self._next(f"control{shard}"),
                               CONSUMER.encode(), CODEC.encode_control(message), 1,
                               [(CREDIT, b"0")])
        self.shards[shard].receive(record)

    def _grant(self, shard: int, grant: int, subscribe: bool = False) -> None:
        assert self.ledger is not None
        request = f"r{next(self.ids)}"
        self.ledger.sent(shard, request, grant)
        self.requests[request] = shard
        common = dict(consumer_id=CONSUMER, session_id=SESSION, request_id=request,
                      queue="A|B", queue_is_regex=True, max_backlog=grant,
                      filter=self.filter,
                      delivery_topic=TOPICS.delivery(CONSUMER), sent_at_ms=0)
        if subscribe:
            self._control(shard, Subscribe(**common, session_timeout_ms=600_000,  # type: ignore[arg-type]
                                           client_name="t", client_version="0"))
        else:
            self._control(shard, Replace(**common))  # type: ignore[arg-type]

    # --- rules --------------------------------------------------------------------------------

    @rule(backlog=st.integers(1, 5), filtered=st.booleans())
    @precondition(lambda self: self.ledger is None)
    def subscribe(self, backlog: int, filtered: bool) -> None:
        self.filter = "/mine = 'yes'" if filtered else None
        self.ledger = CreditLedger(backlog)
        grants = self.ledger.initial([0, 1])
        self._grant(0, grants[0], subscribe=True)
        self.pending_part = grants[1]

    @rule(queue=st.sampled_from(sorted(JOURNALS)), n=st.integers(1, 4), mine=st.booleans())
    def publish(self, queue: str, n: int, mine: bool) -> None:
        journal = JOURNALS[queue]
        for _ in range(n):
            offset = self._next(journal)
            record = JournalRecord(
                journal, 0, offset, None,
                json.dumps({"n": offset, "mine": "yes" if mine else "no"}).encode(), 1, None)
            self.stored[queue].journal.append(record)
            self.stored[queue].history.append(record)
            self.published[(queue, offset)] = mine

    @property
    def wanted(self) -> set[tuple[str, int]]:
        """What the subscription (its filter now) takes of what was published."""
        return {k for k, mine in self.published.items() if mine or self.filter is None}

    @rule(filtered=st.booleans())
    @precondition(lambda self: self.active)
    def consumer_replaces(self, filtered: bool) -> None:
        """A new filter for the whole subscription: a Replace to each part, each with the
        grant the ledger gives it now (as `QueueConsumer.replace` does over parts)."""
        assert self.ledger is not None
        self.filter = "/mine = 'yes'" if filtered else None
        for shard, credit in sorted(self.ledger.shards.items()):
            self._grant(shard, credit.grant)

    @rule(shard=st.sampled_from([0, 1]), control=st.booleans(), acks=st.booleans())
    def shard_steps(self, shard: int, control: bool, acks: bool) -> None:
        self._step(shard, control, acks)

    def _step(self, shard: int, control: bool, acks: bool) -> None:
        model = self.shards[shard]
        records: list[JournalRecord] = []
        for queue, placed in self.placement.items():
            if placed == shard:
                records.extend(self.stored[queue].journal)
                self.stored[queue].journal = []
        if control and model.control:
            records.append(model.control.popleft())
        if acks and model.acks:
            records.append(model.acks.popleft())
        self.now += 0.01
        plan = model.core.step(records, self.now)
        model.core.settled(plan)
        self._store(shard, plan)
        for row in plan.batch.consumers.values():
            # The store: the home row is what the other shard's catalog will show.
            self.catalog = Catalog.of(2, self.catalog.queues.values(), [row], now=self.now,
                                      spans=self.catalog.spans.values())
        for forward in plan.forwards:
            # A record for the shard that serves it now (an ack of a moved queue's lease).
            target = self.shards[forward.partition if forward.partition is not None else 0]
            target.receive(JournalRecord(forward.topic, forward.partition or 0,
                                         self._next(f"{forward.topic}{forward.partition}"),
                                         forward.key, forward.value, 1,
                                         list(forward.headers or ())))
        model.out.extend(d for d in plan.deliveries if isinstance(d, ev.EntryLeased))
        model.out.extend(plan.replies)

    @rule(data=st.data())
    @precondition(lambda self: any(s.out for s in self.shards.values()))
    def consumer_reads(self, data: st.DataObject) -> None:
        shard = data.draw(st.sampled_from(sorted(k for k, s in self.shards.items() if s.out)))
        self._read(shard)

    def _read(self, shard: int) -> None:
        assert self.ledger is not None
        item = self.shards[shard].out.popleft()
        if isinstance(item, ev.EntryLeased):
            if item.token in self.seen:
                return  # a restored lease's delivery sent again: the SDK drops it by token
            self.seen.add(item.token)
            self.tokens_of.setdefault((item.queue, item.bookmark.offset), set()).add(item.token)
            self.holding[item.queue].append(item)
            # As the SDK counts them (`Spans.delivered`): the shard took its turn.
            credit = self.ledger.shards.get(shard)
            if credit is not None:
                credit.delivered += 1
            return
        report = parse_credit_report(item.headers)
        if header_value(item.headers, "qlayer.batch") is not None:
            assert report is not None and reply_shard(item.headers) == shard
            self.ledger.reported(shard, CreditReport(*report))
        else:
            reply = CODEC.decode_reply(item.value)
            if isinstance(reply, SessionEnded):
                return  # the left part's answer (none here: the shard no longer had it)
            if isinstance(reply, AckResult):
                # An ack read again after a restart (its position was not stored: it changed
                # nothing) is answered as a duplicate; the SDK reports that, nothing more.
                return
            assert isinstance(reply, SubscribeResult)
            if reply.request_id not in self.requests:
                # An answer of the part on shard 1 after the consumer left it (B moved): the
                # SDK no longer waits for it either (`Spans.answered`).
                assert self.moved and shard == 1
                return
            assert reply.status is SubscribeStatus.OK, reply.message
            assert self.requests.pop(reply.request_id) == shard
            assert report is not None
            self.ledger.confirmed(shard, reply.request_id, CreditReport(*report))
            if not self.active and shard == 0:
                # The home part holds the session: now the part on shard 1.
                self.active = True
                self._grant(1, self.pending_part, subscribe=True)
                return
        if self.active:
            for target, grant in self.ledger.plan().items():
                self._grant(target, grant)

    @rule(data=st.data())
    @precondition(lambda self: any(self.holding.values()))
    def consumer_acks(self, data: st.DataObject) -> None:
        queue = data.draw(st.sampled_from(sorted(q for q, h in self.holding.items() if h)))
        n = data.draw(st.integers(1, len(self.holding[queue])))
        self._ack(queue, n)

    def _ack(self, queue: str, n: int) -> None:
        leases, self.holding[queue] = self.holding[queue][:n], self.holding[queue][n:]
        shard = self.queue_shard[queue]
        record = AcceptRecord(consumer_id=CONSUMER, session_id=SESSION, sent_at_ms=0,
                              groups=(AcceptGroup(queue=queue, topic=JOURNALS[queue],
                                                  partition=0,
                                                  offsets=tuple(d.bookmark.offset
                                                                for d in leases),
                                                  leases=tuple(d.token for d in leases)),))
        self.shards[shard].receive(JournalRecord(
            TOPICS.ack, shard, self._next(f"ack{shard}"), CONSUMER.encode(),
            CODEC.encode_accept(record), 1, None))
        self.acked.update((queue, d.bookmark.offset) for d in leases)

    def _store(self, shard: int, plan: Plan) -> None:
        """What the step's transaction wrote, as PostgreSQL would keep it."""
        batch = plan.batch
        assert not batch.runs, "the Python core writes entry rows one by one"
        self.shards[shard].positions.update(batch.input_positions)
        for key in batch.entry_deletes:
            self.stored[key.queue].entries.pop(key, None)
        for key, entry in batch.entries.items():
            self.stored[key.queue].entries[key] = entry
        for point, offset in batch.recovery_points.items():
            stored = self.stored[point.queue]
            stored.recovery_point = offset
            stored.entries = {k: r for k, r in stored.entries.items() if k.offset >= offset}
        for point, offset in batch.admitted.items():
            self.stored[point.queue].admitted = offset
        for row in (*batch.consumers.values(), *batch.spans.values()):
            self.sessions[shard] = row
        if batch.consumer_deletes or batch.session_deletes or batch.span_deletes:
            self.sessions.pop(shard, None)

    @rule(shard=st.sampled_from([0, 1]))
    @precondition(lambda self: self.active and self.restarts < 3)
    def shard_restarts(self, shard: int) -> None:
        """The shard's process is SIGKILLed between two steps and another takes the shard
        over: engines, sessions and leases come back from what was stored, the journals are
        read again from the recovery points, and the restored leases' deliveries are sent
        again (the consumer is not told; its ledger goes on from the reports)."""
        self.restarts += 1
        model = self.shards[shard]
        model.core = self._core(shard, epoch=model.core.epoch + 1)
        model.read_again()

    @rule()
    @precondition(lambda self: self.active and not self.moved)
    def queue_moves(self) -> None:
        """`qlayer queue move B --shard 0`: the store places B on shard 0 and fences shard 1,
        which is rebuilt without it; shard 0 loads B from the store (its leases along), joins
        the live regex sessions to it and reads its journal again. The consumer sees the move
        in the directory: acks of B go to shard 0, and it leaves its part on shard 1 (as
        `layer.sdk.spanning.follow_directory` does)."""
        assert self.ledger is not None
        self.moved = True
        self.placement["B"] = 0
        self.catalog = Catalog.of(2, [_record(q, s) for q, s in self.placement.items()],
                                  list(self.catalog.consumers.values()), now=self.now,
                                  spans=self.catalog.spans.values())
        old = self.shards[1]
        old.core = self._core(1, epoch=old.core.epoch + 1)
        old.read_again()
        core = self.shards[0].core
        rows = list(self.sessions.values())
        self._add(core, "B", rows)
        core.subscribe_regex_sessions("B", self.now)
        core.restore_sessions(rows, self.now, only="B")
        self.queue_shard["B"] = 0
        self.ledger.remove(1)
        for request_id in [r for r, s in self.requests.items() if s == 1]:
            del self.requests[request_id]
        self._control(1, Unsubscribe(consumer_id=CONSUMER, session_id=SESSION,
                                     reason="no matching queue here", sent_at_ms=0))

    # --- what holds ---------------------------------------------------------------------------

    def _held(self, shard: int) -> int:
        return sum(c.backlog for engine in self.shards[shard].core.engines.values()
                   for c in engine.consumers() if c.consumer_id == CONSUMER)

    @invariant()
    def one_backlog(self) -> None:
        if self.ledger is None:
            return
        held = {s: self._held(s) for s in self.shards}
        assert sum(held.values()) <= self.ledger.backlog, held
        if self.moved:
            return  # the moved leases are shard 0's now, under shard 1's credit until reported
        for shard, n in held.items():
            credit = self.ledger.shards.get(shard)
            assert n <= (credit.reservation if credit is not None else 0), (shard, n)

    def teardown(self) -> None:
        if self.ledger is None:
            return
        for _ in range(2000):
            for shard in self.shards:
                self._step(shard, True, True)
                while self.shards[shard].out:
                    self._read(shard)
                    self.one_backlog()
            for queue, held in self.holding.items():
                if held:
                    self._ack(queue, len(held))
            if (self.wanted <= self.acked and not any(self.holding.values())
                    and all(not s.control and not s.acks and not s.out
                            for s in self.shards.values())
                    and not any(s.journal for s in self.stored.values())):
                break
        assert self.wanted <= self.acked, (self.wanted - self.acked, self.published)
        assert self.acked <= set(self.published)
        assert {k: t for k, t in self.tokens_of.items() if len(t) > 1} == {}


TwoShards.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestTwoShards = TwoShards.TestCase


def test_one_credit_does_not_stay_on_the_shard_whose_waiting_entries_the_filter_refuses(
        ) -> None:
    """The case the machine above is for, spelled out: one credit over two shards, the home
    shard's entries all refused by the filter, the other shard's taken by it."""
    for first, other in (("A", "B"), ("B", "A")):
        machine = TwoShards()
        machine.publish(queue=first, n=2, mine=False)
        machine.publish(queue=other, n=1, mine=True)
        machine.subscribe(backlog=1, filtered=True)
        machine.teardown()
        assert machine.acked == machine.wanted == {(other, 0)}


def _settle_in(machine: TwoShards, rounds: int = 6) -> None:
    """The home part, the part on shard 1, credit moved to where work is."""
    for _ in range(rounds):
        for shard in (0, 1):
            machine._step(shard, True, False)
            while machine.shards[shard].out:
                machine._read(shard)


def test_a_shard_restarted_while_its_part_holds_leases_keeps_them_and_the_one_backlog() -> None:
    """Shard 1's process dies while the consumer holds two of its leases: the new owner
    restores them from the store (counted as held while the replay has not reached them),
    the consumer's acks of the old tokens settle them, and nothing is delivered again."""
    machine = TwoShards()
    machine.publish(queue="B", n=4, mine=True)
    machine.subscribe(backlog=2, filtered=False)
    _settle_in(machine)
    assert len(machine.holding["B"]) == 2 and machine.holding["A"] == []
    machine.shard_restarts(shard=1)
    core = machine.shards[1].core
    assert core.sessions[CONSUMER].max_backlog == 2
    assert core.control.credit.report(core.sessions[CONSUMER])[0] == 2
    machine._ack("B", 2)
    machine.teardown()
    assert machine.acked == machine.wanted
    assert all(len(t) == 1 for t in machine.tokens_of.values())


def test_a_queue_moved_while_its_leases_are_held_keeps_them_and_the_one_backlog() -> None:
    """B moves to shard 0 while the consumer holds two of its leases: shard 0 restores them,
    the acks (sent to shard 0 now) settle them, the rest of B comes from shard 0 under the
    one backlog, and nothing is delivered twice."""
    machine = TwoShards()
    machine.publish(queue="B", n=6, mine=True)
    machine.publish(queue="A", n=2, mine=True)
    machine.subscribe(backlog=2, filtered=False)
    _settle_in(machine)
    held = list(machine.holding["B"])
    assert held
    machine.queue_moves()
    core = machine.shards[0].core
    assert "B" in core.engines and "B" not in machine.shards[1].core.engines
    machine.one_backlog()
    machine._ack("B", len(held))
    machine.teardown()
    assert machine.acked == machine.wanted
    assert all(len(t) == 1 for t in machine.tokens_of.values())
