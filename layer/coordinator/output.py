"""A plan's records: deliveries, dead letters, events and replies as Kafka records.

Pure but for what the loop hands in (records re-read from Kafka) and the `TopicAdmin` port
asked whether a reply's topic exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from layer.coordinator.translate import event_fields, ms, wire_bookmark, wire_reason
from layer.domain import events as ev
from layer.domain.states import AckSource, Bookmark, ExpiryReason
from layer.kafka import JournalRecord, OutgoingRecord
from layer.protocol import (
    BATCH,
    DeadLetterInfo,
    DeliveryFormat,
    DeliveryInfo,
    dead_letter_headers,
    encode_delivery_batch,
    encode_entry,
    encoded_delivery_headers,
    topic_name_problem,
    with_delivery_headers,
    without_delivery_headers,
)
from layer.protocol.batch import DEFAULT_MAX_BATCH_BYTES
from layer.protocol.eventwire import EntryEventEncoder
from layer.protocol.headers import DLQ_VALUE_OMITTED, SESSION

if TYPE_CHECKING:
    from layer.coordinator.core import ShardCore

log = logging.getLogger(__name__)

__all__ = ["Output"]

_CONSUMER = str(AckSource.CONSUMER)  # an ACKED event's reason: who acked


def _timestamp_ms(record: JournalRecord | None) -> int | None:
    """The journal record's own timestamp (Kafka gives 0 or -1 when it has none)."""
    if record is None or record.timestamp_ms <= 0:
        return None
    return record.timestamp_ms


class _Encoded(dict[str, bytes]):
    """UTF-8 forms of names that recur in every delivery (queues, consumer and session ids)."""

    def __call__(self, text: str) -> bytes:
        found = self.get(text)
        if found is None:
            if len(self) >= 50_000:
                self.clear()
            found = self[text] = text.encode()
        return found


_LEASED, _ACKED = 1, 2  # kinds of the runs `Output.event_records` fills


class _Run:
    """A run of LEASED or ACKED events being gathered: the first event's fields, and the
    offsets of every entry it stands for."""

    __slots__ = ("first", "offsets", "slot")

    def __init__(self, slot: int, first: ev.Event) -> None:
        self.slot = slot
        self.first = first
        self.offsets: list[int] = []

    def encode(self, fast: EntryEventEncoder, session_of: Callable[[str], str | None]) -> bytes:
        e = self.first
        if type(e) is ev.EntryLeased:
            d = e
            b = d.bookmark
            return fast.leased_run(int(d.at * 1000), d.queue, b.topic, b.partition, self.offsets,
                                   d.consumer_id, session_of(d.consumer_id), d.delivery_count,
                                   int(d.deadline * 1000))
        a = cast(ev.EntryAcked, e)
        b = a.bookmark
        return fast.acked_run(int(a.at * 1000), a.queue, b.topic, b.partition, self.offsets,
                              a.consumer_id, _CONSUMER, a.delivery_count)


class _Batch:
    """The delivery batch of one session being filled this iteration."""

    __slots__ = ("consumer", "entries", "headers", "packed", "records", "size", "topic")

    def __init__(self, topic: str, consumer: bytes, session: bytes) -> None:
        self.topic = topic
        self.consumer = consumer
        self.headers = [(BATCH, b"1"), (SESSION, session)]
        self.entries: list[bytes] = []
        self.size = 0
        self.packed = 0
        self.records = 0

    def add(self, entry: bytes, out: list[OutgoingRecord], max_bytes: int) -> None:
        if self.entries and self.size + len(entry) > max_bytes:
            self.close(out)
        self.entries.append(entry)
        self.size += len(entry)
        self.packed += 1

    def close(self, out: list[OutgoingRecord]) -> None:
        if self.entries:
            out.append(OutgoingRecord(self.topic, encode_delivery_batch(self.entries),
                                      self.consumer, list(self.headers)))
            self.records += 1
            self.entries = []
            self.size = 0


class Output:
    """Turns a shard's plans into records."""

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        #: A delivery batch record stops growing past this many bytes.
        self.max_batch_bytes = DEFAULT_MAX_BATCH_BYTES
        #: Messages the last `deliveries` call delivered (batches hold many per record).
        self.delivered = 0
        self._encoded = _Encoded()
        self._entry_events: EntryEventEncoder | None = None
        self._entry_events_for: tuple[str, int] | None = None

    def event_records(self, events: list[ev.Event],
                      fresh: dict[Bookmark, JournalRecord]) -> list[bytes]:
        """This iteration's events, with the core's pending ones (refusals, ownership), as the
        items of one EventBatch's events (docs/protocol.md §4.4b), in the order they happened.

        What every message has, one ENQUEUED, one LEASED and one ACKED, goes in runs: one
        `EventRun` item for the entries one iteration enqueued from one partition, leased to
        one consumer (same delivery count and deadline) or accepted from one consumer. An
        event joins an open run only if its entry has had no event since the run began, so
        each entry's events stay in the order they happened (other entries' may not)."""
        owner, epoch = self.core.owner_id, self.core.epoch
        base = self.core.codec.event_encoder
        fast = self._entry_events
        if fast is None or self._entry_events_for != (owner, epoch):
            fast = self._entry_events = EntryEventEncoder(base, owner, epoch)
            self._entry_events_for = (owner, epoch)
        encode = base.encode_fields
        event_item = self.core.codec.event_item
        session_of = self.core.session_id_of

        def record_time_of(b: Bookmark) -> int | None:
            return _timestamp_ms(fresh.get(b))

        # Items in order: encoded bytes, or a run being filled (encoded at the end). The
        # native lane's come first: with native engines, they are all of the queues' events.
        lane = self.core.lane
        items: list[bytes | _Run] = list(lane.event_items()) if lane is not None else []
        runs: dict[tuple[object, ...], _Run] = {}
        # Per entry (queue, bookmark): the index in `items` of its latest event.
        latest: dict[tuple[str, Bookmark], int] = {}
        # Per journal partition of a queue: the index of its last ENQUEUED run.
        enqueued_at: dict[tuple[str, str, int], int] = {}
        for e in events:
            kind = type(e)
            if kind is ev.EntryLeased:
                d = cast(ev.EntryLeased, e)
                b, queue = d.bookmark, d.queue
                key: tuple[object, ...] = (
                    _LEASED, queue, b.topic, b.partition, d.consumer_id, d.delivery_count,
                    d.at, d.deadline)
            elif kind is ev.EntryAcked and cast(ev.EntryAcked, e).source is AckSource.CONSUMER:
                a = cast(ev.EntryAcked, e)
                b, queue = a.bookmark, a.queue
                key = (_ACKED, queue, b.topic, b.partition, a.consumer_id, a.delivery_count,
                       a.at)
            elif kind is ev.EntriesEnqueued:
                n = cast(ev.EntriesEnqueued, e)
                topic, partition = n.topic, n.partition
                # An entry's ENQUEUED is its first event: no run opened before this one may
                # take a later event of these entries.
                enqueued_at[(n.queue, topic, partition)] = len(items)
                items.append(fast.enqueued_run(
                    int(n.at * 1000), n.queue, topic, partition, n.offsets,
                    [_timestamp_ms(fresh.get(Bookmark(topic, partition, o)))
                     for o in n.offsets]))
                continue
            else:
                items.extend(event_item(encode(owner, epoch, *f))
                             for f in event_fields((e,), session_of=session_of,
                                                   record_time_of=record_time_of))
                bookmark = getattr(e, "bookmark", None)
                if bookmark is not None:
                    latest[(getattr(e, "queue", ""), bookmark)] = len(items) - 1
                continue
            entry = (queue, b)
            run = runs.get(key)
            if run is None or latest.get(entry, -1) > run.slot or (
                    enqueued_at and enqueued_at.get((queue, b.topic, b.partition), -1)
                    > run.slot):
                run = runs[key] = _Run(len(items), e)
                items.append(run)
            run.offsets.append(b.offset)
            latest[entry] = run.slot
        out = [item if type(item) is bytes else cast(_Run, item).encode(fast, session_of)
               for item in items]
        encode_event = self.core.codec.encode_event
        out.extend(event_item(encode_event(w)) for w in self.core.pending_events)
        self.core.pending_events = []
        return out

    def deliveries(self, deliveries: list[ev.Delivery],
                   reread: dict[Bookmark, JournalRecord],
                   unsent: frozenset[str] = frozenset()) -> list[OutgoingRecord]:
        """One record per delivery for sessions that read records (protocol 1), one delivery
        batch per session and iteration for those that read batches (protocol 3); none for
        the consumer ids of ``unsent`` (sessions ended after the step leased to them:
        `Control.lost_claims`).

        With native engines the lane encodes the batches of their deliveries; what it leaves
        (record-format sessions, barriers with such a recipient, and leases of sessions no
        longer known, as ``unsent``'s are) and ``deliveries`` (resent leases) go here first,
        so a barrier's record precedes the leases dispatched after it."""
        lane = self.core.lane
        if lane is None:
            return self._deliveries(_sent_to(deliveries, unsent), reread)
        batches, rest, packed = lane.deliveries(reread, self.max_batch_bytes)
        out = self._deliveries(_sent_to(deliveries + rest, unsent), reread)
        out.extend(batches)
        self.delivered += packed
        return out

    def _deliveries(self, deliveries: list[ev.Delivery],
                    reread: dict[Bookmark, JournalRecord]) -> list[OutgoingRecord]:
        out: list[OutgoingRecord] = []
        batches: dict[str, _Batch] = {}
        encoded = self._encoded
        sessions = self.core.sessions
        for d in deliveries:
            record = self.core.payloads.get(d.bookmark) or reread.get(d.bookmark)
            if record is None:
                # The journal no longer has the record (retention) or could not be read in
                # time; the lease expires and the entry is offered again. Count it, go on.
                self.core.counters["delivery_without_payload"] += 1
                log.error("no payload for %s in queue %s", d.bookmark, d.queue)
                continue
            if type(d) is ev.EntryLeased:
                session = sessions.get(d.consumer_id)
                b = d.bookmark
                if session is not None and session.delivery_format == DeliveryFormat.BATCH:
                    batch = batches.get(d.consumer_id)
                    if batch is None:
                        batch = batches[d.consumer_id] = _Batch(
                            d.delivery_topic, encoded(d.consumer_id),
                            encoded(session.session_id))
                    batch.add(encode_entry(
                        encoded(d.queue), encoded(b.topic), b.partition, b.offset,
                        d.token.encode(), int(d.deadline * 1000), d.delivery_count, False,
                        _timestamp_ms(record), record.key, record.value,
                        without_delivery_headers(record.headers) if record.headers else None),
                        out, self.max_batch_bytes)
                    continue
                headers = without_delivery_headers(record.headers) if record.headers else []
                headers.extend(encoded_delivery_headers(
                    encoded(d.queue), f"{b.topic}/{b.partition}/{b.offset}".encode(),
                    d.token.encode(), int(d.deadline * 1000), d.delivery_count, False,
                    encoded(d.consumer_id),
                    encoded(session.session_id) if session is not None else None))
                out.append(OutgoingRecord(d.delivery_topic, record.value, record.key, headers,
                                          record.timestamp_ms))
            else:
                assert isinstance(d, ev.BarrierDelivered)
                for recipient in d.recipients:
                    session = sessions.get(recipient.consumer_id)
                    if session is not None and session.delivery_format == DeliveryFormat.BATCH:
                        batch = batches.get(recipient.consumer_id)
                        if batch is None:
                            batch = batches[recipient.consumer_id] = _Batch(
                                recipient.delivery_topic, encoded(recipient.consumer_id),
                                encoded(session.session_id))
                        b = d.bookmark
                        batch.add(encode_entry(
                            encoded(d.queue), encoded(b.topic), b.partition, b.offset, b"", 0, 1,
                            True, _timestamp_ms(record), record.key, record.value,
                            without_delivery_headers(record.headers) if record.headers
                            else None), out, self.max_batch_bytes)
                        continue
                    # A barrier needs no ack: no lease token, no deadline.
                    info = DeliveryInfo(queue=d.queue, bookmark=wire_bookmark(d.bookmark),
                                        lease="", lease_expires_ms=0, delivery_count=1,
                                        barrier=True, consumer_id=recipient.consumer_id,
                                        session_id=session.session_id if session else None)
                    out.append(OutgoingRecord(recipient.delivery_topic, record.value,
                                              record.key,
                                              with_delivery_headers(record.headers or [], info),
                                              record.timestamp_ms))
        for batch in batches.values():
            batch.close(out)
        # Messages delivered, whatever records carried them.
        self.delivered = len(out) + sum(b.packed for b in batches.values()) - sum(
            b.records for b in batches.values())
        return out

    def dead_letter(self, e: ev.EntryExpired, now: float,
                    reread: dict[Bookmark, JournalRecord]) -> list[OutgoingRecord]:
        record = self.core.payloads.get(e.bookmark) or reread.get(e.bookmark)
        if record is None:
            self.core.counters["dead_letter_without_payload"] += 1
            log.error("no payload to dead-letter %s of queue %s", e.bookmark, e.queue)
            return []
        engine = self.core.engines[e.queue]
        value, detail = record.value, e.detail
        if e.reason is ExpiryReason.TOO_LARGE:
            # The producer cannot write this value anywhere (the dead-letter topic included):
            # the letter carries the key, headers and where the record is, and the record
            # stays in its journal until retention (`qlayer.dlq.value-omitted` says so).
            value = b""
            detail = (f"{detail}; value of {len(record.value or b'')} bytes left out, read it "
                      f"from the journal at {e.bookmark}")
        info = DeadLetterInfo(reason=wire_reason(str(e.reason)), queue=e.queue,
                              bookmark=wire_bookmark(e.bookmark),
                              delivery_count=e.delivery_count, dead_lettered_at_ms=ms(now),
                              last_consumer=e.consumer_id, detail=detail)
        headers = dead_letter_headers(record.headers or [], info)
        if e.reason is ExpiryReason.TOO_LARGE:
            headers.append((DLQ_VALUE_OMITTED, b"%d" % len(record.value or b"")))
        return [OutgoingRecord((engine.definition.dead_letter_topic
                                or self.core.topics.dead_letter(e.queue)), value,
                               record.key, headers, record.timestamp_ms)]

    def answerable(self, replies: list[OutgoingRecord], now: float) -> list[OutgoingRecord]:
        """Replies whose topic Kafka accepts. A request naming an impossible topic cannot be
        answered; producing to it would fail the iteration, and every retry after it."""
        # A topic no session of this shard uses may have been deleted since it was seen (the
        # delivery-topic sweep, on whichever process runs shard 0): listed again, at most once
        # per iteration.
        core = self.core
        live = {s.delivery_topic for s in core.sessions.values()}
        if any(r.topic not in live for r in replies) and core.topics_listed_at != now:
            core.known_topics = set(core.admin.topics())
            core.topics_listed_at = now
        good = [r for r in replies
                if topic_name_problem(r.topic) is None and self._topic_exists(r.topic, now)]
        if len(good) < len(replies):
            self.core.counters["unanswerable_replies"] += len(replies) - len(good)
            log.warning("%d replies dropped: no legal topic to answer on",
                        len(replies) - len(good))
        return good

    def _topic_exists(self, topic: str, now: float) -> bool:
        """Whether Kafka has the topic. Replies never create one: delivery topics are created
        on a valid Subscribe only (protocol 5, docs/security.md "Session identity"), so
        records naming made-up consumer ids cannot make the coordinator create topics; and
        producing to a missing topic would fail the whole iteration's flush."""
        core = self.core
        if topic in core.known_topics:
            return True
        # Missing at a listing of this iteration: still missing. A flood of records naming
        # made-up consumers then costs one listing per iteration, not one per record (each a
        # metadata request to the broker, in the shard's loop). Not longer: the listing must
        # come after the records it answers were read, as a consumer makes its delivery topic
        # before it sends its Subscribe (an older listing would drop that answer for good).
        if core.topics_listed_at == now:
            return False
        core.known_topics = set(core.admin.topics())
        core.topics_listed_at = now
        return topic in core.known_topics


def _sent_to(deliveries: list[ev.Delivery], unsent: frozenset[str]) -> list[ev.Delivery]:
    """The deliveries not leased to a consumer id of ``unsent``."""
    if not unsent:
        return deliveries
    return [d for d in deliveries if type(d) is not ev.EntryLeased or d.consumer_id not in unsent]
