from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layer.protocol import (
    Bookmark,
    DeadLetterInfo,
    DeliveryInfo,
    ExpiryReason,
    ProtocolError,
    ProtocolErrorKind,
    dead_letter_headers,
    deliver_at_header,
    delivery_headers,
    expiration_header,
    header_value,
    is_reply,
    parse_dead_letter_headers,
    parse_deliver_at,
    parse_delivery_headers,
    parse_expiration,
    reply_headers,
    with_delivery_headers,
)

from . import strategies

INFO = DeliveryInfo(
    queue="WorkToDo",
    bookmark=Bookmark("orders", 1, 41),
    lease="9f1c2e7a",
    lease_expires_ms=1_767_225_660_000,
    delivery_count=2,
    consumer_id="worker-1",
    session_id="s-1",
)


def test_delivery_headers_are_plain_ascii_a_kafka_consumer_can_read() -> None:
    assert delivery_headers(INFO) == [
        ("qlayer.queue", b"WorkToDo"),
        ("qlayer.bookmark", b"orders/1/41"),
        ("qlayer.lease", b"9f1c2e7a"),
        ("qlayer.lease-expires", b"1767225660000"),
        ("qlayer.delivery-count", b"2"),
        ("qlayer.barrier", b"0"),
        ("qlayer.consumer", b"worker-1"),
        ("qlayer.session", b"s-1"),
    ]


def test_delivery_headers_round_trip() -> None:
    assert parse_delivery_headers(delivery_headers(INFO)) == INFO


@given(
    st.builds(
        DeliveryInfo,
        queue=strategies.TEXT,
        bookmark=strategies.bookmarks,
        lease=strategies.TEXT,
        lease_expires_ms=st.integers(min_value=0, max_value=2**63 - 1),
        delivery_count=st.integers(min_value=0, max_value=2**31),
        barrier=st.booleans(),
        consumer_id=strategies.OPT_TEXT,
        session_id=strategies.OPT_TEXT,
    )
)
def test_any_delivery_info_round_trips(info: DeliveryInfo) -> None:
    assert parse_delivery_headers(delivery_headers(info)) == info


def test_original_headers_are_kept_and_stale_delivery_headers_replaced() -> None:
    original = [
        ("trace-id", b"abc"),
        ("qlayer.lease", b"old-token"),
        ("empty", None),
        ("qlayer.deliver-at", b"5"),
    ]
    headers = with_delivery_headers(original, INFO)
    assert headers[:3] == [("trace-id", b"abc"), ("empty", None), ("qlayer.deliver-at", b"5")]
    assert [value for key, value in headers if key == "qlayer.lease"] == [b"9f1c2e7a"]
    assert parse_delivery_headers(headers) == INFO


def test_record_without_headers_gets_delivery_headers() -> None:
    assert with_delivery_headers(None, INFO) == delivery_headers(INFO)


def test_last_header_wins() -> None:
    headers = [*delivery_headers(INFO), ("qlayer.delivery-count", b"3")]
    assert parse_delivery_headers(headers).delivery_count == 3
    assert header_value(headers, "qlayer.delivery-count") == b"3"
    assert header_value(headers, "nope") is None
    assert header_value(None, "qlayer.queue") is None


def test_barrier_flag() -> None:
    barrier = DeliveryInfo(
        queue="Q", bookmark=Bookmark("t", 0, 0), lease="l", lease_expires_ms=0,
        delivery_count=1, barrier=True,
    )  # fmt: skip
    headers = delivery_headers(barrier)
    assert ("qlayer.barrier", b"1") in headers
    assert parse_delivery_headers(headers).barrier is True
    without_flag = [(k, v) for k, v in headers if k != "qlayer.barrier"]
    assert parse_delivery_headers(without_flag).barrier is False


@pytest.mark.parametrize(
    ("key", "value", "kind", "words"),
    [
        ("qlayer.queue", None, ProtocolErrorKind.MISSING_HEADER, "header qlayer.queue is missing"),
        ("qlayer.lease", None, ProtocolErrorKind.MISSING_HEADER, "qlayer.lease is missing"),
        ("qlayer.bookmark", b"orders-1-41", ProtocolErrorKind.BAD_BOOKMARK, "qlayer.bookmark"),
        ("qlayer.delivery-count", b"two", ProtocolErrorKind.BAD_HEADER, "decimal number"),
        ("qlayer.lease-expires", b"-5", ProtocolErrorKind.BAD_HEADER, "decimal number"),
        ("qlayer.lease-expires", b" 5", ProtocolErrorKind.BAD_HEADER, "decimal number"),
        ("qlayer.barrier", b"yes", ProtocolErrorKind.BAD_HEADER, "must be 0 or 1"),
        ("qlayer.queue", b"\xff", ProtocolErrorKind.BAD_HEADER, "not UTF-8"),
    ],
)
def test_bad_delivery_headers_are_named(
    key: str, value: bytes | None, kind: ProtocolErrorKind, words: str
) -> None:
    headers = [(k, v) for k, v in delivery_headers(INFO) if k != key]
    if value is not None:
        headers.append((key, value))
    with pytest.raises(ProtocolError) as caught:
        parse_delivery_headers(headers)
    assert caught.value.kind is kind
    assert words in str(caught.value)


def test_replies_are_told_apart_from_deliveries() -> None:
    assert is_reply(reply_headers())
    assert not is_reply(delivery_headers(INFO))
    assert not is_reply(None)


def test_deliver_at() -> None:
    key, value = deliver_at_header(1_767_225_600_000)
    assert (key, value) == ("qlayer.deliver-at", b"1767225600000")
    assert parse_deliver_at([("x", b"1"), (key, value)]) == 1_767_225_600_000
    assert parse_deliver_at([("x", b"1")]) is None
    assert parse_deliver_at(None) is None
    with pytest.raises(ProtocolError, match=r"qlayer\.deliver-at must be a decimal number"):
        parse_deliver_at([("qlayer.deliver-at", b"tomorrow")])
    with pytest.raises(ValueError, match="must not be negative"):
        deliver_at_header(-1)


def test_expiration() -> None:
    key, value = expiration_header(30_000)
    assert (key, value) == ("qlayer.expiration", b"30000")
    assert parse_expiration([("x", b"1"), (key, value)]) == 30_000
    assert parse_expiration([("x", b"1")]) is None
    assert parse_expiration(None) is None
    with pytest.raises(ProtocolError, match=r"qlayer\.expiration must be a decimal number"):
        parse_expiration([("qlayer.expiration", b"30s")])
    for ms in (0, 366 * 24 * 3600 * 1000 + 1):
        with pytest.raises(ProtocolError, match=r"must be 1\.\.31622400000 ms"):
            parse_expiration([("qlayer.expiration", b"%d" % ms)])
        with pytest.raises(ValueError, match="expiration_ms must be"):
            expiration_header(ms)


DEAD = DeadLetterInfo(
    reason=ExpiryReason.REJECTED.value,
    queue="Jobs",
    bookmark=Bookmark("jobs", 2, 9),
    delivery_count=1,
    dead_lettered_at_ms=1_767_225_600_000,
    last_consumer="worker-1",
    detail="cannot parse order",
)


def test_dead_letter_headers_keep_the_original_and_say_why() -> None:
    original = [
        ("trace-id", b"abc"),
        ("qlayer.lease", b"stale"),
        ("qlayer.dlq.reason", b"max_cancels"),
    ]
    headers = dead_letter_headers(original, DEAD)
    assert headers == [
        ("trace-id", b"abc"),
        ("qlayer.dlq.reason", b"rejected"),
        ("qlayer.dlq.queue", b"Jobs"),
        ("qlayer.dlq.bookmark", b"jobs/2/9"),
        ("qlayer.dlq.original-topic", b"jobs"),
        ("qlayer.dlq.delivery-count", b"1"),
        ("qlayer.dlq.dead-lettered-at", b"1767225600000"),
        ("qlayer.dlq.last-consumer", b"worker-1"),
        ("qlayer.dlq.detail", b"cannot parse order"),
    ]
    parsed = parse_dead_letter_headers(headers)
    assert parsed == DEAD
    assert parsed.original_topic == "jobs"


def test_dead_letter_headers_without_optional_fields() -> None:
    info = DeadLetterInfo(
        reason=ExpiryReason.MAX_DELIVERIES.value,
        queue="Jobs",
        bookmark=Bookmark("jobs", 0, 1),
        delivery_count=10,
        dead_lettered_at_ms=5,
    )
    assert parse_dead_letter_headers(dead_letter_headers(None, info)) == info


def test_missing_dead_letter_header_is_named() -> None:
    headers = [(k, v) for k, v in dead_letter_headers(None, DEAD) if k != "qlayer.dlq.queue"]
    with pytest.raises(ProtocolError, match=r"header qlayer\.dlq\.queue is missing"):
        parse_dead_letter_headers(headers)
