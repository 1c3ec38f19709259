"""Hand-written Avro encoders for the two records written once per message: `Event` (the
coordinator's hottest encoding) and `AckRecord` (every consumer's).

Every queued message costs the coordinator at least three events (ENQUEUED, LEASED, ACKED).
fastavro spends about 6 µs on each (it resolves the eleven nullable unions of `event.avsc`
field by field, from a dict built for it), which made event encoding a third of the
coordinator's CPU time. The Avro binary encoding of a record is simply its fields in schema
order, so this module writes them directly, reusing the bytes of values that repeat (the
coordinator's id and epoch, queue names, consumer ids, the loop's timestamp). The result is
byte for byte what fastavro writes; `tests/unit/protocol/test_eventwire.py` checks that on
generated records, and `Codec.encode_event` / `Codec.encode_ack` use these encoders, so every
codec test covers them.

Avro binary encoding, as used here (Avro specification, "Binary Encoding"):
int and long are zig-zag varints; a string is its UTF-8 length as a long, then the bytes; an
enum is its symbol's index as an int; a union is the branch index as an int, then the value
(branch 0 is null, with no value); an array is written as one block, its item count then the
items, and a zero count ends it (an empty array is just the zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from layer.protocol.records import AckRecord, AckType, Event, EventRun, EventType

__all__ = ["EVENT_ITEM", "RUN_ITEM", "EntryEventEncoder", "EventEncoder", "Located",
           "encode_ack_record", "encode_event_array", "encode_event_arrays", "encode_event_batch",
           "encode_long", "encode_run_item", "encode_string", "event_item"]

_NULL = b"\x00"
_SOME = b"\x02"  # union branch 1: the non-null type
# Caches of encoded values stop growing here; cleared, they fill again with what repeats.
_CACHE_LIMIT = 50_000
_SMALL = tuple(bytes([n]) for n in range(0x80))


def _varint(z: int) -> bytes:
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


# Every zig-zag value below 2**14 encoded (one or two bytes), and the same 14 bits with the
# continuation bit on both bytes: offsets and timestamps take one or two lookups, not a loop
# (offsets are most of what an event run holds).
_SHORT = tuple(_varint(z) for z in range(0x4000))
_CONTINUED = tuple(bytes(((z & 0x7F) | 0x80, (z >> 7) | 0x80)) for z in range(0x4000))


def encode_long(n: int) -> bytes:
    """An Avro int or long: zig-zag, then 7 bits per byte, least significant first."""
    z = (n << 1) ^ (n >> 63)
    if 0 <= z < 0x4000:
        return _SHORT[z]
    if 0 <= z < 0x1000_0000:
        return _CONTINUED[z & 0x3FFF] + _SHORT[z >> 14]
    if 0 <= z < 0x400_0000_0000:  # millisecond timestamps until the year 2109
        return b"".join((_CONTINUED[z & 0x3FFF], _CONTINUED[(z >> 14) & 0x3FFF],
                         _SHORT[z >> 28]))
    if not -0x8000_0000_0000_0000 <= n <= 0x7FFF_FFFF_FFFF_FFFF:
        raise OverflowError(f"{n} does not fit an Avro long (64 bits)")
    if z < 0x80:
        return _SMALL[z]
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def encode_string(text: str) -> bytes:
    data = text.encode()
    return encode_long(len(data)) + data


class Located(Protocol):
    """Anything with a bookmark's three parts (the protocol's `Bookmark`, the engine's)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...


class EventEncoder:
    """Encodes `Event` records (single-object encoding) for one schema header.

    The caches keep encoded strings and longs that recur from one event to the next; they are
    per encoder, so an encoder is not shared between threads.
    """

    def __init__(self, header: bytes, symbols: Sequence[str]) -> None:
        # The enum's index is its position in the schema, not in the Python enum.
        self._types = {EventType(s): header + encode_long(i) for i, s in enumerate(symbols)}
        #: Each type's encoded enum index alone (an `EventRun`'s first field).
        self.type_index = {EventType(s): encode_long(i) for i, s in enumerate(symbols)}
        self._strings: dict[str, bytes] = {}
        self._longs: dict[int, bytes] = {}
        # None matches no coordinator id: a cache primed with ("", -1) wrote nothing for an
        # event of coordinator "" at epoch -1 (found by the property test).
        self._coordinator: tuple[str | None, int, bytes] = (None, -1, b"")

    def _string(self, text: str | None) -> bytes:
        """A nullable string, cached: queue names, consumer and session ids, reasons."""
        if text is None:
            return _NULL
        found = self._strings.get(text)
        if found is None:
            if len(self._strings) >= _CACHE_LIMIT:
                self._strings.clear()
            found = self._strings[text] = _SOME + encode_string(text)
        return found

    def _long(self, n: int) -> bytes:
        """A long that recurs (timestamps of one loop iteration, lease deadlines)."""
        found = self._longs.get(n)
        if found is None:
            if len(self._longs) >= _CACHE_LIMIT:
                self._longs.clear()
            found = self._longs[n] = encode_long(n)
        return found

    def encode(self, event: Event) -> bytes:
        return self.encode_fields(
            event.coordinator_id, event.coordinator_epoch, event.type, event.timestamp_ms,
            event.queue, event.bookmark, event.consumer_id, event.session_id,
            event.delivery_count, event.reason, event.lease_expires_ms, event.available_at_ms,
            event.record_timestamp_ms)

    def encode_fields(self, coordinator_id: str, coordinator_epoch: int, type: EventType,
                      timestamp_ms: int, queue: str | None, bookmark: Located | None,
                      consumer_id: str | None = None, session_id: str | None = None,
                      delivery_count: int | None = None, reason: str | None = None,
                      lease_expires_ms: int | None = None, available_at_ms: int | None = None,
                      record_timestamp_ms: int | None = None) -> bytes:
        """An `Event` from its fields, in schema order, without building the `Event`."""
        b = bookmark
        if b is None:
            where = _NULL * 4
        else:
            text = f"{b.topic}/{b.partition}/{b.offset}".encode()
            where = b"".join((_SOME, encode_long(len(text)), text, self._string(b.topic),
                              _SOME, encode_long(b.partition), _SOME, encode_long(b.offset)))
        known_id, known_epoch, fixed = self._coordinator
        if coordinator_id != known_id or coordinator_epoch != known_epoch:
            fixed = encode_string(coordinator_id) + encode_long(coordinator_epoch)
            self._coordinator = (coordinator_id, coordinator_epoch, fixed)
        return b"".join((
            self._types[type],
            self._long(timestamp_ms),
            fixed,
            self._string(queue),
            where,
            self._string(consumer_id),
            self._string(session_id),
            _NULL if delivery_count is None else _SOME + encode_long(delivery_count),
            self._string(reason),
            _NULL if lease_expires_ms is None else _SOME + self._long(lease_expires_ms),
            _NULL if available_at_ms is None else _SOME + encode_long(available_at_ms),
            _NULL if record_timestamp_ms is None else _SOME + encode_long(record_timestamp_ms),
        ))


#: The union branch that starts each item of an `EventBatch`'s ``events``: an `Event`, or an
#: `EventRun` (one event per offset).
EVENT_ITEM = _SMALL[0]
RUN_ITEM = _SMALL[2]


def event_item(record: bytes, header_length: int) -> bytes:
    """A single-object `Event` record as an item of an `EventBatch`'s ``events``."""
    return EVENT_ITEM + record[header_length:]


def encode_event_array(items: Sequence[bytes]) -> bytes:
    """The ``events`` array of an `EventBatch` from its items (`event_item`, run items)."""
    if not items:
        return _NULL
    return b"".join((encode_long(len(items)), *items, _NULL))


def encode_event_arrays(items: Sequence[bytes], max_bytes: int) -> list[bytes]:
    """`encode_event_array` in pieces of about ``max_bytes`` at most (an iteration that enqueues
    tens of thousands of records has more events than one Kafka record may hold)."""
    arrays: list[bytes] = []
    start = size = 0
    for i, item in enumerate(items):
        size += len(item)
        if size > max_bytes and i > start:
            arrays.append(encode_event_array(items[start:i]))
            start, size = i, len(item)
    if start < len(items):
        arrays.append(encode_event_array(items[start:]))
    return arrays


def _long_array(values: Sequence[int]) -> bytes:
    if not values:
        return _NULL
    return b"".join((encode_long(len(values)), *map(encode_long, values), _NULL))


def _optional_long_array(values: Sequence[int | None] | None) -> bytes:
    """A nullable array of nullable longs (a run's record timestamps)."""
    if values is None:
        return _NULL
    if not values:
        return _SOME + _NULL
    return b"".join((_SOME, encode_long(len(values)),
                     *(_NULL if v is None else _SOME + encode_long(v) for v in values), _NULL))


def _optional(value: bytes | None) -> bytes:
    return _NULL if value is None else _SOME + value


def encode_run_item(type_index: bytes, run: EventRun) -> bytes:
    """An `EventRun` as an item of an `EventBatch`'s ``events`` (``type_index`` is its type's
    encoded position in the schema's enum)."""
    return b"".join((
        RUN_ITEM, type_index, encode_long(run.timestamp_ms), encode_string(run.coordinator_id),
        encode_long(run.coordinator_epoch), encode_string(run.queue), encode_string(run.topic),
        encode_long(run.partition), _long_array(run.offsets),
        _optional(None if run.consumer_id is None else encode_string(run.consumer_id)),
        _optional(None if run.session_id is None else encode_string(run.session_id)),
        _optional(None if run.delivery_count is None else encode_long(run.delivery_count)),
        _optional(None if run.reason is None else encode_string(run.reason)),
        _optional(None if run.lease_expires_ms is None else encode_long(run.lease_expires_ms)),
        _optional_long_array(run.record_timestamps_ms),
    ))


def encode_event_batch(header: bytes, batch_id: int, shard: int, events: bytes) -> bytes:
    """An `EventBatch` record (single-object encoding) around an `encode_event_array`."""
    return b"".join((header, encode_long(batch_id), encode_long(shard), events))


class EntryEventEncoder:
    """The three events every message has (ENQUEUED, LEASED, ACKED), encoded straight from
    their values: `EventEncoder.encode_fields` with the branches and the intermediate tuple
    of fields taken out (a fifth of the coordinator's time went to events). Byte for byte the
    same records; `tests/unit/protocol/test_eventwire.py` compares them."""

    def __init__(self, base: EventEncoder, coordinator_id: str, epoch: int) -> None:
        self._base = base
        self._fixed = encode_string(coordinator_id) + encode_long(epoch)
        self._where: dict[tuple[str, int], tuple[bytes, bytes]] = {}
        types = base._types
        self._enqueued = types[EventType.ENQUEUED]
        self._leased = types[EventType.LEASED]
        self._acked = types[EventType.ACKED]
        index = base.type_index
        # What starts a run item of each type: the union branch, the type, (time follows).
        self._enqueued_run = RUN_ITEM + index[EventType.ENQUEUED]
        self._leased_run = RUN_ITEM + index[EventType.LEASED]
        self._acked_run = RUN_ITEM + index[EventType.ACKED]
        self._partitions: dict[tuple[str, str, int], bytes] = {}

    def _run_where(self, queue: str, topic: str, partition: int) -> bytes:
        """A run's coordinator, queue, topic and partition fields."""
        known = self._partitions.get((queue, topic, partition))
        if known is None:
            if len(self._partitions) >= _CACHE_LIMIT:
                self._partitions.clear()
            known = self._partitions[(queue, topic, partition)] = b"".join((
                self._fixed, encode_string(queue), encode_string(topic),
                encode_long(partition)))
        return known

    def enqueued_run(self, at_ms: int, queue: str, topic: str, partition: int,
                     offsets: Sequence[int], record_timestamps_ms: Sequence[int | None]
                     ) -> bytes:
        """ENQUEUED for each offset: `EventRun` item (record timestamps, one per offset)."""
        return b"".join((
            self._enqueued_run, self._base._long(at_ms),
            self._run_where(queue, topic, partition), _long_array(offsets),
            _NULL * 5,  # consumer, session, delivery count, reason, lease expiry
            _optional_long_array(record_timestamps_ms),
        ))

    def leased_run(self, at_ms: int, queue: str, topic: str, partition: int,
                   offsets: Sequence[int], consumer_id: str, session_id: str | None,
                   delivery_count: int, lease_expires_ms: int) -> bytes:
        """LEASED for each offset, to one consumer with one deadline: `EventRun` item."""
        base = self._base
        return b"".join((
            self._leased_run, base._long(at_ms), self._run_where(queue, topic, partition),
            _long_array(offsets), base._string(consumer_id), base._string(session_id),
            _SOME, encode_long(delivery_count), _NULL, _SOME, base._long(lease_expires_ms),
            _NULL,
        ))

    def acked_run(self, at_ms: int, queue: str, topic: str, partition: int,
                  offsets: Sequence[int], consumer_id: str | None, reason: str,
                  delivery_count: int | None = None) -> bytes:
        """ACKED for each offset, by one consumer, after the same number of deliveries:
        `EventRun` item."""
        base = self._base
        return b"".join((
            self._acked_run, base._long(at_ms), self._run_where(queue, topic, partition),
            _long_array(offsets), base._string(consumer_id), _NULL,
            _NULL if delivery_count is None else _SOME + encode_long(delivery_count),
            base._string(reason), _NULL, _NULL,
        ))

    def _bookmark(self, topic: str, partition: int, offset: int) -> bytes:
        """The bookmark string, topic, partition and offset fields (all non-null)."""
        known = self._where.get((topic, partition))
        if known is None:
            if len(self._where) >= _CACHE_LIMIT:
                self._where.clear()
            known = self._where[(topic, partition)] = (
                f"{topic}/{partition}/".encode(),
                self._base._string(topic) + _SOME + encode_long(partition) + _SOME)
        prefix, fields = known
        text = prefix + str(offset).encode()
        return b"".join((_SOME, encode_long(len(text)), text, fields, encode_long(offset)))

    def enqueued(self, at_ms: int, queue: str, topic: str, partition: int, offset: int,
                 record_timestamp_ms: int | None) -> bytes:
        base = self._base
        return b"".join((
            self._enqueued, base._long(at_ms), self._fixed, base._string(queue),
            self._bookmark(topic, partition, offset),
            _NULL * 6,  # consumer, session, delivery count, reason, lease expiry, available
            _NULL if record_timestamp_ms is None else _SOME + encode_long(record_timestamp_ms),
        ))

    def leased(self, at_ms: int, queue: str, topic: str, partition: int, offset: int,
               consumer_id: str, session_id: str | None, delivery_count: int,
               lease_expires_ms: int) -> bytes:
        base = self._base
        return b"".join((
            self._leased, base._long(at_ms), self._fixed, base._string(queue),
            self._bookmark(topic, partition, offset), base._string(consumer_id),
            base._string(session_id), _SOME, encode_long(delivery_count), _NULL,
            _SOME, base._long(lease_expires_ms), _NULL * 2,
        ))

    def acked(self, at_ms: int, queue: str, topic: str, partition: int, offset: int,
              consumer_id: str | None, reason: str, delivery_count: int | None = None) -> bytes:
        base = self._base
        return b"".join((
            self._acked, base._long(at_ms), self._fixed, base._string(queue),
            self._bookmark(topic, partition, offset), base._string(consumer_id), _NULL,
            _NULL if delivery_count is None else _SOME + encode_long(delivery_count),
            base._string(reason), _NULL * 3,
        ))


_ACK_TYPES = {t: encode_long(i) for i, t in enumerate(
    (AckType.ACCEPT, AckType.RELEASE, AckType.REJECT, AckType.RENEW))}


def encode_ack_record(header: bytes, record: AckRecord) -> bytes:
    """An `AckRecord` (single-object encoding): what a consumer writes for each batch of acks.

    The enum's symbol order in ack.avsc is ACCEPT, RELEASE, REJECT, RENEW (the share-group
    ids 1..4), which `test_eventwire` checks against the schema file.
    """
    parts = [header, encode_string(record.consumer_id), encode_string(record.session_id),
             encode_long(record.sent_at_ms)]
    items = record.items
    if items:
        parts.append(encode_long(len(items)))
        strings: dict[str, bytes] = {}
        for item in items:
            queue = strings.get(item.queue)
            if queue is None:
                queue = strings[item.queue] = encode_string(item.queue)
            delay, reason = item.delay_ms, item.reason
            parts += (queue, encode_string(item.bookmark), encode_string(item.lease),
                      _ACK_TYPES[item.type],
                      _NULL if delay is None else _SOME + encode_long(delay),
                      _NULL if reason is None else _SOME + encode_string(reason))
    parts.append(_NULL)  # the array's end (or the whole of an empty one)
    return b"".join(parts)
