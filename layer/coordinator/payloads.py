"""The journal records the coordinator holds in memory, within a byte budget.

The journal is the store (DESIGN §2): payloads are never copied into PostgreSQL. A record
read from a journal is held while at least one queue holds it as a live entry (the number of
holding queues is counted), so it can be delivered, redelivered and dead-lettered without
reading Kafka again — as long as the held bytes stay within the budget. Past the budget the
cache keeps nothing at all for a record (its entry lives on in the engines, with its position
and document: a bookmark per entry here was about 200 bytes per queued message); when such an
entry comes up for delivery, the coordinator re-reads the records it does not find here from
the journal in sequential ranges (:class:`RangeReader`). Only entries ask, so a bookmark not
here is one whose bytes were dropped.

The budget is first come, first kept: the oldest records, which FIFO queues deliver first,
stay in memory, and memory freed by acknowledged entries takes new records in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from layer.domain.states import Bookmark
from layer.kafka import JournalReader, JournalRecord, RetentionGap

#: 32 MiB: tens of thousands of records in flight (about 50,000 of 200 bytes, 22,000 of 1 KiB),
#: so consumers' backlogs are served from memory, while a deep queue costs about 100 bytes per
#: message beyond it rather than its records' size (docs/operations.md, "Sizing"). Raise it
#: (`--payload-budget-mb`) to re-read less when a backlog deeper than that drains.
DEFAULT_PAYLOAD_BUDGET = 32 * 1024 * 1024


#: What a held record costs beyond its key, value and header bytes: the record tuple, the
#: bytes and header objects, its cache slot and its entry's unparsed document (measured with
#: tracemalloc: about 440 bytes; tests/unit/coordinator/test_payloads.py). Counted, so the
#: budget bounds the memory the records really take.
RECORD_OVERHEAD = 440


def record_size(record: JournalRecord) -> int:
    """The bytes a held record counts against the budget: key, value and headers, and the
    Python objects around them (`RECORD_OVERHEAD`)."""
    size = RECORD_OVERHEAD + len(record.value or b"") + len(record.key or b"")
    if record.headers:
        size += sum(len(k) + len(v or b"") for k, v in record.headers)
    return size



@dataclass
class MemoryPool:
    """The payload budget of a whole process, shared by its shard loops: one busy shard may
    use it all, and every shard together no more."""

    budget: int = DEFAULT_PAYLOAD_BUDGET
    used: int = 0


@dataclass
class PayloadCache:
    """Records by bookmark, with the number of queues that still hold each.

    One dict entry per record whose bytes are kept, none for those past the budget: the count
    of holders is kept apart, and only for the rare record several queues hold (several
    queues over one journal). A record dropped past the budget is counted for one holder when
    it is read again: the first queue done with it frees it, and another that still needs it
    reads it again — bytes again, never a lost message.
    """

    budget: int = DEFAULT_PAYLOAD_BUDGET
    # The held records whose bytes are kept.
    _records: dict[Bookmark, JournalRecord] = field(default_factory=dict)
    # Holders beyond the first.
    _extra_holders: dict[Bookmark, int] = field(default_factory=dict)
    bytes: int = 0
    dropped: int = 0  # records held past the budget, without their bytes
    pool: MemoryPool | None = None

    def hold(self, bookmark: Bookmark, record: JournalRecord) -> None:
        if bookmark in self._records:
            self._extra_holders[bookmark] = self._extra_holders.get(bookmark, 0) + 1
            return
        self.fill(bookmark, record)

    def fill(self, bookmark: Bookmark, record: JournalRecord) -> bool:
        """Keep the bytes of a record an entry holds (new, or read again) if the budget
        allows; True when kept."""
        if bookmark in self._records:
            return False  # its bytes are already here
        size = record_size(record)
        pool = self.pool
        if self.bytes + size > self.budget or (pool is not None
                                               and pool.used + size > pool.budget):
            self.dropped += 1
            return False
        self._records[bookmark] = record
        self.bytes += size
        if pool is not None:
            pool.used += size
        return True

    def get(self, bookmark: Bookmark) -> JournalRecord | None:
        """The record's bytes, or None when not held or dropped past the budget."""
        return self._records.get(bookmark)

    def missing(self, bookmarks: Iterable[Bookmark]) -> list[Bookmark]:
        """Those of these entries' bookmarks whose bytes are not here (to be re-read)."""
        records = self._records
        return [b for b in bookmarks if b not in records]

    def release(self, bookmark: Bookmark) -> None:
        """One queue is done with the record; the last one frees it."""
        extra = self._extra_holders.get(bookmark)
        if extra is not None:
            if extra > 1:
                self._extra_holders[bookmark] = extra - 1
            else:
                del self._extra_holders[bookmark]
            return
        record = self._records.pop(bookmark, None)
        if record is not None:
            size = record_size(record)
            self.bytes -= size
            if self.pool is not None:
                self.pool.used -= size

    def clear(self) -> None:
        """Drop every record and give their bytes back to the pool (a loop rebuilding)."""
        if self.pool is not None:
            self.pool.used -= self.bytes
        self._records.clear()
        self._extra_holders.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)


class RangeReader:
    """Re-reads journal records in sequential ranges, for entries whose bytes were dropped."""

    def __init__(self, config: Mapping[str, Any], group_id: str) -> None:
        self._reader = JournalReader(config, group_id=group_id)
        self.records_read = 0

    def read(self, bookmarks: Iterable[Bookmark],
             timeout: float = 10.0) -> dict[Bookmark, JournalRecord]:
        """The records at these bookmarks: one sequential range per partition."""
        import time

        wanted: dict[tuple[str, int], set[int]] = {}
        for b in bookmarks:
            wanted.setdefault((b.topic, b.partition), set()).add(b.offset)
        found: dict[Bookmark, JournalRecord] = {}
        for (topic, partition), offsets in wanted.items():
            first, last = min(offsets), max(offsets)
            self._reader.assign({(topic, partition): first})
            deadline = time.monotonic() + timeout
            position = first
            while position <= last and time.monotonic() < deadline:
                batch = self._reader.poll(min(10_000, last - position + 1), 0.1)
                if self._reader.out_of_range:
                    # The range starts below the log's start: retention deleted records
                    # whose bytes were dropped. The shard's rebuild expires exactly those
                    # (reason retention); waiting here would stall their deliveries.
                    gone, self._reader.out_of_range = self._reader.out_of_range, set()
                    raise RetentionGap(f"{', '.join(f'{t}[{p}]' for t, p in sorted(gone))}: "
                                       "records to read again were deleted by retention")
                for r in batch:
                    self.records_read += 1
                    position = r.offset + 1
                    if r.offset in offsets:
                        found[Bookmark(topic, partition, r.offset)] = r
                    if r.offset >= last:
                        break
        return found

    def close(self) -> None:
        self._reader.close()
