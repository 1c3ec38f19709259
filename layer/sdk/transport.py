"""The consumer's Kafka clients: its delivery topic reader and one producer for control and acks.

The delivery topic is read without a consumer group: partition 0 is assigned at its end
*before* the Subscribe is sent, so the answer and every delivery of the new session lie
after the starting point and nothing of an earlier run of the same consumer id is re-read.
Driver errors become qlayer errors here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka import Message as KafkaMessage
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from layer.kafka.errors import DeliveryFailed, KafkaAdapterError, LoginWatch, driver_error
from layer.kafka.logs import logged
from layer.kafka.offsets import end_offset
from layer.kafka.reports import DeliveryFailures
from layer.sdk.config import ClientConfig

__all__ = ["DeliveryReader", "SdkProducer", "ensure_topic"]

log = logging.getLogger(__name__)


# Creating a topic we may not create is fine: the coordinator creates delivery topics too.
_TOLERATED_CREATE_ERRORS = frozenset(
    {
        KafkaError.TOPIC_ALREADY_EXISTS,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.POLICY_VIOLATION,
    }
)


def ensure_topic(
    config: ClientConfig,
    topic: str,
    *,
    partitions: int = 1,
    topic_config: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> bool:
    """Create ``topic`` unless it exists and wait for its leaders; True when it is usable.

    False means it does not exist and could not be created here (no permission): the caller
    decides whether that is fatal. A topic this client may not even see (no ACL) or a refused
    login raise `KafkaAdapterError` with one line naming the broker, the user and the fix.
    """
    login = LoginWatch()
    properties = config.client()
    settings: dict[str, Any] = {"error_cb": login, **properties}
    admin = AdminClient(logged(settings))

    def problem(what: str, exc: BaseException) -> KafkaAdapterError:
        with contextlib.suppress(KafkaException, RuntimeError):
            admin.poll(0)  # serves error_cb: the reason of a refused login
        return driver_error(what, exc, config=properties, login=login)

    future = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=-1,
                  config=dict(topic_config or {}))],
        operation_timeout=timeout,
        request_timeout=timeout,
    )[topic]
    try:
        future.result(timeout=timeout)
    except KafkaException as exc:
        error = exc.args[0]
        if error.code() not in _TOLERATED_CREATE_ERRORS:
            raise problem(f"cannot create topic {topic}", exc) from exc
        if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            log.info("not allowed to create topic %s (%s); expecting it to exist", topic,
                     error.str())
            if not _visible(admin, topic, timeout, problem):
                return False
    except Exception as exc:  # a timeout: the broker did not answer
        raise problem(f"cannot create topic {topic}", exc) from exc
    return _wait_for_leaders(admin, topic, timeout)


def _visible(admin: AdminClient, topic: str, timeout: float,
             problem: Callable[[str, BaseException], KafkaAdapterError]) -> bool:
    """Whether a topic this client could not create exists (False: not yet); raises when the
    client may not see it at all. A plain metadata request cannot tell: it asks to create a
    missing topic and answers TOPIC_AUTHORIZATION_FAILED for both. DescribeTopics does not."""
    future = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout)[topic]
    try:
        future.result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return False
        raise problem(f"cannot read topic {topic}", exc) from exc
    except Exception as exc:
        raise problem(f"cannot read topic {topic}", exc) from exc
    return True


def _wait_for_leaders(admin: AdminClient, topic: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = admin.list_topics(topic=topic, timeout=max(0.1, deadline - time.monotonic()))
        except KafkaException as exc:
            raise KafkaAdapterError(f"cannot read metadata of {topic}: {exc}") from exc
        meta = found.topics.get(topic)
        if meta is not None and meta.error is not None and (
            meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
        ):
            return False
        if (meta is not None and meta.error is None and meta.partitions
                and all(p.leader >= 0 for p in meta.partitions.values())):
            return True
        if time.monotonic() >= deadline:
            raise KafkaAdapterError(f"topic {topic} has no partition leader after {timeout}s")
        time.sleep(0.05)


class DeliveryReader:
    """Reads one consumer's delivery topic (partition 0) from the end as it was at start()."""

    def __init__(self, config: ClientConfig, topic: str, group_id: str) -> None:
        self.topic = topic
        self._config = config
        self._consumer = Consumer(logged(config.client(**{
            # librdkafka wants a group id even without subscribe(); nothing is ever committed.
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "allow.auto.create.topics": False,
            # The broker answers a fetch as soon as a record is there, so this does not delay
            # a delivery: it only bounds how long a fetch with nothing to read is held (how
            # often an idle consumer asks again: ten times a second here).
            "fetch.wait.max.ms": 100,
        })))
        self.errors = 0
        # Held while polling: librdkafka must not close a consumer another thread polls.
        self._lock = threading.RLock()
        self._closed = False
        self._polling = False

    def start(self, timeout: float) -> int:
        """Create the topic if possible, assign partition 0 at its current end; the offset."""
        exists = ensure_topic(self._config, self.topic, partitions=1, timeout=timeout)
        start = OFFSET_BEGINNING
        if exists:
            start = self._end(timeout)
        # A topic that does not exist yet will be created by the coordinator on Subscribe:
        # everything in it is then newer than this session, so reading it from the start is
        # the same as reading it from "now".
        self._consumer.assign([TopicPartition(self.topic, 0, start)])
        return int(start)

    def _end(self, timeout: float) -> int:
        """Partition 0's end offset. A broker that has just started answers "not leader" (or
        another retriable error) for a while: asked again until ``timeout`` (seen in the
        soak: consumers started right after a broker restart failed at once)."""
        return end_offset(self._consumer, self.topic, 0, timeout,
                          what=f"delivery topic {self.topic}")

    def poll(self, timeout: float, max_records: int = 500) -> list[KafkaMessage]:
        """Records that are there, waiting up to ``timeout`` for the first one; nothing once
        the reader is closed."""
        with self._lock:
            if self._closed:
                return []
            self._polling = True
            try:
                batch = self._fetch(timeout, max_records)
            finally:
                self._polling = False
                if self.is_closed():
                    # close() ran inside the poll: confluent-kafka runs Python signal handlers
                    # while it waits, and closing the consumer there would pull it out from
                    # under the C call. The deferred close happens now, outside it.
                    self._consumer.close()
                    batch = []
        out: list[KafkaMessage] = []
        for message in batch:
            error = message.error()
            if error is None:
                out.append(message)
            elif error.code() != KafkaError._PARTITION_EOF:
                self.errors += 1
                log.warning("delivery topic %s: %s", self.topic, error)
        return out

    def _fetch(self, timeout: float, max_records: int) -> list[KafkaMessage]:
        try:
            first = self._consumer.poll(max(0.0, timeout))
            if first is None or self.is_closed():
                return []
            batch = [first]
            if max_records > 1:
                batch.extend(self._consumer.consume(max_records - 1, 0))
            return batch
        except KafkaException as exc:
            raise KafkaAdapterError(
                f"reading delivery topic {self.topic} failed: {exc}") from exc

    def is_closed(self) -> bool:
        # A method, not the attribute: a signal handler may set it during a call, which a
        # type checker's narrowing of self._closed cannot know.
        return self._closed

    def close(self) -> None:
        """Close the Kafka consumer. Safe from any thread (it waits for a poll in progress,
        at most its timeout) and from a signal handler (then the poll closes it on return)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._polling:
                self._consumer.close()


class SdkProducer:
    """One idempotent producer for the control and ack topics; thread-safe.

    Delivery failures are counted and logged; ``wait`` flushes and raises when any record of
    the batch was lost.
    """

    def __init__(self, config: ClientConfig) -> None:
        self._producer = Producer(logged(config.client(**{
            "enable.idempotence": True,
            "acks": "all",
            # Acks are batched by the SDK itself (ack_batch_size, ack_interval): a linger
            # here would only add to the time a consumer's backlog stays full.
            "linger.ms": 0,
        })))
        # Not a bound method of self: librdkafka would keep this object, and so the producer
        # and its threads, alive after close() (layer/kafka/reports.py).
        self._reports = DeliveryFailures(log, "qlayer record not written: %s")

    @property
    def failed(self) -> int:
        """Control and ack records Kafka did not accept, so far."""
        return self._reports.count

    def send(self, topic: str, key: bytes | None, value: bytes | None,
             partition: int | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        """Queue one record (a None value is a tombstone); written by ``wait`` at the latest.
        Without ``partition`` the key picks one (Kafka's default partitioner)."""
        extra: dict[str, Any] = {} if headers is None else {"headers": headers}
        if partition is not None:
            extra["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, key=key, value=value,
                                       on_delivery=self._reports, **extra)
                break
            except BufferError:
                # librdkafka's local queue is full: let it drain, then try again.
                self._producer.poll(0.05)
        self._producer.poll(0)

    def poll(self) -> None:
        self._producer.poll(0)

    def failures(self) -> list[str]:
        """Delivery failures since the last call."""
        return self._reports.take()

    def wait(self, timeout: float) -> None:
        """Wait until everything sent so far is written; DeliveryFailed if something was not."""
        remaining = self._producer.flush(timeout)
        failures = self.failures()
        if remaining:
            failures.append(f"{remaining} record(s) still unwritten after {timeout}s")
        if failures:
            raise DeliveryFailed("; ".join(failures))
