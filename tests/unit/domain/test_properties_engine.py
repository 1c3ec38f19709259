"""Property-based tests of the queue engine: random interleavings of every operation.

A hypothesis state machine drives one engine with enqueue, subscribe, replace, unsubscribe,
heartbeat, dispatch, ack (ACCEPT / RELEASE with or without delay / REJECT / RENEW, with right
or wrong tokens), admin acks and time passing (lease expiry, delays, expiration, session
timeouts). A model built only from the engine's events checks after every step that:

- no entry is leased to two consumers at once;
- nothing is lost: every entry reached exactly one outcome (ACKED, or EXPIRED with a reason),
  or is still in the queue, and the engine agrees;
- at-most-once never delivers an entry twice;
- no consumer is given an entry while its backlog is full (barriers aside);
- every lease is the first AVAILABLE entry, in priority-then-age order, that the consumer's
  filter matches (FIFO and priority order among eligible entries);
- dispatch leaves no consumer with backlog room while an entry it may get is AVAILABLE;
- key groups never have two entries of one key in flight, and deliver a key's entries in order;
- a barrier goes out only once every earlier entry is done, and nothing after it goes first;
- the recovery point never passes an entry that is not done;
- a restart (a new engine restored from the persisted entry states and recovery points, the
  journal replayed from there, consumers back with their sessions) loses nothing and keeps
  every lease, token and count.

Each configuration of the queue is its own machine. The example budget is modest so the file
runs in well under a minute; raise it with ``--hypothesis-profile=engine-deep``.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from layer.domain.engine import EntryAck, QueueEngine, RecordsWanted
from layer.domain.entries import EntryRecord, OfferedRecord
from layer.domain.events import (
    BacklogFreed,
    BarrierDelivered,
    ConsumerLeft,
    ConsumerReplaced,
    ConsumerSubscribed,
    EntriesEnqueued,
    EntryAcked,
    EntryExpired,
    EntryLeased,
    EntryReleased,
    Event,
    LeaseBroken,
    LeaseExpired,
    LeaseRenewed,
)
from layer.domain.expressions import Expression, compile_expression
from layer.domain.states import AckOutcome, AckSource, AckType, Bookmark, EntryState
from tests.support.examples import examples

from .engine_helpers import TOPIC, engine, record

settings.register_profile("engine-deep", max_examples=1000, stateful_step_count=80, deadline=None)
# CI budget, unless a profile asks for more (pytest --hypothesis-profile=engine-deep).
_PROFILE = settings.default
MACHINE_SETTINGS = settings(
    max_examples=examples(max(120, _PROFILE.max_examples)),
    stateful_step_count=40 if _PROFILE.stateful_step_count <= 50 else _PROFILE.stateful_step_count,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

CONSUMERS = ("a", "b", "c")
FILTERS = (None, "/k = 0", "/k <> 0")
SESSION_TIMEOUT = 40.0

documents = st.fixed_dictionaries(
    {"k": st.integers(0, 2)},
    optional={"p": st.one_of(st.none(), st.integers(0, 3), st.just("high"))},
)


class EngineMachine(RuleBasedStateMachine):
    """The model and the checks; subclasses choose the queue definition."""

    fields: ClassVar[dict[str, object]] = {}
    barrier_every: ClassVar[int] = 0  # 0: no barrier messages offered
    implementation: ClassVar[str] = "python"  # or "native": the same checks on the port

    def __init__(self) -> None:
        super().__init__()
        self.queue: QueueEngine = engine(session_timeout=SESSION_TIMEOUT,
                                         implementation=self.implementation, **self.fields)
        self.at_most_once = self.fields.get("semantics") == "at-most-once"
        self.keyed = bool(self.fields.get("key_groups"))
        self.now = 0.0
        self.next_offset = [0, 0]
        self.docs: dict[Bookmark, object] = {}
        self.keys: dict[Bookmark, bytes | None] = {}
        self.arrival: dict[Bookmark, int] = {}  # enqueue order
        self.barriers: set[Bookmark] = set()
        self.live: set[Bookmark] = set()
        self.outcomes: Counter[Bookmark] = Counter()
        self.delivered: Counter[Bookmark] = Counter()
        self.holder: dict[Bookmark, tuple[str, str]] = {}  # leases and at-most-once slots
        self.limits: dict[str, int] = {}
        self.filters: dict[str, Expression | None] = {}
        self.backlog: Counter[str] = Counter()
        self.sessions = 0
        self.records: dict[Bookmark, OfferedRecord] = {}
        self.store: dict[Bookmark, EntryRecord] = {}  # what the coordinator persisted
        self.subscriptions: dict[str, ConsumerSubscribed | ConsumerReplaced] = {}
        self.restarted = False

    # ------------------------------------------------------------------ model
    def absorb(self, events: list[Event], *, expected_order: list[Bookmark] | None = None) -> None:
        """Apply the engine's events to the model, checking each as it comes."""
        for event in events:
            if isinstance(event, EntriesEnqueued):
                for offset in event.offsets:
                    bookmark = Bookmark(event.topic, event.partition, offset)
                    if self.restarted and bookmark in self.live:
                        continue  # replayed after a restart: announced again, same entry
                    assert bookmark not in self.arrival, "enqueued twice"
                    self.arrival[bookmark] = len(self.arrival)
                    self.live.add(bookmark)
            elif isinstance(event, EntryLeased):
                bookmark = event.bookmark
                assert bookmark not in self.holder, f"{bookmark} leased to two consumers"
                assert bookmark in self.live, "a done entry was delivered"
                consumer = event.consumer_id
                assert self.backlog[consumer] < self.limits[consumer], "backlog overflow"
                self.holder[bookmark] = (consumer, event.token)
                self.backlog[consumer] += 1
                self.delivered[bookmark] += 1
                assert event.delivery_count == self.delivered[bookmark]
                if self.at_most_once:
                    assert self.delivered[bookmark] == 1, "at-most-once delivered twice"
                if expected_order is not None:
                    self.check_order(bookmark, consumer, expected_order)
                if self.keyed:
                    self.check_key_group(bookmark)
                self.check_not_behind_a_barrier(bookmark)
            elif isinstance(event, EntryAcked):
                if event.source is not AckSource.DELIVERY:
                    self.end_lease(event.bookmark)
                self.settle(event.bookmark)
            elif isinstance(event, EntryExpired):
                assert event.reason is not None
                self.end_lease(event.bookmark)
                self.settle(event.bookmark)
            elif isinstance(event, EntryReleased | LeaseExpired | LeaseBroken | BacklogFreed):
                assert event.bookmark in self.holder
                self.end_lease(event.bookmark)
            elif isinstance(event, BarrierDelivered):
                earlier = [b for b in self.live if self.arrival[b] < self.arrival[event.bookmark]]
                assert not earlier, f"barrier before {earlier} were done"
                assert not [
                    b for b in self.holder if self.arrival[b] < self.arrival[event.bookmark]
                ]
                for recipient in event.recipients:
                    expression = self.filters[recipient.consumer_id]
                    assert expression is None or expression.matches(self.docs[event.bookmark])
            elif isinstance(event, ConsumerSubscribed | ConsumerReplaced):
                self.subscriptions[event.consumer_id] = event
                self.limits[event.consumer_id] = event.max_backlog
                self.filters[event.consumer_id] = (
                    compile_expression(event.filter) if event.filter else None
                )
            elif isinstance(event, ConsumerLeft):
                assert self.backlog[event.consumer_id] == 0, "a lease survived its consumer"
                del self.limits[event.consumer_id]
                del self.filters[event.consumer_id]
                del self.subscriptions[event.consumer_id]
            elif isinstance(event, LeaseRenewed):
                assert event.bookmark in self.holder

    def replay_order(self, r: OfferedRecord) -> tuple[int, int]:
        """Arrival order; with target_queue_depth offset order per partition, as a journal is
        read (records deferred past the depth arrive after later ones of other partitions,
        and some never did)."""
        if "target_queue_depth" in self.fields:
            return (r.offset, r.partition)
        return (self.arrival.get(Bookmark(r.topic, r.partition, r.offset), -1), 0)

    def deferred_live(self) -> set[Bookmark]:
        """Live entries the engine does not hold: deferred past target_queue_depth again
        after a restart (the partitions interleave differently in the replay)."""
        deferred = self.queue.deferred()
        return {b for b in self.live
                if deferred.get((b.topic, b.partition), b.offset + 1) <= b.offset}

    def end_lease(self, bookmark: Bookmark) -> None:
        held = self.holder.pop(bookmark, None)
        if held is not None:
            self.backlog[held[0]] -= 1

    def settle(self, bookmark: Bookmark) -> None:
        assert bookmark in self.live, f"{bookmark} reached a second outcome"
        self.live.discard(bookmark)
        self.outcomes[bookmark] += 1

    def check_order(self, bookmark: Bookmark, consumer: str, order: list[Bookmark]) -> None:
        """The lease is the first AVAILABLE entry in queue order this consumer's filter wants."""
        expression = self.filters[consumer]
        wanted = [b for b in order if expression is None or expression.matches(self.docs[b])]
        assert wanted and wanted[0] == bookmark, f"{consumer} got {bookmark}, first was {wanted}"
        order.remove(bookmark)

    def check_key_group(self, bookmark: Bookmark) -> None:
        key = self.keys[bookmark]
        if key is None:
            return
        in_flight = [b for b in self.holder if b != bookmark and self.keys[b] == key]
        assert not in_flight, f"two entries of key {key!r} in flight"
        older = [
            b for b in self.live if self.keys[b] == key and self.arrival[b] < self.arrival[bookmark]
        ]
        assert not older, f"{bookmark} went before older entries of its key {older}"

    def check_not_behind_a_barrier(self, bookmark: Bookmark) -> None:
        pending = [b for b in self.barriers if b in self.live]
        assert all(self.arrival[bookmark] < self.arrival[b] for b in pending)

    def serve_rereads(self) -> None:
        """The coordinator reads the records deferred past target_queue_depth again when
        there is room (each loop iteration), in timestamp order across partitions."""
        wanted = self.queue.records_wanted()
        asked: list[object] = []
        while wanted and wanted != asked:  # again while it moves (acked or refused records)
            self.reread(wanted)
            asked, wanted = wanted, self.queue.records_wanted()

    def reread(self, wanted: list[RecordsWanted]) -> None:
        records: list[OfferedRecord] = []
        through: dict[tuple[str, int], int] = {}
        for w in wanted:
            got = sorted((r for b, r in self.records.items()
                          if (b.topic, b.partition) == (w.topic, w.partition)
                          and w.from_offset <= b.offset < w.until),
                         key=lambda r: r.offset)[:w.max_records]
            through[(w.topic, w.partition)] = (got[-1].offset + 1 if len(got) == w.max_records
                                               else w.until)
            records.extend(got)
        records.sort(key=lambda r: (r.timestamp or 0.0, r.partition, r.offset))
        self.queue.readmit(records, through, self.now)

    def drain(self, *, expected_order: list[Bookmark] | None = None) -> None:
        self.serve_rereads()
        outbox = self.queue.drain()
        for entry in outbox.entries:
            self.store[entry.bookmark] = entry
        self.absorb(outbox.events, expected_order=expected_order)

    # ------------------------------------------------------------------ rules
    @rule(
        partition=st.integers(0, 1),
        docs=st.lists(documents, min_size=1, max_size=6),
        keys=st.lists(st.sampled_from([None, b"x", b"y"]), min_size=6, max_size=6),
        delays=st.lists(st.sampled_from([None, None, None, 2.0]), min_size=6, max_size=6),
        dispatch=st.booleans(),
    )
    def enqueue(
        self,
        partition: int,
        docs: list[dict[str, object]],
        keys: list[bytes | None],
        delays: list[float | None],
        dispatch: bool = False,
    ) -> None:
        records = []
        for index, doc in enumerate(docs):
            offset = self.next_offset[partition]
            self.next_offset[partition] += 1
            if self.barrier_every and offset % self.barrier_every == self.barrier_every - 1:
                doc = {**doc, "barrier": 1}
            bookmark = Bookmark(TOPIC, partition, offset)
            self.docs[bookmark] = doc
            self.keys[bookmark] = keys[index]
            if doc.get("barrier") == 1:
                self.barriers.add(bookmark)
            delay = delays[index]
            journal_record = record(
                offset,
                doc,
                partition=partition,
                key=keys[index],
                timestamp=self.now,
                deliver_at=None if delay is None else self.now + delay,
            )
            self.records[bookmark] = journal_record
            records.append(journal_record)
        self.queue.enqueue(records, self.now)
        self.drain()
        self.then(dispatch)

    @rule(
        consumer=st.sampled_from(CONSUMERS),
        max_backlog=st.sampled_from([None, 0, 1, 2, 4]),
        filter=st.sampled_from(FILTERS),
        new_session=st.booleans(),
        dispatch=st.booleans(),
    )
    def subscribe(
        self,
        consumer: str,
        max_backlog: int | None,
        filter: str | None,
        new_session: bool,
        dispatch: bool = False,
    ) -> None:
        if new_session:
            self.sessions += 1
        self.queue.subscribe(
            consumer,
            f"{consumer}-{self.sessions}",
            self.now,
            delivery_topic=f"deliver.{consumer}",
            max_backlog=max_backlog,
            filter=filter,
        )
        self.drain()
        self.then(dispatch)

    @precondition(lambda self: bool(self.limits))
    @rule(
        data=st.data(),
        max_backlog=st.sampled_from([None, 1, 3]),
        filter=st.sampled_from(FILTERS),
    )
    def replace(self, data: st.DataObject, max_backlog: int | None, filter: str | None) -> None:
        consumer = data.draw(st.sampled_from(sorted(self.limits)))
        held = self.backlog[consumer]
        self.queue.replace(consumer, self.now, max_backlog=max_backlog, filter=filter)
        self.drain()
        assert self.backlog[consumer] == held, "replace changed the leases"

    @precondition(lambda self: bool(self.limits))
    @rule(data=st.data())
    def unsubscribe(self, data: st.DataObject) -> None:
        consumer = data.draw(st.sampled_from(sorted(self.limits)))
        assert self.queue.unsubscribe(consumer, self.now)
        self.drain()

    @rule()
    def heartbeat(self) -> None:
        for consumer in list(self.limits):
            assert self.queue.heartbeat(consumer, self.now)

    @initialize()
    def a_consumer_and_some_work(self) -> None:
        self.subscribe("a", 2, None, False)
        self.enqueue(0, [{"k": i % 3, "p": i % 4} for i in range(4)], [None] * 6, [None] * 6)

    def then(self, dispatch: bool) -> None:
        """Like the coordinator's loop, often dispatch right after the input was applied."""
        if dispatch:
            self.dispatch()

    @rule()
    def dispatch(self) -> None:
        self.drain()
        order = [entry.bookmark for entry in self.queue.view(limit=10_000)]
        self.queue.dispatch(self.now)
        check = None if (self.keyed or self.barrier_every) else order
        self.drain(expected_order=check)
        self.check_work_conserving()

    def eligible(self, bookmark: Bookmark) -> bool:
        """Whether the queue may deliver this AVAILABLE entry now (key groups, barriers)."""
        arrival = self.arrival[bookmark]
        if self.keyed and self.keys[bookmark] is not None:
            key = self.keys[bookmark]
            same_key = [b for b in self.live | set(self.holder) if self.keys[b] == key]
            if any(self.arrival[b] < arrival for b in same_key):
                return False
        pending = [self.arrival[b] for b in self.barriers if b in self.live]
        return not pending or arrival < min(pending)

    def check_work_conserving(self) -> None:
        available = [entry.bookmark for entry in self.queue.view(limit=10_000)]
        for consumer, limit in self.limits.items():
            if self.backlog[consumer] >= limit:
                continue
            expression = self.filters[consumer]
            starved = [
                b
                for b in available
                if b not in self.barriers
                and self.eligible(b)
                and (expression is None or expression.matches(self.docs[b]))
            ]
            assert not starved, f"{consumer} has room but {starved} stayed AVAILABLE"
        for barrier in self.barriers & self.live:
            due = (
                barrier in available
                and self.limits
                and not [
                    b
                    for b in self.live | set(self.holder)
                    if self.arrival[b] < self.arrival[barrier]
                ]
            )
            assert not due, f"barrier {barrier} was due but not delivered"

    @precondition(lambda self: bool(self.holder))
    @rule(
        data=st.data(),
        kind=st.sampled_from(list(AckType)),
        delay=st.sampled_from([None, 0.0, 3.0]),
        right_token=st.booleans(),
        dispatch=st.booleans(),
    )
    def ack(
        self,
        data: st.DataObject,
        kind: AckType,
        delay: float | None,
        right_token: bool,
        dispatch: bool,
    ) -> None:
        bookmark = data.draw(st.sampled_from(sorted(self.holder)))
        _consumer, token = self.holder[bookmark]
        result = self.queue.ack(
            [EntryAck(bookmark, token if right_token else "forged", kind, delay, "bad data")],
            self.now,
        )[0]
        strict = self.fields.get("leasing", "strict") == "strict"
        if right_token:
            assert result is AckOutcome.APPLIED
        elif strict:
            assert result is AckOutcome.WRONG_TOKEN
        self.drain()
        self.then(dispatch)

    @rule(bookmark_index=st.integers(0, 50), kind=st.sampled_from([AckType.ACCEPT]))
    def ack_something_unleased(self, bookmark_index: int, kind: AckType) -> None:
        """Acks for entries that are not leased (available, done or unknown) never break it."""
        bookmark = Bookmark(TOPIC, 0, bookmark_index)
        before = self.queue.entry(bookmark)
        deferred = (self.queue.deferred().get((TOPIC, 0), bookmark_index + 1) <= bookmark_index
                    < self.next_offset[0])
        result = self.queue.ack([EntryAck(bookmark, None, kind)], self.now)[0]
        if deferred:
            # Past target_queue_depth, not in memory: acknowledged (remembered) at once.
            assert result in (AckOutcome.APPLIED, AckOutcome.ALREADY_DONE,
                              AckOutcome.NOT_LEASED)
        elif before is None and bookmark_index < self.next_offset[0]:
            assert result in (AckOutcome.ALREADY_DONE, AckOutcome.UNKNOWN_BOOKMARK)
        self.drain()

    @rule(roll=st.integers(0, 5))
    def purge(self, roll: int) -> None:
        """qlayer queue purge: the active part, then the deferred part as it is read back."""
        if roll:
            return
        while self.queue.ack_matching(None, self.now):
            self.queue.tick(self.now)
        self.queue.purge_deferred()
        self.drain()
        assert self.queue.stats().not_read == 0

    @rule(filter=st.sampled_from(["/k = 1", "/p = 3"]), roll=st.integers(0, 5))
    def admin_ack(self, filter: str, roll: int) -> None:
        if roll:  # rare: it settles a third of the queue at once
            return
        self.queue.ack_matching(filter, self.now)
        self.drain()

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 7.0, 45.0]), dispatch=st.booleans())
    def advance(self, dt: float, dispatch: bool) -> None:
        self.now += dt
        self.queue.tick(self.now)
        self.drain()
        self.then(dispatch)

    @rule(late=st.sampled_from([0.0, 2.0]))
    def restart(self, late: float) -> None:
        """The coordinator restarts: everything in memory is rebuilt from what it persisted."""
        self.drain()
        points = self.queue.recovery_points()
        self.now += late
        self.queue = engine(seed=len(self.arrival), session_timeout=SESSION_TIMEOUT,
                            implementation=self.implementation, **self.fields)
        self.restarted = True
        self.queue.restore(self.store.values(), points)
        if self.at_most_once:
            # Backlog slots of at-most-once deliveries live in memory only: a restart frees them.
            for bookmark in [b for b in self.holder if b not in self.live]:
                self.end_lease(bookmark)
        subscriptions = list(self.subscriptions.values())
        for subscription in subscriptions:
            self.queue.subscribe(
                subscription.consumer_id,
                subscription.session_id,
                self.now,
                delivery_topic=subscription.delivery_topic,
                max_backlog=subscription.max_backlog,
                filter=subscription.filter,
            )
        # The journals are replayed from each partition's recovery point (records below it
        # too, as when another queue over the same journal needs them: they are ignored).
        self.queue.enqueue(
            sorted(
                self.records.values(),
                key=self.replay_order,
            ),
            self.now,
        )
        self.drain()
        deferred = self.deferred_live()
        for bookmark in self.live:
            entry = self.queue.entry(bookmark)
            if entry is None and bookmark in deferred:
                assert bookmark not in self.holder, f"{bookmark}: a lease was deferred"
                continue
            assert entry is not None and not entry.state.done, f"{bookmark} lost in a restart"
            held = self.holder.get(bookmark)
            if held is not None:
                assert (entry.state, entry.consumer_id, entry.token) == (
                    EntryState.LEASED,
                    *held,
                ), f"{bookmark}: lease not kept across the restart: {entry}"
            assert entry.delivery_count == self.delivered[bookmark]

    # ------------------------------------------------------------------ invariants
    @invariant()
    def nothing_is_lost(self) -> None:
        deferred = self.deferred_live()
        for bookmark in self.arrival:
            entry = self.queue.entry(bookmark)
            if bookmark in deferred:
                assert entry is None and self.outcomes[bookmark] == 0
            elif bookmark in self.live:
                assert entry is not None and not entry.state.done, f"{bookmark} lost: {entry}"
                assert self.outcomes[bookmark] == 0
            else:
                assert self.outcomes[bookmark] == 1
                assert entry is None or entry.state.done
        stats = self.queue.stats()
        held = stats.available + stats.leased + stats.delayed + stats.inactive
        assert held == len(self.live) - len(deferred)

    @invariant()
    def backlogs_agree(self) -> None:
        engine_view = {c.consumer_id: c.backlog for c in self.queue.consumers()}
        assert engine_view == {c: self.backlog[c] for c in self.limits}
        leased = [b for b in self.holder if b in self.live]
        assert all(self.queue.entry(b).state is EntryState.LEASED for b in leased)

    @invariant()
    def target_depth_keeps_the_active_part_full(self) -> None:
        depth = self.fields.get("target_queue_depth")
        if not isinstance(depth, int):
            return
        stats = self.queue.stats()
        active = stats.available + stats.leased + stats.delayed
        if self.queue.deferred():
            # Records wait past the depth: the coordinator has read them back into every
            # place that came free (`serve_rereads`); restored leases may exceed it.
            assert active >= depth, (active, stats)
        elif self.restarted:
            assert active >= min(depth, len(self.live)), (active, stats)
        else:
            assert active == min(depth, len(self.live)), (active, stats)

    @invariant()
    def recovery_point_never_passes_an_entry_not_done(self) -> None:
        for (topic, partition), offset in self.queue.recovery_points().items():
            pending = [b.offset for b in self.live if (b.topic, b.partition) == (topic, partition)]
            if pending:
                assert offset <= min(pending)
            else:
                assert offset <= self.next_offset[partition]


class AtLeastOnceLimits(EngineMachine):
    fields: ClassVar[dict[str, object]] = {
        "max_deliveries": 3,
        "max_cancels": 2,
        "lease_period": "5s",
        "expiration": "60s",
        "max_per_subscription_backlog": 3,
    }


class RoundRobinPriorityBackoff(EngineMachine):
    fields: ClassVar[dict[str, object]] = {
        "priority": "/p",
        "fairness": "round-robin",
        "lease_period": "4s",
        "redelivery_backoff": {"initial": "1s", "multiplier": 2, "maximum": "5s"},
    }


class FastPermissive(EngineMachine):
    fields: ClassVar[dict[str, object]] = {"fairness": "fast", "leasing": "permissive"}


class AtMostOnce(EngineMachine):
    fields: ClassVar[dict[str, object]] = {"semantics": "at-most-once", "lease_period": "6s"}


class KeyGroups(EngineMachine):
    fields: ClassVar[dict[str, object]] = {"key_groups": True, "lease_period": "5s"}


class Barriers(EngineMachine):
    fields: ClassVar[dict[str, object]] = {
        "barrier_expression": "/barrier = 1",
        "priority": "/p",
        "lease_period": "5s",
    }
    barrier_every = 4


class TargetDepth(EngineMachine):
    fields: ClassVar[dict[str, object]] = {
        "target_queue_depth": 4,
        "leasing": "permissive",
        "lease_period": "5s",
        "max_cancels": 3,
        "expiration": "20s",
    }


def _case(machine: type[EngineMachine], implementation: str = "python") -> type:
    if implementation != "python":
        machine = type(f"{machine.__name__}Native", (machine,),
                       {"implementation": implementation})
    case = machine.TestCase
    case.settings = MACHINE_SETTINGS
    return case


TestAtLeastOnceLimits = _case(AtLeastOnceLimits)
TestRoundRobinPriorityBackoff = _case(RoundRobinPriorityBackoff)
TestFastPermissive = _case(FastPermissive)
TestAtMostOnce = _case(AtMostOnce)
TestKeyGroups = _case(KeyGroups)
TestBarriers = _case(Barriers)
TestTargetDepth = _case(TargetDepth)

# The same machines on the native engine (layer/domain/native.py).
TestAtLeastOnceLimitsNative = _case(AtLeastOnceLimits, "native")
TestRoundRobinPriorityBackoffNative = _case(RoundRobinPriorityBackoff, "native")
TestFastPermissiveNative = _case(FastPermissive, "native")
TestAtMostOnceNative = _case(AtMostOnce, "native")
TestKeyGroupsNative = _case(KeyGroups, "native")
TestBarriersNative = _case(Barriers, "native")
TestTargetDepthNative = _case(TargetDepth, "native")
