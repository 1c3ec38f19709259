"""Records the broker refused as too large for their topic, taken apart to be sent alone.

A delivery topic whose ``max.message.bytes`` is below the producer's ``message.max.bytes``
(made by hand, or altered) takes nothing larger than its own limit; librdkafka accepts such a
record locally and learns of the refusal (MSG_SIZE_TOO_LARGE) in a delivery report, an
iteration later. The broker refuses the whole produce batch librdkafka sent to the partition,
so the refused records include ones that would fit alone (replies among them), and a delivery
batch record (protocol 3) carries many messages. Which message is too large is known only by
sending each alone: `alone` gives one record per message, with the `Refused` delivery it
carries (the queue and entry; None for anything else: a reply, a dead letter, an event batch),
and the shard loop writes them one at a time (`ShardLoop._resend_refused`). A message still
refused alone is dead-lettered from its queue with reason ``too_large``
(`ShardCore.too_large`); the others are delivered. The
refusals are rare (a misconfigured topic), so this path may take a round trip per message;
the loop's ordinary path is unchanged.

In a Kafka transaction (``--transactions``) one refusal fails the whole transaction: the
shard loop aborts it, makes a new producer and writes the transaction again without the
refused records, then each of their messages alone in a transaction of its own
(`ShardLoop._transact`). `refused_among` finds the refused records in either case.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from layer.domain.states import Bookmark
from layer.kafka import DeliveryFailed, OutgoingRecord
from layer.protocol import BATCH, ProtocolError
from layer.protocol.batch import decode_delivery_batch, encode_delivery_batch, encode_entry
from layer.protocol.headers import DLQ_REASON, LEASE, header_value, parse_delivery_headers

__all__ = ["Refused", "alone", "refused_among"]


class Refused(NamedTuple):
    """One message of a refused delivery record: which queue's entry it delivered."""

    queue: str
    bookmark: Bookmark
    #: The lease token it carried: an at-most-once delivery's backlog slot is freed with it.
    lease: str
    delivery_count: int
    #: A barrier goes to every matching consumer at once and is done when sent: one topic
    #: refusing it is logged, not dead-lettered (the others have it).
    barrier: bool
    #: The delivery topic that refused it: it names the consumer, the dead letter's
    #: ``last_consumer`` (None when not known).
    topic: str | None = None


def refused_among(reported: list[OutgoingRecord],
                  sent: list[list[OutgoingRecord]]) -> list[OutgoingRecord]:
    """The records of ``sent`` (the very objects, headers and all) that the ``reported``
    refusals are about. A delivery report has the topic, key and value, not the headers: the
    records are paired by those, one report per record sent, so equal ones pair off. A report
    that matches no record sent raises DeliveryFailed (the caller cannot deal with it)."""
    sent_by: dict[tuple[str, int, bytes | None], list[OutgoingRecord]] = {}
    for records in sent:
        for r in records:
            sent_by.setdefault((r.topic, len(r.value or b""), r.key), []).append(r)
    refused: list[OutgoingRecord] = []
    for report in reported:
        candidates = sent_by.get((report.topic, len(report.value or b""), report.key), [])
        found = next((i for i, r in enumerate(candidates) if r.value == report.value), None)
        if found is None:
            raise DeliveryFailed(f"{report.topic}: the broker refused a record of "
                                 f"{len(report.value or b'')} bytes as larger than the "
                                 "topic's max.message.bytes")
        refused.append(candidates.pop(found))
    return refused


def alone(records: list[OutgoingRecord]) -> Iterator[tuple[OutgoingRecord, Refused | None]]:
    """Each refused record's messages as records of their own, each with the delivery it
    carries (None: not a delivery)."""
    for record in records:
        headers = record.headers or []
        if header_value(headers, BATCH) is not None and record.value is not None:
            try:
                entries = decode_delivery_batch(record.value)
            except ProtocolError:
                yield record, None
                continue
            for e in entries:
                value = encode_delivery_batch([encode_entry(
                    e.queue.encode(), e.topic.encode(), e.partition, e.offset, e.lease.encode(),
                    e.lease_expires_ms, e.delivery_count, e.barrier, e.timestamp_ms, e.key,
                    e.value, e.headers)])
                yield (record._replace(value=value),
                       Refused(e.queue, Bookmark(e.topic, e.partition, e.offset), e.lease,
                               e.delivery_count, e.barrier, record.topic))
        elif header_value(headers, LEASE) is not None and header_value(
                headers, DLQ_REASON) is None:
            try:
                info = parse_delivery_headers(headers)
            except ProtocolError:
                yield record, None
                continue
            b = info.bookmark
            yield record, Refused(info.queue, Bookmark(b.topic, b.partition, b.offset),
                                  info.lease, info.delivery_count, info.barrier, record.topic)
        else:
            yield record, None
