"""Delivery batches (protocol 3): many leased messages in one record of a delivery topic.

Version 1 delivers one Kafka record per message, the original record with ``qlayer.*`` headers
appended; producing and consuming a record costs about as much as everything else the
coordinator does for a message. A delivery batch carries every message one iteration leased to
one consumer session in one record (split only past ``max_bytes``). Each message keeps its
original key, value, timestamp and headers and has its own lease fields: a batch is a wire
shape, not a coarser lease.

The record's headers are ``qlayer.batch: 1`` and ``qlayer.session: <session id>``; its key is
the consumer id. Its value (all integers big-endian, unsigned unless said)::

    batch   := magic "qB" (71 42) | version u8 (01) | count u32 | message * count
    message := queue str16 | topic str16 | partition u32 | offset u64
               | lease str16 (empty for a barrier) | lease_expires_ms u64 (0 for a barrier)
               | delivery_count u32 | flags u8 (bit 0: barrier)
               | timestamp_ms i64 (-1: the record has none)
               | key bytes32 | value bytes32 | header_count u16 | header * header_count
    header  := name str16 | value bytes32
    str16   := length u16 | UTF-8 bytes
    bytes32 := length u32 | bytes; length FFFFFFFF is null (no bytes follow)

`docs/protocol.md` §6 shows a batch byte by byte (a test keeps the example true).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from layer.protocol.errors import ProtocolError, ProtocolErrorKind

__all__ = [
    "BATCH",
    "BATCH_MAGIC",
    "BATCH_VERSION",
    "DEFAULT_MAX_BATCH_BYTES",
    "DELIVERY_FORMAT",
    "BatchEntry",
    "DeliveryFormat",
    "decode_delivery_batch",
    "decode_delivery_batch_fields",
    "delivery_format",
    "encode_delivery_batch",
    "encode_entry",
]

#: Header of a delivery-batch record (value ``1``).
BATCH = "qlayer.batch"
#: Header of a Subscribe or Replace record: how the consumer wants its deliveries,
#: ``batch`` (protocol 3) or ``record`` (one record per message, protocol 1; the default, which
#: plain Kafka readers understand).
DELIVERY_FORMAT = "qlayer.delivery-format"

BATCH_MAGIC = b"qB"
BATCH_VERSION = 1
#: A batch record stops growing past this many bytes (a message larger than it goes alone):
#: below Kafka's default 1 MiB record limit with room for the record's own overhead.
DEFAULT_MAX_BATCH_BYTES = 512 * 1024

try:  # the native decoder (native/src/batch.rs); this module's own is the reference
    from qlayer_native import decode_delivery_batch as _native_decode
except ImportError:  # pragma: no cover - where the extension is not built
    _native_decode = None

_NULL = 0xFFFFFFFF
_new: Final = tuple.__new__  # a NamedTuple without its generated Python __new__
_HEAD = struct.Struct(">2sBI")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_POSITION = struct.Struct(">IQ")
_LEASE = struct.Struct(">QIBq")


class DeliveryFormat:
    """The two delivery formats a consumer may ask for (``qlayer.delivery-format``)."""

    BATCH = "batch"
    RECORD = "record"
    ALL = (BATCH, RECORD)


class BatchEntry(NamedTuple):
    """One leased message of a batch: the original record and its lease fields.

    A named tuple: a consumer makes one per message it receives (a frozen dataclass cost it
    a microsecond each)."""

    queue: str
    topic: str
    partition: int
    offset: int
    lease: str
    lease_expires_ms: int
    delivery_count: int
    barrier: bool
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


def _str16(text: bytes, parts: list[bytes]) -> None:
    parts.append(_U16.pack(len(text)))
    parts.append(text)


def _bytes32(data: bytes | None, parts: list[bytes]) -> None:
    if data is None:
        parts.append(_U32.pack(_NULL))
    else:
        parts.append(_U32.pack(len(data)))
        parts.append(data)


def encode_entry(queue: bytes, topic: bytes, partition: int, offset: int, lease: bytes,
                 lease_expires_ms: int, delivery_count: int, barrier: bool,
                 timestamp_ms: int | None, key: bytes | None, value: bytes | None,
                 headers: Sequence[tuple[str, bytes | None]] | None) -> bytes:
    """One message of a batch (names already UTF-8: the coordinator encodes them once)."""
    parts = [_U16.pack(len(queue)), queue, _U16.pack(len(topic)), topic,
             _POSITION.pack(partition, offset), _U16.pack(len(lease)), lease,
             _LEASE.pack(lease_expires_ms, delivery_count, 1 if barrier else 0,
                         -1 if timestamp_ms is None else timestamp_ms)]
    _bytes32(key, parts)
    _bytes32(value, parts)
    parts.append(_U16.pack(len(headers) if headers else 0))
    if headers:
        for name, data in headers:
            _str16(name.encode(), parts)
            _bytes32(data, parts)
    return b"".join(parts)


def encode_delivery_batch(entries: Sequence[bytes]) -> bytes:
    """A batch record's value from messages encoded by `encode_entry`."""
    return _HEAD.pack(BATCH_MAGIC, BATCH_VERSION, len(entries)) + b"".join(entries)


def _fail(message: str) -> ProtocolError:
    return ProtocolError(f"delivery batch: {message}", kind=ProtocolErrorKind.MALFORMED)


def decode_delivery_batch(data: bytes) -> list[BatchEntry]:
    """The messages of a batch record's value; ``ProtocolError`` if it is not a whole batch."""
    native = _native_decode
    if native is not None:
        try:
            return [_new(BatchEntry, fields) for fields in native(data)]
        except ValueError:
            pass
    return _decode_delivery_batch(data)


def decode_delivery_batch_fields(data: bytes) -> Sequence[tuple[Any, ...]]:
    """`decode_delivery_batch` as plain tuples of `BatchEntry`'s fields, in its order: what an
    SDK consumer reads, for every message it receives.

    With the native extension installed (`make install`), its decoder does the work (5-12 times
    less per message, `benchmarks/batch_decode.py`: this loop in Python was a quarter of an SDK
    consumer's CPU, and making a named tuple of each message another tenth). It refuses what
    the reference refuses; the reference then runs to say why."""
    native = _native_decode
    if native is not None:
        try:
            return native(data)  # type: ignore[no-any-return]
        except ValueError:
            pass
    return _decode_delivery_batch(data)


def _decode_delivery_batch(data: bytes) -> list[BatchEntry]:
    """The reference decoder (Python)."""
    if len(data) < _HEAD.size:
        raise _fail(f"{len(data)} bytes is shorter than a batch header")
    magic, version, count = _HEAD.unpack_from(data, 0)
    if magic != BATCH_MAGIC:
        raise _fail(f"bad magic {magic!r}")
    if version != BATCH_VERSION:
        raise _fail(f"version {version} is not supported (this reader knows {BATCH_VERSION})")
    view = memoryview(data)
    pos = _HEAD.size
    entries: list[BatchEntry] = []
    u16, u32 = _U16.unpack_from, _U32.unpack_from
    try:
        for _ in range(count):
            (n,) = u16(data, pos)
            queue = str(view[pos + 2:pos + 2 + n], "utf-8")
            pos += 2 + n
            (n,) = u16(data, pos)
            topic = str(view[pos + 2:pos + 2 + n], "utf-8")
            pos += 2 + n
            partition, offset = _POSITION.unpack_from(data, pos)
            pos += _POSITION.size
            (n,) = u16(data, pos)
            lease = str(view[pos + 2:pos + 2 + n], "ascii")
            pos += 2 + n
            expires, deliveries, flags, timestamp = _LEASE.unpack_from(data, pos)
            pos += _LEASE.size
            fields: list[bytes | None] = []
            for _field in range(2):
                (n,) = u32(data, pos)
                pos += 4
                if n == _NULL:
                    fields.append(None)
                else:
                    fields.append(data[pos:pos + n])
                    pos += n
            (header_count,) = u16(data, pos)
            pos += 2
            headers: list[tuple[str, bytes | None]] = []
            for _header in range(header_count):
                (n,) = u16(data, pos)
                name = str(view[pos + 2:pos + 2 + n], "utf-8")
                pos += 2 + n
                (n,) = u32(data, pos)
                pos += 4
                if n == _NULL:
                    headers.append((name, None))
                else:
                    headers.append((name, data[pos:pos + n]))
                    pos += n
            if pos > len(data):
                raise _fail("a message runs past the end of the record")
            entries.append(_new(BatchEntry, (queue, topic, partition, offset, lease, expires,
                                             deliveries, flags & 1 == 1,
                                             None if timestamp < 0 else timestamp,
                                             fields[0], fields[1], headers)))
    except (struct.error, UnicodeDecodeError) as exc:
        raise _fail(f"message {len(entries)} of {count} is cut or garbled ({exc})") from exc
    if pos != len(data):
        raise _fail(f"{len(data) - pos} bytes after the last of {count} messages")
    return entries


def delivery_format(headers: Sequence[tuple[str, bytes | None]] | None) -> str:
    """The delivery format a Subscribe or Replace record asks for (its last
    ``qlayer.delivery-format`` header); ``record`` when it names none or one unknown here."""
    found: bytes | None = None
    for name, value in headers or ():
        if name == DELIVERY_FORMAT:
            found = value
    return DeliveryFormat.BATCH if found == b"batch" else DeliveryFormat.RECORD
