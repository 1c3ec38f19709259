"""Re-reads past the payload budget stream from a real broker: the next range of a partition
is read on from where the last call stopped, not fetched again after a move."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Producer

from layer.coordinator.payloads import READ_ON_LIMIT, RangeReader
from layer.domain.states import Bookmark
from layer.settings import Settings

pytestmark = pytest.mark.integration


def _fill(settings: Settings, topic: str, partitions: int, per_partition: int) -> None:
    # Idempotent: record i of a partition is at offset i even when a produce request is
    # retried (without it, a retried batch landed after the next one on a busy machine).
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 5,
                         "enable.idempotence": True})
    for p in range(partitions):
        for i in range(per_partition):
            producer.produce(topic, b"%d:%06d" % (p, i) + b"x" * 1000, key=b"%d" % i,
                             partition=p, headers=[("n", b"%d" % i)])
    assert producer.flush(30) == 0


@contextmanager
def _reader(settings: Settings, name: str) -> Iterator[RangeReader]:
    reader = RangeReader(settings.kafka_config(), group_id=f"{settings.topic_prefix}{name}")
    try:
        yield reader
    finally:
        reader.close()


def _values(found: dict[Bookmark, object]) -> dict[tuple[int, int], bytes]:
    return {(b.partition, b.offset): r.value[:8] for b, r in found.items()}  # type: ignore[attr-defined]


def test_ranges_in_offset_order_are_read_on_without_moving(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("Reread", partitions=2)
    _fill(settings, topic, 2, 3000)
    with _reader(settings, "rr-test") as reader:
        # Deliveries go on in offset order, skipping what is still in memory (every 7th).
        for start in range(0, 3000, 500):
            wanted = [Bookmark(topic, p, o) for p in (0, 1)
                      for o in range(start, start + 500) if o % 7]
            found = reader.read(wanted)
            assert _values(found) == {(b.partition, b.offset): b"%d:%06d" % (b.partition, b.offset)
                                      for b in wanted}
            record = found[wanted[0]]
            assert record.key == b"%d" % wanted[0].offset
            assert record.headers == [("n", b"%d" % wanted[0].offset)]
        # Each partition was assigned once, and never moved.
        assert reader.moves == 0
        # What was read past a range served the next calls: nothing was read twice.
        assert reader.records_read <= 2 * 3000

        # An entry behind the stream (a redelivery of an old one) moves its partition back.
        back = reader.read([Bookmark(topic, 0, 10), Bookmark(topic, 0, 11)])
        assert _values(back) == {(0, 10): b"0:000010", (0, 11): b"0:000011"}
        assert reader.moves == 1
        # A partition asked again right after reads on from there.
        on = reader.read([Bookmark(topic, 0, 12 + READ_ON_LIMIT // 2)])
        assert len(on) == 1 and reader.moves == 1
        # Further on than that is read on or moved to, as is cheaper; the record is the same.
        ahead = reader.read([Bookmark(topic, 0, 2990)])
        assert _values(ahead) == {(0, 2990): b"0:002990"}


def test_an_offset_the_log_no_longer_has_is_left_out_after_the_timeout(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("RereadEnd", partitions=1)
    _fill(settings, topic, 1, 10)
    with _reader(settings, "rr-test2") as reader:
        found = reader.read([Bookmark(topic, 0, 9), Bookmark(topic, 0, 50)], timeout=1.0)
        assert _values(found) == {(0, 9): b"0:000009"}
        # Then a range it has is read as before.
        assert _values(reader.read([Bookmark(topic, 0, 3)])) == {(0, 3): b"0:000003"}
