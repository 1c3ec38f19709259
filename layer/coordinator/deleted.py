"""Journal partitions deleted while their queue's shard had no owner (issue 15): pure.

A queue's stored state of a journal partition (its recovery point, how far it was admitted,
its entry rows) describes one log. When the shard is taken, that log may be gone: the journal
deleted while the previous owner was stopped or SIGKILLed -- and, on a broker that creates
topics on first use, made again, empty, before the next owner loads the shard. Read from the
stored recovery point, a log made again would be taken for the old one: the old entries never
reach an outcome, and new records are taken for old entries at the same offsets.

`deleted_partitions` tells, from what is stored and what Kafka lists, which partitions of a
queue are gone: not listed any more, or listed with a log that ends before what the queue had
admitted of it (retention moves a log's start, never its end back, so a log that ends before
what was read of it was made again). `lost_to_deletion` is one EXPIRED (reason
``journal_deleted``) per entry the queue had not finished, including those queued and never
leased, which have no row: the recovery point and the admitted offset bound them, so no record
of the deleted log is needed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from itertools import chain
from typing import NamedTuple

from layer.domain import events as ev
from layer.domain.definitions import QueueDefinition
from layer.domain.states import Bookmark, ExpiryReason
from layer.store.rows import EntryRow, PartitionKey

__all__ = ["DeletedPartition", "deleted_partitions", "lost_to_deletion"]

_DONE = ("ACKED", "EXPIRED")


class DeletedPartition(NamedTuple):
    """A partition whose log the queue's stored state describes is gone."""

    topic: str
    partition: int
    #: Where the journal made again is read from (its log start); None: it is not listed.
    start: int | None
    #: The EXPIRED events of the entries the queue had not finished.
    expired: list[ev.EntryExpired]


def deleted_partitions(definition: QueueDefinition, stored_points: Mapping[PartitionKey, int],
                       admitted: Mapping[PartitionKey, int], rows: Iterable[EntryRow],
                       ends: Mapping[tuple[str, int], int],
                       log_starts: Mapping[tuple[str, int], int], now: float
                       ) -> list[DeletedPartition]:
    """The queue's partitions whose stored state outlived their log.

    ``ends`` is the end offset of every journal partition the queue's underlying topic matches
    that Kafka lists now; ``log_starts`` their first offsets. A partition not listed with
    nothing unfinished stored (its recovery point at its admitted offset, no open row) has
    nothing to lose and is left alone: its stored point, 0 after a deletion, reads a log made
    again from its start anyway. A listed one whose recovery point is past its log's end (all
    done, then made again) loses nothing but starts over at the new log's start."""
    name = definition.name
    open_rows: dict[tuple[str, int], dict[int, EntryRow]] = {}
    done: dict[tuple[str, int], set[int]] = {}
    for row in rows:
        tp = (row.topic, row.partition)
        if row.state in _DONE:
            done.setdefault(tp, set()).add(row.offset)
        else:
            open_rows.setdefault(tp, {})[row.offset] = row
    partitions = {(k.topic, k.partition) for k in stored_points} | set(open_rows)
    found: list[DeletedPartition] = []
    for tp in sorted(partitions):
        topic, partition = tp
        key = PartitionKey(name, topic, partition)
        point = stored_points.get(key, 0)
        rows_of = open_rows.get(tp, {})
        # The next offset past everything the queue knew of the old log.
        top = max(point, admitted.get(key, point), max(rows_of, default=-1) + 1)
        end = ends.get(tp)
        if end is None:
            if (top <= point and not rows_of) or not definition.matches_topic(topic):
                # Nothing unfinished, or the queue reads another journal now.
                continue
            start = None
        elif top > end:
            start = log_starts.get(tp, 0)
        else:
            continue
        expired = lost_to_deletion(name, topic, partition, point, top, rows_of,
                                   done.get(tp, set()), now)
        found.append(DeletedPartition(topic, partition, start, expired))
    return found


def lost_to_deletion(queue: str, topic: str, partition: int, point: int, top: int,
                     open_rows: Mapping[int, EntryRow], done: Collection[int], now: float,
                     closed: Collection[int] = ()) -> list[ev.EntryExpired]:
    """One EXPIRED (reason ``journal_deleted``, no dead letter: there is no record to write)
    per offset in ``[point, top)`` the queue had not finished, and per open row: leased ones
    with their holder and counts, queued ones (no row) with none. Offsets in ``done`` (acked
    or expired rows) and ``closed`` (expired already by the engine) are left out.

    An offset that never became an entry (refused by the queue's filter, a transaction
    marker) cannot be told apart once its log is gone, so it is reported too, as retention's
    losses are: over-reporting a loss is safer than hiding one."""
    top = max(top, max(open_rows, default=-1) + 1)
    lost: list[ev.EntryExpired] = []
    # No set of the range: a partition may hold millions of queued entries.
    for offset in chain(sorted(o for o in open_rows if o < point), range(point, top)):
        if offset in done or offset in closed:
            continue
        row = open_rows.get(offset)
        lost.append(ev.EntryExpired(
            queue, Bookmark(topic, partition, offset), ExpiryReason.JOURNAL_DELETED, False,
            row.delivery_count if row is not None else 0,
            row.cancel_count if row is not None else 0,
            row.lease_consumer if row is not None else None, None, now))
    return lost
