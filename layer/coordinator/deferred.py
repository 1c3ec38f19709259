"""Records deferred past a queue's ``target_queue_depth``, read again from the journal.

AMPS: messages beyond the TargetQueueDepth are inactive, "not read from the transaction log
until needed". A queue engine keeps only each partition's first deferred offset; when its
active part has room it asks for the records from there (`QueueEngine.records_wanted`), and
the shard loop reads them here, after a step's plan is carried out, and offers them back
(`ShardCore.readmit`). docs/engine.md "Target queue depth" has the rules.

Offsets in a journal partition are not contiguous (compaction, transaction markers), so a
range is read sequentially from its first offset with `RangeScanner` and ends after the
records asked for, or at the engine's live read position (what lies beyond comes by the live
read), whichever comes first: the engine learns how far the read got (``through``), so a
range that held no record at all is passed over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from layer.coordinator.core import ShardCore
from layer.domain.engine import RecordsWanted
from layer.kafka import JournalRecord
from layer.kafka.scan import RangeScanner

log = logging.getLogger(__name__)

__all__ = ["DeferredReader"]

#: Records read per partition at once at least: a queue with a small depth asks for a few
#: records each iteration, and a Kafka read per iteration would bound its throughput. What is
#: read beyond the ask waits here for the next ask (coordinator memory, bounded by this many
#: records per deferring partition; the engine holds none of it).
READ_AHEAD = 1000

#: Rounds of reading per loop iteration: a round whose records were acknowledged early or
#: refused by the queue's filter leaves room, and the next round fills it at once.
MAX_ROUNDS = 8


class DeferredReader:
    """Reads the ranges the shard's queues want back, for `ShardCore.readmit`."""

    def __init__(self, config: Mapping[str, Any], group_id: str) -> None:
        self._config = dict(config)
        self._group_id = group_id
        self._scanner: RangeScanner | None = None
        self.records_read = 0
        # Per partition, records read ahead: every record in [start, through) past the last
        # ask, in order, as (start, records, through).
        self._ahead: dict[tuple[str, int], tuple[int, list[JournalRecord], int]] = {}

    def serve(self, core: ShardCore, now: float) -> int:
        """Read and offer back what the queues want now; returns how many records were read."""
        read = 0
        asked: list[tuple[str, RecordsWanted]] = []
        wanted = core.records_wanted()
        rounds = 0
        while wanted and wanted != asked and rounds < MAX_ROUNDS:
            by_queue: dict[str, list[RecordsWanted]] = {}
            for name, w in wanted:
                by_queue.setdefault(name, []).append(w)
            for name, ranges in by_queue.items():
                records, through = self.read(ranges)
                read += len(records)
                core.readmit(name, records, through, now)
                log.debug("queue %s: read %s again: %d records, through %s", name, ranges,
                          len(records), through)
            asked, wanted = wanted, core.records_wanted()
            rounds += 1
        self.records_read += read
        return read

    def read(self, ranges: list[RecordsWanted]
             ) -> tuple[list[JournalRecord], dict[tuple[str, int], int]]:
        """Up to ``max_records`` records of each range from its first offset, and per
        partition how far the read got (one past the last record read when it stopped for
        the count, else the range's end)."""
        records: list[JournalRecord] = []
        through: dict[tuple[str, int], int] = {}
        fresh: list[RecordsWanted] = []
        for w in ranges:
            tp = (w.topic, w.partition)
            served = self._from_ahead(w)
            if served is None:
                fresh.append(w)
                continue
            records.extend(served[0])
            through[tp] = served[1]
        if fresh:
            read, reached = self._scan(fresh)
            for w in fresh:
                tp = (w.topic, w.partition)
                got = read.get(tp, [])
                if len(got) > w.max_records:
                    through[tp] = got[w.max_records - 1].offset + 1
                    self._ahead[tp] = (through[tp], got[w.max_records:], reached[tp])
                    got = got[:w.max_records]
                else:
                    through[tp] = reached[tp]
                records.extend(got)
        return records, through

    def _from_ahead(self, w: RecordsWanted) -> tuple[list[JournalRecord], int] | None:
        """The ask answered from what was read ahead, if that covers it."""
        tp = (w.topic, w.partition)
        ahead = self._ahead.pop(tp, None)
        if ahead is None:
            return None
        start, kept, end = ahead
        if not start <= w.from_offset <= end:
            return None  # not where the last ask ended (the queue took fewer, or was rebuilt)
        kept = [r for r in kept if r.offset >= w.from_offset]
        if len(kept) > w.max_records:
            through = kept[w.max_records - 1].offset + 1
            self._ahead[tp] = (through, kept[w.max_records:], end)
            return kept[:w.max_records], through
        if len(kept) == w.max_records:
            return kept, kept[-1].offset + 1
        if end >= w.until:
            return kept, w.until
        return None  # too few: read afresh from the ask's offset

    def _scan(self, ranges: list[RecordsWanted]
              ) -> tuple[dict[tuple[str, int], list[JournalRecord]], dict[tuple[str, int], int]]:
        """Read each range sequentially: up to READ_AHEAD (or the ask, if more) records, and
        per partition how far the read got."""
        # A new consumer per scan: one that read before may still hold records it fetched
        # past where it stopped, which must not pass for the next range's first records (a
        # scan is READ_AHEAD records or more, so this is rare).
        if self._scanner is not None:
            self._scanner.close()
        self._scanner = scanner = RangeScanner(self._config, self._group_id)
        starts = {(w.topic, w.partition): w.from_offset for w in ranges}
        ends = {(w.topic, w.partition): w.until for w in ranges}
        left = {(w.topic, w.partition): max(w.max_records, READ_AHEAD) for w in ranges}
        reached = dict(ends)
        read: dict[tuple[str, int], list[JournalRecord]] = {tp: [] for tp in starts}
        for r in scanner.read(starts, ends):
            tp = (r.topic, r.partition)
            if left.get(tp, 0) <= 0:
                continue  # fetched before the stop took effect
            got = read[tp]
            if r.offset < (got[-1].offset + 1 if got else starts[tp]):
                continue  # not the next record of the range (a repeat)
            got.append(r)
            left[tp] -= 1
            if left[tp] == 0:
                reached[tp] = r.offset + 1
                scanner.stop(tp)
        return read, reached

    def close(self) -> None:
        if self._scanner is not None:
            try:
                self._scanner.close()
            except Exception as exc:  # closing must not hide why the loop stops
                log.warning("closing the deferred-records reader failed: %s", exc)
            self._scanner = None
        self._ahead.clear()
