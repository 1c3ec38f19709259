"""docs/protocol.md is a contract for other languages: its schemas, fingerprints, hex examples
and code must stay what the implementation does."""

from __future__ import annotations

import io
import json
import re
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest

from layer.protocol import (
    AckItem,
    AckRecord,
    AckStatus,
    AckType,
    Codec,
    EventType,
    ExpiryReason,
    Heartbeat,
    LeaseEndReason,
    SchemaKind,
    SessionEnded,
    SessionEndReason,
    SubscribeStatus,
    schema_text,
)
from layer.protocol import headers as header_module

DOC = (Path(__file__).resolve().parents[3] / "docs" / "protocol.md").read_text(encoding="utf-8")

WORKED_ACK = AckRecord(
    consumer_id="worker-1",
    session_id="s-1",
    sent_at_ms=1_767_225_600_000,
    items=(
        AckItem(queue="WorkToDo", bookmark="orders/1/41", lease="9f1c2e7a", type=AckType.ACCEPT),
    ),
)
WORKED_HEARTBEAT = Heartbeat(consumer_id="worker-1", session_id="s-1", sent_at_ms=1_767_225_610_000)


def block_after(marker: str) -> str:
    """The fenced code block that follows ``<!-- marker -->``."""
    found = re.search(
        rf"<!-- {re.escape(marker)} -->\s*```[a-z]*\n(.*?)\n```", DOC, flags=re.DOTALL
    )
    assert found is not None, f"no code block after <!-- {marker} --> in docs/protocol.md"
    return found.group(1)


@pytest.mark.parametrize("kind", list(SchemaKind))
def test_each_schema_is_pasted_in_full(kind: SchemaKind) -> None:
    assert json.loads(block_after(f"schema:{kind.value}")) == json.loads(schema_text(kind))


def test_fingerprint_table(codec: Codec) -> None:
    table = DOC.split("<!-- fingerprints -->", 1)[1].strip().split("\n\n", 1)[0]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert len(rows) == len(SchemaKind)
    for row in rows:
        file, fullname, fingerprint, java_long = [
            cell.strip().strip("`") for cell in row.strip("|").split("|")
        ]
        schema = codec.schema(SchemaKind(file.removesuffix(".avsc")))
        assert fullname == schema.fullname
        assert fingerprint == schema.fingerprint.hex(" ")
        assert int(java_long) == schema.fingerprint_int


def test_worked_hex_examples_are_what_the_codec_writes(codec: Codec) -> None:
    assert block_after("worked-example:ack-hex") == codec.encode_ack(WORKED_ACK).hex(" ")
    assert block_after("worked-example:heartbeat-hex") == (
        codec.encode_control(WORKED_HEARTBEAT).hex(" ")
    )


def run_doc_examples() -> dict[str, Any]:
    """Run the documented hand-built codec and ack code (project files, not user input)."""

    def open_schema(name: str) -> io.StringIO:
        return io.StringIO(schema_text(SchemaKind(name.removesuffix(".avsc"))))

    namespace: dict[str, Any] = {"open": open_schema}
    exec(compile(block_after("example:hand-built-codec"), "protocol.md", "exec"), namespace)
    exec(compile(block_after("example:hand-built-ack"), "protocol.md", "exec"), namespace)
    return namespace


def test_hand_built_ack_from_the_docs_is_accepted_byte_for_byte(codec: Codec) -> None:
    value = run_doc_examples()["value"]
    assert value.hex(" ") == block_after("worked-example:ack-hex")
    assert codec.decode_ack(value) == WORKED_ACK


def test_documented_decoder_reads_replies_and_refuses_other_records(codec: Codec) -> None:
    single_object_codec = run_doc_examples()["single_object_codec"]
    _, decode_reply = single_object_codec(schema_text(SchemaKind.REPLY))
    reply = SessionEnded(
        consumer_id="worker-1", session_id="s-1", reason=SessionEndReason.EVICTED, sent_at_ms=1
    )
    name, body = decode_reply(codec.encode_reply(reply))["body"]
    assert (name, body["reason"]) == ("io.qlayer.v1.SessionEnded", "EVICTED")
    with pytest.raises(ValueError, match="not a record of this schema"):
        decode_reply(codec.encode_ack(WORKED_ACK))


def test_spark_example_filters_on_the_event_header(codec: Codec) -> None:
    unhex = re.search(r"unhex\('([0-9A-F]+)'\)", block_after("example:spark-events"))
    assert unhex is not None
    assert bytes.fromhex(unhex.group(1)) == codec.schema(SchemaKind.EVENT).header


@pytest.mark.parametrize(
    "values",
    [EventType, ExpiryReason, LeaseEndReason, AckStatus, SubscribeStatus, SessionEndReason],
    ids=lambda e: e.__name__,
)
def test_every_wire_value_is_documented(values: type[StrEnum]) -> None:
    missing = [v.value for v in values if f"`{v.value}`" not in DOC]
    assert missing == []


def test_the_credit_examples_are_what_the_code_writes() -> None:
    from layer.protocol.batch import encode_delivery_batch
    from layer.protocol.headers import credit_report_header, parse_credit_report, shards_header

    assert block_after("worked-example:credit-notice-hex") == encode_delivery_batch([]).hex(" ")
    header = credit_report_header(2, 2, 1)
    assert block_after("worked-example:credit-report-hex") == header[1].hex(" ")
    assert parse_credit_report([header]) == (2, 2, 1)
    assert block_after("worked-example:shards-hex") == shards_header([1, 0])[1].hex(" ")


def test_worked_transactional_id_hex_is_what_the_sdk_names() -> None:
    from layer.sdk.transaction import transactional_id_for

    session = "2b4d7f1e-1c9a-4e6f-8b0d-5a3c9e7f1b2d"
    name = transactional_id_for("qlayer.qlayer-tx.", "billing-1", session)
    assert block_after("worked-example:transactional-id-hex").split() == name.encode().hex(
        " ").split()
    assert header_module.transactional_id([(header_module.TRANSACTIONAL_ID, name.encode())]
                                          ) == name
    assert name.endswith("." + session)  # what a coordinator requires


def test_every_header_is_documented() -> None:
    keys = [getattr(header_module, name) for name in header_module.__all__ if name.isupper()]
    names = [k for k in keys if isinstance(k, str)]
    # 8 delivery, reply, shard, deliver-at, expiration, 9 dlq, forwarded, secret, proof,
    # credential, refusal; protocol 8: credit, credit-report, shards and the word spans_shards;
    # protocol 9: transactional-id and the word fencing
    assert len(names) == 32
    assert [n for n in names if f"`{n}`" not in DOC] == []


def test_worked_batch_hex_is_what_the_encoder_writes_and_reads_back() -> None:
    from layer.protocol.batch import decode_delivery_batch, encode_delivery_batch, encode_entry

    first = encode_entry(b"WorkToDo", b"orders", 1, 41, b"9f1c2e7a", 1_767_225_660_000, 1,
                         False, 1_767_225_600_000, b"k1", b'{"id":1}', [("trace", b"t1")])
    barrier = encode_entry(b"WorkToDo", b"orders", 1, 42, b"", 0, 1, True, None, None,
                           b'{"id":2}', None)
    value = encode_delivery_batch([first, barrier])
    documented = block_after("worked-example:batch-hex").split()
    assert value.hex(" ").split() == documented
    one, two = decode_delivery_batch(bytes.fromhex("".join(documented)))
    assert (one.queue, one.topic, one.partition, one.offset, one.lease, one.key, one.value,
            one.headers, one.timestamp_ms, one.barrier) == (
        "WorkToDo", "orders", 1, 41, "9f1c2e7a", b"k1", b'{"id":1}', [("trace", b"t1")],
        1_767_225_600_000, False)
    assert (two.barrier, two.lease, two.key, two.timestamp_ms) == (True, "", None, None)


def test_worked_identity_example_is_what_the_sdk_sends_and_the_coordinator_keeps() -> None:
    """§5.6: the proof header's bytes and the SHA-256 the coordinator stores of the secret."""
    from layer.protocol import proof_headers, proves, secret_hash

    example = b"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
    assert f"`{example.decode()}`" in DOC
    ((key, value),) = proof_headers(example)
    assert key == "qlayer.proof"
    assert value.hex(" ") == block_after("worked-example:proof-hex")
    assert secret_hash(example).hex() == block_after("worked-example:secret-sha256")
    stored = bytes.fromhex(block_after("worked-example:secret-sha256"))
    assert proves([(key, bytes.fromhex(block_after("worked-example:proof-hex")))], stored)
    assert not proves([(key, example[:-1] + b"0")], stored)


def test_worked_credential_hex_and_its_stored_hash_are_what_the_code_makes() -> None:
    from layer.domain.authorization import Entitlements, Principal, parse_credential

    value = bytes.fromhex(block_after("worked-example:credential-hex"))
    credential = parse_credential(value)
    assert str(credential).encode() == value
    stored = bytes.fromhex(block_after("worked-example:credential-sha256"))
    assert credential.sha256 == stored
    entitlements = Entitlements(principals={"alice": Principal("alice", stored)})
    assert entitlements.authenticate(credential) == Principal("alice", stored)
    assert entitlements.authenticate(parse_credential(value[:-1] + b"x")) is None
