"""QueuePublisher: write records to journals, routing a queue's name to its publish target.

Publishing needs nothing of qlayer but routing and the delayed-delivery header: the records
are ordinary Kafka records, readable by anything. A publish to a queue's name goes to the
queue's ``default_publish_target`` (or its one journal), found in the queue directory topic;
any other name is a topic and is written as it is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self

from confluent_kafka import Producer

from layer.kafka.logs import logged
from layer.kafka.reports import DeliveryFailures
from layer.protocol.headers import MAX_EXPIRATION_MS, deliver_at_header, expiration_header
from layer.protocol.topics import validate_topic_name
from layer.sdk.config import ClientConfig
from layer.sdk.directory import QueueDirectory
from layer.sdk.errors import PublishError

__all__ = ["QueuePublisher", "deliver_at_ms", "expiration_ms"]

log = logging.getLogger(__name__)

HeadersIn = Mapping[str, bytes | str | None] | Sequence[tuple[str, bytes | str | None]]


def deliver_at_ms(deliver_at: datetime | float) -> int:
    """A delivery time as milliseconds since the epoch: an aware datetime, or epoch seconds.

    A naive datetime is refused: whose midnight it means cannot be known here.
    """
    if isinstance(deliver_at, datetime):
        if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
            raise ValueError(
                f"deliver_at {deliver_at.isoformat()} has no time zone; use an aware datetime "
                "(e.g. datetime.now(UTC) + timedelta(minutes=5)) or epoch seconds"
            )
        seconds = deliver_at.timestamp()
    elif isinstance(deliver_at, bool) or not isinstance(deliver_at, int | float):
        raise TypeError(
            f"deliver_at must be a datetime or epoch seconds, got {type(deliver_at).__name__}"
        )
    else:
        seconds = float(deliver_at)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"deliver_at must be a time after 1970, got {deliver_at!r}")
    return round(seconds * 1000)


def expiration_ms(expiration: timedelta | float) -> int:
    """A message's own expiration in milliseconds: a timedelta, or seconds.

    At least 1 ms and at most 366 days (`MAX_EXPIRATION_MS`).
    """
    if isinstance(expiration, timedelta):
        seconds = expiration.total_seconds()
    elif isinstance(expiration, bool) or not isinstance(expiration, int | float):
        raise TypeError(
            f"expiration must be a timedelta or seconds, got {type(expiration).__name__}")
    else:
        seconds = float(expiration)
    ms = round(seconds * 1000) if math.isfinite(seconds) else -1
    if not 1 <= ms <= MAX_EXPIRATION_MS:
        raise ValueError(
            f"expiration must be between 1 ms and 366 days, got {expiration!r}")
    return ms


def _bytes(value: bytes | str | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"{what} must be bytes, str or None, got {type(value).__name__}")


def _headers(headers: HeadersIn | None) -> list[tuple[str, bytes | None]]:
    if headers is None:
        return []
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return [(str(name), _bytes(value, f"header {name!r}")) for name, value in pairs]


class QueuePublisher:
    """Publishes records to queues (by name) and topics. Thread-safe; use one per process.

    ``publish`` is asynchronous: records are written in the background, and ``flush()`` (or
    leaving the ``with`` block, or ``close()``) waits for them and raises ``PublishError``
    if any could not be written.
    """

    def __init__(
        self,
        bootstrap_servers: str | None = None,
        *,
        topic_prefix: str | None = None,
        kafka_config: Mapping[str, Any] | None = None,
        directory_refresh: float = 30.0,
        directory: QueueDirectory | None = None,
        linger_ms: int = 5,
    ) -> None:
        self._config = ClientConfig.resolve(bootstrap_servers, topic_prefix, kafka_config)
        self._own_directory = directory is None
        self._directory = directory or QueueDirectory(
            config=self._config, refresh_interval=directory_refresh
        )
        self._producer = Producer(logged(self._config.client(**{
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": linger_ms,
        })))
        # Not a bound method of self: librdkafka would keep this object, and so the producer
        # and its threads, alive after close() (layer/kafka/reports.py).
        self._reports = DeliveryFailures(log, "record not published: %s")
        self._closed = False

    @property
    def directory(self) -> QueueDirectory:
        return self._directory

    def target(self, queue_or_topic: str) -> str:
        """The topic a publish to ``queue_or_topic`` is written to."""
        return validate_topic_name(self._directory.publish_target(queue_or_topic))

    def publish(
        self,
        queue_or_topic: str,
        value: bytes | str | None,
        key: bytes | str | None = None,
        headers: HeadersIn | None = None,
        deliver_at: datetime | float | None = None,
        *,
        partition: int | None = None,
        expiration: timedelta | float | None = None,
    ) -> str:
        """Publish one record; returns the topic it goes to.

        ``deliver_at`` (an aware datetime or epoch seconds) asks the queue to hold the message
        until then (the ``qlayer.deliver-at`` header). ``expiration`` (a timedelta or seconds)
        gives the message its own expiration, counted from when it is written, in place of the
        queue's (the ``qlayer.expiration`` header): once that old and not leased, it leaves
        every queue it is in, dead-lettered where the queue dead-letters expired messages.
        Raises ``NoPublishTargetError`` for a queue over a regex without a
        ``default_publish_target``.
        """
        if self._closed:
            raise PublishError(["the publisher is closed"])
        topic = self.target(queue_or_topic)
        record_headers = _headers(headers)
        if deliver_at is not None:
            record_headers.append(deliver_at_header(deliver_at_ms(deliver_at)))
        if expiration is not None:
            record_headers.append(expiration_header(expiration_ms(expiration)))
        kwargs: dict[str, Any] = {
            "key": _bytes(key, "key"),
            "value": _bytes(value, "value"),
            "on_delivery": self._reports,
        }
        if record_headers:
            kwargs["headers"] = record_headers
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError:
                # librdkafka's local queue is full: let it drain, then try again.
                self._producer.poll(0.05)
        self._producer.poll(0)
        return topic

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every record published so far is written; ``PublishError`` if any was
        not (each failure is reported once)."""
        remaining = self._producer.flush(timeout)
        failures = self._reports.take()
        if remaining:
            failures.append(f"{remaining} record(s) still unwritten after {timeout:g}s")
        if failures:
            raise PublishError(failures)

    def close(self, timeout: float = 30.0) -> None:
        """Flush, then release the clients. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush(timeout)
        finally:
            if self._own_directory:
                self._directory.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
