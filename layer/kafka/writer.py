"""Writing deliveries, dead letters, events and replies: one producer, batched, checked.

The coordinator calls `send` for a whole loop iteration's records. Records that must be safe
before the loop goes on (dead letters, records passed to other shards) are waited for with
`flush`, which raises if any record was not written. Deliveries, replies and event batches
are not waited for: `drain`, early in the next iteration, serves the delivery reports that
came in meanwhile, raises for any failure and says how many records are still in flight.
Postgres was written first, so a failure here leaves leases without deliveries: the shard is
rebuilt and sends them again (or they expire and are redelivered).

With a transactional id, `flush` commits the Kafka transaction `send` began, and follows
librdkafka's rules when that fails (rdkafka.h, "Transactional producer API"): a retriable
error (a timeout: the commit goes on in the background) is resumed by calling
``commit_transaction`` again, within the flush's time and at the next `flush`; an abortable
one aborts the transaction. Then, or after a fatal error, or with a transaction whose outcome
the writer can no longer settle, the writer is *unusable*: every call raises, and the owner
must close it and make a new one with the same transactional id, whose ``init_transactions``
fences this producer and settles its open transaction on the broker (commit completed or
aborted). (After an abort for a record the broker refused, librdkafka 2.16 failed the next
transaction too, with OUT_OF_ORDER_SEQUENCE_NUMBER: the refused record's sequence number left
a gap. A new producer starts from a new epoch.) Either outcome is safe for the coordinator:
PostgreSQL was committed first, and the rebuild that follows sends the deliveries of the
restored leases and the outbox's event batches again. (A record refused as too large for its
topic need not cost a rebuild: with ``keep_too_large`` the refused records are kept for
`take_too_large`, and `wait` finds them record by record without committing; the coordinator
writes such a transaction again without them, `ShardLoop._transact`.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import Producer

from layer.kafka.errors import (
    DRIVER_ERRORS,
    DeliveryFailed,
    KafkaAdapterError,
    driver_error,
    translated,
)
from layer.kafka.logs import logged
from layer.kafka.records import OutgoingRecord
from layer.kafka.reports import DeliveryFailures

log = logging.getLogger(__name__)

#: Pause between two attempts to settle a transaction (commit or abort) that failed with a
#: retriable error which did not itself wait (e.g. the coordinator being reloaded).
_RETRY_PAUSE = 0.2


class RecordWriter:
    """A batched, idempotent producer. With transactional_id, a zombie writer is fenced."""

    def __init__(self, config: Mapping[str, Any], transactional_id: str | None = None, *,
                 keep_too_large: bool = False) -> None:
        # With ``keep_too_large``, the records the broker refuses as too large for their
        # topic are kept for `take_too_large`. Without a transaction they do not fail `flush`
        # or `drain` (`send_alone` tries one again); in a transaction one refusal still fails
        # the commit whole (the transaction is aborted), and they say which records it was.
        self._reports = reports = DeliveryFailures(keep_too_large=keep_too_large)
        settings: dict[str, Any] = {
            # Delivery batches of JSON shrink several times; a deployment's `kafka:` settings
            # may choose another codec (or none: about 1 µs of CPU per message less here and
            # in each consumer, for payloads that do not compress).
            "compression.type": "lz4",
            **config,
            "enable.idempotence": True,
            "acks": "all",
            # No waiting for more: an iteration sends all it has at once (many messages per
            # delivery record), and librdkafka still batches whatever queues up while a
            # request is in flight. A linger here is added to every delivery's latency.
            "linger.ms": 0,
            "batch.num.messages": 10_000,
            "queue.buffering.max.messages": 1_000_000,
            "queue.buffering.max.kbytes": 1_048_576,
            # One producer-wide callback that librdkafka calls for failures only: a report
            # per written record cost a Python call per record, for nothing to do. Not a bound
            # method of self, which would keep the producer alive forever (reports.py).
            "on_delivery": reports,
            "delivery.report.only.error": True,
        }
        if transactional_id is not None:
            settings["transactional.id"] = transactional_id
        with translated("cannot create a Kafka producer"):
            self._producer = Producer(logged(settings))
        self._transactional = transactional_id is not None
        #: Whether records become readable only with `flush` (a Kafka transaction's commit).
        self.transactional = self._transactional
        self._in_transaction = False
        # A commit that failed with a retriable error goes on in the background; until it is
        # resumed to its end no other transactional call is allowed (librdkafka answers
        # _CONFLICT), so the next flush resumes it before anything else.
        self._committing = False
        #: Why this writer can no longer be used (see the module's docstring); None while it can.
        self.unusable: str | None = None
        if self._transactional:
            try:
                self._producer.init_transactions(30)
            except DRIVER_ERRORS as exc:
                # A retriable timeout could be resumed, but the owner makes a new writer for
                # its next attempt anyway: that one's init_transactions starts afresh.
                raise driver_error("cannot initialise Kafka transactions", exc) from exc

    def send(self, records: Iterable[OutgoingRecord], timeout: float = 30.0) -> int:
        """Queue records for writing; returns how many. Nothing is guaranteed until flush().

        While librdkafka's local queue is full it is given time to drain, up to ``timeout``
        seconds in all (a broker away fills it); then DeliveryFailed."""
        self._usable()
        if self._committing:
            raise DeliveryFailed("the last Kafka transaction is still being committed",
                                 retriable=True)
        produce = self._producer.produce
        poll = self._producer.poll
        if self._transactional and not self._in_transaction:
            try:
                self._producer.begin_transaction()
            except DRIVER_ERRORS as exc:
                # Only a fatal error or a state this writer did not expect refuses a begin
                # (librdkafka's _STATE, _CONFLICT): nothing this producer can settle.
                error = driver_error("cannot begin a Kafka transaction", exc, DeliveryFailed)
                self._give_up(error)
                raise error from exc
            self._in_transaction = True
        n = 0
        deadline: float | None = None
        try:
            for r in records:
                while True:
                    try:
                        # librdkafka's own defaults stand for "none": partition -1 lets the
                        # partitioner choose, timestamp 0 means now. (The stubs want a list of
                        # headers; any sequence of pairs is accepted.)
                        produce(r.topic, r.value, r.key,
                                partition=-1 if r.partition is None else r.partition,
                                timestamp=r.timestamp_ms or 0,
                                headers=r.headers or None)  # type: ignore[arg-type]
                        break
                    except BufferError:
                        # The local queue is full: let librdkafka drain it, then retry.
                        now = time.monotonic()
                        if deadline is None:
                            deadline = now + timeout
                        elif now > deadline:
                            raise
                        poll(0.05)
                n += 1
            poll(0)
        except Exception as exc:
            # A record refused half-way (too large, an invalid topic, a queue that stays
            # full): the records queued before it must not be committed by the next flush
            # with somebody else's.
            self._abort()
            if isinstance(exc, DRIVER_ERRORS):
                raise driver_error("Kafka refused a record", exc, DeliveryFailed) from exc
            raise
        return n

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued record is written; raise DeliveryFailed if any was not.

        In a transaction: commit it (or resume the commit an earlier flush left going)."""
        self._usable()
        if self._in_transaction or self._committing:
            self._commit(timeout)
        elif not self._transactional:
            with translated("writing to Kafka failed", DeliveryFailed):
                remaining = self._producer.flush(timeout)
            if remaining:
                raise DeliveryFailed(f"{remaining} records not written within {timeout}s",
                                     retriable=True)
        failures = self._reports.take()
        if failures:
            raise DeliveryFailed(f"{len(failures)} records failed, first: {failures[0]}")

    def _commit(self, timeout: float) -> None:
        """Commit the open transaction within ``timeout`` (librdkafka's rules, see the module)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                # At least a little time for a commit resumed at the deadline: the call
                # returns at once when the background commit has finished meanwhile.
                self._producer.commit_transaction(max(left, 0.1))
            except DRIVER_ERRORS as exc:
                error = driver_error("committing the Kafka transaction failed", exc,
                                     DeliveryFailed)
                if error.fatal or not (error.retriable or error.abortable):
                    self._give_up(error)
                    raise error from exc
                if error.abortable:
                    self._committing = False
                    self._abort()
                    self._give_up(error)  # see the module's docstring
                    raise error from exc
                # Retriable: the commit goes on in the background; resuming it is allowed.
                self._committing = True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise error from exc
                time.sleep(min(_RETRY_PAUSE, left))
                continue
            self._in_transaction = False
            self._committing = False
            return

    def drain(self) -> int:
        """Serve the delivery reports that arrived, without waiting; raise DeliveryFailed if
        any record failed since the last check. Returns the records still in flight (queued
        or awaiting the broker's acknowledgement); 0 means every record sent so far is
        written. In a transaction nothing is written before `flush`."""
        self._usable()
        with translated("writing to Kafka failed", DeliveryFailed):
            self._producer.poll(0)
        failures = self._reports.take()
        if failures:
            raise DeliveryFailed(f"{len(failures)} records failed, first: {failures[0]}")
        return len(self._producer)

    def take_too_large(self) -> list[OutgoingRecord]:
        """The records the broker refused as too large for their topic (MSG_SIZE_TOO_LARGE)
        since the last call: reported by `drain` or `flush`, which do not fail for them (with
        ``keep_too_large``). The broker refuses the whole produce batch librdkafka sent to a
        partition, so a record that would fit alone may be among them."""
        return self._reports.take_too_large()

    def wait(self, timeout: float = 30.0) -> None:
        """Wait until the broker has acknowledged every record sent, without committing the
        open transaction (`flush` commits it); raise DeliveryFailed if any record failed. A
        record refused as too large fails this too: in a transaction it dooms the whole of it
        (the owner aborts it), and `take_too_large` says which records were refused."""
        self._usable()
        with translated("writing to Kafka failed", DeliveryFailed):
            remaining = self._producer.flush(timeout)
        if remaining:
            raise DeliveryFailed(f"{remaining} records not acknowledged within {timeout}s",
                                 retriable=True)
        failures = self._reports.take()
        if failures:
            raise DeliveryFailed(f"{len(failures)} records failed, first: {failures[0]}")
        if self._transactional and self._reports.has_too_large():
            raise DeliveryFailed("the broker refused records as too large for their topic")

    def send_alone(self, record: OutgoingRecord, timeout: float = 30.0) -> bool:
        """Write one record by itself and wait for it: False if the broker refused it as too
        large for its topic, True once it is written; DeliveryFailed for any other failure.
        Records sent before it are waited for too (a flush), and their refusals kept for
        `take_too_large`."""
        self.flush(timeout)  # what is in flight first: only this record is in flight then
        earlier = self._reports.take_too_large()
        try:
            self.send([record], timeout)
            self.flush(timeout)
            refused = self._reports.take_too_large()
        finally:
            self._reports.put_back(earlier)
        return not refused

    def _usable(self) -> None:
        if self.unusable is not None:
            raise DeliveryFailed(f"this Kafka producer is unusable ({self.unusable}); a new "
                                 "one must replace it")

    def _give_up(self, error: KafkaAdapterError) -> None:
        """The transaction's state can no longer be settled by this producer."""
        if self.unusable is None:
            self.unusable = str(error)
            log.warning("Kafka producer unusable, to be replaced: %s", error)

    def _abort(self, timeout: float = 10.0) -> None:
        """Abort the open transaction (its records are discarded); retriable failures are
        resumed within ``timeout``. One that cannot be aborted makes the writer unusable."""
        if not self._in_transaction:
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._producer.abort_transaction(max(deadline - time.monotonic(), 0.1))
                break
            except DRIVER_ERRORS as exc:
                error = driver_error("aborting the Kafka transaction failed", exc)
                if error.retriable and not error.fatal and time.monotonic() < deadline:
                    time.sleep(_RETRY_PAUSE)
                    continue
                self._give_up(error)
                return
        self._in_transaction = False
        # The aborted records are reported as purged or failed: that write has failed
        # already, and the next one must not be failed for them.
        try:
            self._producer.poll(0)
        except DRIVER_ERRORS as exc:
            log.debug("serving reports after an abort: %s", exc)
        self._reports.take()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``; 0: drop it) and let go of the producer.

        Never raises: an owner closes its writer because something failed already. A
        transaction that cannot be aborted here is settled on the broker: by the next writer
        with the same transactional id, or after the transaction timeout."""
        try:
            if self.unusable is None and not self._committing:
                self._abort(timeout)
                if timeout > 0 and not self._transactional:
                    remaining = self._producer.flush(timeout)
                    if remaining:
                        log.warning("%d records not written before the producer closed",
                                    remaining)
            # What is left is dropped now rather than when the producer is destroyed, which
            # would warn about it.
            self._producer.purge()
            self._producer.poll(0)
        except DRIVER_ERRORS as exc:
            log.warning("closing the Kafka producer: %s", driver_error("closing", exc))
        self._reports.take()
