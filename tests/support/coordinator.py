"""Test support: a real coordinator in a thread, and a consumer built only from the protocol.

`RawConsumer` knows nothing of `layer.sdk`: it is what a team writing a consumer in another
language would build from docs/protocol.md — a plain Kafka consumer on its delivery topic and
a plain producer of hand-encoded control and ack records.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from confluent_kafka import Consumer, Producer, TopicPartition

from layer.coordinator.service import Coordinator, CoordinatorOptions
from layer.protocol import (
    AckItem,
    AckRecord,
    AckType,
    Codec,
    Heartbeat,
    Subscribe,
    SubscribeResult,
    TopicNames,
    Unsubscribe,
    is_reply,
    parse_delivery_headers,
)
from layer.settings import Settings
from layer.store.store import Store


@contextmanager
def running_coordinator(settings: Settings, **options: object) -> Iterator[Coordinator]:
    """A coordinator running its real loop in a background thread until the block ends."""
    defaults: dict[str, object] = {"transactional": False, "refresh_interval": 0.5}
    defaults.update(options)
    coordinator = Coordinator(settings, CoordinatorOptions(**defaults))  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def target() -> None:
        try:
            coordinator.run(install_signals=False)
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=target, name="coordinator", daemon=True)
    thread.start()
    try:
        yield coordinator
    finally:
        coordinator.stop()
        thread.join(30)
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
    """A queue consumer written against the wire protocol only."""

    def __init__(self, bootstrap_servers: str, prefix: str, queue: str, *,
                 max_backlog: int | None = None, filter: str | None = None,
                 session_timeout_ms: int = 10_000, consumer_id: str | None = None) -> None:
        self.codec = Codec()
        self.topics = TopicNames(prefix)
        self.consumer_id = consumer_id or f"raw-{uuid.uuid4().hex[:8]}"
        self.session_id = uuid.uuid4().hex
        self.queue = queue
        self.delivery_topic = self.topics.delivery(self.consumer_id)
        self.producer = Producer({"bootstrap.servers": bootstrap_servers, "linger.ms": 1})
        self.consumer = Consumer({"bootstrap.servers": bootstrap_servers,
                                  "group.id": self.consumer_id, "enable.auto.commit": False,
                                  "auto.offset.reset": "earliest"})
        self.consumer.assign([TopicPartition(self.delivery_topic, 0, 0)])
        self.replies: list[object] = []
        self.max_backlog = max_backlog
        self.filter = filter
        self.session_timeout_ms = session_timeout_ms
        self._early: list[Delivered] = []
        self._next_heartbeat = time.monotonic() + session_timeout_ms / 3000

    def _send_control(self, message: object) -> None:
        self.producer.produce(self.topics.control, self.codec.encode_control(message),  # type: ignore[arg-type]
                              key=self.consumer_id.encode())
        self.producer.flush(10)

    def subscribe(self, timeout: float = 30.0) -> SubscribeResult:
        request_id = uuid.uuid4().hex
        self._send_control(Subscribe(
            consumer_id=self.consumer_id, session_id=self.session_id, request_id=request_id,
            queue=self.queue, max_backlog=self.max_backlog, filter=self.filter,
            delivery_topic=self.delivery_topic, session_timeout_ms=self.session_timeout_ms,
            client_name="raw-test", client_version="0", sent_at_ms=int(time.time() * 1000)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Deliveries may follow the reply in the same fetch: keep them for poll().
            self._early.extend(self._read(0.2))
            for reply in self.replies:
                if isinstance(reply, SubscribeResult) and reply.request_id == request_id:
                    return reply
        raise TimeoutError(f"no SubscribeResult for {self.consumer_id} within {timeout}s")

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
                              key=self.consumer_id.encode())
        self.producer.flush(10)

    def heartbeat(self) -> None:
        self._send_control(Heartbeat(consumer_id=self.consumer_id, session_id=self.session_id,
                                     sent_at_ms=int(time.time() * 1000)))

    def unsubscribe(self) -> None:
        self._send_control(Unsubscribe(consumer_id=self.consumer_id, session_id=self.session_id,
                                       reason="test done", sent_at_ms=int(time.time() * 1000)))

    def close(self) -> None:
        self.consumer.close()
        self.producer.flush(5)
