"""Refused records taken apart to be sent alone (`layer.coordinator.refused`), no I/O."""

from __future__ import annotations

import pytest

from layer.coordinator.refused import Refused, alone, refused_among
from layer.domain.states import Bookmark
from layer.kafka import DeliveryFailed, OutgoingRecord
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
    # Each names the delivery topic that refused it: the consumer, for the dead letter.
    assert [d for _, d in split] == [
        Refused("Q", Bookmark("jobs", 0, 3), "tok3", 1, False, "p.delivery.c1"),
        Refused("Q", Bookmark("jobs", 0, 4), "tok4", 1, False, "p.delivery.c1")]
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
        (delivery, Refused("Q", Bookmark("jobs", 1, 9), "t", 1, False, "p.delivery.c1")),
        (reply, None),
        (letter, None)]



def test_refusals_pair_off_with_the_records_sent_headers_and_all() -> None:
    """A report has no headers: the sent records are found by topic, key and value, and two
    equal records refused once each are both found (each once)."""
    first = OutgoingRecord("p.delivery.c1", b"same", b"c1", [(SESSION, b"s1")])
    second = OutgoingRecord("p.delivery.c1", b"same", b"c1", [(SESSION, b"s2")])
    other = OutgoingRecord("p.delivery.c1", b"else", b"c1", [(SESSION, b"s1")])
    events = OutgoingRecord("p.events", b"same", b"c1")
    reported = [OutgoingRecord("p.delivery.c1", b"same", b"c1")] * 2
    found = refused_among(reported, [[first, other], [events, second]])
    assert [id(r) for r in found] == [id(first), id(second)]
    assert refused_among([], [[first]]) == []


def test_a_refusal_of_a_record_never_sent_is_a_delivery_failure() -> None:
    sent = OutgoingRecord("p.delivery.c1", b"v", b"c1", [(SESSION, b"s1")])
    with pytest.raises(DeliveryFailed, match="refused a record of 1 bytes"):
        refused_among([OutgoingRecord("p.delivery.c2", b"v", b"c1")], [[sent]])
