"""Compact storage of a queue's entries, their order, and the per-partition recovery points.

A queue holds up to millions of AVAILABLE entries, and AMPS keeps ~200 bytes of state per
message; qlayer's budget is 150 (DESIGN §2). So an entry is not an object: it is a *slot* in
parallel columns (``bytearray`` / ``array`` / ``list``) indexed by its sequence number, the
order in which the entry reached the queue. Only entries that have been delivered carry an
object (:class:`Touched`), and there are few of those because backlogs are bounded.

The columns only grow at the end and are trimmed at the front once the oldest entries are
done, so a sequence number stays valid for an entry's whole life (``slot = seq - base``).
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from collections.abc import Iterator
from enum import Enum
from typing import Final, NamedTuple

from sortedcontainers import SortedList

from layer.domain.states import Bookmark, EntryState, ExpiryReason

__all__ = [
    "DELETE",
    "EntryRecord",
    "EntryTable",
    "FifoOrder",
    "Location",
    "OfferedRecord",
    "PriorityOrder",
    "Source",
    "Touched",
    "priority_rank",
]

AVAILABLE: Final = int(EntryState.AVAILABLE)
LEASED: Final = int(EntryState.LEASED)
DELAYED: Final = int(EntryState.DELAYED)
INACTIVE: Final = int(EntryState.INACTIVE)
ACKED: Final = int(EntryState.ACKED)
EXPIRED: Final = int(EntryState.EXPIRED)

# The first state byte that is not ACKED or EXPIRED, found at C speed.
_LIVE_BYTE: Final = re.compile(bytes([ord("["), ord("^"), ACKED, EXPIRED, ord("]")]))

# Columns are trimmed when at least this many done slots sit at the front and they are at
# least half of the table: amortised O(1) per entry and never a long memmove for little gain.
_TRIM_AT_LEAST: Final = 4096


class _Delete:
    """The type of `DELETE` (a named singleton, so it reads well in reprs)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DELETE"


#: The ``doc`` of an offered record that is a delete, not a publish (a Kafka tombstone: a
#: null value). AMPS: "Only publish messages are added to the queue", and a delete does not
#: remove earlier messages from it either; the queue passes over its offset.
DELETE: Final = _Delete()


class OfferedRecord(NamedTuple):
    """One journal record offered to a queue by the coordinator.

    ``doc`` is whatever the queue's expressions should see (the decoded JSON document or a
    projection of it, see ``expressions.project``); the engine never parses payloads.
    ``timestamp`` is when the record entered the journal (seconds); expiration counts from
    it, so it survives restarts. ``deliver_at`` (seconds) delays the first delivery.
    ``expiration`` (seconds) is the message's own: counted from ``timestamp`` like the queue's
    ``expiration``, which it overrides for this entry.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None = None
    doc: object = None
    timestamp: float | None = None
    deliver_at: float | None = None
    expiration: float | None = None


class EntryRecord(NamedTuple):
    """The persistent state of one touched entry: what the coordinator writes to Postgres.

    It is also what :meth:`QueueEngine.restore` reads back after a restart.
    """

    bookmark: Bookmark
    state: EntryState
    delivery_count: int = 0
    cancel_count: int = 0
    consumer_id: str | None = None
    session_id: str | None = None
    token: str | None = None
    deadline: float | None = None
    available_at: float | None = None
    reason: ExpiryReason | None = None


class Touched:
    """The mutable state of an entry that has been delivered at least once.

    It lives while the entry is in the queue (so the counts survive a return to AVAILABLE),
    and a little longer for an at-most-once delivery, whose backlog slot stays taken until
    the consumer acknowledges (``slot_only``).
    """

    __slots__ = (
        "available_at",
        "bookmark",
        "cancel_count",
        "consumer_id",
        "deadline",
        "delivery_count",
        "reason",
        "restored",
        "seq",
        "session_id",
        "slot_only",
        "token",
    )

    def __init__(self, seq: int, bookmark: Bookmark) -> None:
        self.seq = seq
        self.bookmark = bookmark
        self.delivery_count = 0
        self.cancel_count = 0
        self.consumer_id = ""  # the lease holder ("" when not leased)
        self.session_id = ""
        self.token: str | None = None
        self.deadline: float = 0.0
        self.available_at: float | None = None
        self.reason: ExpiryReason | None = None
        self.restored = False
        self.slot_only = False


class Location(Enum):
    """What a bookmark is to a queue."""

    FOUND = "found"  # an entry of the queue (its state says live or done)
    DONE = "done"  # below what the queue still indexes: done long ago, or never enqueued
    UNKNOWN = "unknown"  # not offered to this queue (yet), or refused by its filter


class Source:
    """One journal partition feeding a queue: the offsets of its entries, in order.

    ``offsets`` / ``seqs`` map the partition's offsets to the queue's sequence numbers (the
    coordinator offers a partition's records in offset order), which makes both bookmark
    lookups and the recovery point a walk over two small-int arrays.
    """

    __slots__ = (
        "deferred_from",
        "expiry_index",
        "floor",
        "head",
        "index",
        "next_offset",
        "offsets",
        "partition",
        "purge_until",
        "seqs",
        "topic",
    )

    def __init__(self, index: int, topic: str, partition: int, next_offset: int) -> None:
        self.index = index
        self.topic = topic
        self.partition = partition
        self.offsets = array("q")
        self.seqs = array("q")
        self.head = 0  # index of the first entry that may still be live
        self.expiry_index = 0  # index of the next entry the expiration timer looks at
        self.next_offset = next_offset  # one past the highest offset offered to the queue
        self.floor = next_offset  # offsets below this are done (or were never enqueued)
        # target_queue_depth: the first offset offered past the depth and not admitted (-1:
        # none). Every offset from here to ``next_offset`` is deferred, not in memory: read
        # again from the journal when there is room (`QueueEngine.records_wanted`).
        self.deferred_from = -1
        # An operator's purge: deferred records below this offset are acknowledged (source
        # admin) as they are read back, taking no place in the active part.
        self.purge_until = -1

    def advance_head(self, state: bytearray, base: int) -> None:
        seqs = self.seqs
        head = self.head
        end = len(seqs)
        while head < end:
            seq = seqs[head]
            if seq >= base and state[seq - base] < ACKED:
                break
            head += 1
        self.head = head

    def recovery_point(self, state: bytearray, base: int) -> int:
        """The lowest offset with every offset below it done (DESIGN §1)."""
        self.advance_head(state, base)
        if self.head < len(self.offsets):
            return self.offsets[self.head]
        # Deferred records are not settled: the point stays at the first of them.
        return self.next_offset if self.deferred_from < 0 else self.deferred_from

    def locate(self, offset: int) -> tuple[Location, int]:
        if offset < self.floor:
            return Location.DONE, -1
        if offset >= self.next_offset:
            return Location.UNKNOWN, -1
        offsets = self.offsets
        index = bisect_left(offsets, offset)
        if index < len(offsets) and offsets[index] == offset:
            return Location.FOUND, self.seqs[index]
        return Location.UNKNOWN, -1

    def trim(self) -> None:
        head = self.head
        if head < _TRIM_AT_LEAST or head * 2 < len(self.offsets):
            return
        if head < len(self.offsets):
            self.floor = self.offsets[head]
        else:
            # Deferred offsets are not done: lookups must still find them not read.
            self.floor = self.next_offset if self.deferred_from < 0 else self.deferred_from
        del self.offsets[:head]
        del self.seqs[:head]
        self.expiry_index = max(0, self.expiry_index - head)
        self.head = 0


class EntryTable:
    """The columns of a queue's entries, indexed by ``seq - base``.

    Per slot: state (1 byte), source (4), offset (8), enqueue time (8), a document reference
    (8), and two more references for key groups or priority queues only. With the per-source
    offset/seq index (16) that is ~45 bytes per entry before array over-allocation.
    """

    __slots__ = (
        "base",
        "docs",
        "first_live",
        "key_next",
        "keys",
        "offsets",
        "positions",
        "source_ids",
        "sources",
        "sources_by_name",
        "state",
        "times",
    )

    def __init__(self, *, keyed: bool, prioritised: bool) -> None:
        self.base = 0
        self.first_live = 0
        self.state = bytearray()
        self.source_ids = array("I")
        self.offsets = array("q")
        self.times = array("d")
        self.docs: list[object] = []
        self.keys: list[bytes | None] | None = [] if keyed else None
        self.key_next: array[int] | None = array("q") if keyed else None
        self.positions: list[int] | None = [] if prioritised else None
        self.sources: list[Source] = []
        self.sources_by_name: dict[tuple[str, int], Source] = {}

    @property
    def end(self) -> int:
        """The sequence number the next entry will get."""
        return self.base + len(self.state)

    def source(self, topic: str, partition: int, next_offset: int) -> Source:
        """The source for a partition, created (starting at ``next_offset``) on first use."""
        source = self.sources_by_name.get((topic, partition))
        if source is None:
            source = Source(len(self.sources), topic, partition, next_offset)
            self.sources.append(source)
            self.sources_by_name[(topic, partition)] = source
        return source

    def append(
        self,
        source: Source,
        offset: int,
        timestamp: float,
        doc: object,
        key: bytes | None,
        state: int,
        position: int,
    ) -> int:
        seq = self.base + len(self.state)
        self.state.append(state)
        self.source_ids.append(source.index)
        self.offsets.append(offset)
        self.times.append(timestamp)
        self.docs.append(doc)
        if self.keys is not None and self.key_next is not None:
            self.keys.append(key)
            self.key_next.append(-1)
        if self.positions is not None:
            self.positions.append(position)
        source.offsets.append(offset)
        source.seqs.append(seq)
        return seq

    def append_plain(self, source: Source, offset: int, timestamp: float, doc: object) -> None:
        """Append an AVAILABLE entry to a table without key or priority columns (hot path)."""
        source.seqs.append(self.base + len(self.state))
        source.offsets.append(offset)
        self.state.append(AVAILABLE)
        self.source_ids.append(source.index)
        self.offsets.append(offset)
        self.times.append(timestamp)
        self.docs.append(doc)

    def bookmark(self, seq: int) -> Bookmark:
        slot = seq - self.base
        source = self.sources[self.source_ids[slot]]
        # tuple.__new__ skips NamedTuple's generated Python __new__: this runs once per lease.
        return tuple.__new__(Bookmark, (source.topic, source.partition, self.offsets[slot]))

    def locate(self, bookmark: Bookmark) -> tuple[Location, int]:
        source = self.sources_by_name.get((bookmark[0], bookmark[1]))
        if source is None:
            return Location.UNKNOWN, -1
        location, seq = source.locate(bookmark[2])
        if location is Location.FOUND and seq < self.base:
            return Location.DONE, -1
        return location, seq

    def state_of(self, seq: int) -> int:
        return self.state[seq - self.base] if seq >= self.base else ACKED

    def advance_first_live(self) -> int:
        """Move ``first_live`` to the oldest entry not ACKED or EXPIRED, and return it."""
        found = _LIVE_BYTE.search(self.state, self.first_live - self.base)
        self.first_live = self.base + (found.start() if found else len(self.state))
        return self.first_live

    def trim(self) -> None:
        """Drop the done slots at the front once they are worth a memmove."""
        done = self.advance_first_live() - self.base
        if done < _TRIM_AT_LEAST or done * 2 < len(self.state):
            return
        # bytearray deletes from the front in O(1); the arrays memmove, amortised by the rule.
        del self.state[:done]
        del self.source_ids[:done]
        del self.offsets[:done]
        del self.times[:done]
        del self.docs[:done]
        if self.keys is not None and self.key_next is not None:
            del self.keys[:done]
            del self.key_next[:done]
        if self.positions is not None:
            del self.positions[:done]
        self.base += done
        for source in self.sources:
            source.advance_head(self.state, self.base)
            source.trim()


# Priority order: position = (rank + 2**64) << 64 | seq, so one int compares like the pair
# (rank, seq). A valid priority p (an unsigned 64-bit integer, AMPS) has rank -p; every other
# value ranks 1, after all valid ones ("non-numeric or NULL ... lowest priority").
_SEQ_BITS: Final = 64
_SEQ_MASK: Final = (1 << _SEQ_BITS) - 1
_RANK_BIAS: Final = 1 << 64
_NULL_RANK: Final = 1
_MAX_PRIORITY: Final = (1 << 64) - 1


def priority_rank(value: object) -> int:
    """The rank of a priority expression's value: lower ranks are delivered first.

    AMPS interprets the value as an unsigned 64-bit integer; NULL and non-numeric values are
    NaN and have the lowest priority. A float is truncated toward zero like a C cast; a value
    outside 0..2**64-1 is no unsigned long and ranks with NULL.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _NULL_RANK
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return _NULL_RANK
        value = int(value)
    if 0 <= value <= _MAX_PRIORITY:
        return -value
    return _NULL_RANK


class FifoOrder:
    """Queue order without a priority: the sequence number itself (oldest first)."""

    fifo: Final = True

    __slots__ = ("_table",)

    def __init__(self, table: EntryTable) -> None:
        self._table = table

    def position(self, seq: int) -> int:
        return seq

    @staticmethod
    def seq_at(position: int) -> int:
        return position

    def start(self) -> int:
        return self._table.first_live

    def end(self) -> int:
        return self._table.end

    def add(self, seq: int, position: int) -> None:
        """Entries are appended in sequence order; nothing to index."""

    def discard(self, seq: int) -> None:
        """Done entries are skipped by their state byte; nothing to unindex."""

    def scan(self, position: int) -> Iterator[int]:
        """Sequence numbers of AVAILABLE entries from ``position`` on, in queue order."""
        table = self._table
        state = table.state
        base = table.base
        slot = max(position - base, 0)
        while True:
            slot = state.find(AVAILABLE, slot)
            if slot < 0:
                return
            yield base + slot
            slot += 1


class PriorityOrder:
    """Queue order with a priority: highest priority first, oldest first within a priority.

    Positions sit in a sorted list; an entry keeps its position for its whole life, so a
    returned entry goes back to exactly where it was (Qpid: order is kept through the
    entry's lifetime).
    """

    fifo: Final = False

    __slots__ = ("_positions", "_table")

    def __init__(self, table: EntryTable) -> None:
        self._table = table
        self._positions: SortedList[int] = SortedList()

    @staticmethod
    def encode(rank: int, seq: int) -> int:
        return ((rank + _RANK_BIAS) << _SEQ_BITS) | seq

    @staticmethod
    def rank_of(position: int) -> int:
        return (position >> _SEQ_BITS) - _RANK_BIAS

    def position(self, seq: int) -> int:
        positions = self._table.positions
        assert positions is not None
        return positions[seq - self._table.base]

    @staticmethod
    def seq_at(position: int) -> int:
        return position & _SEQ_MASK

    def start(self) -> int:
        return 0

    def end(self) -> int:
        return 1 << (2 * _SEQ_BITS + 2)

    def add(self, seq: int, position: int) -> None:
        self._positions.add(position)

    def discard(self, seq: int) -> None:
        self._positions.discard(self.position(seq))

    def scan(self, position: int) -> Iterator[int]:
        table = self._table
        state = table.state
        base = table.base
        for found in self._positions.irange(minimum=position):
            seq = found & _SEQ_MASK
            if state[seq - base] == AVAILABLE:
                yield seq
