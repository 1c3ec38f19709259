"""A fake coordinator peer for the SDK tests: real Kafka, real protocol, the test's hand.

It reads the control and ack topics the SDK writes, answers on the consumer's delivery topic
with real ``ReplyRecord``s and writes deliveries with real ``qlayer.*`` headers, exactly as
docs/protocol.md says a coordinator does. What it does and when is up to each test, so every
behaviour the SDK promises can be observed from the coordinator's side of the wire.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from layer.protocol import (
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckStatus,
    AckType,
    Bookmark,
    Codec,
    ControlMessage,
    DeliveryInfo,
    GrantSemantics,
    QueueGrant,
    Replace,
    ReplyMessage,
    RequestKind,
    SessionEnded,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    TopicNames,
    reply_headers,
    with_delivery_headers,
)
from tests.support.kafka import create_topic

T = TypeVar("T")
C = TypeVar("C", bound=ControlMessage)

DEFAULT_WAIT = 30.0


def now_ms() -> int:
    return int(time.time() * 1000)


class CoordinatorPeer:
    """Plays the coordinator over Kafka for one test (one topic prefix)."""

    def __init__(self, bootstrap_servers: str, prefix: str, *, partitions: int = 3) -> None:
        self.topics = TopicNames(prefix)
        self.codec = Codec()
        self.id = f"peer-{secrets.token_hex(3)}"
        for topic in (self.topics.control, self.topics.ack):
            create_topic(bootstrap_servers, topic, partitions)
        self._reader = Consumer({
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"{prefix}peer",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 20,
        })
        self._reader.assign([
            TopicPartition(topic, p, OFFSET_BEGINNING)
            for topic in (self.topics.control, self.topics.ack) for p in range(partitions)
        ])
        self._producer = Producer({"bootstrap.servers": bootstrap_servers, "linger.ms": 0})
        self.controls: list[ControlMessage] = []
        self.control_keys: list[bytes | None] = []
        self.acks: list[AckRecord] = []
        self.ack_keys: list[bytes | None] = []
        self.delivered: list[DeliveryInfo] = []
        self._seen: dict[type, int] = {}
        self._lock = threading.Lock()  # one reader at a time (a test thread or a helper)
        self._pool = ThreadPoolExecutor(max_workers=2)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._reader.close()
        self._producer.flush(10)

    # --- reading what the consumer wrote -----------------------------------------------------

    def poll(self, timeout: float = 0.2) -> None:
        with self._lock:
            for record in self._reader.consume(500, timeout):
                if record.error() is not None:
                    continue
                if record.topic() == self.topics.control:
                    self.controls.append(self.codec.decode_control(record.value()))
                    self.control_keys.append(record.key())
                else:
                    self.acks.append(self.codec.decode_ack(record.value()))
                    self.ack_keys.append(record.key())

    def wait_for(self, found: Callable[[], T | None], what: str,
                 timeout: float = DEFAULT_WAIT) -> T:
        deadline = time.monotonic() + timeout
        while True:
            result = found()
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                raise AssertionError(f"peer: no {what} within {timeout}s")
            self.poll(0.1)

    def next_control(self, kind: type[C], timeout: float = DEFAULT_WAIT) -> C:
        """The next control record of this kind not returned before."""
        def found() -> C | None:
            seen = self._seen.get(kind, 0)
            matching = [c for c in self.controls if isinstance(c, kind)]
            if len(matching) > seen:
                self._seen[kind] = seen + 1
                return matching[seen]
            return None
        return self.wait_for(found, kind.__name__, timeout)

    def of_kind(self, kind: type[C]) -> list[C]:
        return [c for c in self.controls if isinstance(c, kind)]

    def ack_items(self, count: int, timeout: float = DEFAULT_WAIT) -> list[AckItem]:
        """Wait until ``count`` ack items arrived in all; every item so far, in order."""
        def found() -> list[AckItem] | None:
            items = [item for record in self.acks for item in record.items]
            return items if len(items) >= count else None
        return self.wait_for(found, f"{count} ack items", timeout)

    # --- answering ------------------------------------------------------------------------

    def reply(self, delivery_topic: str, consumer_id: str, message: ReplyMessage) -> None:
        self._producer.produce(delivery_topic, key=consumer_id.encode(),
                               value=self.codec.encode_reply(message), headers=reply_headers(),
                               partition=0)
        assert self._producer.flush(10) == 0

    def subscribe_result(
        self,
        request: Subscribe | Replace,
        *,
        status: SubscribeStatus = SubscribeStatus.OK,
        message: str | None = None,
        heartbeat_interval_ms: int = 10_000,
        session_timeout_ms: int = 30_000,
        lease_period_ms: int = 60_000,
        queues: Sequence[str] | None = None,
    ) -> SubscribeResult:
        grants = () if status is not SubscribeStatus.OK else tuple(
            QueueGrant(queue=q, max_backlog=request.max_backlog or 1,
                       lease_period_ms=lease_period_ms, semantics=GrantSemantics.AT_LEAST_ONCE)
            for q in (queues if queues is not None else [request.queue])
        )
        result = SubscribeResult(
            consumer_id=request.consumer_id, session_id=request.session_id,
            request_id=request.request_id,
            request=RequestKind.SUBSCRIBE if isinstance(request, Subscribe)
            else RequestKind.REPLACE,
            status=status, message=message, queues=grants,
            session_timeout_ms=session_timeout_ms, heartbeat_interval_ms=heartbeat_interval_ms,
            coordinator_id=self.id, sent_at_ms=now_ms(),
        )
        self.reply(request.delivery_topic, request.consumer_id, result)
        return result

    def answer_subscribe(self, **result: Any) -> Future[Subscribe]:
        """In the background: wait for the next Subscribe and answer it."""
        def answer() -> Subscribe:
            subscribe = self.next_control(Subscribe)
            self.subscribe_result(subscribe, **result)
            return subscribe
        return self._pool.submit(answer)

    def answer_replace(self, **result: Any) -> Future[Replace]:
        def answer() -> Replace:
            request = self.next_control(Replace)
            self.subscribe_result(request, **result)
            return request
        return self._pool.submit(answer)

    def answer_renew(
        self,
        subscribe: Subscribe,
        *,
        status: AckStatus = AckStatus.OK,
        extend_ms: int = 60_000,
        message: str | None = None,
    ) -> Future[tuple[AckItem, AckResult]]:
        """In the background: wait for a RENEW item and answer it."""
        def answer() -> tuple[AckItem, AckResult]:
            def renew() -> tuple[AckRecord, AckItem] | None:
                for record in self.acks:
                    for item in record.items:
                        if item.type is AckType.RENEW:
                            return record, item
                return None
            record, item = self.wait_for(renew, "RENEW")
            result = AckResult(
                consumer_id=record.consumer_id, session_id=record.session_id,
                items=(AckItemResult(
                    queue=item.queue, bookmark=item.bookmark, type=AckType.RENEW,
                    status=status, message=message,
                    lease_expires_ms=now_ms() + extend_ms if status is AckStatus.OK else None),),
                sent_at_ms=now_ms())
            self.reply(subscribe.delivery_topic, subscribe.consumer_id, result)
            return item, result
        return self._pool.submit(answer)

    def ack_result(self, subscribe: Subscribe, items: Sequence[AckItemResult]) -> None:
        self.reply(subscribe.delivery_topic, subscribe.consumer_id, AckResult(
            consumer_id=subscribe.consumer_id, session_id=subscribe.session_id,
            items=tuple(items), sent_at_ms=now_ms()))

    def end_session(self, subscribe: Subscribe, reason: SessionEndReason,
                    message: str | None = None) -> None:
        self.reply(subscribe.delivery_topic, subscribe.consumer_id, SessionEnded(
            consumer_id=subscribe.consumer_id, session_id=subscribe.session_id, reason=reason,
            message=message, sent_at_ms=now_ms()))

    # --- delivering -----------------------------------------------------------------------

    def deliver(
        self,
        subscribe: Subscribe,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: list[tuple[str, bytes | None]] | None = None,
        bookmark: Bookmark | None = None,
        queue: str | None = None,
        lease: str | None = None,
        lease_expires_ms: int | None = None,
        delivery_count: int = 1,
        barrier: bool = False,
        session_id: str | None = None,
        timestamp_ms: int | None = None,
    ) -> DeliveryInfo:
        """Write one leased delivery to the consumer's delivery topic."""
        info = DeliveryInfo(
            queue=queue or subscribe.queue,
            bookmark=bookmark or Bookmark("journal", 0, len(self.delivered)),
            lease=lease or secrets.token_hex(8),
            lease_expires_ms=lease_expires_ms or now_ms() + 60_000,
            delivery_count=delivery_count,
            barrier=barrier,
            consumer_id=subscribe.consumer_id,
            session_id=session_id or subscribe.session_id,
        )
        kwargs: dict[str, Any] = {"key": key, "value": value, "partition": 0,
                                  "headers": with_delivery_headers(headers, info)}
        if timestamp_ms is not None:
            kwargs["timestamp"] = timestamp_ms
        self._producer.produce(subscribe.delivery_topic, **kwargs)
        assert self._producer.flush(10) == 0
        self.delivered.append(info)
        return info



@contextmanager
def running_peer(bootstrap_servers: str, prefix: str) -> Iterator[CoordinatorPeer]:
    peer = CoordinatorPeer(bootstrap_servers, prefix)
    try:
        yield peer
    finally:
        peer.close()
