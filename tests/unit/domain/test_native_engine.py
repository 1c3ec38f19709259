"""The native engine against the Python reference, side by side (differential testing).

A hypothesis state machine drives two engines of the same queue, the Python `QueueEngine` and
the native port (`layer.domain.native`), with the same operations in the same order, each
with an identically seeded token source, and requires every answer to be equal: deliveries,
ack outcomes, events and changed entry states (`drain`), views, stats, consumers, recovery
points, timer deadlines, the documents asked for again, and the state after a restart. Any
difference is a bug in the port (or an unintended change to the reference).

Each queue configuration is its own machine; together they reach every transition.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from layer.domain.consumers import BacklogShare
from layer.domain.definitions import QueueDefinition
from layer.domain.engine import EntryAck, QueueEngine, random_tokens
from layer.domain.entries import DELETE, EntryRecord, OfferedRecord
from layer.domain.events import EntryLeased, Outbox
from layer.domain.expressions import RawDocument, project
from layer.domain.native import NativeQueueEngine, native_available
from layer.domain.states import AckType, Bookmark, ExpiryReason, LeaveReason
from tests.support.examples import examples

pytestmark = pytest.mark.skipif(not native_available(), reason="never: make install builds it")

TOPIC = "Work"
CONSUMERS = ("a", "b", "c")
FILTERS = (None, "/k = 0", "/k <> 0", "/k IS NULL")
#: Destructive rules (admin acks, retention, restarts) act on one draw in five, so queues get
#: deep enough for dispatch to matter.
ROLL = st.integers(0, 4)
MACHINE_SETTINGS = settings(max_examples=examples(150), stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])

documents = st.one_of(
    st.fixed_dictionaries({"k": st.integers(0, 2)},
                          optional={"p": st.one_of(st.none(), st.integers(0, 3), st.just("x"),
                                                   st.floats(-1, 5), st.just(float("nan"))),
                                    "barrier": st.just(1)}),
    st.none(),
    st.just(DELETE),
)


class Twins(RuleBasedStateMachine):
    """Two engines, one of each implementation, fed the same inputs."""

    fields: ClassVar[dict[str, object]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.definition = QueueDefinition.model_validate(
            {"name": "Q", "underlying_topic": TOPIC, "max_per_subscription_backlog": 4,
             **self.fields})
        self.seed = 0
        self.python, self.native = self._pair()
        self.now = 0.0
        self.next_offset = [0, 0]
        self.offered: list[OfferedRecord] = []
        self.leases: list[EntryLeased] = []
        self.sessions: dict[str, int] = {}
        self.stored: dict[Bookmark, EntryRecord] = {}
        self.shares: tuple[BacklogShare, BacklogShare] | None = None

    def _pair(self) -> tuple[QueueEngine, NativeQueueEngine]:
        self.seed += 1
        pair = (QueueEngine(self.definition, tokens=random_tokens(random.Random(self.seed)),
                            session_timeout=30.0),
                NativeQueueEngine(self.definition,
                                  tokens=random_tokens(random.Random(self.seed)),
                                  session_timeout=30.0))
        if self.definition.parts > 1:
            # One part of the queue, as a shard serves it: the records of the other parts'
            # partitions are offered too (another queue's journal read) and passed over.
            for engine in pair:
                engine.serve_parts(self.definition.parts, frozenset({1}))
        return pair

    def both(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the method on both engines; they must answer alike (errors included)."""
        answers = []
        for engine in (self.python, self.native):
            try:
                answers.append(("ok", getattr(engine, method)(*args, **kwargs)))
            except Exception as exc:  # compared below: the same kind of error
                answers.append(("error", type(exc).__name__))
        assert answers[0] == answers[1], f"{method}{args}: {answers[0]!r} != {answers[1]!r}"
        return answers[0][1]

    def _absorb(self, outbox: Outbox) -> None:
        for record in outbox.entries:
            self.stored[record.bookmark] = record

    # ------------------------------------------------------------------ inputs
    @initialize(docs=st.lists(documents, min_size=3, max_size=10),
                backlogs=st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3),
                filters=st.lists(st.sampled_from(FILTERS), min_size=3, max_size=3))
    def busy_start(self, docs: list[object], backlogs: list[int],
                   filters: list[str | None]) -> None:
        """Start with entries and consumers, so dispatch has work from the first step."""
        self.offer(docs, 0, False, None, None, False)
        for consumer, backlog, filter in zip(CONSUMERS, backlogs, filters, strict=False):
            self.subscribe(consumer, backlog, filter, False, False)

    @rule(docs=st.lists(documents, min_size=1, max_size=6), partition=st.integers(0, 1),
          keyed=st.booleans(), delay=st.sampled_from([None, None, 0.5, 3.0]),
          projected=st.sampled_from([None, None, frozenset(), frozenset({"/k"})]),
          raw=st.booleans(), expiration=st.sampled_from([None, None, None, 0.5, 4.0]))
    def offer(self, docs: list[object], partition: int, keyed: bool, delay: float | None,
              projected: frozenset[str] | None, raw: bool,
              expiration: float | None = None) -> None:
        records = []
        for i, doc in enumerate(docs):
            offset = self.next_offset[partition]
            self.next_offset[partition] += 1
            if projected is not None and doc is not DELETE:
                doc = project(doc, projected) if projected else None
            elif raw and isinstance(doc, dict):
                doc = RawDocument(repr(doc).replace("'", '"').replace("None", "null")
                                  .replace("nan", "NaN").encode())
            records.append(OfferedRecord(
                TOPIC, partition, offset, f"k{i % 2}".encode() if keyed else None, doc,
                self.now - 1.0, self.now + delay if delay else None,
                expiration if i % 2 == 0 else None))
        self.offered.extend(records)
        self.both("enqueue", records, self.now, projected)

    @rule(consumer=st.sampled_from(CONSUMERS), backlog=st.sampled_from([None, 0, 1, 2, 5]),
          filter=st.sampled_from(FILTERS), new_session=st.booleans(), shared=st.booleans())
    def subscribe(self, consumer: str, backlog: int | None, filter: str | None,
                  new_session: bool, shared: bool) -> None:
        if new_session or consumer not in self.sessions:
            self.sessions[consumer] = self.sessions.get(consumer, 0) + 1
        session = f"{consumer}-{self.sessions[consumer]}"
        share_py = share_native = None
        if shared and consumer == "c":
            if self.shares is None:
                self.shares = (BacklogShare(), BacklogShare())
            share_py, share_native = self.shares
        answers = []
        for engine, share in ((self.python, share_py), (self.native, share_native)):
            try:
                answers.append(engine.subscribe(consumer, session, self.now,
                                                delivery_topic=f"d.{consumer}",
                                                max_backlog=backlog, filter=filter,
                                                share=share))
            except ValueError as exc:
                answers.append(str(exc))
        assert answers[0] == answers[1]

    @rule(consumer=st.sampled_from(CONSUMERS), backlog=st.sampled_from([None, 1, 3]),
          filter=st.sampled_from(FILTERS))
    def replace(self, consumer: str, backlog: int | None, filter: str | None) -> None:
        self.both("replace", consumer, self.now, max_backlog=backlog, filter=filter)

    @rule(consumer=st.sampled_from(CONSUMERS), shared=st.booleans())
    def retire(self, consumer: str, shared: bool) -> None:
        """A replace took the subscription off the queue (it keeps its leases)."""
        share_py = share_native = None
        if shared:
            if self.shares is None:
                self.shares = (BacklogShare(), BacklogShare())
            share_py, share_native = self.shares
        assert (self.python.retire(consumer, self.now, share_py)
                == self.native.retire(consumer, self.now, share_native))

    @rule(consumer=st.sampled_from(CONSUMERS), same_session=st.booleans())
    def heartbeat(self, consumer: str, same_session: bool) -> None:
        session = f"{consumer}-{self.sessions.get(consumer, 0)}" if same_session else "other"
        self.both("heartbeat", consumer, self.now, session)

    @rule(consumer=st.sampled_from(CONSUMERS),
          reason=st.sampled_from([LeaveReason.UNSUBSCRIBED, LeaveReason.EVICTED]))
    def unsubscribe(self, consumer: str, reason: LeaveReason) -> None:
        self.both("unsubscribe", consumer, self.now, reason)

    @rule(consumer=st.sampled_from([*CONSUMERS, "nobody"]))
    def transactional(self, consumer: str) -> None:
        """The consumer settles in its own Kafka transactions: its leases and session wait
        for a fence."""
        self.both("set_transactional", consumer)

    @rule(data=st.data())
    def fence_done(self, data: st.DataObject) -> None:
        """The coordinator fenced one of the consumers held for a fence (or a gone one)."""
        wanted = self.both("take_fences")
        consumer = data.draw(st.sampled_from([*wanted, *CONSUMERS, "nobody"]))
        self.both("fenced", consumer, self.now)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), kind=st.sampled_from(list(AckType)),
          token=st.sampled_from(["right", "right", "wrong", None]),
          delay=st.sampled_from([None, 0.0, 2.0]), count=st.integers(1, 4))
    def ack(self, data: st.DataObject, kind: AckType, token: str | None, delay: float | None,
            count: int) -> None:
        items = []
        for _ in range(count):
            lease = data.draw(st.sampled_from(self.leases))
            given = lease.token if token == "right" else token
            items.append(EntryAck(lease.bookmark, given, kind, delay, "bad"))
        self.both("ack", items, self.now)

    @rule(offset=st.integers(0, 30), partition=st.integers(0, 1),
          kind=st.sampled_from([AckType.ACCEPT, AckType.REJECT, AckType.RELEASE]))
    def ack_any_bookmark(self, offset: int, partition: int, kind: AckType) -> None:
        self.both("ack", [EntryAck(Bookmark(TOPIC, partition, offset), "t", kind)], self.now)

    @rule(filter=st.sampled_from(FILTERS), roll=ROLL)
    def ack_matching(self, filter: str | None, roll: int) -> None:
        if roll == 0:  # rarely: it settles most of the queue
            self.both("ack_matching", filter, self.now)

    @rule(seconds=st.sampled_from([0.0, 0.4, 1.0, 3.0, 7.0]))
    def time_passes(self, seconds: float) -> None:
        self._pass(seconds)

    @rule(roll=ROLL)
    def long_pause(self, roll: int) -> None:
        """Past the session timeout: every consumer leaves."""
        if roll == 0:
            self._pass(40.0)

    def _pass(self, seconds: float) -> None:
        self.now += seconds
        self.both("tick", self.now)
        self.both("resends", self.now)

    @rule()
    def dispatch(self) -> None:
        deliveries = self.both("dispatch", self.now)
        self.leases.extend(d for d in deliveries if isinstance(d, EntryLeased))
        self.leases = self.leases[-30:]

    @rule()
    def dispatch_again(self) -> None:
        self.dispatch()

    @rule(consumer=st.sampled_from([*CONSUMERS, "nobody"]))
    def credit_view(self, consumer: str) -> None:
        # A rule, not a reading: it moves the consumer's pointer as dispatch would, and what
        # the engines dispatch after it must still agree.
        self.both("credit_view", consumer)

    @rule()
    def drain(self) -> None:
        self._absorb(self.both("drain"))

    @rule(fields=st.sampled_from([frozenset({"/k"}), frozenset({"/k", "/p"})]))
    def documents_come_back(self, fields: frozenset[str]) -> None:
        wanted = self.both("documents_wanted")
        by_bookmark = {Bookmark(r.topic, r.partition, r.offset): r.doc for r in self.offered}
        docs = {b: by_bookmark.get(b) for b in wanted}
        self.both("refresh_documents", docs, fields)

    @rule(short=st.booleans())
    def deferred_records_come_back(self, short: bool) -> None:
        """The coordinator reads the ranges past target_queue_depth again (in timestamp
        order across partitions) and offers them back; ``short``: a read that stopped early
        (fewer records than asked, ending before ``until``)."""
        wanted = self.both("records_wanted")
        if not wanted:
            return
        records: list[OfferedRecord] = []
        through: dict[tuple[str, int], int] = {}
        for w in wanted:
            got = [r for r in self.offered if (r.topic, r.partition) == (w.topic, w.partition)
                   and w.from_offset <= r.offset < w.until][:w.max_records]
            if short and len(got) > 1:
                got = got[:-1]
                through[(w.topic, w.partition)] = got[-1].offset + 1
            elif len(got) == w.max_records:
                through[(w.topic, w.partition)] = got[-1].offset + 1
            else:
                through[(w.topic, w.partition)] = w.until
            records.extend(got)
        records.sort(key=lambda r: (r.timestamp or 0.0, r.partition))
        self.both("readmit", records, through, self.now)

    @rule(roll=ROLL)
    def purge_deferred(self, roll: int) -> None:
        if roll == 0:
            self.both("purge_deferred")

    @rule(partition=st.integers(0, 1), offset=st.integers(0, 6), roll=ROLL)
    def retention(self, partition: int, offset: int, roll: int) -> None:
        if roll == 0:
            self.both("expire_before", TOPIC, partition, offset, self.now)

    @rule(partition=st.integers(0, 1), roll=ROLL)
    def journal_deleted(self, partition: int, roll: int) -> None:
        if roll == 0:
            self.both("expire_before", TOPIC, partition, 1 << 62, self.now,
                      ExpiryReason.JOURNAL_DELETED)

    @rule(partition=st.integers(0, 1), offset=st.integers(0, 6),
          delivered=st.booleans())
    def too_large(self, partition: int, offset: int, delivered: bool) -> None:
        # An entry in any state (available, leased, done, unknown) found too large to deliver.
        self.both("expire_entries", [Bookmark(TOPIC, partition, offset)],
                  ExpiryReason.TOO_LARGE, self.now, "over the limit" if delivered else None)

    @rule(roll=ROLL)
    def restart(self, roll: int) -> None:
        """Both restart from the same stored states and replay the journal from the same
        recovery points (the coordinator's restart)."""
        if roll != 0:
            return
        self._absorb(self.both("drain"))
        points = self.both("recovery_points")
        self.python, self.native = self._pair()
        self.shares = None
        entries = list(self.stored.values())
        self.both("restore", entries, points)
        replay = [r for r in self.offered if r.offset >= points.get((r.topic, r.partition), 0)]
        self.both("enqueue", replay, self.now)
        self.leases = []

    # ------------------------------------------------------------------ readings
    @invariant()
    def readings_agree(self) -> None:
        self.both("stats")
        self.both("consumers")
        self.both("next_deadline")
        self.both("fields_needed")
        self.both("deferred")
        self.both("records_wanted")
        for filter in FILTERS:
            self.both("view", filter, 5)
        for partition in (0, 1):
            self.both("serves", partition)
            for offset in (0, 1, 3):
                bookmark = Bookmark(TOPIC, partition, offset)
                self.both("entry", bookmark)
                self.both("restoring", bookmark)

    def teardown(self) -> None:
        # The last decisions agree too.
        self.both("dispatch", self.now)
        self.both("drain")
        self.both("recovery_points")


class Plain(Twins):
    fields: ClassVar[dict[str, object]] = {"lease_period": "5s"}


class Limits(Twins):
    fields: ClassVar[dict[str, object]] = {
        "max_deliveries": 3, "max_cancels": 2, "lease_period": "4s", "expiration": "20s",
        "redelivery_backoff": {"initial": "1s", "multiplier": 2, "maximum": "5s"},
        "dead_letter_topic": "dlq"}


class PriorityRoundRobin(Twins):
    fields: ClassVar[dict[str, object]] = {"priority": "/p", "fairness": "round-robin",
                                           "lease_period": "4s"}


class FastPermissive(Twins):
    fields: ClassVar[dict[str, object]] = {"fairness": "fast", "leasing": "permissive",
                                           "filter": "/k <> 2"}


class AtMostOnce(Twins):
    fields: ClassVar[dict[str, object]] = {"semantics": "at-most-once", "lease_period": "6s",
                                           "key_groups": True}


class KeyGroups(Twins):
    fields: ClassVar[dict[str, object]] = {"key_groups": True, "lease_period": "5s",
                                           "delivery_delay": "2s"}


class Parts(Twins):
    fields: ClassVar[dict[str, object]] = {"parts": 2, "key_groups": True, "priority": "/p",
                                           "lease_period": "5s"}


class Barriers(Twins):
    fields: ClassVar[dict[str, object]] = {"barrier_expression": "/barrier = 1",
                                           "priority": "/p", "lease_period": "5s"}


class TargetDepth(Twins):
    fields: ClassVar[dict[str, object]] = {"target_queue_depth": 4, "leasing": "permissive",
                                           "lease_period": "5s", "max_cancels": 3,
                                           "expiration": "20s"}


def _case(machine: type[Twins]) -> type:
    case = machine.TestCase
    case.settings = MACHINE_SETTINGS
    return case


TestPlain = _case(Plain)
TestLimits = _case(Limits)
TestPriorityRoundRobin = _case(PriorityRoundRobin)
TestFastPermissive = _case(FastPermissive)
TestAtMostOnce = _case(AtMostOnce)
TestKeyGroups = _case(KeyGroups)
TestBarriers = _case(Barriers)
TestParts = _case(Parts)
TestTargetDepth = _case(TargetDepth)
