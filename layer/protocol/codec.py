"""Avro single-object encoding of control, ack, reply and event records.

Layout of every encoded record (the Avro specification's "single object encoding")::

    C3 01 | fingerprint (8 bytes) | body
    magic   CRC-64-AVRO of the      Avro binary encoding of the record
            schema's Parsing
            Canonical Form,
            little-endian

Any Avro library decodes a record given the ``.avsc`` file; the fingerprint tells a reader which
schema wrote it, so a record on the wrong topic, a schema from another qlayer version or plain
garbage is recognised before the body is read.

A ``Codec`` parses the four schemas once when it is created; create one per process (or per
component) and pass it around. Decoders raise ``ProtocolError`` and nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from io import BytesIO
from typing import Any

import fastavro
from fastavro.schema import fingerprint as avro_fingerprint
from fastavro.schema import to_parsing_canonical_form

from layer.protocol.bookmark import Bookmark
from layer.protocol.errors import ProtocolError, ProtocolErrorKind
from layer.protocol.eventwire import (
    EventEncoder,
    encode_ack_record,
    encode_event_array,
    encode_event_arrays,
    encode_event_batch,
    encode_run_item,
    event_item,
)
from layer.protocol.indexcheck import IndexChecker, index_checker
from layer.protocol.records import (
    AcceptGroup,
    AcceptRecord,
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckStatus,
    AckType,
    ControlMessage,
    Event,
    EventBatch,
    EventRun,
    EventType,
    GrantSemantics,
    Heartbeat,
    QueueGrant,
    Replace,
    ReplyMessage,
    RequestKind,
    SessionEnded,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    Unsubscribe,
)

__all__ = [
    "HEADER_LENGTH",
    "SINGLE_OBJECT_MAGIC",
    "Codec",
    "ProtocolSchema",
    "SchemaKind",
    "read_fingerprint",
    "schema_text",
]

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
HEADER_LENGTH = 10  # magic (2) + fingerprint (8)
#: An EventBatch record stops growing at about this many bytes of events.
MAX_EVENT_BATCH_BYTES = 256 * 1024
_NAMESPACE = "io.qlayer.v1."


class SchemaKind(StrEnum):
    """The schemas; the value is the file name under ``layer/protocol/schemas/``."""

    CONTROL = "control"
    ACK = "ack"
    REPLY = "reply"
    EVENT = "event"
    #: ACCEPT of many batch-delivered messages at once (protocol 3), on the ack topic.
    ACCEPT = "accept"
    #: The events of one coordinator iteration (protocol 3), on the events topic.
    EVENT_BATCH = "event-batch"


def schema_text(kind: SchemaKind) -> str:
    """The ``.avsc`` file shipped in the package, as text."""
    return (
        resources.files("layer.protocol")
        .joinpath("schemas", f"{kind.value}.avsc")
        .read_text(encoding="utf-8")
    )


@dataclass(frozen=True, slots=True)
class ProtocolSchema:
    """One parsed schema and what identifies it on the wire."""

    kind: SchemaKind
    fullname: str
    text: str
    canonical_form: str
    fingerprint: bytes  # 8 bytes, little-endian, exactly as they appear in a record
    parsed: Any  # fastavro's parsed schema
    #: Refuses union and enum indexes fastavro would read from the end of the list (-1 ...);
    #: None for a schema with neither.
    check_indexes: IndexChecker | None = None

    @classmethod
    def load(cls, kind: SchemaKind) -> ProtocolSchema:
        text = schema_text(kind)
        # A fresh named-type table per file: each .avsc stands alone (ack and reply both define
        # io.qlayer.v1.AckType), exactly as a reader in another language would load it.
        named: dict[str, Any] = {}
        parsed: Any = fastavro.parse_schema(json.loads(text), named_schemas=named)
        canonical = to_parsing_canonical_form(parsed)
        return cls(
            kind=kind,
            fullname=parsed["name"],
            text=text,
            canonical_form=canonical,
            fingerprint=bytes.fromhex(avro_fingerprint(canonical, "CRC-64-AVRO")),
            parsed=parsed,
            check_indexes=index_checker(parsed, named),
        )

    @property
    def fingerprint_int(self) -> int:
        """The fingerprint as Java's ``SchemaNormalization.parsingFingerprint64`` (signed)."""
        return int.from_bytes(self.fingerprint, "little", signed=True)

    @property
    def header(self) -> bytes:
        """The 10 bytes every record of this schema starts with."""
        return SINGLE_OBJECT_MAGIC + self.fingerprint


def read_fingerprint(data: bytes | None) -> bytes:
    """Check the single-object header of ``data`` and return its 8-byte fingerprint."""
    return _checked_header(data)[1]


def _checked_header(data: bytes | None) -> tuple[bytes, bytes]:
    """``(data, fingerprint)`` once the header is known to be well formed."""
    if data is None or len(data) == 0:
        raise ProtocolError("record has no value", kind=ProtocolErrorKind.EMPTY)
    if len(data) < HEADER_LENGTH:
        raise ProtocolError(
            f"record is {len(data)} bytes, too short for the {HEADER_LENGTH}-byte Avro "
            "single-object header",
            kind=ProtocolErrorKind.TOO_SHORT,
        )
    if data[:2] != SINGLE_OBJECT_MAGIC:
        raise ProtocolError(
            f"record starts with {data[:2].hex(' ')}, not the Avro single-object magic c3 01",
            kind=ProtocolErrorKind.WRONG_MAGIC,
        )
    return data, bytes(data[2:HEADER_LENGTH])


class Codec:
    """Encodes and decodes every qlayer protocol record.

    Immutable after construction but for the event encoder's caches of encoded values, which
    only ever hold what a value encodes to (safe to share between threads under the GIL).
    """

    __slots__ = ("_accept", "_ack", "_by_fingerprint", "_control", "_event", "_event_batch",
                 "_event_encoder", "_reply", "_schemas")

    def __init__(self) -> None:
        self._control = ProtocolSchema.load(SchemaKind.CONTROL)
        self._ack = ProtocolSchema.load(SchemaKind.ACK)
        self._reply = ProtocolSchema.load(SchemaKind.REPLY)
        self._event = ProtocolSchema.load(SchemaKind.EVENT)
        self._accept = ProtocolSchema.load(SchemaKind.ACCEPT)
        self._event_batch = ProtocolSchema.load(SchemaKind.EVENT_BATCH)
        self._schemas = {s.kind: s for s in (self._control, self._ack, self._reply, self._event,
                                             self._accept, self._event_batch)}
        self._by_fingerprint = {s.fingerprint: s for s in self._schemas.values()}
        self._event_encoder = EventEncoder(self._event.header,
                                           self._event.parsed["fields"][0]["type"]["symbols"])

    def schema(self, kind: SchemaKind) -> ProtocolSchema:
        return self._schemas[kind]

    # --- framing ---------------------------------------------------------------------------

    def _encode(self, schema: ProtocolSchema, datum: dict[str, Any]) -> bytes:
        out = BytesIO()
        out.write(schema.header)
        try:
            fastavro.schemaless_writer(out, schema.parsed, datum)
        except Exception as error:  # fastavro raises TypeError, ValueError, OverflowError...
            raise ProtocolError(
                f"cannot encode {schema.kind.value} record: {error}", kind=ProtocolErrorKind.ENCODE
            ) from error
        return out.getvalue()

    def _decode(self, schema: ProtocolSchema, data: bytes | None, *, unions: bool) -> Any:
        data, fingerprint = _checked_header(data)
        if fingerprint != schema.fingerprint:
            other = self._by_fingerprint.get(fingerprint)
            if other is not None:
                raise ProtocolError(
                    f"expected a record of the {schema.kind.value} schema, "
                    f"got one of the {other.kind.value} schema",
                    kind=ProtocolErrorKind.WRONG_SCHEMA,
                )
            raise ProtocolError(
                f"unknown schema fingerprint {fingerprint.hex()} (expected {schema.kind.value} "
                f"schema {schema.fingerprint.hex()}); written by another protocol version?",
                kind=ProtocolErrorKind.UNKNOWN_FINGERPRINT,
            )
        if schema.check_indexes is not None:
            try:
                schema.check_indexes(data, HEADER_LENGTH)
            except ProtocolError as error:
                raise ProtocolError(f"{schema.kind.value} record: {error.message}",
                                    kind=error.kind) from None
        source = BytesIO(data)
        source.seek(HEADER_LENGTH)
        try:
            datum = fastavro.schemaless_reader(
                source, schema.parsed, None, return_record_name=unions
            )
        except EOFError as error:
            raise ProtocolError(
                f"{schema.kind.value} record body is truncated ({len(data)} bytes in all)",
                kind=ProtocolErrorKind.TRUNCATED,
            ) from error
        except Exception as error:  # garbage makes fastavro raise almost anything
            raise ProtocolError(
                f"{schema.kind.value} record body is not valid Avro: {type(error).__name__}: "
                f"{error}",
                kind=ProtocolErrorKind.MALFORMED,
            ) from error
        if source.tell() != len(data):
            raise ProtocolError(
                f"{schema.kind.value} record has {len(data) - source.tell()} bytes after its body",
                kind=ProtocolErrorKind.TRAILING_BYTES,
            )
        return datum

    # --- control ---------------------------------------------------------------------------

    def encode_control(self, message: ControlMessage) -> bytes:
        body: dict[str, Any]
        match message:
            case Subscribe():
                body = {
                    "consumer_id": message.consumer_id,
                    "session_id": message.session_id,
                    "request_id": message.request_id,
                    "queue": message.queue,
                    "queue_is_regex": message.queue_is_regex,
                    "max_backlog": message.max_backlog,
                    "filter": message.filter,
                    "delivery_topic": message.delivery_topic,
                    "session_timeout_ms": message.session_timeout_ms,
                    "client_name": message.client_name,
                    "client_version": message.client_version,
                    "sent_at_ms": message.sent_at_ms,
                }
            case Replace():
                body = {
                    "consumer_id": message.consumer_id,
                    "session_id": message.session_id,
                    "request_id": message.request_id,
                    "queue": message.queue,
                    "queue_is_regex": message.queue_is_regex,
                    "max_backlog": message.max_backlog,
                    "filter": message.filter,
                    "delivery_topic": message.delivery_topic,
                    "sent_at_ms": message.sent_at_ms,
                }
            case Heartbeat():
                body = {
                    "consumer_id": message.consumer_id,
                    "session_id": message.session_id,
                    "sent_at_ms": message.sent_at_ms,
                }
            case Unsubscribe():
                body = {
                    "consumer_id": message.consumer_id,
                    "session_id": message.session_id,
                    "reason": message.reason,
                    "sent_at_ms": message.sent_at_ms,
                }
        # Tuple notation names the union branch, so fastavro need not try each one.
        return self._encode(self._control, {"body": (_NAMESPACE + type(message).__name__, body)})

    def decode_control(self, data: bytes | None) -> ControlMessage:
        name, body = self._decode(self._control, data, unions=True)["body"]
        # Field names in the schema are the dataclass field names, so keywords map 1:1.
        match name:
            case "io.qlayer.v1.Subscribe":
                return Subscribe(**body)
            case "io.qlayer.v1.Replace":
                return Replace(**body)
            case "io.qlayer.v1.Heartbeat":
                return Heartbeat(**body)
            case "io.qlayer.v1.Unsubscribe":
                return Unsubscribe(**body)
        raise ProtocolError(f"unexpected control body {name}", kind=ProtocolErrorKind.MALFORMED)

    # --- ack -------------------------------------------------------------------------------

    def encode_ack(self, record: AckRecord) -> bytes:
        """The record, written by `encode_ack_record` (byte for byte fastavro's encoding of
        `ack_datum`, at a fifth of its cost: consumers write one item per message)."""
        try:
            return encode_ack_record(self._ack.header, record)
        except (AttributeError, KeyError, OverflowError, TypeError, UnicodeError) as error:
            raise ProtocolError(f"cannot encode ack record: {error}",
                                kind=ProtocolErrorKind.ENCODE) from error

    def ack_datum(self, record: AckRecord) -> dict[str, Any]:
        """The record as the dict a generic Avro library (fastavro) encodes."""
        return {
            "consumer_id": record.consumer_id,
            "session_id": record.session_id,
            "sent_at_ms": record.sent_at_ms,
            "items": [
                {
                    "queue": item.queue,
                    "bookmark": item.bookmark,
                    "lease": item.lease,
                    "type": item.type.name,
                    "delay_ms": item.delay_ms,
                    "reason": item.reason,
                }
                for item in record.items
            ],
        }

    def decode_ack(self, data: bytes | None) -> AckRecord:
        datum = self._decode(self._ack, data, unions=False)
        ack_types = AckType.__members__  # symbol -> member, without a per-item enum lookup
        return AckRecord(
            consumer_id=datum["consumer_id"],
            session_id=datum["session_id"],
            sent_at_ms=datum["sent_at_ms"],
            items=tuple(
                AckItem(
                    queue=item["queue"],
                    bookmark=item["bookmark"],
                    lease=item["lease"],
                    type=ack_types[item["type"]],
                    delay_ms=item["delay_ms"],
                    reason=item["reason"],
                )
                for item in datum["items"]
            ),
        )

    def encode_accept(self, record: AcceptRecord) -> bytes:
        """An AcceptRecord: per (queue, topic, partition), the offsets and their tokens."""
        for group in record.groups:
            if len(group.offsets) != len(group.leases):
                raise ProtocolError(
                    f"accept group {group.queue} {group.topic}/{group.partition}: "
                    f"{len(group.offsets)} offsets but {len(group.leases)} leases",
                    kind=ProtocolErrorKind.ENCODE)
            if any("," in lease for lease in group.leases):
                raise ProtocolError("a lease token holds ',': send it as an AckRecord item",
                                    kind=ProtocolErrorKind.ENCODE)
        return self._encode(self._accept, {
            "consumer_id": record.consumer_id,
            "session_id": record.session_id,
            "sent_at_ms": record.sent_at_ms,
            "groups": [{"queue": g.queue, "topic": g.topic, "partition": g.partition,
                        "offsets": list(g.offsets), "leases": ",".join(g.leases)}
                       for g in record.groups],
        })

    def decode_accept(self, data: bytes | None) -> AcceptRecord:
        datum = self._decode(self._accept, data, unions=False)
        groups = []
        for g in datum["groups"]:
            offsets = g["offsets"]
            leases = g["leases"].split(",") if offsets else []
            if len(leases) != len(offsets):
                raise ProtocolError(
                    f"accept group {g['queue']} {g['topic']}/{g['partition']}: "
                    f"{len(offsets)} offsets but {len(leases)} leases",
                    kind=ProtocolErrorKind.MALFORMED)
            groups.append(AcceptGroup(queue=g["queue"], topic=g["topic"],
                                      partition=g["partition"], offsets=tuple(offsets),
                                      leases=tuple(leases)))
        return AcceptRecord(consumer_id=datum["consumer_id"], session_id=datum["session_id"],
                            sent_at_ms=datum["sent_at_ms"], groups=tuple(groups))

    def peek_ack_session(self, data: bytes | None) -> tuple[str, str] | None:
        """The ``consumer_id`` and ``session_id`` of an ack-topic record (an AckRecord or an
        AcceptRecord), read without decoding the rest: both schemas start with these two
        strings. None when the record is not one of them or the two strings cannot be read.

        The coordinator checks the session before it decodes a record's items, so a record
        that names no session costs a few byte reads, whatever its size (issue 36)."""
        if data is None or len(data) < HEADER_LENGTH or data[:2] != SINGLE_OBJECT_MAGIC:
            return None
        fingerprint = data[2:HEADER_LENGTH]
        if fingerprint != self._ack.fingerprint and fingerprint != self._accept.fingerprint:
            return None
        position = HEADER_LENGTH
        found: list[str] = []
        for _ in range(2):
            read = _read_avro_long(data, position)
            if read is None:
                return None
            length, position = read
            if not 0 <= length <= _MAX_PEEKED_STRING or position + length > len(data):
                return None
            try:
                found.append(bytes(data[position:position + length]).decode("utf-8"))
            except UnicodeDecodeError:
                return None
            position += length
        return found[0], found[1]

    def decode_ack_topic_any(self, data: bytes | None) -> AckRecord | AcceptRecord:
        """A record of the ack topic as it was written: an AckRecord or an AcceptRecord."""
        if data is not None and data[2:HEADER_LENGTH] == self._accept.fingerprint:
            return self.decode_accept(data)
        return self.decode_ack(data)

    def decode_ack_topic(self, data: bytes | None) -> AckRecord:
        """A record of the ack topic, either schema, as an AckRecord: the groups of an
        AcceptRecord become ACCEPT items in their order."""
        if data is not None and data[2:HEADER_LENGTH] == self._accept.fingerprint:
            return self.decode_accept(data).as_ack_record()
        return self.decode_ack(data)

    # --- replies ---------------------------------------------------------------------------

    def encode_reply(self, message: ReplyMessage) -> bytes:
        body: dict[str, Any]
        match message:
            case SubscribeResult():
                body = {
                    "consumer_id": message.consumer_id,
                    "session_id": message.session_id,
                    "request_id": message.request_id,
                    "request": message.request.value,
                    "status": message.status.value,
                    "message": message.message,
                    "queues": [
                        {
                            "queue": grant.queue,
                            "max_backlog": grant.max_backlog,
                            "lease_period_ms": grant.lease_period_ms,
                            "semantics": grant.semantics.value,
                        }
                        for grant in message.queues
                    ],
                    "session_timeout_ms": message.session_timeout_ms,
                    "heartbeat_interval_ms": message.heartbeat_interval_ms,
                    "coordinator_id": message.coordinator_id,
                    "sent_at_ms": message.sent_at_ms,
                }
            case AckResult():
                body = {
                    "consumer_id": message.consumer_id,
                    "session_id": message.session_id,
                    "items": [
                        {
                            "queue": item.queue,
                            "bookmark": item.bookmark,
                            "type": item.type.name,
                            "status": item.status.value,
                            "lease_expires_ms": item.lease_expires_ms,
                            "message": item.message,
                        }
                        for item in message.items
                    ],
                    "sent_at_ms": message.sent_at_ms,
                }
            case SessionEnded():
                body = {
                    "consumer_id": message.consumer_id,
                    "session_id": message.session_id,
                    "reason": message.reason.value,
                    "message": message.message,
                    "sent_at_ms": message.sent_at_ms,
                }
        return self._encode(self._reply, {"body": (_NAMESPACE + type(message).__name__, body)})

    def decode_reply(self, data: bytes | None) -> ReplyMessage:
        name, body = self._decode(self._reply, data, unions=True)["body"]
        match name:
            case "io.qlayer.v1.SubscribeResult":
                return SubscribeResult(
                    consumer_id=body["consumer_id"],
                    session_id=body["session_id"],
                    request_id=body["request_id"],
                    request=RequestKind(body["request"]),
                    status=SubscribeStatus(body["status"]),
                    message=body["message"],
                    queues=tuple(
                        QueueGrant(
                            queue=grant["queue"],
                            max_backlog=grant["max_backlog"],
                            lease_period_ms=grant["lease_period_ms"],
                            semantics=GrantSemantics(grant["semantics"]),
                        )
                        for grant in body["queues"]
                    ),
                    session_timeout_ms=body["session_timeout_ms"],
                    heartbeat_interval_ms=body["heartbeat_interval_ms"],
                    coordinator_id=body["coordinator_id"],
                    sent_at_ms=body["sent_at_ms"],
                )
            case "io.qlayer.v1.AckResult":
                return AckResult(
                    consumer_id=body["consumer_id"],
                    session_id=body["session_id"],
                    items=tuple(
                        AckItemResult(
                            queue=item["queue"],
                            bookmark=item["bookmark"],
                            type=AckType[item["type"]],
                            status=AckStatus(item["status"]),
                            lease_expires_ms=item["lease_expires_ms"],
                            message=item["message"],
                        )
                        for item in body["items"]
                    ),
                    sent_at_ms=body["sent_at_ms"],
                )
            case "io.qlayer.v1.SessionEnded":
                return SessionEnded(
                    consumer_id=body["consumer_id"],
                    session_id=body["session_id"],
                    reason=SessionEndReason(body["reason"]),
                    message=body["message"],
                    sent_at_ms=body["sent_at_ms"],
                )
        raise ProtocolError(f"unexpected reply body {name}", kind=ProtocolErrorKind.MALFORMED)

    # --- events ----------------------------------------------------------------------------

    def encode_event(self, event: Event) -> bytes:
        """The event's record; written by `EventEncoder`, byte for byte what fastavro writes
        from `event_datum` (fastavro took a third of the coordinator's time)."""
        try:
            return self._event_encoder.encode(event)
        except (AttributeError, KeyError, OverflowError, TypeError, UnicodeError) as error:
            raise ProtocolError(f"cannot encode event record: {error}",
                                kind=ProtocolErrorKind.ENCODE) from error

    @property
    def event_encoder(self) -> EventEncoder:
        """The encoder behind `encode_event`, whose `encode_fields` writes an event record
        without an `Event` object (the coordinator's hot path)."""
        return self._event_encoder

    def event_datum(self, event: Event) -> dict[str, Any]:
        """The event as the dict a generic Avro library (fastavro) encodes."""
        bookmark = event.bookmark
        return {
            "type": event.type.value,
            "timestamp_ms": event.timestamp_ms,
            "coordinator_id": event.coordinator_id,
            "coordinator_epoch": event.coordinator_epoch,
            "queue": event.queue,
            "bookmark": None if bookmark is None else bookmark.format(),
            "topic": None if bookmark is None else bookmark.topic,
            "partition": None if bookmark is None else bookmark.partition,
            "offset": None if bookmark is None else bookmark.offset,
            "consumer_id": event.consumer_id,
            "session_id": event.session_id,
            "delivery_count": event.delivery_count,
            "reason": event.reason,
            "lease_expires_ms": event.lease_expires_ms,
            "available_at_ms": event.available_at_ms,
            "record_timestamp_ms": event.record_timestamp_ms,
        }

    def encode_event_batch(self, batch_id: int, shard: int, events: bytes) -> bytes:
        """An EventBatch record around events encoded by `event_array`."""
        return encode_event_batch(self._event_batch.header, batch_id, shard, events)

    @staticmethod
    def event_item(record: bytes) -> bytes:
        """An `Event` record this codec encoded, as an item of an EventBatch's events."""
        return event_item(record, HEADER_LENGTH)

    def run_item(self, run: EventRun) -> bytes:
        """An `EventRun` as an item of an EventBatch's events."""
        try:
            return encode_run_item(self._event_encoder.type_index[run.type], run)
        except (KeyError, OverflowError, AttributeError) as error:
            raise ProtocolError(f"cannot encode event run: {error}",
                                kind=ProtocolErrorKind.ENCODE) from error

    @staticmethod
    def event_array(items: list[bytes]) -> bytes:
        """The ``events`` array of an EventBatch, from its items (`event_item`, `run_item`)."""
        return encode_event_array(items)

    @staticmethod
    def event_arrays(items: list[bytes], max_bytes: int = MAX_EVENT_BATCH_BYTES) -> list[bytes]:
        """`event_array` split into arrays of at most about ``max_bytes`` each: one
        EventBatch record each (Kafka's default record limit is 1 MiB)."""
        return encode_event_arrays(items, max_bytes)

    def decode_event_batch(self, data: bytes | None) -> EventBatch:
        """The batch with its runs expanded into one `Event` per offset."""
        datum = self._decode(self._event_batch, data, unions=False)
        events: list[Event] = []
        for item in datum["events"]:
            if "offsets" in item:
                try:
                    events.extend(_run(item).events())
                except (ValueError, ProtocolError) as error:
                    raise ProtocolError(f"malformed event run: {error}",
                                        kind=ProtocolErrorKind.MALFORMED) from error
            else:
                events.append(_event(item))
        return EventBatch(batch_id=datum["batch_id"], shard=datum["shard"],
                          events=tuple(events))

    def decode_events(self, data: bytes | None) -> list[Event]:
        """The events of a record of the events topic: an EventBatch's, or a single Event."""
        if data is not None and data[2:HEADER_LENGTH] == self._event_batch.fingerprint:
            return list(self.decode_event_batch(data).events)
        return [self.decode_event(data)]

    def decode_event(self, data: bytes | None) -> Event:
        return _event(self._decode(self._event, data, unions=False))

    # --- any -------------------------------------------------------------------------------

    def decode(self, data: bytes | None
               ) -> ControlMessage | AckRecord | AcceptRecord | ReplyMessage | Event | EventBatch:
        """Decode a record of any qlayer schema, chosen by its fingerprint (for tools)."""
        fingerprint = read_fingerprint(data)
        schema = self._by_fingerprint.get(fingerprint)
        if schema is None:
            raise ProtocolError(
                f"unknown schema fingerprint {fingerprint.hex()}; not a qlayer record, or "
                "written by another protocol version",
                kind=ProtocolErrorKind.UNKNOWN_FINGERPRINT,
            )
        match schema.kind:
            case SchemaKind.CONTROL:
                return self.decode_control(data)
            case SchemaKind.ACK:
                return self.decode_ack(data)
            case SchemaKind.REPLY:
                return self.decode_reply(data)
            case SchemaKind.EVENT:
                return self.decode_event(data)
            case SchemaKind.ACCEPT:
                return self.decode_accept(data)
            case SchemaKind.EVENT_BATCH:
                return self.decode_event_batch(data)


#: The longest consumer or session id `Codec.peek_ack_session` reads (a topic name is at most
#: 249 characters, so a consumer id is shorter still; a session id is a UUID).
_MAX_PEEKED_STRING = 1024


def _read_avro_long(data: bytes, position: int) -> tuple[int, int] | None:
    """An Avro ``long`` (zig-zag varint, at most 10 bytes) at ``position``: (value, the
    position after it), or None when the bytes end or run past 10."""
    shift = result = 0
    for i in range(position, min(position + 10, len(data))):
        byte = data[i]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), i + 1
        shift += 7
    return None


def _run(datum: dict[str, Any]) -> EventRun:
    """An `EventRun` from fastavro's datum of one."""
    times = datum["record_timestamps_ms"]
    return EventRun(
        type=EventType(datum["type"]),
        timestamp_ms=datum["timestamp_ms"],
        coordinator_id=datum["coordinator_id"],
        coordinator_epoch=datum["coordinator_epoch"],
        queue=datum["queue"],
        topic=datum["topic"],
        partition=datum["partition"],
        offsets=tuple(datum["offsets"]),
        consumer_id=datum["consumer_id"],
        session_id=datum["session_id"],
        delivery_count=datum["delivery_count"],
        reason=datum["reason"],
        lease_expires_ms=datum["lease_expires_ms"],
        record_timestamps_ms=tuple(times) if times is not None else None,
    )


def _event(datum: dict[str, Any]) -> Event:
    """An `Event` from fastavro's datum of one."""
    bookmark: Bookmark | None = None
    if datum["bookmark"] is not None:
        # The string is the authority: it is what every other record carries.
        bookmark = Bookmark.parse(datum["bookmark"])
    return Event(
        type=EventType(datum["type"]),
        timestamp_ms=datum["timestamp_ms"],
        coordinator_id=datum["coordinator_id"],
        coordinator_epoch=datum["coordinator_epoch"],
        queue=datum["queue"],
        bookmark=bookmark,
        consumer_id=datum["consumer_id"],
        session_id=datum["session_id"],
        delivery_count=datum["delivery_count"],
        reason=datum["reason"],
        lease_expires_ms=datum["lease_expires_ms"],
        available_at_ms=datum["available_at_ms"],
        record_timestamp_ms=datum["record_timestamp_ms"],
    )
