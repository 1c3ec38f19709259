"""The native shard core against the Python reference, side by side (differential testing).

Two `ShardCore`s serve the same queues, one with the Python engines and per-message paths, one
with the native engines and the native lane (`layer/coordinator/lane.py`). A hypothesis state
machine gives both the same records (subscribes in either delivery format, journal records with
keys, headers, tombstones and deliver-at times, AcceptRecords, ack items of every type, wrong
tokens, unsubscribes) and time, with identically seeded lease tokens, and requires that each
step writes the same: the delivery records on every consumer's topic (decoded: every message
with its lease), the EventBatch's items byte for byte, the store's rows (runs expanded), the
counters, recovery points, input positions, replies and dead letters.
"""

from __future__ import annotations

import json
import random
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from layer.coordinator.catalog import Catalog
from layer.coordinator.core import Plan, QueueState, ShardCore
from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.output import Output
from layer.coordinator.ports import FakeTopicAdmin
from layer.coordinator.refused import Refused
from layer.domain.definitions import QueueDefinition
from layer.domain.native import native_available
from layer.domain.states import Bookmark
from layer.kafka import JournalRecord
from layer.protocol import (
    AcceptGroup,
    AcceptRecord,
    AckItem,
    AckRecord,
    AckType,
    Codec,
    Subscribe,
    TopicNames,
    Unsubscribe,
    decode_delivery_batch,
)
from layer.protocol.batch import DELIVERY_FORMAT
from layer.protocol.headers import DELIVER_AT
from layer.store.rows import QueueRecord
from tests.support.examples import examples

pytestmark = pytest.mark.skipif(not native_available(), reason="never: make install builds it")

TOPICS = TopicNames("qt.")
CODEC = Codec()
JOURNAL = "work"
CONSUMERS = ("a", "b", "c")

QUEUES = {
    "plain": {"lease_period": "5s", "max_per_subscription_backlog": 5},
    "limits": {"lease_period": "4s", "max_deliveries": 2, "max_cancels": 2,
               "dead_letter_topic": "dlq", "expiration": "30s"},
    "priority": {"priority": "/p", "lease_period": "5s", "key_groups": True},
    "at-most-once": {"semantics": "at-most-once", "lease_period": "5s"},
}


def _core(kind: str, definition: dict[str, Any], seed: int) -> ShardCore:
    record = QueueRecord(name="Work", definition={"name": "Work", "underlying_topic": JOURNAL,
                                                   **definition},
                         version=1, created_at=0.0, updated_at=0.0, shard=0)
    catalog = Catalog.of(1, [record], [], now=0.0)
    admin = FakeTopicAdmin({JOURNAL: 2, TOPICS.control: 1, TOPICS.ack: 1})
    rng = random.Random(seed)
    core = ShardCore(0, CoordinatorOptions(owner_id="test", core=kind, payload_budget=60_000),
                     topics=TOPICS, catalog=lambda: catalog, admin=admin,
                     tokens=lambda: f"{rng.getrandbits(64):016x}", owner_id="test")
    core.epoch = 1
    starts = {(JOURNAL, p): 0 for p in range(2)}
    core.add_queue(QueueState(QueueDefinition.from_mapping(record.definition), 1, [], starts,
                              {}, {}, starts), [], 0.0)
    return core


def _rows(plan: Plan) -> set[tuple[Any, ...]]:
    """The batch's entry rows, runs expanded into the rows they stand for."""
    rows = {tuple(row) for row in plan.batch.entries.values()}
    for run in plan.batch.runs:
        queue, topic, partition, state, deliveries, cancels, consumer, deadline = run.key
        for i, offset in enumerate(run.offsets):
            token = run.tokens[i] if run.tokens is not None else None
            rows.add((queue, topic, partition, offset, state, deliveries, cancels, consumer,
                      token, deadline, None, None))
    return rows


def _by_topic(records: list[Any]) -> dict[str, list[Any]]:
    """Delivery records per destination topic, decoded (order kept per topic)."""
    out: dict[str, list[Any]] = {}
    for r in records:
        headers = dict(r.headers or [])
        if headers.get("qlayer.batch") == b"1":
            body: Any = [(r.key, headers.get("qlayer.session"), e)
                         for e in decode_delivery_batch(r.value or b"")]
        else:
            body = [(r.key, r.value, sorted(r.headers or []), r.timestamp_ms)]
        out.setdefault(r.topic, []).extend(body)
    return out


class Twins(RuleBasedStateMachine):
    """The same queue on both cores."""

    def __init__(self) -> None:
        super().__init__()
        self.offsets: dict[str, int] = {}
        self.now = 1.0
        self.leases: list[tuple[str, str, int, int, str]] = []  # consumer, topic, p, o, token
        self.subscribed: dict[str, int] = {}
        self.cores: tuple[ShardCore, ShardCore] | None = None

    @initialize(queue=st.sampled_from(sorted(QUEUES)), seed=st.integers(0, 1000))
    def start(self, queue: str, seed: int) -> None:
        self.cores = (_core("python", QUEUES[queue], seed), _core("native", QUEUES[queue], seed))
        self.outputs = tuple(Output(c) for c in self.cores)

    def _input(self, topic: str, value: bytes | None, key: bytes | None = None,
               headers: list[tuple[str, bytes | None]] | None = None,
               partition: int = 0, timestamp: int = 1) -> JournalRecord:
        at = (topic, partition)
        offset = self.offsets.get(f"{at}", 0)
        self.offsets[f"{at}"] = offset + 1
        return JournalRecord(topic, partition, offset, key, value, timestamp, headers)

    def step(self, records: list[JournalRecord]) -> None:
        assert self.cores is not None
        seen = []
        for core, output in zip(self.cores, self.outputs, strict=True):
            plan = core.step(records, self.now)
            expired = sorted(str(e.bookmark) for e in plan.expired)
            items = output.event_records(plan.events, plan.fresh)
            deliveries = output.deliveries(plan.deliveries, {})
            delivered = output.delivered
            core.settled(plan)
            seen.append({
                "deliveries": _by_topic(deliveries),
                "delivered": delivered,
                "items": items,
                "rows": _rows(plan),
                "counters": {q: dict(c) for q, c in plan.batch.counters.items()},
                "points": dict(plan.batch.recovery_points),
                "admitted": dict(plan.batch.admitted),
                "positions": dict(plan.batch.input_positions),
                "replies": [(r.topic, r.key, r.value) for r in plan.replies],
                "expired": expired,
                "wanted": sorted(map(str, plan.wanted_documents)),
            })
        python, native = seen
        for key in python:
            assert python[key] == native[key], f"{key}: {python[key]!r} != {native[key]!r}"
        # What the consumers got, for the next acks (both cores gave the same).
        for entries in python["deliveries"].values():
            for item in entries:
                if len(item) == 3 and not item[2].barrier:
                    consumer = (item[0] or b"").decode()
                    e = item[2]
                    self.leases.append((consumer, e.topic, e.partition, e.offset, e.lease))
        self.leases = self.leases[-40:]

    # ------------------------------------------------------------------ inputs
    @rule(consumer=st.sampled_from(CONSUMERS), backlog=st.integers(0, 4), batch=st.booleans(),
          filter=st.sampled_from([None, None, "/k = 1"]), new_session=st.booleans())
    def subscribe(self, consumer: str, backlog: int, batch: bool, filter: str | None,
                  new_session: bool) -> None:
        if new_session or consumer not in self.subscribed:
            self.subscribed[consumer] = self.subscribed.get(consumer, 0) + 1
        session = f"s-{consumer}-{self.subscribed[consumer]}"
        headers = [(DELIVERY_FORMAT, b"batch" if batch else b"record")]
        self.step([self._input(TOPICS.control, CODEC.encode_control(Subscribe(
            consumer_id=consumer, session_id=session, request_id="r", queue="Work",
            queue_is_regex=False, max_backlog=backlog, filter=filter,
            delivery_topic=TOPICS.delivery(consumer), session_timeout_ms=20_000,
            client_name="test", client_version="0", sent_at_ms=0)), consumer.encode(), headers)])

    @rule(docs=st.lists(st.fixed_dictionaries({"k": st.integers(0, 2),
                                               "p": st.integers(0, 3)}), min_size=1, max_size=8),
          partition=st.integers(0, 1), tombstone=st.booleans(), headers=st.booleans(),
          delay=st.sampled_from([None, None, 2.0]))
    def publish(self, docs: list[dict[str, int]], partition: int, tombstone: bool,
                headers: bool, delay: float | None) -> None:
        records = []
        for i, doc in enumerate(docs):
            value = None if tombstone and i == 1 else json.dumps(doc).encode()
            extra: list[tuple[str, bytes | None]] | None = None
            if headers:
                extra = [("trace", b"t1"), ("qlayer.lease", b"stale")]
                if delay is not None:
                    extra.append((DELIVER_AT, str(int((self.now + delay) * 1000)).encode()))
            records.append(self._input(JOURNAL, value, f"k{i % 3}".encode(), extra, partition,
                                       1_700_000_000_000 + i))
        self.step(records)

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data(), forged=st.booleans())
    def accept(self, data: st.DataObject, forged: bool) -> None:
        consumer = data.draw(st.sampled_from(sorted({lease[0] for lease in self.leases})))
        mine = [lease for lease in self.leases if lease[0] == consumer]
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=6))
        groups: dict[tuple[str, int], list[tuple[int, str]]] = {}
        for _, topic, partition, offset, token in chosen:
            groups.setdefault((topic, partition), []).append(
                (offset, "forged" if forged else token))
        session = f"s-{consumer}-{self.subscribed.get(consumer, 0)}"
        self.step([self._input(TOPICS.ack, CODEC.encode_accept(AcceptRecord(
            consumer_id=consumer, session_id=session, sent_at_ms=0, groups=tuple(
                AcceptGroup(queue="Work", topic=t, partition=p,
                            offsets=tuple(o for o, _ in items),
                            leases=tuple(tok for _, tok in items))
                for (t, p), items in groups.items()))), consumer.encode())])

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data(), kind=st.sampled_from(list(AckType)))
    def ack(self, data: st.DataObject, kind: AckType) -> None:
        consumer, topic, partition, offset, token = data.draw(st.sampled_from(self.leases))
        session = f"s-{consumer}-{self.subscribed.get(consumer, 0)}"
        self.step([self._input(TOPICS.ack, CODEC.encode_ack(AckRecord(
            consumer_id=consumer, session_id=session, sent_at_ms=0, items=(AckItem(
                queue="Work", bookmark=f"{topic}/{partition}/{offset}", lease=token,
                type=kind, delay_ms=1000 if kind is AckType.RELEASE else None,
                reason="bad" if kind is AckType.REJECT else None),))), consumer.encode())])

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def refused_as_too_large(self, data: st.DataObject) -> None:
        """A delivery topic refused a delivery (learned from a delivery report): the next
        step dead-letters it, leased (at-least-once) or already done (at-most-once)."""
        _, topic, partition, offset, token = data.draw(st.sampled_from(self.leases))
        assert self.cores is not None
        for core in self.cores:
            core.too_large([Refused("Work", Bookmark(topic, partition, offset), token, 1,
                                    False)])
        self.step([])

    @rule(consumer=st.sampled_from(CONSUMERS))
    def unsubscribe(self, consumer: str) -> None:
        session = f"s-{consumer}-{self.subscribed.get(consumer, 0)}"
        self.step([self._input(TOPICS.control, CODEC.encode_control(Unsubscribe(
            consumer_id=consumer, session_id=session, sent_at_ms=0)), consumer.encode())])

    @rule(seconds=st.sampled_from([0.0, 0.5, 2.5, 6.0, 25.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.step([])


Twins.TestCase.settings = settings(max_examples=examples(120), stateful_step_count=40,
                                   deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestTwins = Twins.TestCase
