"""Refused records taken apart to be sent alone (`layer.coordinator.refused`), no I/O."""

from __future__ import annotations

from layer.coordinator.refused import alone
from layer.domain.states import Bookmark
from layer.kafka import OutgoingRecord
from layer.protocol import BATCH, DeadLetterInfo, DeliveryInfo
from layer.protocol.batch import decode_delivery_batch, encode_delivery_batch, encode_entry
from layer.protocol.bookmark import Bookmark as WireBookmark
from layer.protocol.headers import SESSION, dead_letter_headers, with_delivery_headers


def _entry(offset: int, value: bytes) -> bytes:
    return encode_entry(b"Q", b"jobs", 0, offset, b"tok%d" % offset, 5000, 1, False, 7, b"k",
                        value, [("trace", b"t")])


def test_a_refused_batch_becomes_one_batch_record_per_message_with_its_headers() -> None:
    headers = [(BATCH, b"1"), (SESSION, b"s1")]
    batch = OutgoingRecord("p.delivery.c1", encode_delivery_batch(
        [_entry(3, b"small"), _entry(4, b"x" * 50)]), b"c1", headers)
    split = list(alone([batch]))
    assert [b for _, b in split] == [Bookmark("jobs", 0, 3), Bookmark("jobs", 0, 4)]
    assert all(r.topic == batch.topic and r.key == b"c1" and r.headers == headers
               for r, _ in split)
    [first] = decode_delivery_batch(split[0][0].value or b"")
    [second] = decode_delivery_batch(split[1][0].value or b"")
    assert (first.offset, first.lease, first.value, first.headers) == (
        3, "tok3", b"small", [("trace", b"t")])
    assert (second.offset, second.value) == (4, b"x" * 50)


def test_a_record_delivery_keeps_its_record_and_a_reply_or_dead_letter_has_no_bookmark() -> None:
    info = DeliveryInfo(queue="Q", bookmark=WireBookmark("jobs", 1, 9), lease="t",
                        lease_expires_ms=1, delivery_count=1)
    delivery = OutgoingRecord("p.delivery.c1", b"v", b"k", with_delivery_headers([], info))
    reply = OutgoingRecord("p.delivery.c1", b"r", b"c1", [("qlayer.reply", b"1")])
    letter = OutgoingRecord("p.dlq.Q", b"v", b"k", dead_letter_headers([], DeadLetterInfo(
        reason="too_large", queue="Q", bookmark=WireBookmark("jobs", 1, 9), delivery_count=1,
        dead_lettered_at_ms=1)))
    assert list(alone([delivery, reply, letter])) == [
        (delivery, Bookmark("jobs", 1, 9)), (reply, None), (letter, None)]

