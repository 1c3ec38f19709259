"""`WriteBatch`: everything one coordinator loop iteration writes, applied in one transaction.

The coordinator collects into a batch while it applies the engine's decisions, then hands it to
`Store.commit`. The batch keeps only the *last* write per row (a lease then an ack of the same
entry in one iteration is one row write), which both saves work and is required by PostgreSQL:
one ``INSERT ... ON CONFLICT DO UPDATE`` may not touch the same row twice.

Collection order is respected: forgetting a queue drops what was collected for it before, and
a put after a delete of the same row wins (and vice versa).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from layer.store.rows import ConsumerRow, EntryKey, EntryRow, PartitionKey
from layer.store.tables import COUNTER_NAMES

if TYPE_CHECKING:
    from layer.store.store import EntryRun

__all__ = ["WriteBatch"]

# Named tuples built positionally: one per changed entry, on the coordinator's hot path.
_new: Final = tuple.__new__


@dataclass
class WriteBatch:
    """The writes of one loop iteration, keyed by row so that the last write of a row wins."""

    entries: dict[EntryKey, EntryRow] = field(default_factory=dict)
    entry_deletes: set[EntryKey] = field(default_factory=set)
    #: Rows the native core grouped into runs already (`put_runs`): entries no other write
    #: of the batch touches (one drain of their queue per iteration).
    runs: list[EntryRun] = field(default_factory=list)
    recovery_points: dict[PartitionKey, int] = field(default_factory=dict)
    # partition -> the next offset not yet admitted (see `recovery_points.admitted_to`)
    admitted: dict[PartitionKey, int] = field(default_factory=dict)
    consumers: dict[str, ConsumerRow] = field(default_factory=dict)
    consumer_deletes: set[str] = field(default_factory=set)
    #: Rows to delete only while they still hold this session (consumer id -> session id):
    #: a shard ending its session must not delete the row of the consumer's newer session on
    #: another shard.
    session_deletes: dict[str, str] = field(default_factory=dict)
    # consumer id -> time of its latest heartbeat (epoch seconds)
    heartbeats: dict[str, float] = field(default_factory=dict)
    #: Parts of sessions whose home is another shard (protocol 8, `consumer_spans`): rows to
    #: write, rows to delete while they hold the session (consumer id -> (shard, session id)),
    #: heartbeats (consumer id -> (shard, time)).
    spans: dict[str, ConsumerRow] = field(default_factory=dict)
    span_deletes: dict[str, tuple[int, str]] = field(default_factory=dict)
    span_heartbeats: dict[str, tuple[int, float]] = field(default_factory=dict)
    # queue -> counter name -> increment
    counters: defaultdict[str, defaultdict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    # Queues whose stored state (entries, recovery points, counters) is dropped before the rest
    # of the batch is written: a deleted, re-created or purged queue.
    forgotten_queues: set[str] = field(default_factory=set)
    # queue -> purge_requested_at of the purge this batch completes
    purges_done: dict[str, float] = field(default_factory=dict)
    # queue -> how many entries that purge (or ack by filter) acknowledged
    purges_acked: dict[str, int] = field(default_factory=dict)
    # queue -> reset_requested_at of the reset this batch completes
    resets_done: dict[str, float] = field(default_factory=dict)
    #: Partitions of a queue whose entry rows all go before the rest of the batch is written:
    #: a reset moved the queue's position there back, and the entries it held start over.
    forgotten_partitions: set[PartitionKey] = field(default_factory=set)
    # (topic, partition) of the control and ack topics -> the next offset to read
    input_positions: dict[tuple[str, int], int] = field(default_factory=dict)
    #: This iteration's events (EventBatch ``events`` arrays, one per batch record): written to
    #: the shard's outbox in the same transaction as the state changes they describe (DESIGN §2).
    outbox: list[bytes] = field(default_factory=list)
    #: Outbox batches up to this id were published: they go in this transaction.
    outbox_published: int | None = None
    #: Increments of the shard's fault and refusal counters (`ownership.counters`), stored
    #: with the input positions of the records that caused them (`FaultLedger`).
    shard_counts: dict[str, int] = field(default_factory=dict)

    def put_events(self, arrays: list[bytes]) -> None:
        self.outbox.extend(arrays)

    def published(self, batch_id: int) -> None:
        self.outbox_published = max(batch_id, self.outbox_published or 0)

    def put_entry(self, row: EntryRow) -> None:
        key = _new(EntryKey, (row.queue, row.topic, row.partition, row.offset))
        if self.entry_deletes:
            self.entry_deletes.discard(key)
        self.entries[key] = row

    def put_runs(self, runs: list[EntryRun], singles: list[EntryRow]) -> None:
        """Rows of the native core: runs formed already, and rows of their own."""
        self.runs.extend(runs)
        for row in singles:
            self.put_entry(row)

    def delete_entry(self, key: EntryKey) -> None:
        self.entries.pop(key, None)
        self.entry_deletes.add(key)

    def set_recovery_point(self, queue: str, topic: str, partition: int, offset: int) -> None:
        if offset < 0:
            raise ValueError(f"recovery point offset must be >= 0, got {offset}")
        self.recovery_points[PartitionKey(queue, topic, partition)] = offset

    def set_admitted(self, queue: str, topic: str, partition: int, admitted_to: int) -> None:
        """How far the queue has admitted the partition; written with its recovery point,
        which must be set in the same batch or stored already."""
        self.admitted[PartitionKey(queue, topic, partition)] = admitted_to

    def set_input_position(self, topic: str, partition: int, next_offset: int) -> None:
        """Where to read a control or ack partition on from: committed with the effects of
        the records below it."""
        if next_offset < 0:
            raise ValueError(f"input position must be >= 0, got {next_offset}")
        self.input_positions[(topic, partition)] = next_offset

    def put_consumer(self, row: ConsumerRow) -> None:
        if row.is_span:
            self.span_deletes.pop(row.consumer_id, None)
            self.spans[row.consumer_id] = row
            return
        self.consumer_deletes.discard(row.consumer_id)
        self.session_deletes.pop(row.consumer_id, None)
        self.consumers[row.consumer_id] = row

    def delete_consumer(self, consumer_id: str, session_id: str | None = None,
                        span: int | None = None) -> None:
        """Delete the consumer's row; with ``session_id``, only if it still holds that
        session. ``span``: the row is that shard's part of a session whose home is another
        shard (protocol 8), deleted only while it holds ``session_id``."""
        if span is not None:
            assert session_id is not None
            self.spans.pop(consumer_id, None)
            self.span_heartbeats.pop(consumer_id, None)
            self.span_deletes[consumer_id] = (span, session_id)
            return
        self.consumers.pop(consumer_id, None)
        self.heartbeats.pop(consumer_id, None)
        if session_id is None:
            self.session_deletes.pop(consumer_id, None)
            self.consumer_deletes.add(consumer_id)
        elif consumer_id not in self.consumer_deletes:
            self.session_deletes[consumer_id] = session_id

    def heartbeat(self, consumer_id: str, at: float, span: int | None = None) -> None:
        if span is not None:
            previous = self.span_heartbeats.get(consumer_id)
            self.span_heartbeats[consumer_id] = (
                span, at if previous is None else max(previous[1], at))
            return
        previous_at = self.heartbeats.get(consumer_id)
        self.heartbeats[consumer_id] = at if previous_at is None else max(previous_at, at)

    def count(self, queue: str, name: str, increment: int = 1) -> None:
        """Add to one of a queue's running totals (`layer.store.tables.COUNTER_NAMES`)."""
        if name not in COUNTER_NAMES:
            raise ValueError(f"unknown counter {name!r}; known: {', '.join(COUNTER_NAMES)}")
        if increment < 0:
            raise ValueError(f"counters only grow; got increment {increment} for {name!r}")
        self.counters[queue][name] += increment

    def forget_queue(self, queue: str) -> None:
        """Drop the queue's stored state; what is collected for it afterwards is still written."""
        self.forgotten_queues.add(queue)
        for key in [key for key in self.entries if key.queue == queue]:
            del self.entries[key]
        self.runs = [run for run in self.runs if run.queue != queue]
        self.entry_deletes = {key for key in self.entry_deletes if key.queue != queue}
        for pkey in [pkey for pkey in self.recovery_points if pkey.queue == queue]:
            del self.recovery_points[pkey]
        for pkey in [pkey for pkey in self.admitted if pkey.queue == queue]:
            del self.admitted[pkey]
        self.counters.pop(queue, None)

    def purge_done(self, queue: str, requested_at: float, acked: int = 0) -> None:
        """Record that the purge asked for at ``requested_at`` has been carried out,
        acknowledging ``acked`` entries."""
        previous = self.purges_done.get(queue)
        if previous is None or requested_at > previous:
            self.purges_done[queue] = requested_at
            self.purges_acked[queue] = acked
        elif requested_at == previous:
            self.purges_acked[queue] = self.purges_acked.get(queue, 0) + acked

    def reset_done(self, queue: str, requested_at: float) -> None:
        """Record that the reset asked for at ``requested_at`` has been carried out."""
        previous = self.resets_done.get(queue)
        self.resets_done[queue] = (
            requested_at if previous is None else max(previous, requested_at)
        )

    def forget_partition(self, queue: str, topic: str, partition: int) -> None:
        """Drop every entry row of one partition of a queue; what is collected for it
        afterwards is still written."""
        self.forgotten_partitions.add(PartitionKey(queue, topic, partition))
        for key in [key for key in self.entries
                    if (key.queue, key.topic, key.partition) == (queue, topic, partition)]:
            del self.entries[key]
        self.runs = [run for run in self.runs if run.key[:3] != (queue, topic, partition)]
        self.entry_deletes = {key for key in self.entry_deletes
                              if (key.queue, key.topic, key.partition)
                              != (queue, topic, partition)}

    def __len__(self) -> int:
        """Number of row writes collected (a forgotten queue counts as one)."""
        return (
            len(self.entries)
            + len(self.runs)
            + len(self.entry_deletes)
            + len(self.recovery_points)
            + len(self.consumers)
            + len(self.consumer_deletes)
            + len(self.session_deletes)
            + len(self.heartbeats)
            + len(self.spans)
            + len(self.span_deletes)
            + len(self.span_heartbeats)
            + len(self.counters)
            + len(self.forgotten_queues)
            + len(self.purges_done)
            + len(self.resets_done)
            + len(self.forgotten_partitions)
            + len(self.input_positions)
            + len(self.outbox)
            + (self.outbox_published is not None)
            + len(self.shard_counts)
        )

    def is_empty(self) -> bool:
        return len(self) == 0
