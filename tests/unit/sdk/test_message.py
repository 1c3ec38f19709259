"""A Message built from a delivery record: original headers back, lease fields as properties."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest

from layer.protocol import AckType, Bookmark, DeliveryInfo, ProtocolError, with_delivery_headers
from layer.protocol.batch import BatchEntry
from layer.sdk import Message, MessageSettledError


@dataclass
class RecordingSettler:
    """Stands in for the consumer: records what a message asks of it."""

    settled: list[tuple[str, AckType, int | None, str | None]] = field(default_factory=list)
    renew_to: datetime = datetime(2030, 1, 1, tzinfo=UTC)
    extends: list[int | None] = field(default_factory=list)

    def _settle(self, message: Message, ack_type: AckType, delay_ms: int | None,
                reason: str | None) -> None:
        self.settled.append((str(message.bookmark), ack_type, delay_ms, reason))

    def _renew(self, message: Message, timeout: float | None,
               extend_ms: int | None = None) -> datetime:
        self.extends.append(extend_ms)
        return self.renew_to


INFO = DeliveryInfo(queue="WorkToDo", bookmark=Bookmark("orders", 2, 41), lease="9f1c2e7a",
                    lease_expires_ms=1_767_225_630_000, delivery_count=3,
                    consumer_id="worker-1", session_id="s-1")
ORIGINAL: list[tuple[str, bytes | None]] = [
    ("trace", b"abc"), ("empty", None), ("trace", b"def"), ("qlayer.deliver-at", b"5")]


def build(headers: list[tuple[str, bytes | None]] | None = None,
          settler: RecordingSettler | None = None, value: bytes | None = b'{"a": [1, 2]}',
          info: DeliveryInfo = INFO) -> Message:
    return Message.from_record(
        key=b"k", value=value, timestamp_ms=1_767_225_600_000,
        settler=settler or RecordingSettler(),
        headers=with_delivery_headers(ORIGINAL if headers is None else headers, info))


def test_headers_are_the_records_own_and_lease_fields_are_properties() -> None:
    message = build()
    # Order, repeats and null values kept; only what the coordinator appended is gone.
    assert message.headers == ORIGINAL
    assert message.header("trace") == b"def"  # the last one, as Kafka readers do
    assert message.header("missing") is None
    assert (message.queue, message.bookmark, message.lease) == (
        "WorkToDo", Bookmark("orders", 2, 41), "9f1c2e7a")
    assert str(message.bookmark) == "orders/2/41"
    assert (message.topic, message.partition, message.offset) == ("orders", 2, 41)
    assert message.delivery_count == 3
    assert message.lease_expires_at == datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)
    assert message.timestamp == datetime(2026, 1, 1, tzinfo=UTC)
    assert message.session_id == "s-1"
    assert message.is_barrier is False
    assert (message.key, message.json()) == (b"k", {"a": [1, 2]})


def test_a_record_without_headers_of_its_own_has_none() -> None:
    assert build(headers=[]).headers == []


def test_json_of_a_null_or_non_json_value_raises_value_error() -> None:
    with pytest.raises(ValueError, match="no value"):
        build(value=None).json()
    with pytest.raises(ValueError):
        build(value=b"not json").json()


def test_a_delivery_without_lease_headers_is_refused() -> None:
    with pytest.raises(ProtocolError, match=r"qlayer\.lease"):
        Message.from_record(key=None, value=b"x", timestamp_ms=0, settler=RecordingSettler(),
                            headers=[("qlayer.queue", b"Q"), ("qlayer.bookmark", b"t/0/1")])


def test_settling_asks_the_consumer_once() -> None:
    settler = RecordingSettler()
    a, b, c = (build(settler=settler, info=DeliveryInfo(
        queue="Q", bookmark=Bookmark("t", 0, n), lease="l", lease_expires_ms=0,
        delivery_count=1)) for n in range(3))
    a.ack()
    b.release(delay=timedelta(seconds=1.5))
    c.reject(reason="bad")
    assert settler.settled == [("t/0/0", AckType.ACCEPT, None, None),
                               ("t/0/1", AckType.RELEASE, 1500, None),
                               ("t/0/2", AckType.REJECT, None, "bad")]
    assert (a.settled, b.settled, c.settled) == (AckType.ACCEPT, AckType.RELEASE, AckType.REJECT)
    with pytest.raises(MessageSettledError, match="already settled"):
        a.release()
    assert len(settler.settled) == 3


@pytest.mark.parametrize(("delay", "ms"), [(0, 0), (0.0004, 0), (2.5, 2500),
                                           (timedelta(minutes=2), 120_000), (None, None)])
def test_release_delay_in_milliseconds(delay: float | timedelta | None, ms: int | None) -> None:
    settler = RecordingSettler()
    build(settler=settler).release(delay=delay)
    assert settler.settled[0][2] == ms


@pytest.mark.parametrize("delay", [-1, float("nan"), timedelta(seconds=-1), timedelta(days=2),
                                   1e30])
def test_a_release_delay_out_of_bounds_is_refused(delay: float | timedelta) -> None:
    settler = RecordingSettler()
    message = build(settler=settler)
    with pytest.raises(ValueError, match="from 0 seconds to 24 hours"):
        message.release(delay=delay)
    assert settler.settled == [] and message.settled is None


def test_renew_moves_the_lease_deadline() -> None:
    settler = RecordingSettler()
    message = build(settler=settler)
    assert message.renew() == settler.renew_to
    assert message.lease_expires_at == settler.renew_to


def test_renew_with_a_length_sends_it_in_milliseconds_and_checks_its_bounds() -> None:
    settler = RecordingSettler()
    message = build(settler=settler)
    message.renew(extend=90)
    message.renew(extend=timedelta(milliseconds=1500))
    assert settler.extends == [90_000, 1_500]
    for wrong in (0, -1, float("nan"), 12 * 3600 + 1, timedelta(0)):
        with pytest.raises(ValueError, match="12 hours"):
            message.renew(extend=wrong)
    assert settler.extends == [90_000, 1_500], "nothing sent for a refused length"


def test_barrier_flag() -> None:
    barrier = DeliveryInfo(queue="Q", bookmark=Bookmark("t", 0, 1), lease="l",
                           lease_expires_ms=0, delivery_count=1, barrier=True)
    assert build(info=barrier).is_barrier


TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_w3c_trace_context_of_the_record_is_on_the_message_in_both_formats() -> None:
    headers: list[tuple[str, bytes | None]] = [
        ("traceparent", TRACEPARENT), ("tracestate", b"congo=t61rcWkgMzE")]
    from_record = build(headers)
    from_batch = Message.from_batch(
        BatchEntry("WorkToDo", "orders", 2, 41, "9f1c2e7a", 1_767_225_630_000, 1, False,
                   1_767_225_600_000, b"k", b"{}", headers),
        consumer_id="worker-1", session_id="s-1", settler=RecordingSettler())
    for message in (from_record, from_batch):
        assert message.traceparent == TRACEPARENT.decode()
        assert message.tracestate == "congo=t61rcWkgMzE"
    untraced = build([("trace", b"abc")])
    assert (untraced.traceparent, untraced.tracestate) == (None, None)
