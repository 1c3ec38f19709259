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

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
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


#: How far a partition's stream is read on, past records no entry wants, rather than moved:
#: records already fetched cost a few µs each to pass over, a move costs a new fetch (a round
#: trip to the broker, and the prefetched records thrown away).
READ_ON_LIMIT = 2000
#: Bytes of records read past what a call wanted, kept for the next calls: the entries that
#: come up for delivery next are mostly the next offsets of the same partitions.
LOOKAHEAD_BYTES = 8 * 1024 * 1024
#: A partition no call asked for this long is let go, with what was prefetched of it.
IDLE_PARTITION_SECONDS = 30.0
#: What librdkafka prefetches per re-read partition (KiB, records): enough for the next calls,
#: small beside the payload budget.
PREFETCH_KBYTES = 2048
PREFETCH_RECORDS = 2000


class RangeReader:
    """Re-reads journal records for entries whose bytes were dropped past the budget.

    The reads stream: a partition stays assigned where the last call stopped, so the next call
    (deliveries go on in offset order) reads on from records librdkafka has already fetched,
    and records a call read past its range wait in a bounded look-ahead for the next one. A
    partition moves (a new fetch) only when a call wants an offset behind its stream, or far
    ahead of it. Re-assigning every partition on every call cost a fetch round trip per
    partition per shard iteration: a 200,000-message backlog of 1 KiB records drained at a
    sixth of the in-memory rate, the shard loop waiting on those fetches 64 % of its time
    (py-spy; docs/coordinator.md, "Records past the payload budget")."""

    def __init__(self, config: Mapping[str, Any], group_id: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reader = JournalReader(config, group_id=group_id,
                                     prefetch_kbytes=PREFETCH_KBYTES,
                                     prefetch_records=PREFETCH_RECORDS)
        self._clock = clock
        # Per assigned partition, the offset the next record of its stream will have.
        self._positions: dict[tuple[str, int], int] = {}
        # When a call last wanted each assigned partition.
        self._asked: dict[tuple[str, int], float] = {}
        # Records read past what was wanted, by (topic, partition, offset), oldest first: the
        # oldest go when their bytes pass LOOKAHEAD_BYTES.
        self._ahead: OrderedDict[tuple[str, int, int], JournalRecord] = OrderedDict()
        self._ahead_bytes = 0
        self.records_read = 0
        self.moves = 0
        self.from_lookahead = 0

    def read(self, bookmarks: Iterable[Bookmark],
             timeout: float = 10.0) -> dict[Bookmark, JournalRecord]:
        """The records at these bookmarks (those the journal still has within ``timeout``)."""
        now = self._clock()
        wanted: dict[tuple[str, int], set[int]] = {}
        for b in bookmarks:
            wanted.setdefault((b.topic, b.partition), set()).add(b.offset)
        found: dict[Bookmark, JournalRecord] = {}
        # Per partition still to read: the offsets wanted and the last of them.
        pending: dict[tuple[str, int], tuple[set[int], int]] = {}
        budget = 0
        for tp, offsets in wanted.items():
            self._asked[tp] = now
            if self._ahead:
                for offset in list(offsets):
                    record = self._ahead.pop((tp[0], tp[1], offset), None)
                    if record is not None:
                        self._ahead_bytes -= record_size(record)
                        found[Bookmark(tp[0], tp[1], offset)] = record
                        offsets.discard(offset)
                        self.from_lookahead += 1
            if not offsets:
                continue
            first, last = min(offsets), max(offsets)
            position = self._positions.get(tp)
            if position is None or first < position or first - position > READ_ON_LIMIT:
                self._move(tp, first)
                position = first
            pending[tp] = (offsets, last)
            budget += last - position + 1
        deadline = now + timeout
        reader = self._reader
        while pending and self._clock() < deadline:
            batch = reader.poll(min(max(budget, 1), 10_000), 0.1)
            if reader.out_of_range:
                # The range starts below the log's start: retention deleted records whose
                # bytes were dropped. The shard's rebuild expires exactly those (reason
                # retention); waiting here would stall their deliveries.
                gone, reader.out_of_range = reader.out_of_range, set()
                for tp in gone:
                    self._forget(tp)
                raise RetentionGap(f"{', '.join(f'{t}[{p}]' for t, p in sorted(gone))}: "
                                   "records to read again were deleted by retention")
            for r in batch:
                self.records_read += 1
                tp = (r.topic, r.partition)
                self._positions[tp] = r.offset + 1
                want = pending.get(tp)
                if want is None or r.offset > want[1]:
                    self._keep_ahead(tp, r)
                    continue
                budget -= 1
                if r.offset in want[0]:
                    found[Bookmark(tp[0], tp[1], r.offset)] = r
                if r.offset >= want[1]:
                    del pending[tp]
        self._let_go_idle(now)
        return found

    def _move(self, tp: tuple[str, int], offset: int) -> None:
        """Read the partition from ``offset`` on (assigned anew: a seek right after an assign
        fails in librdkafka until the first fetch, an unassign and assign never do)."""
        reader = self._reader
        if tp in self._positions:
            reader.remove([tp])
            self.moves += 1
        reader.add({tp: offset})
        self._positions[tp] = offset
        self._drop_ahead(tp)

    def _keep_ahead(self, tp: tuple[str, int], record: JournalRecord) -> None:
        ahead = self._ahead
        key = (tp[0], tp[1], record.offset)
        if key in ahead:
            return
        ahead[key] = record
        self._ahead_bytes += record_size(record)
        while self._ahead_bytes > LOOKAHEAD_BYTES and ahead:
            self._ahead_bytes -= record_size(ahead.popitem(last=False)[1])

    def _drop_ahead(self, tp: tuple[str, int]) -> None:
        ahead = self._ahead
        for key in [k for k in ahead if (k[0], k[1]) == tp]:
            self._ahead_bytes -= record_size(ahead.pop(key))

    def _forget(self, tp: tuple[str, int]) -> None:
        self._reader.remove([tp])
        self._positions.pop(tp, None)
        self._asked.pop(tp, None)
        self._drop_ahead(tp)

    def _let_go_idle(self, now: float) -> None:
        idle = [tp for tp, at in self._asked.items() if now - at > IDLE_PARTITION_SECONDS]
        for tp in idle:
            self._forget(tp)

    def close(self) -> None:
        self._reader.close()
