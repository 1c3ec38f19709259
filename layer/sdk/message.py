"""A delivered message: the journal record as its producer wrote it, plus its lease.

The coordinator delivers the original record (key, value, timestamp, headers) with ``qlayer.*``
delivery headers appended. :class:`Message` gives the original headers back untouched and the
lease fields as properties, and settles the lease through the consumer that received it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from layer.protocol.batch import BatchEntry
from layer.protocol.bookmark import Bookmark
from layer.protocol.headers import (
    DELIVERY_HEADER_KEYS,
    DeliveryInfo,
    InputHeaders,
    RecordHeaders,
    header_value,
    parse_delivery_headers,
)
from layer.protocol.records import MAX_RELEASE_DELAY_MS, MAX_RENEW_MS, AckType
from layer.sdk.errors import MessageSettledError

__all__ = ["Message", "Settler", "delay_ms", "from_epoch_ms"]


class Settler(Protocol):
    """What a message needs from the consumer that received it (implemented by QueueConsumer)."""

    def _settle(
        self, message: Message, ack_type: AckType, delay_ms: int | None, reason: str | None
    ) -> None: ...

    def _renew(self, message: Message, timeout: float | None,
               extend_ms: int | None = None) -> datetime: ...


def from_epoch_ms(epoch_ms: int) -> datetime:
    """Milliseconds since the Unix epoch as an aware UTC datetime."""
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)


def delay_ms(delay: float | timedelta | None) -> int | None:
    """A release delay (seconds or a timedelta) in whole milliseconds; None stays None."""
    if delay is None:
        return None
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not 0 <= seconds <= MAX_RELEASE_DELAY_MS / 1000:  # also refuses NaN
        raise ValueError(f"release delay must be from 0 seconds to 24 hours, got {delay!r}")
    return round(seconds * 1000)


def renew_ms(extend: float | timedelta | None) -> int | None:
    """A renewal's length (seconds or a timedelta) in whole milliseconds; None stays None."""
    if extend is None:
        return None
    seconds = extend.total_seconds() if isinstance(extend, timedelta) else float(extend)
    ms = round(seconds * 1000) if seconds == seconds else 0  # NaN is refused below
    if not 1 <= ms <= MAX_RENEW_MS:
        raise ValueError(f"extend must be more than 0 and at most 12 hours, got {extend!r}")
    return ms


def _text(value: bytes | None) -> str | None:
    """A trace header as text (W3C trace context is ASCII; anything else is replaced)."""
    return None if value is None else value.decode("ascii", errors="replace")


class Message:
    """One leased delivery. Settle it exactly once: :meth:`ack`, :meth:`release` or
    :meth:`reject`; :meth:`renew` extends the lease while you work on it.

    ``headers`` are the record's own headers, as its producer wrote them; the lease is in
    ``queue``, ``bookmark``, ``lease``, ``lease_expires_at`` and ``delivery_count``.
    """

    __slots__ = (
        "_batched",
        "_bookmark",
        "_lease_expires_at",
        "_lease_fields",
        "_session_id",
        "_settled",
        "_settler",
        "_timestamp",
        "_timestamp_ms",
        "headers",
        "key",
        "value",
    )

    def __init__(
        self,
        *,
        key: bytes | None,
        value: bytes | None,
        headers: RecordHeaders,
        timestamp: datetime | None,
        info: DeliveryInfo,
        settler: Settler,
    ) -> None:
        self.key = key
        self.value = value
        self.headers = headers
        self._timestamp = timestamp
        self._timestamp_ms: int | None = None  # from a record: made a datetime on first read
        b = info.bookmark
        # The lease as plain values (queue, topic, partition, offset, lease, expiry in ms,
        # delivery count, barrier): the objects around them are made when first read, since a
        # consumer makes a message per delivery and most are only acked.
        self._lease_fields: tuple[str, str, int, int, str, int, int, bool] = (
            info.queue, b.topic, b.partition, b.offset, info.lease, info.lease_expires_ms,
            info.delivery_count, info.barrier)
        self._bookmark: Bookmark | None = b
        self._session_id = info.session_id
        # Made on first read: two datetimes per message were a tenth of a consumer's time.
        self._lease_expires_at: datetime | None = None
        self._settler = settler
        self._settled: AckType | None = None
        #: Came in a delivery batch (protocol 3): its ACCEPT may travel in an AcceptRecord.
        self._batched = False

    @classmethod
    def from_record(
        cls,
        *,
        key: bytes | None,
        value: bytes | None,
        headers: InputHeaders,
        timestamp_ms: int | None,
        settler: Settler,
    ) -> Message:
        """Build a message from a delivery record; raises ``ProtocolError`` when its
        ``qlayer.*`` headers are missing or malformed (such a record cannot be settled)."""
        info = parse_delivery_headers(headers)
        original = [(k, v) for k, v in headers or () if k not in DELIVERY_HEADER_KEYS]
        message = cls(key=key, value=value, headers=original, timestamp=None, info=info,
                      settler=settler)
        if timestamp_ms is not None and timestamp_ms >= 0:
            message._timestamp_ms = timestamp_ms
        return message

    @classmethod
    def from_batch(cls, entry: BatchEntry | tuple[Any, ...], *, consumer_id: str,
                   session_id: str, settler: Settler) -> Message:
        """Build a message from one entry of a delivery batch (protocol 3): a `BatchEntry`, or
        the plain tuple of its fields (`decode_delivery_batch_fields`), read by position."""
        message = cls.__new__(cls)
        message.key = entry[9]
        message.value = entry[10]
        message.headers = entry[11]
        message._timestamp = None
        message._timestamp_ms = entry[8]
        message._lease_fields = entry[:8]  # queue ... barrier, in `BatchEntry`'s order
        message._bookmark = None
        message._session_id = session_id
        message._lease_expires_at = None
        message._settler = settler
        message._settled = None
        message._batched = True
        return message

    def __repr__(self) -> str:
        return (
            f"<Message {self.queue} {self.bookmark} delivery {self.delivery_count}"
            f"{' barrier' if self.is_barrier else ''}{' settled' if self._settled else ''}>"
        )

    # --- the record ---------------------------------------------------------------------------

    def header(self, name: str) -> bytes | None:
        """The value of the record header ``name`` (the last one when repeated), or None."""
        return header_value(self.headers, name)

    @property
    def traceparent(self) -> str | None:
        """The record's W3C trace context ``traceparent`` header, as its producer wrote it
        (None when it has none): pass it to OpenTelemetry's propagator to continue the trace.
        The coordinator passes every record header through, in both delivery formats."""
        return _text(self.header("traceparent"))

    @property
    def tracestate(self) -> str | None:
        """The record's W3C ``tracestate`` header (vendor trace data), or None."""
        return _text(self.header("tracestate"))

    def json(self) -> Any:
        """The value parsed as JSON (``ValueError`` when it is not)."""
        if self.value is None:
            raise ValueError(f"message {self.bookmark} has no value (a null record)")
        return json.loads(self.value)

    @property
    def topic(self) -> str:
        """The journal the record was published to."""
        return self._lease_fields[1]

    @property
    def partition(self) -> int:
        return self._lease_fields[2]

    @property
    def offset(self) -> int:
        return self._lease_fields[3]

    # --- the lease ----------------------------------------------------------------------------

    @property
    def queue(self) -> str:
        return self._lease_fields[0]

    @property
    def bookmark(self) -> Bookmark:
        """``topic/partition/offset`` of the record: the entry's identity (``str()`` it)."""
        if self._bookmark is None:
            fields = self._lease_fields
            self._bookmark = Bookmark(fields[1], fields[2], fields[3])
        return self._bookmark

    @property
    def timestamp(self) -> datetime | None:
        """The record's own timestamp (UTC), as its producer or the broker set it."""
        if self._timestamp is None and self._timestamp_ms is not None:
            self._timestamp = from_epoch_ms(self._timestamp_ms)
        return self._timestamp

    @property
    def lease(self) -> str:
        """The lease token the coordinator checks on acknowledgement."""
        return self._lease_fields[4]

    @property
    def lease_expires_at(self) -> datetime:
        """The lease deadline (UTC, the coordinator's clock); moved by :meth:`renew`."""
        if self._lease_expires_at is None:
            self._lease_expires_at = from_epoch_ms(self._lease_fields[5])
        return self._lease_expires_at

    @property
    def delivery_count(self) -> int:
        """1 on the first delivery, 2 on the first redelivery, ..."""
        return self._lease_fields[6]

    @property
    def is_barrier(self) -> bool:
        """A barrier message: delivered to every consumer, needs no acknowledgement."""
        return self._lease_fields[7]

    @property
    def session_id(self) -> str | None:
        return self._session_id

    @property
    def settled(self) -> AckType | None:
        """How the message was settled (ACCEPT, RELEASE, REJECT), or None while it is not."""
        return self._settled

    # --- settling -----------------------------------------------------------------------------

    def ack(self) -> None:
        """Processing succeeded: the entry leaves the queue (ACCEPT)."""
        self._settle(AckType.ACCEPT, None, None)

    def release(self, delay: float | timedelta | None = None) -> None:
        """Give the entry back for redelivery (RELEASE), after ``delay`` seconds if given.

        Counts towards the queue's ``max_cancels``; a later delivery has a higher
        ``delivery_count``.
        """
        self._settle(AckType.RELEASE, delay_ms(delay), None)

    def reject(self, reason: str | None = None) -> None:
        """The entry cannot be processed: it is dead-lettered with ``reason`` (REJECT)."""
        self._settle(AckType.REJECT, None, reason)

    def renew(self, timeout: float | None = None, *,
              extend: float | timedelta | None = None) -> datetime:
        """Extend the lease; returns the new deadline (the coordinator's clock).

        By default the lease ends one lease period of the queue from now; with ``extend``
        (seconds or a timedelta, more than 0 and at most 12 hours) it ends that long from now
        instead, longer or shorter than the lease period, like SQS's
        ChangeMessageVisibility. Needs a protocol-4 coordinator; an older one refuses an
        ``extend`` (``LeaseLostError`` with status INVALID) and keeps the lease as it was.

        Waits for the coordinator's answer (up to ``timeout`` seconds, default the consumer's
        ``subscribe_timeout``). Raises ``LeaseLostError`` when the lease is already gone and
        ``NoCoordinatorError`` when no answer comes.
        """
        if self._settled is not None:
            raise MessageSettledError(
                f"message {self.bookmark} was already settled ({self._settled.name}); "
                "only a held lease can be renewed"
            )
        deadline = self._settler._renew(self, timeout, renew_ms(extend))
        self._lease_expires_at = deadline
        return deadline

    def _settle(self, ack_type: AckType, delay: int | None, reason: str | None) -> None:
        if self._settled is not None:
            raise MessageSettledError(
                f"message {self.bookmark} was already settled ({self._settled.name}); "
                f"it cannot be settled again ({ack_type.name})"
            )
        self._settler._settle(self, ack_type, delay, reason)
        self._settled = ack_type
