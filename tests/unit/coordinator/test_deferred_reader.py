"""`DeferredReader`: ranges of a journal partition read back for target_queue_depth, with
offset gaps (compaction, transaction markers), the read-ahead kept for the next ask, and the
engine told how far each read got. The Kafka scan is replaced by an in-memory journal here;
tests/integration/coordinator/test_target_depth_deep.py reads the real broker."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from layer.coordinator import deferred
from layer.coordinator.deferred import DeferredReader
from layer.domain.engine import RecordsWanted
from layer.kafka import JournalRecord

#: Offsets 0..2999 without every seventh (gaps), and nothing past 2999.
JOURNAL = [o for o in range(3000) if o % 7 != 3]


class _Scanner:
    """RangeScanner over JOURNAL: every record from each start up to its end, in order."""

    scans = 0

    def __init__(self, config: Mapping[str, Any], group_id: str) -> None:
        self._pending: dict[tuple[str, int], int] = {}

    def read(self, starts: Mapping[tuple[str, int], int], ends: Mapping[tuple[str, int], int]
             ) -> Iterator[JournalRecord]:
        _Scanner.scans += 1
        self._pending = dict(ends)
        for (topic, partition), start in starts.items():
            for o in JOURNAL:
                if (topic, partition) not in self._pending or o >= ends[(topic, partition)]:
                    break
                if o >= start:
                    yield JournalRecord(topic, partition, o, None, b"v", o, None)

    def stop(self, partition: tuple[str, int]) -> None:
        self._pending.pop(partition, None)

    def close(self) -> None:
        pass


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> DeferredReader:
    monkeypatch.setattr(deferred, "RangeScanner", _Scanner)
    _Scanner.scans = 0
    return DeferredReader({}, "g")


def test_a_range_is_read_from_its_first_offset_and_says_how_far_it_got(
        reader: DeferredReader) -> None:
    records, through = reader.read([RecordsWanted("J", 0, 3, 5, 3000)])
    # 3 is a gap: the first record at or past it is the partition's next one.
    assert [r.offset for r in records] == [4, 5, 6, 7, 8]
    assert through == {("J", 0): 9}


def test_what_is_read_ahead_answers_the_next_asks_without_another_scan(
        reader: DeferredReader) -> None:
    first, through = reader.read([RecordsWanted("J", 0, 0, 10, 3000)])
    assert len(first) == 10 and _Scanner.scans == 1
    after, again = reader.read([RecordsWanted("J", 0, through[("J", 0)], 10, 3000)])
    assert _Scanner.scans == 1
    expected = [o for o in JOURNAL if o >= through[("J", 0)]][:10]
    assert [r.offset for r in after] == expected
    assert again == {("J", 0): expected[-1] + 1}
    # An ask from elsewhere (the queue took fewer than it asked) reads afresh.
    records, _ = reader.read([RecordsWanted("J", 0, 5, 2, 3000)])
    assert [r.offset for r in records] == [5, 6] and _Scanner.scans == 2


def test_a_range_that_ends_at_the_live_position_is_read_to_its_end(
        reader: DeferredReader) -> None:
    records, through = reader.read([RecordsWanted("J", 0, 2990, 100, 2995)])
    assert [r.offset for r in records] == [o for o in JOURNAL if 2990 <= o < 2995]
    assert through == {("J", 0): 2995}
    # A range holding no record at all is passed over whole.
    records, through = reader.read([RecordsWanted("J", 0, 3, 10, 4)])
    assert records == [] and through == {("J", 0): 4}
