"""Exactly-once processing: a consumer settles messages inside its own Kafka transaction
(protocol 9; docs/sdk.md "Exactly-once processing").

The records a consumer produces for a message and the acknowledgement that settles it commit
together or not at all::

    consumer = QueueConsumer("Orders", transactional=True, consumer_id="billing-1")
    for message in consumer:
        with consumer.transaction() as tx:
            tx.produce("invoices", render(message.json()), key=message.key)
            tx.ack(message)

A session of a transactional consumer has a producer of its own, whose ``transactional.id`` is
``<prefix><consumer id>.<session id>`` (the prefix defaults to ``<topic prefix>qlayer-tx.``)
and is named on the Subscribe, so the coordinator can fence it before it breaks any of the
session's leases (`layer.coordinator.fences`). The acknowledgements are ack records on the ack
topic, like every other; they are produced at the end of the transaction, just before its
commit, so a transaction holds the ack partition's last stable offset (which the coordinator
reads up to) only for the time of its commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from confluent_kafka import KafkaError, KafkaException, Producer

from layer.domain.errors import QlayerError
from layer.kafka.logs import logged
from layer.protocol.records import AckItem, AckStatus, AckType
from layer.sdk.config import ClientConfig
from layer.sdk.errors import (
    AckFailure,
    LeaseLostError,
    MessageSettledError,
    TransactionAbortedError,
)
from layer.sdk.message import delay_ms

if TYPE_CHECKING:
    from layer.sdk.message import Message

log = logging.getLogger(__name__)

__all__ = ["Transaction", "TransactionAbortedError", "TransactionalProducer",
           "transactional_id_for"]

#: How long a transaction may stay open before the broker aborts it (Kafka's
#: ``transaction.timeout.ms``); a consumer may set its own in ``kafka_config``.
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000


def transactional_id_for(prefix: str, consumer_id: str, session_id: str) -> str:
    """The ``transactional.id`` of one session (docs/sdk.md): ending with ``.`` + its session
    id, as the coordinator requires (a session may have only its own producer fenced)."""
    return f"{prefix}{consumer_id}.{session_id}"


class TransactionalProducer:
    """The Kafka producer of one transactional session (initialised before the Subscribe is
    sent, so any fence the coordinator makes comes after it)."""

    def __init__(self, config: ClientConfig, transactional_id: str, timeout: float) -> None:
        self.transactional_id = transactional_id
        self._timeout = timeout
        try:
            self._producer = Producer(logged(config.client(**{
                "transaction.timeout.ms": DEFAULT_TRANSACTION_TIMEOUT_MS,
                **dict(config.kafka_config),
                "transactional.id": transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
            })))
            self._producer.init_transactions(timeout)
        except KafkaException as exc:
            raise TransactionAbortedError(
                f"cannot initialise Kafka transactions with transactional.id "
                f"{transactional_id!r}: {exc}") from exc
        self.open = False
        self.usable = True

    def begin(self) -> None:
        self._call(self._producer.begin_transaction)
        self.open = True

    def produce(self, topic: str, value: bytes | None, key: bytes | None = None,
                headers: Sequence[tuple[str, bytes]] | None = None,
                partition: int | None = None) -> None:
        extra: dict[str, Any] = {}
        if headers:
            extra["headers"] = list(headers)
        if partition is not None:
            extra["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, **extra)
                break
            except BufferError:
                self._producer.poll(0.05)  # librdkafka's local queue is full: let it drain
            except KafkaException as exc:
                raise self._failure("cannot produce in the transaction", exc) from exc
        self._producer.poll(0)

    def commit(self) -> None:
        self._call(self._producer.commit_transaction, self._timeout)
        self.open = False

    def abort(self) -> None:
        if not self.open:
            return
        self.open = False
        if not self.usable:
            return
        try:
            self._producer.abort_transaction(self._timeout)
        except KafkaException as exc:
            self.usable = False
            log.warning("aborting transaction of %s failed (the coordinator fences it before "
                        "its leases break): %s", self.transactional_id, exc)

    def close(self) -> None:
        """Abort what is open; the producer is not used again."""
        self.abort()
        self.usable = False
        try:
            self._producer.flush(0)
        except KafkaException as exc:  # fenced: nothing of it can be sent any more
            log.debug("closing the producer of %s: %s", self.transactional_id, exc)

    def _call(self, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except KafkaException as exc:
            raise self._failure(f"transaction of {self.transactional_id!r} failed", exc) from exc

    def _failure(self, what: str, exc: KafkaException) -> TransactionAbortedError:
        error = exc.args[0] if exc.args else None
        fenced = isinstance(error, KafkaError) and (
            error.fatal() or error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                              KafkaError.INVALID_PRODUCER_EPOCH))
        if fenced:
            self.usable = False
            self.open = False
            return TransactionAbortedError(
                f"{what}: this session's producer was fenced (the coordinator ended the "
                f"session: a lease ran out, it timed out or was evicted): {exc}", fenced=True)
        self.abort()
        return TransactionAbortedError(f"{what}; it was aborted: {exc}")


class Transaction:
    """Records produced and messages settled, committed together (`QueueConsumer.transaction`).

    ``produce`` sends at once (inside the transaction); ``ack``, ``release`` and ``reject``
    are sent as ack records when the ``with`` block ends, then the transaction commits. An
    exception in the block aborts it. A message must be one of this consumer's session, not
    settled yet, and not a barrier message."""

    def __init__(self, producer: TransactionalProducer, session_id: str,
                 settle: Callable[[list[AckItem]], None],
                 check: Callable[[str], str | None]) -> None:
        self._producer = producer
        self._session_id = session_id
        self._settle = settle
        self._check = check
        self._items: list[AckItem] = []
        self._messages: list[Message] = []

    @property
    def transactional_id(self) -> str:
        return self._producer.transactional_id

    def __enter__(self) -> Self:
        self._producer.begin()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if exc_type is not None:
            self._producer.abort()
            return
        lost = self._check(self._session_id)
        if lost is not None:
            self._producer.abort()
            raise LeaseLostError(
                [AckFailure(m.queue, str(m.bookmark), i.type, AckStatus.LEASE_LOST, lost)
                 for m, i in zip(self._messages, self._items, strict=True)]
                or [AckFailure("", "", AckType.ACCEPT, AckStatus.LEASE_LOST, lost)])
        try:
            if self._items:
                self._settle(self._items)
            self._producer.commit()
        except TransactionAbortedError:
            raise
        except QlayerError:
            self._producer.abort()
            raise
        for message, item in zip(self._messages, self._items, strict=True):
            message._settled = item.type

    def produce(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                headers: Sequence[tuple[str, bytes]] | None = None,
                partition: int | None = None) -> None:
        """Produce one record in the transaction: visible to ``read_committed`` readers once
        it commits, never if it aborts."""
        self._producer.produce(topic, value, key, headers, partition)

    def ack(self, message: Message) -> None:
        """Settle ``message`` as processed when the transaction commits."""
        self._add(message, AckType.ACCEPT, None, None)

    def release(self, message: Message, delay: float | None = None) -> None:
        """Give ``message`` back to the queue (after ``delay`` seconds) when it commits."""
        self._add(message, AckType.RELEASE, delay_ms(delay), None)

    def reject(self, message: Message, reason: str | None = None) -> None:
        """Reject ``message`` (it goes to the dead-letter topic) when it commits."""
        self._add(message, AckType.REJECT, None, reason)

    def _add(self, message: Message, kind: AckType, delay: int | None,
             reason: str | None) -> None:
        if message.is_barrier:
            raise ValueError("a barrier message has no lease to settle")
        if message._settled is not None or any(m is message for m in self._messages):
            raise MessageSettledError(f"{message.bookmark} is settled already")
        if message.session_id != self._session_id:
            raise LeaseLostError([AckFailure(message.queue, str(message.bookmark), kind,
                                             AckStatus.LEASE_LOST, "its session has ended")])
        self._messages.append(message)
        self._items.append(AckItem(queue=message.queue, bookmark=str(message.bookmark),
                                   lease=message.lease, type=kind, delay_ms=delay,
                                   reason=reason))


