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
            asked, wanted = wanted, core.records_wanted()
            rounds += 1
        self.records_read += read
        return read

    def read(self, ranges: list[RecordsWanted]
             ) -> tuple[list[JournalRecord], dict[tuple[str, int], int]]:
        """Up to ``max_records`` records of each range from its first offset, and per
        partition how far the read got (one past the last record read when it stopped for
        the count, else the range's end)."""
        if self._scanner is None:
            self._scanner = RangeScanner(self._config, self._group_id)
        scanner = self._scanner
        starts = {(w.topic, w.partition): w.from_offset for w in ranges}
        ends = {(w.topic, w.partition): w.until for w in ranges}
        left = {(w.topic, w.partition): w.max_records for w in ranges}
        through = dict(ends)
        records: list[JournalRecord] = []
        for r in scanner.read(starts, ends):
            tp = (r.topic, r.partition)
            if left.get(tp, 0) <= 0:
                continue  # fetched before the stop took effect
            records.append(r)
            left[tp] -= 1
            if left[tp] == 0:
                through[tp] = r.offset + 1
                scanner.stop(tp)
        return records, through

    def close(self) -> None:
        if self._scanner is not None:
            try:
                self._scanner.close()
            except Exception as exc:  # closing must not hide why the loop stops
                log.warning("closing the deferred-records reader failed: %s", exc)
            self._scanner = None
