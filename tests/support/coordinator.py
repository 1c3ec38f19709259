"""Test support: a real coordinator in a thread, and a consumer built only from the protocol.

`RawConsumer` knows nothing of `layer.sdk`: it is what a team writing a consumer in another
language would build from docs/protocol.md — a plain Kafka consumer on its delivery topic and
a plain producer of hand-encoded control and ack records.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.process import CoordinatorProcess
from layer.coordinator.shard import ShardLoop
from layer.kafka.logs import logged
from layer.protocol import (
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckType,
    Codec,
    Event,
    Heartbeat,
    Replace,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    TopicNames,
    Unsubscribe,
    is_reply,
    parse_delivery_headers,
    proof_headers,
    reply_shard,
    secret_headers,
)
from layer.protocol.headers import CREDENTIAL, new_session_secret
from layer.settings import Settings
from layer.store.store import Store
from layer.store.tables import COUNTER_NAMES
from tests.support.kafka import create_topic


@contextmanager
def running_coordinator(settings: Settings, *, loop_class: type[ShardLoop] = ShardLoop,
                        wait_for_shards: bool = True,
                        **options: object) -> Iterator[CoordinatorProcess]:
    """A coordinator process running its real loop in a background thread until the block
    ends; by default the block starts once it runs every shard (it is alone)."""
    defaults: dict[str, object] = {"transactional": False, "refresh_interval": 0.5,
                                    "topic_check_interval": 0.5, "group_session_timeout": 6.0,
                                    # The test process outlives its coordinators: nothing of
                                    # theirs may be frozen out of the collector's reach.
                                    "gc_freeze": False}
    defaults.update(options)
    coordinator = CoordinatorProcess(
        settings, CoordinatorOptions(**defaults),  # type: ignore[arg-type]
        loop_class=loop_class)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            coordinator.run(install_signals=False)
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=target, name="coordinator", daemon=True)
    thread.start()
    try:
        if wait_for_shards:
            with Store(settings.database_url) as store:
                count = store.shard_count()
            deadline = time.monotonic() + 60
            while len(coordinator.shards) < count and not errors:
                assert time.monotonic() < deadline, (
                    f"the coordinator runs shards {coordinator.shards} of {count} after 60s")
                time.sleep(0.05)
        yield coordinator
    finally:
        coordinator.stop()
        thread.join(30)
        # Raised even when the block failed: a dead coordinator is usually why it did (the
        # block's own error is kept as the context).
        if errors:
            raise errors[0]


def put_queues(settings: Settings, *definitions: dict[str, object]) -> None:
    with Store(settings.database_url) as store:
        for d in definitions:
            store.put_queue(str(d["name"]), d, time.time())


@dataclass
class Delivered:
    queue: str
    bookmark: str
    lease: str
    value: bytes | None
    key: bytes | None
    delivery_count: int
    barrier: bool
    headers: list[tuple[str, bytes | None]]


class RawConsumer:
    """A queue consumer written against the wire protocol only.

    With ``follow_shard`` (protocol 2, the default) it writes its control and ack records to
    the partition a reply's ``qlayer.shard`` header names; without, it writes them by key as a
    protocol-1 client does, and the coordinators pass them on. With ``identity`` (protocol 5,
    the default) its Subscribe carries a session secret (``secret``, settable to forge) and
    every later record proves it; without, it is a protocol 1–4 consumer. It creates its
    delivery topic itself (replies create none), as the SDK does."""

    def __init__(self, bootstrap_servers: str, prefix: str, queue: str, *,
                 max_backlog: int | None = None, filter: str | None = None,
                 session_timeout_ms: int = 10_000, consumer_id: str | None = None,
                 queue_is_regex: bool = False, follow_shard: bool = True,
                 identity: bool = True, credential: str | None = None,
                 kafka: dict[str, str] | None = None, create_delivery_topic: bool = True,
                 read_delivery_topic: bool = True,
                 extra_headers: list[tuple[str, bytes | None]] | None = None) -> None:
        self.codec = Codec()
        self.topics = TopicNames(prefix)
        self.consumer_id = consumer_id or f"raw-{uuid.uuid4().hex[:8]}"
        self.session_id = uuid.uuid4().hex
        self.queue = queue
        self.queue_is_regex = queue_is_regex
        self.delivery_topic = self.topics.delivery(self.consumer_id)
        #: The session secret its Subscribe sends and later records prove (None: protocol 1–4).
        self.secret: bytes | None = new_session_secret() if identity else None
        #: The principal's credential its Subscribe sends (protocol 7; None: anonymous).
        self.credential = credential
        #: More headers its Subscribe sends (a later protocol's, or forged ones).
        self.extra_headers = list(extra_headers or [])
        security = dict(kafka or {})
        if create_delivery_topic:
            create_topic(bootstrap_servers, self.delivery_topic, 1, exist_ok=True)
        self.producer = Producer(logged({"bootstrap.servers": bootstrap_servers,
                                         "linger.ms": 1, **security}))
        # A forger under ACLs may not read the consumer id's delivery topic: it writes only.
        self.consumer = Consumer(logged({"bootstrap.servers": bootstrap_servers,
                                         "group.id": self.consumer_id,
                                         "enable.auto.commit": False,
                                         "auto.offset.reset": "earliest", **security}))
        if read_delivery_topic:
            self.consumer.assign([TopicPartition(self.delivery_topic, 0, 0)])
        self.replies: list[object] = []
        self.max_backlog = max_backlog
        self.filter = filter
        self.session_timeout_ms = session_timeout_ms
        self._early: list[Delivered] = []
        #: True once the coordinator accepted a Subscribe, until unsubscribe().
        self.subscribed = False
        self._next_heartbeat = time.monotonic() + session_timeout_ms / 3000
        self.follow_shard = follow_shard
        #: The shard the last reply came from (None before any).
        self.shard: int | None = None

    def _route(self) -> dict[str, int]:
        return {"partition": self.shard} if self.follow_shard and self.shard is not None else {}

    def proof(self) -> list[tuple[str, bytes | None]]:
        """The header proving this consumer's secret (none without one)."""
        return list(proof_headers(self.secret)) if self.secret is not None else []

    def _send_control(self, message: object,
                      headers: list[tuple[str, bytes | None]] | None = None) -> None:
        self.producer.produce(self.topics.control, self.codec.encode_control(message),  # type: ignore[arg-type]
                              key=self.consumer_id.encode(),
                              headers=self.proof() if headers is None else headers,
                              **self._route())
        self.producer.flush(10)

    def subscribe(self, timeout: float = 30.0, delivery_topic: str | None = None,
                  prove: bytes | None = None) -> SubscribeResult:
        """Subscribe and wait for the answer; ``delivery_topic`` names another topic in the
        request (this consumer still reads its conventional one); ``prove`` is the secret of
        the live session of this consumer id the new one replaces."""
        request_id = self.send_subscribe(delivery_topic, prove)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Deliveries may follow the reply in the same fetch: keep them for poll().
            self._early.extend(self._read(0.2))
            for reply in self.replies:
                if isinstance(reply, SubscribeResult) and reply.request_id == request_id:
                    self.subscribed = reply.status is SubscribeStatus.OK
                    return reply
        raise TimeoutError(f"no SubscribeResult for {self.consumer_id} within {timeout}s")

    def send_subscribe(self, delivery_topic: str | None = None, prove: bytes | None = None,
                       partition: int | None = None) -> str:
        """Write a Subscribe and return its request id, without waiting for an answer (a
        forger under ACLs cannot read the answer); ``partition``: the control partition to
        write it to (another shard's), else as `_route` says."""
        request_id = uuid.uuid4().hex
        headers: list[tuple[str, bytes | None]] = []
        if self.secret is not None:
            headers += secret_headers(self.secret)
        if prove is not None:
            headers += proof_headers(prove)
        if self.credential is not None:
            headers.append((CREDENTIAL, self.credential.encode()))
        headers += self.extra_headers
        message = Subscribe(
            consumer_id=self.consumer_id, session_id=self.session_id, request_id=request_id,
            queue=self.queue, queue_is_regex=self.queue_is_regex,
            max_backlog=self.max_backlog, filter=self.filter,
            delivery_topic=delivery_topic or self.delivery_topic,
            session_timeout_ms=self.session_timeout_ms,
            client_name="raw-test", client_version="0", sent_at_ms=int(time.time() * 1000))
        route = {"partition": partition} if partition is not None else self._route()
        self.producer.produce(self.topics.control, self.codec.encode_control(message),
                              key=self.consumer_id.encode(), headers=headers, **route)
        self.producer.flush(10)
        return request_id

    def replace(self, queue: str, *, max_backlog: int | None = None,
                filter: str | None = None, timeout: float = 30.0) -> SubscribeResult:
        """Replace this session's subscription (another queue, backlog or filter) and wait
        for the answer."""
        request_id = uuid.uuid4().hex
        self.queue, self.max_backlog, self.filter = queue, max_backlog, filter
        self._send_control(Replace(
            consumer_id=self.consumer_id, session_id=self.session_id, request_id=request_id,
            queue=queue, queue_is_regex=self.queue_is_regex, max_backlog=max_backlog,
            filter=filter, delivery_topic=self.delivery_topic,
            sent_at_ms=int(time.time() * 1000)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._early.extend(self._read(0.2))
            for reply in self.replies:
                if isinstance(reply, SubscribeResult) and reply.request_id == request_id:
                    return reply
        raise TimeoutError(f"no SubscribeResult for {self.consumer_id}'s replace within "
                           f"{timeout}s")

    def poll(self, timeout: float = 0.5) -> list[Delivered]:
        """Deliveries that arrived; heartbeats on the way, as a real consumer would."""
        if time.monotonic() >= self._next_heartbeat:
            self.heartbeat()
            self._next_heartbeat = time.monotonic() + self.session_timeout_ms / 3000
        early, self._early = self._early, []
        return early + self._read(timeout)

    def _read(self, timeout: float) -> list[Delivered]:
        out = []
        for m in self.consumer.consume(500, timeout):
            if m.error() is not None:
                continue
            headers = m.headers() or []
            if is_reply(headers):
                self.replies.append(self.codec.decode_reply(m.value()))
                shard = reply_shard(headers)
                if shard is not None:
                    self.shard = shard
                continue
            info = parse_delivery_headers(headers)
            out.append(Delivered(info.queue, info.bookmark.format(), info.lease, m.value(),
                                 m.key(), info.delivery_count, info.barrier, headers))
        return out

    def ack(self, deliveries: list[Delivered], type: AckType = AckType.ACCEPT,
            delay_ms: int | None = None, reason: str | None = None) -> None:
        if not deliveries:
            return
        items = tuple(AckItem(queue=d.queue, bookmark=d.bookmark, lease=d.lease, type=type,
                              delay_ms=delay_ms, reason=reason) for d in deliveries)
        record = AckRecord(consumer_id=self.consumer_id, session_id=self.session_id,
                           sent_at_ms=int(time.time() * 1000), items=items)
        self.producer.produce(self.topics.ack, self.codec.encode_ack(record),
                              key=self.consumer_id.encode(), headers=self.proof(),
                              **self._route())
        self.producer.flush(10)

    def send_items(self, items: Iterable[AckItem]) -> None:
        """One ack record with these items as given (forged tokens, unknown bookmarks...)."""
        record = AckRecord(consumer_id=self.consumer_id, session_id=self.session_id,
                           sent_at_ms=int(time.time() * 1000), items=tuple(items))
        self.producer.produce(self.topics.ack, self.codec.encode_ack(record),
                              key=self.consumer_id.encode(), headers=self.proof(),
                              **self._route())
        self.producer.flush(10)

    def send_raw(self, topic: str, value: bytes | None) -> None:
        """Bytes written as they are (garbage on the ack or control topic)."""
        self.producer.produce(topic, value, key=self.consumer_id.encode())
        self.producer.flush(10)

    def receive(self, count: int, timeout: float = 20.0) -> list[Delivered]:
        """Exactly the next ``count`` deliveries, polling (and heartbeating) until they came;
        deliveries beyond ``count`` are kept for the next call."""
        got: list[Delivered] = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            got.extend(self.poll(0.1))
        if len(got) < count:
            raise TimeoutError(f"{self.consumer_id} received {len(got)} of {count} deliveries "
                               f"within {timeout}s")
        self._early = got[count:] + self._early
        return got[:count]

    def idle(self, seconds: float) -> list[Delivered]:
        """Keep the session alive for ``seconds``; whatever was delivered meanwhile."""
        got: list[Delivered] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            got.extend(self.poll(min(0.1, max(deadline - time.monotonic(), 0.0))))
        return got

    def ack_results(self) -> list[AckItemResult]:
        """Every AckResult item answered to this consumer so far, in order."""
        return [item for reply in self.replies if isinstance(reply, AckResult)
                for item in reply.items]

    def wait_for_ack_results(self, count: int, timeout: float = 20.0) -> list[AckItemResult]:
        """Poll until at least ``count`` AckResult items came; deliveries are kept."""
        deadline = time.monotonic() + timeout
        while len(self.ack_results()) < count and time.monotonic() < deadline:
            self._early.extend(self.poll(0.1))
        results = self.ack_results()
        if len(results) < count:
            raise TimeoutError(f"{self.consumer_id} got {len(results)} of {count} ack results "
                               f"within {timeout}s: {results}")
        return results

    def heartbeat(self) -> None:
        self._send_control(Heartbeat(consumer_id=self.consumer_id, session_id=self.session_id,
                                     sent_at_ms=int(time.time() * 1000)))

    def unsubscribe(self) -> None:
        self.subscribed = False
        self._send_control(Unsubscribe(consumer_id=self.consumer_id, session_id=self.session_id,
                                       reason="test done", sent_at_ms=int(time.time() * 1000)))

    def close(self) -> None:
        self.consumer.close()
        self.producer.flush(5)


# --------------------------------------------------------------------------- helpers

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.1,
               what: str = "condition") -> T:
    """Call ``probe`` until it returns something truthy; that value, or TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(interval)


def collect(consumers: Iterable[RawConsumer], count: int, timeout: float = 20.0
            ) -> dict[str, list[Delivered]]:
    """Poll every consumer (none acks) until ``count`` deliveries came in all; by consumer id."""
    group = list(consumers)
    got: dict[str, list[Delivered]] = {c.consumer_id: [] for c in group}
    deadline = time.monotonic() + timeout
    while sum(len(v) for v in got.values()) < count:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{sum(len(v) for v in got.values())} of {count} deliveries "
                               f"within {timeout}s")
        for c in group:
            got[c.consumer_id].extend(c.poll(0.05))
    return got


def produce(bootstrap_servers: str, topic: str, values: Iterable[bytes | None], *,
            keys: Iterable[bytes | None] | None = None,
            headers: list[tuple[str, bytes]] | None = None,
            partition: int | None = None) -> None:
    """Write records with a plain producer, as any application would; waits until written."""
    producer = Producer(logged({"bootstrap.servers": bootstrap_servers, "linger.ms": 5}))
    key_list = list(keys) if keys is not None else None
    for i, value in enumerate(values):
        kwargs: dict[str, object] = {}
        if key_list is not None:
            kwargs["key"] = key_list[i]
        if headers:
            kwargs["headers"] = headers
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                producer.produce(topic, value, **kwargs)  # type: ignore[arg-type]
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.05)
    remaining = producer.flush(30)
    assert remaining == 0, f"{remaining} records not written to {topic}"


@dataclass
class TopicRecord:
    """A record read back from a topic (dead letters, events)."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp_ms: int


class TopicReader:
    """Reads every partition of a topic from the beginning, accumulating what it saw."""

    def __init__(self, bootstrap_servers: str, topic: str) -> None:
        self.topic = topic
        self.records: list[TopicRecord] = []
        self._consumer = Consumer(logged({"bootstrap.servers": bootstrap_servers,
                                          "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                                          "enable.auto.commit": False,
                                          "auto.offset.reset": "earliest",
                                          "isolation.level": "read_committed"}))
        self._assigned: set[int] = set()

    def _assign(self) -> None:
        topic = self._consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
        if topic is None or topic.error is not None:
            return
        new = [p for p in topic.partitions if p not in self._assigned]
        if new:
            self._consumer.incremental_assign(
                [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in new])
            self._assigned.update(new)

    def read(self, timeout: float = 0.3) -> list[TopicRecord]:
        """What arrived since the last read (waiting at most ``timeout``)."""
        self._assign()
        fresh = []
        for m in self._consumer.consume(1000, timeout):
            if m.error() is not None:
                continue
            fresh.append(TopicRecord(m.partition(), m.offset(), m.key(), m.value(),  # type: ignore[arg-type]
                                     list(m.headers() or []), m.timestamp()[1]))
        self.records.extend(fresh)
        return fresh

    def read_until(self, done: Callable[[list[TopicRecord]], bool],
                   timeout: float = 20.0) -> list[TopicRecord]:
        """Read until ``done(all records so far)``; all records, or TimeoutError."""
        deadline = time.monotonic() + timeout
        while not done(self.records):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.topic}: condition not met within {timeout}s with "
                                   f"{len(self.records)} records")
            self.read()
        return self.records

    def close(self) -> None:
        self._consumer.close()


class EventReader:
    """The coordinator's events topic, decoded with the protocol's codec."""

    def __init__(self, settings: Settings) -> None:
        self._reader = TopicReader(settings.bootstrap_servers,
                                   TopicNames(settings.topic_prefix).events)
        self._codec = Codec()
        self.events: list[Event] = []

    def read_until(self, done: Callable[[list[Event]], bool], timeout: float = 20.0
                   ) -> list[Event]:
        deadline = time.monotonic() + timeout
        while not done(self.events):
            if time.monotonic() >= deadline:
                kinds = [e.type.value for e in self.events]
                raise TimeoutError(f"events: condition not met within {timeout}s; saw {kinds}")
            for r in self._reader.read():
                self.events.extend(self._codec.decode_events(r.value))
        return self.events

    def close(self) -> None:
        self._reader.close()


def forged(delivery: Delivered, lease: str) -> Delivered:
    """The same delivery with another lease token (to ack with a token one never got)."""
    return replace(delivery, lease=lease)


def counters(settings: Settings, queue: str) -> dict[str, int]:
    """The queue's running totals as PostgreSQL has them (all zero before the first commit)."""
    with Store(settings.database_url) as store:
        found = store.load_counters(queue).get(queue)
    if found is None:
        return {}
    return {name: getattr(found, name) for name in COUNTER_NAMES}


def recovery_points(settings: Settings, queue: str) -> dict[tuple[str, int], int]:
    with Store(settings.database_url) as store:
        return {(k.topic, k.partition): offset
                for k, offset in store.load_recovery_points(queue).items()}


class Consumers:
    """RawConsumers for one test: each subscribed (and checked OK) on creation, all closed
    when the block ends."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.all: list[RawConsumer] = []

    def subscribe(self, queue: str, **options: object) -> RawConsumer:
        consumer = self.new(queue, **options)
        result = consumer.subscribe()
        assert result.status is SubscribeStatus.OK, (result.status, result.message)
        return consumer

    def new(self, queue: str, **options: object) -> RawConsumer:
        """A consumer that has not subscribed yet."""
        consumer = RawConsumer(self.settings.bootstrap_servers, self.settings.topic_prefix,
                               queue, **options)  # type: ignore[arg-type]
        self.all.append(consumer)
        return consumer

    def __enter__(self) -> Consumers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for consumer in self.all:
            consumer.close()


def wait_for_counters(settings: Settings, queue: str, timeout: float = 20.0,
                      **at_least: int) -> dict[str, int]:
    """The queue's counters once each named one reached at least the given value."""
    def probe() -> dict[str, int] | None:
        found = counters(settings, queue)
        return found if found and all(found[k] >= v for k, v in at_least.items()) else None

    return wait_until(probe, timeout, what=f"{queue} counters {at_least}")
