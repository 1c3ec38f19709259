"""Interoperability: a reader with only the .avsc files and a plain Avro library (fastavro
here, used directly) decodes what qlayer writes, and qlayer decodes what it writes."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.schema import to_parsing_canonical_form

from layer.protocol import (
    AckItem,
    AckRecord,
    AckType,
    Bookmark,
    Codec,
    Event,
    EventType,
    Heartbeat,
    SchemaKind,
    SessionEnded,
    SessionEndReason,
)

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "layer" / "protocol" / "schemas"

# CRC-64-AVRO as the Avro specification writes it, so the fingerprints are checked against the
# spec and not only against the library that computed them.
_EMPTY = 0xC15D213AA4D7A795


def _table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_EMPTY & -(fp & 1))
        table.append(fp)
    return table


_TABLE = _table()


def rabin_fingerprint(data: bytes) -> int:
    """Unsigned 64-bit CRC-64-AVRO of ``data``."""
    fp = _EMPTY
    for byte in data:
        fp = (fp >> 8) ^ _TABLE[(fp ^ byte) & 0xFF]
    return fp


def signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


@pytest.mark.parametrize(
    ("canonical", "expected"),
    [
        # Published vectors of the Avro project (share/test/data/schema-tests.txt).
        ('"null"', 7195948357588979594),
        ('"boolean"', -6970731678124411036),
        ('"string"', -8142146995180207161),
        ('{"name":"foo","type":"fixed","size":15}', 1756455273707447556),
        (
            '{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"}]}',
            7843277075252814651,
        ),
    ],
)
def test_reference_fingerprint_matches_the_avro_test_vectors(canonical: str, expected: int) -> None:
    assert signed(rabin_fingerprint(canonical.encode())) == expected


def load_avsc(kind: SchemaKind) -> Any:
    """What a reader in another project does: read the .avsc file, parse it, nothing else."""
    return fastavro.parse_schema(json.loads((SCHEMA_DIR / f"{kind.value}.avsc").read_text()))


@pytest.mark.parametrize("kind", list(SchemaKind))
def test_header_fingerprint_is_crc64_of_the_canonical_form_little_endian(
    codec: Codec, kind: SchemaKind
) -> None:
    canonical = to_parsing_canonical_form(load_avsc(kind))
    assert '"doc"' not in canonical and '"default"' not in canonical
    expected = rabin_fingerprint(canonical.encode()).to_bytes(8, "little")
    schema = codec.schema(kind)
    assert schema.canonical_form == canonical
    assert schema.fingerprint == expected
    assert schema.fingerprint_int == signed(rabin_fingerprint(canonical.encode()))


def plain_decode(kind: SchemaKind, data: bytes) -> Any:
    schema = load_avsc(kind)
    assert data[:2] == b"\xc3\x01"
    canonical = to_parsing_canonical_form(schema)
    assert data[2:10] == rabin_fingerprint(canonical.encode()).to_bytes(8, "little")
    return fastavro.schemaless_reader(io.BytesIO(data[10:]), schema, None)


def plain_encode(kind: SchemaKind, datum: Any) -> bytes:
    schema = load_avsc(kind)
    canonical = to_parsing_canonical_form(schema)
    out = io.BytesIO()
    out.write(b"\xc3\x01" + rabin_fingerprint(canonical.encode()).to_bytes(8, "little"))
    fastavro.schemaless_writer(out, schema, datum)
    return out.getvalue()


def test_plain_avro_reads_an_ack_record(codec: Codec) -> None:
    record = AckRecord(
        consumer_id="worker-1",
        session_id="s",
        sent_at_ms=1_767_225_600_000,
        items=(
            AckItem(queue="Jobs", bookmark="jobs/0/5", lease="t", type=AckType.RELEASE, delay_ms=9),
            AckItem(queue="Jobs", bookmark="jobs/0/6", lease="u", type=AckType.REJECT, reason="no"),
        ),
    )
    assert plain_decode(SchemaKind.ACK, codec.encode_ack(record)) == {
        "consumer_id": "worker-1",
        "session_id": "s",
        "sent_at_ms": 1_767_225_600_000,
        "items": [
            {
                "queue": "Jobs",
                "bookmark": "jobs/0/5",
                "lease": "t",
                "type": "RELEASE",
                "delay_ms": 9,
                "reason": None,
            },
            {
                "queue": "Jobs",
                "bookmark": "jobs/0/6",
                "lease": "u",
                "type": "REJECT",
                "delay_ms": None,
                "reason": "no",
            },
        ],
    }


def test_plain_avro_reads_control_reply_and_event_records(codec: Codec) -> None:
    heartbeat = codec.encode_control(Heartbeat(consumer_id="c", session_id="s", sent_at_ms=3))
    assert plain_decode(SchemaKind.CONTROL, heartbeat) == {
        "body": {"consumer_id": "c", "session_id": "s", "sent_at_ms": 3}
    }
    ended = codec.encode_reply(
        SessionEnded(consumer_id="c", session_id="s", reason=SessionEndReason.EVICTED, sent_at_ms=4)
    )
    assert plain_decode(SchemaKind.REPLY, ended)["body"]["reason"] == "EVICTED"
    event = codec.encode_event(
        Event(
            type=EventType.ACKED,
            timestamp_ms=5,
            coordinator_id="coord",
            coordinator_epoch=2,
            queue="Jobs",
            bookmark=Bookmark("jobs", 1, 77),
            delivery_count=1,
        )
    )
    columns = plain_decode(SchemaKind.EVENT, event)
    assert (columns["type"], columns["topic"], columns["partition"], columns["offset"]) == (
        "ACKED",
        "jobs",
        1,
        77,
    )
    assert columns["bookmark"] == "jobs/1/77"


def test_qlayer_reads_a_record_built_by_hand_with_plain_avro(codec: Codec) -> None:
    data = plain_encode(
        SchemaKind.ACK,
        {
            "consumer_id": "java-worker",
            "session_id": "s",
            "sent_at_ms": 1,
            "items": [
                {"queue": "Jobs", "bookmark": "jobs/3/12", "lease": "t", "type": "RENEW"},
            ],
        },
    )
    decoded = codec.decode_ack(data)
    assert decoded.items == (
        AckItem(queue="Jobs", bookmark="jobs/3/12", lease="t", type=AckType.RENEW),
    )
    assert codec.encode_ack(decoded) == data


def test_ack_type_symbol_order_follows_kafka_ids() -> None:
    ack_type = load_avsc(SchemaKind.ACK)["fields"][3]["type"]["items"]["fields"][3]["type"]
    assert ack_type["symbols"] == [t.name for t in sorted(AckType)]
    assert [t.value for t in sorted(AckType)] == [1, 2, 3, 4]


def test_every_avsc_file_stands_alone_and_has_the_v1_namespace() -> None:
    files = sorted(SCHEMA_DIR.glob("*.avsc"))
    assert sorted(f.stem for f in files) == sorted(kind.value for kind in SchemaKind)
    for file in files:
        schema = fastavro.parse_schema(json.loads(file.read_text()), named_schemas={})
        assert schema["name"].startswith("io.qlayer.v1.")
