"""`Store`: qlayer's PostgreSQL state behind a narrow, named API (DESIGN §3).

Three kinds of callers:

- the coordinator, once per loop iteration: `commit` a `WriteBatch` in one transaction, guarded
  by its (owner_id, epoch) on the shard; `take_shard` / `release` / `report_shard`;
- the coordinator on (re)start: `load_queues`, `load_entries`, `load_recovery_points`,
  `load_consumers`, `load_counters`;
- the CLI: `put_queue`, `delete_queue`, `get_queue`, `list_queues`, `request_purge`, `owners`.

Every method takes the caller's ``now`` (epoch seconds) where time matters; the database clock
decides nothing. Driver errors leave as `StoreError` (see `layer.store.errors`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Row

from layer.domain.errors import QueueConfigError, UnknownConsumerError, UnknownQueueError
from layer.domain.positions import DEFAULT_RECOVERY_POINT
from layer.domain.shards import shard_for, shard_key
from layer.store import statements as sql
from layer.store.batch import WriteBatch
from layer.store.errors import FencedError, QueueVersionConflictError, StoreError, translate_errors
from layer.store.pipeline import (
    CompiledCache,
    Executor,
    Result,
    StatementsLost,
    executor_for,
    no_automatic_preparing,
)
from layer.store.rows import (
    ConsumerRow,
    EntryKey,
    EntryRow,
    Ownership,
    PartitionKey,
    ProcessRow,
    QueueCounters,
    QueueMove,
    QueueRecord,
    parts_in,
)
from layer.store.tables import (
    COUNTER_NAMES,
    DONE_STATES,
    entries,
    entry_runs,
    queue_counters,
    queues,
    recovery_points,
)
from layer.store.url import parse_database_url

__all__ = ["CommitResult", "Store", "WriteBatch", "joined_filters", "recording_statements"]


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What one `Store.commit` did, for the coordinator's metrics."""

    epoch: int
    statements: int
    #: Entries whose state the batch wrote (each is in a run or has a row of its own).
    entries_written: int
    entries_deleted: int
    entries_pruned: int
    #: Rows written for those entries: runs plus rows of their own (DESIGN §3 version 2).
    rows_written: int = 0
    #: The ids of the outbox batches this commit wrote, in the order of `WriteBatch.outbox`.
    outbox_batch_ids: tuple[int, ...] = ()
    #: Consumer rows of `WriteBatch.consumers` that were not written: another shard holds a
    #: live session under that consumer id (`statements.UPSERT_CONSUMERS`).
    consumers_refused: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class _Written:
    """What `Store._write` sent; its results are read once the transaction has synced."""

    statements: int
    entries_written: int
    entries_deleted: int
    rows_written: int
    pruned: Result | None
    outbox: list[Result]
    consumers: Result | None = None
    spans: Result | None = None


def _to_datetime(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _to_datetime_or_none(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _to_seconds(moment: datetime) -> float:
    return moment.timestamp()


def _to_seconds_or_none(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def _json_roundtrip(definition: Mapping[str, Any]) -> dict[str, Any]:
    """The definition as JSONB will hand it back, so "unchanged" compares like with like."""
    loaded = json.loads(json.dumps(definition))
    if not isinstance(loaded, dict):
        raise TypeError("a queue definition must be a JSON object")
    return loaded


class Store:
    """qlayer's PostgreSQL state. Give it an Engine (shared, not disposed here) or a URL."""

    def __init__(self, engine_or_url: Engine | str) -> None:
        if isinstance(engine_or_url, Engine):
            self._engine = engine_or_url
            self._owns_engine = False
        else:
            # No pool_pre_ping: it would add a round trip to every loop iteration. A connection
            # that died with the server fails one call with a retryable StoreError, and
            # SQLAlchemy then drops the stale pool, so the next call reconnects.
            self._engine = create_engine(parse_database_url(engine_or_url))
            self._owns_engine = True
        # The commit path's statements, compiled once and prepared once per connection
        # (`layer/store/pipeline.py`); psycopg's own preparing would deallocate them.
        self._compiled = CompiledCache()
        if not event.contains(self._engine, "connect", no_automatic_preparing):
            event.listen(self._engine, "connect", no_automatic_preparing)

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        if self._owns_engine:
            self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- ownership -----------------------------------------------------------------------------

    def take_shard(self, shard: str, owner_id: str, now: float) -> int:
        """Take the shard for ``owner_id``; returns the new epoch (one more than any before).

        Unconditional: Kafka's group protocol decided this process runs the shard. The new
        epoch fences every earlier holder's writes, this owner id's earlier takes included.
        """
        with translate_errors(f"taking shard {shard!r}"), self._engine.begin() as conn:
            epoch = conn.execute(
                sql.TAKE_SHARD,
                {"the_shard": shard, "the_owner_id": owner_id, "now": _to_datetime(now)},
            ).scalar_one()
        return int(epoch)

    def report_shard(self, shard: str, owner_id: str, epoch: int, lag: int | None,
                     now: float) -> bool:
        """Record the owner's lag; False when (owner_id, epoch) no longer holds the shard."""
        with translate_errors(f"reporting shard {shard!r}"), self._engine.begin() as conn:
            done = conn.execute(
                sql.REPORT_SHARD,
                {**_holder_params(shard, owner_id, epoch, _to_datetime(now)), "the_lag": lag},
            ).scalar_one_or_none()
        return done is not None

    def release(self, shard: str, owner_id: str, epoch: int, now: float) -> bool:
        """Say the shard has no owner (clean stop, revocation); False when it was not ours."""
        with translate_errors(f"releasing shard {shard!r}"), self._engine.begin() as conn:
            released = conn.execute(
                sql.RELEASE,
                _holder_params(shard, owner_id, epoch, _to_datetime(now)),
            ).scalar_one_or_none()
        return released is not None

    def owner(self, shard: str) -> Ownership | None:
        """The shard's current holder, None when released or never taken."""
        with translate_errors(f"reading owner of shard {shard!r}"), self._engine.connect() as conn:
            row = conn.execute(sql.SELECT_OWNER, {"the_shard": shard}).one_or_none()
        return None if row is None else _ownership(row)

    def owners(self) -> list[Ownership]:
        with translate_errors("reading shard owners"), self._engine.connect() as conn:
            return [_ownership(row) for row in conn.execute(sql.SELECT_OWNERS)]

    # --- installation and processes -----------------------------------------------------------

    def shard_count(self) -> int:
        """The installation's shard count (`qlayer db upgrade --shards N`)."""
        with translate_errors("reading the shard count"), self._engine.connect() as conn:
            return self._shard_count(conn)

    def report_process(self, owner_id: str, host: str, pid: int, started_at: float,
                       shards: Iterable[int], now: float) -> None:
        """A coordinator process says it is alive and which shards it was assigned."""
        with translate_errors("reporting a coordinator process"), self._engine.begin() as conn:
            conn.execute(sql.REPORT_PROCESS, {
                "the_owner_id": owner_id, "the_host": host, "the_pid": pid,
                "the_started_at": _to_datetime(started_at), "now": _to_datetime(now),
                "the_shards": sorted(shards)})

    def shard_counters(self, shard: str) -> dict[str, int]:
        """The shard's stored running totals (0008), whoever holds it; {} when none."""
        with translate_errors(f"reading counters of shard {shard!r}"), \
                self._engine.connect() as conn:
            found = conn.execute(sql.SELECT_SHARD_COUNTERS, {"the_shard": shard}).scalar()
        return {str(k): int(v) for k, v in (found or {}).items()}

    def all_shard_counters(self) -> dict[str, dict[str, int]]:
        """Every shard's stored running totals (0008), owned or not: shard -> name -> n."""
        with translate_errors("reading shard counters"), self._engine.connect() as conn:
            return {row.shard: {str(k): int(v) for k, v in (row.counters or {}).items()}
                    for row in conn.execute(sql.SELECT_ALL_SHARD_COUNTERS)}

    def report(self, owner_id: str, host: str, pid: int, started_at: float,
               shards: Iterable[int], lags: Mapping[str, tuple[int, int | None]],
               now: float, forget_before: float) -> None:
        """A coordinator process's periodic report, in one transaction: it is alive and was
        assigned ``shards``; the lag of each shard it holds (``lags``: shard -> (epoch, lag);
        a shard another process holds by now is left alone); and the rows of processes silent
        since ``forget_before`` go. One commit per report instead of one per shard, each of
        which the loop had waited for."""
        moment = _to_datetime(now)
        with translate_errors("reporting a coordinator process"), self._engine.begin() as conn:
            conn.execute(sql.REPORT_PROCESS, {
                "the_owner_id": owner_id, "the_host": host, "the_pid": pid,
                "the_started_at": _to_datetime(started_at), "now": moment,
                "the_shards": sorted(shards)})
            if lags:
                conn.execute(sql.REPORT_SHARDS, [
                    {**_holder_params(shard, owner_id, epoch, moment), "the_lag": lag}
                    for shard, (epoch, lag) in sorted(lags.items())])
            conn.execute(sql.FORGET_PROCESSES_SEEN_BEFORE,
                         {"before": _to_datetime(forget_before)})

    def forget_process(self, owner_id: str) -> None:
        """A coordinator process stopped cleanly."""
        with translate_errors("forgetting a coordinator process"), self._engine.begin() as conn:
            conn.execute(sql.FORGET_PROCESS, {"the_owner_id": owner_id})

    def forget_processes_seen_before(self, before: float) -> int:
        """Drop the registry rows of processes silent since ``before`` (killed ones)."""
        with translate_errors("forgetting silent coordinator processes"), \
                self._engine.begin() as conn:
            return conn.execute(sql.FORGET_PROCESSES_SEEN_BEFORE,
                                {"before": _to_datetime(before)}).rowcount

    def processes(self) -> list[ProcessRow]:
        with translate_errors("listing coordinator processes"), self._engine.connect() as conn:
            return [ProcessRow(owner_id=row.owner_id, host=row.host, pid=int(row.pid),
                               started_at=_to_seconds(row.started_at),
                               seen_at=_to_seconds(row.seen_at), shards=tuple(row.shards))
                    for row in conn.execute(sql.SELECT_PROCESSES)]

    # --- the write path ------------------------------------------------------------------------

    def commit(
        self, batch: WriteBatch, shard: str, owner_id: str, epoch: int, now: float
    ) -> CommitResult:
        """Write the batch in one transaction, if (owner_id, epoch) still holds the shard.

        Raises `FencedError` (and writes nothing) when it does not. Done entries that fall
        below a recovery point set in this same batch are deleted instead of written, and done
        entries the new recovery points pass are pruned (DESIGN §3).
        """
        moment = _to_datetime(now)
        with (
            translate_errors(f"committing a batch for shard {shard!r}"),
            self._engine.connect() as plain,
            _fenced_as(shard, owner_id, epoch),
        ):
            # The whole transaction in one round trip (`layer/store/pipeline.py`): BEGIN, the
            # guard (it row-locks the shard's ownership row, so a takeover waits for this
            # transaction; when another owner holds the shard it raises, and the server skips
            # everything sent after it), the batch, COMMIT. The executor begins and commits
            # the transaction itself, so the connection is in autocommit mode for it.
            conn = plain.execution_options(isolation_level="AUTOCOMMIT")
            try:
                with executor_for(conn, self._compiled) as ex:
                    written = self._write(ex, batch, shard, owner_id, epoch, moment)
            except StatementsLost:
                # Nothing was written and the pipeline forgot the lost statements: once more,
                # preparing them again.
                with executor_for(conn, self._compiled) as ex:
                    written = self._write(ex, batch, shard, owner_id, epoch, moment)
            pruned = written.pruned.rowcount if written.pruned is not None else 0
            outbox_batch_ids = [int(result.scalar_one()) for result in written.outbox]
            refused: frozenset[str] = frozenset()
            if written.consumers is not None:
                refused = frozenset(batch.consumers) - set(written.consumers.scalars())
            if written.spans is not None:
                refused |= frozenset(batch.spans) - set(written.spans.scalars())
        return CommitResult(
            epoch=epoch,
            statements=written.statements,
            entries_written=written.entries_written,
            entries_deleted=written.entries_deleted,
            entries_pruned=pruned,
            rows_written=written.rows_written,
            outbox_batch_ids=tuple(outbox_batch_ids),
            consumers_refused=refused,
        )

    def _write(self, ex: Executor, batch: WriteBatch, shard: str, owner_id: str, epoch: int,
               moment: datetime) -> _Written:
        """Send the batch's statements (`commit`'s transaction, less its BEGIN)."""
        statements = 0
        outbox: list[Result] = []
        ex.execute(sql.HOLD_SHARD, _holder_params(shard, owner_id, epoch, moment))
        ex.flush()  # the server takes the row lock while the batch is composed
        statements += 1
        statements += self._forget(ex, batch.forgotten_queues)
        statements += _forget_partitions(ex, batch.forgotten_partitions)
        upserts, deletes = _split_passed_entries(batch)
        statements += _delete_entries(ex, deletes)
        runs, singles = runs_of(upserts.values())
        runs.extend(batch.runs)
        statements += _insert_runs(ex, runs, moment)
        statements += _upsert_entries(ex, singles, moment)
        statements += _upsert_recovery_points(ex, batch.recovery_points, batch.admitted, moment)
        pruned_rows = _prune_below(ex, batch.recovery_points)
        statements += 2 if batch.recovery_points else 0  # the prunes
        consumer_statements, consumers_written = _write_consumers(ex, batch)
        span_statements, spans_written = _write_spans(ex, batch)
        consumer_statements += span_statements
        statements += consumer_statements
        statements += _increment_counters(ex, batch.counters, moment)
        statements += _mark_purged(ex, batch.purges_done, batch.purges_acked)
        statements += _mark_reset(ex, batch.resets_done)
        statements += _upsert_input_positions(ex, shard, batch.input_positions, moment)
        if batch.shard_counts:
            ordered = sorted(batch.shard_counts.items())
            ex.execute(sql.INCREMENT_SHARD_COUNTERS, {
                "the_shard": shard, "counter": [k for k, _ in ordered],
                "increment": [n for _, n in ordered]})
            statements += 1
        if batch.outbox_published is not None:
            ex.execute(sql.DELETE_PUBLISHED, {"the_shard": shard,
                                              "published": batch.outbox_published})
            statements += 1
        for events in batch.outbox:  # one, but for iterations with very many events
            outbox.append(ex.execute(sql.INSERT_OUTBOX, {
                "the_shard": shard, "events": events, "now": moment}))
            statements += 1
        ex.commit()
        return _Written(
            statements=statements,
            entries_written=len(upserts) + sum(len(run.offsets) for run in batch.runs),
            entries_deleted=len(deletes),
            rows_written=len(runs) + len(singles),
            pruned=pruned_rows,
            outbox=outbox,
            consumers=consumers_written,
            spans=spans_written,
        )

    def load_outbox(self, shard: str) -> list[tuple[int, bytes]]:
        """The shard's event batches not known to be published, oldest first: (id, events)."""
        with translate_errors(f"loading the outbox of shard {shard!r}"), \
                self._engine.connect() as conn:
            return [(int(row[0]), bytes(row[1]))
                    for row in conn.execute(sql.SELECT_OUTBOX, {"the_shard": shard})]

    def forget_published(self, shard: str, published: int) -> None:
        """Delete the shard's outbox batches up to ``published`` (they are on the events
        topic). Not guarded: deleting what was published is right whoever owns the shard."""
        with translate_errors(f"trimming the outbox of shard {shard!r}"), \
                self._engine.begin() as conn:
            conn.execute(sql.DELETE_PUBLISHED, {"the_shard": shard, "published": published})

    @staticmethod
    def _forget(conn: Executor | Connection, queue_names: set[str]) -> int:
        if not queue_names:
            return 0
        names = sorted(queue_names)
        for statement in (sql.FORGET_ENTRIES, sql.FORGET_RUNS, sql.FORGET_RECOVERY_POINTS,
                          sql.FORGET_COUNTERS):
            conn.execute(statement, {"queues": names})
        return 4

    # --- restart recovery ----------------------------------------------------------------------

    def load_queues(self) -> list[QueueRecord]:
        """Live queue definitions (not deleted), by name."""
        return self.list_queues()

    def load_entries(self, queue: str) -> list[EntryRow]:
        """The touched entries restart needs, in bookmark order, one row per entry.

        Every entry at or above its partition's recovery point that has a row of its own or is
        in a run; where several writes speak of one entry, the latest (highest ``seq``) wins.
        Below the recovery point everything is done and pruned.
        """
        with (
            translate_errors(f"loading entries of queue {queue!r}"),
            self._engine.connect() as conn,
        ):
            # fetchall, then build: iterating the result would fetch row by row (~2x slower).
            result = conn.execute(sql.SELECT_ENTRIES_TO_RECOVER, {"queue": queue}).all()
            runs = conn.execute(sql.SELECT_RUNS_TO_RECOVER, {"queue": queue}).all()
        return _latest_entries(result, runs).get(queue, [])

    def load_entries_of(self, queues: Iterable[str]) -> dict[str, list[EntryRow]]:
        """`load_entries` of several queues in two round trips, whatever their number (`qlayer
        stats` and the console's queue list): queue -> its entries (a queue without any is
        left out)."""
        names = sorted(set(queues))
        if not names:
            return {}
        with translate_errors("loading entries of queues"), self._engine.connect() as conn:
            result = conn.execute(sql.SELECT_ENTRIES_OF_QUEUES, {"queues": names}).all()
            runs = conn.execute(sql.SELECT_RUNS_OF_QUEUES, {"queues": names}).all()
        return _latest_entries(result, runs)

    def load_entry(self, queue: str, topic: str, partition: int, offset: int
                   ) -> EntryRow | None:
        """One entry's latest stored state (its own row or a run holding it), None when
        nothing is stored for it: untouched (AVAILABLE) at or above its recovery point, done
        and pruned below it."""
        where = {"queue": queue, "topic": topic, "partition": partition, "offset": offset}
        with translate_errors(f"loading entry {topic}/{partition}/{offset} of {queue!r}"), \
                self._engine.connect() as conn:
            result = conn.execute(sql.SELECT_ENTRY_AT, where).all()
            runs = conn.execute(sql.SELECT_RUNS_AT, where).all()
        for row in _latest_entries(result, runs).get(queue, []):
            if (row.topic, row.partition, row.offset) == (topic, partition, offset):
                return row
        return None

    def load_recovery_points(self, queue: str | None = None) -> dict[PartitionKey, int]:
        """Recovery points of one queue, or of every queue."""
        statement = sql.SELECT_RECOVERY_POINTS
        if queue is not None:
            statement = statement.where(recovery_points.c.queue == queue)
        with translate_errors("loading recovery points"), self._engine.connect() as conn:
            return {
                PartitionKey(row.queue, row.topic, row.partition): row.offset
                for row in conn.execute(statement)
            }

    def load_admitted(self, queue: str) -> dict[PartitionKey, int]:
        """How far each partition of the queue was admitted (where it is known): a restart
        re-admits the records below it without counting them as enqueued again."""
        statement = sql.SELECT_RECOVERY_POINTS.where(recovery_points.c.queue == queue)
        with translate_errors("loading admitted positions"), self._engine.connect() as conn:
            return {
                PartitionKey(row.queue, row.topic, row.partition): row.admitted_to
                for row in conn.execute(statement) if row.admitted_to is not None
            }

    def load_input_positions(self, shard: str) -> dict[tuple[str, int], int]:
        """Where the shard's owner reads each control and ack partition on from (written
        with what the records below did; see `WriteBatch.set_input_position`)."""
        with translate_errors("loading input positions"), self._engine.connect() as conn:
            return {(row.topic, row.partition): row.next_offset
                    for row in conn.execute(sql.SELECT_INPUT_POSITIONS, {"shard": shard})}

    def load_consumers(self) -> list[ConsumerRow]:
        with translate_errors("loading consumers"), self._engine.connect() as conn:
            return [_consumer_row(row) for row in conn.execute(sql.SELECT_CONSUMERS)]

    def load_spans(self) -> list[ConsumerRow]:
        """The parts of sessions on shards other than their home (protocol 8)."""
        with translate_errors("loading session parts"), self._engine.connect() as conn:
            return [_consumer_row(row) for row in conn.execute(sql.SELECT_SPANS)]

    def delivery_topics_in_use(self) -> set[str]:
        """The delivery topics of every stored session, whichever shard serves it."""
        with translate_errors("loading delivery topics"), self._engine.connect() as conn:
            return {row.delivery_topic
                    for row in conn.execute(sql.SELECT_DELIVERY_TOPICS_IN_USE)}

    def request_eviction(self, consumer_id: str, now: float) -> None:
        """Ask the owning coordinator to evict a consumer (`qlayer consumers evict`).

        The coordinator breaks all its leases at once, answers SessionEnded(EVICTED) and
        deletes the row within its refresh interval. Raises `UnknownConsumerError` when no
        consumer has that id.
        """
        with (
            translate_errors(f"requesting the eviction of consumer {consumer_id!r}"),
            self._engine.begin() as conn,
        ):
            found = conn.execute(
                sql.REQUEST_EVICTION,
                {"the_consumer_id": consumer_id, "moment": _to_datetime(now)},
            ).scalar_one_or_none()
        if found is None:
            raise UnknownConsumerError(consumer_id)

    def load_counters(self, queue: str | None = None) -> dict[str, QueueCounters]:
        statement = sql.SELECT_COUNTERS
        if queue is not None:
            statement = statement.where(queue_counters.c.queue == queue)
        with translate_errors("loading queue counters"), self._engine.connect() as conn:
            return {
                row.queue: QueueCounters(
                    queue=row.queue,
                    updated_at=_to_seconds(row.updated_at),
                    **{name: int(getattr(row, name)) for name in COUNTER_NAMES},
                )
                for row in conn.execute(statement)
            }

    def delete_done_below_recovery_points(self, queue: str | None = None) -> int:
        """Bulk-delete ACKED and EXPIRED entries their recovery point has passed; returns count.

        `commit` already prunes behind the recovery points it moves; this is the maintenance
        form (e.g. after a crash between two batches, or for `qlayer` housekeeping).
        """
        statement = sql.DELETE_DONE_BELOW_RECOVERY_POINTS
        runs = sql.DELETE_RUNS_BELOW_RECOVERY_POINTS
        if queue is not None:
            statement = statement.where(entries.c.queue == queue)
            runs = runs.where(entry_runs.c.queue == queue)
        with translate_errors("deleting done entries"), self._engine.begin() as conn:
            conn.execute(runs)
            return conn.execute(statement).rowcount

    # --- queue definitions (CLI) ---------------------------------------------------------------

    def put_queue(
        self,
        name: str,
        definition: Mapping[str, Any],
        now: float,
        *,
        expected_version: int | None = None,
    ) -> int:
        """Create or update a queue definition; returns its version afterwards.

        The version goes up by one on every change; writing an identical definition changes
        nothing (so `qlayer queue apply` is idempotent). Re-creating a deleted queue makes a new
        queue: whatever state the old one left is dropped in the same transaction. With
        ``expected_version``, the write happens only if the stored live version is that one
        (raises `QueueVersionConflictError` otherwise).
        """
        wanted = _json_roundtrip(definition)
        # Definitions written with defaults left out start at the default point.
        setting = wanted.get("recovery_point", DEFAULT_RECOVERY_POINT)
        params: dict[str, Any] = {"queue_name": name, "new_definition": wanted,
                                  "now": _to_datetime(now),
                                  "the_positions_from": None if setting is None else str(setting)}
        with translate_errors(f"writing queue {name!r}"), self._engine.begin() as conn:
            count = self._shard_count(conn)
            placed = _placement(name, wanted, count)
            # Two rounds at most: a concurrent creator can win the INSERT race, after which the
            # row exists and the update path applies.
            for _ in range(2):
                current = _lock_queue(conn, name)
                live = current is not None and current.deleted_at is None
                if expected_version is not None:
                    actual = current.version if current is not None and live else None
                    if actual != expected_version:
                        raise QueueVersionConflictError(name, expected_version, actual)
                if current is None:
                    created = conn.execute(sql.INSERT_QUEUE,
                                           {**params, "the_shard": placed}).scalar_one_or_none()
                    if created is not None:
                        return int(created)
                    continue
                if live:
                    if current.definition == wanted:
                        return int(current.version)
                    shard = int(current.shard)
                    parts = parts_in(wanted)
                    if parts_in(current.definition) != parts:
                        raise QueueConfigError([("parts", (
                            f"cannot change on a live queue ({parts_in(current.definition)} -> "
                            f"{parts}): its entries are split by journal partition between "
                            "the parts' shards. Create a queue with the parts you want over "
                            "the same journal, move the consumers to it, then delete this "
                            "one (docs/coordinator.md, 'Partitioned queues')"))])
                    if _placement_fields(current.definition) != _placement_fields(wanted):
                        # The queue file asks for another placement: a move, fenced like
                        # `qlayer queue move`.
                        if placed != shard:
                            _refuse_moving_parts(current.definition)
                            _fence(conn, shard)
                        shard = placed
                    # A recovery_point other than the one the positions were set from moves
                    # them there (AMPS: a changed RecoveryPoint); the reset is requested in
                    # the same write, so no coordinator sees the one without the other.
                    moves = (setting is not None and current.positions_from is not None
                             and str(setting) != current.positions_from)
                    if moves and parts > 1:
                        raise QueueConfigError([("recovery_point", (
                            f"cannot change on a queue of {parts} parts (from "
                            f"{current.positions_from}): moving the positions of every part "
                            "at once is not supported yet (docs/coordinator.md, 'Partitioned "
                            "queues')"))])
                    statement = (sql.UPDATE_QUEUE_DEFINITION_AND_RESET if moves
                                 else sql.UPDATE_QUEUE_DEFINITION)
                    return int(conn.execute(statement,
                                            {**params, "the_shard": shard}).scalar_one())
                self._forget(conn, {name})
                return int(conn.execute(sql.RECREATE_QUEUE,
                                        {**params, "the_shard": placed}).scalar_one())
        raise StoreError(f"writing queue {name!r}: it kept changing underneath", retryable=True)

    def move_queue(self, name: str, shard: int, now: float) -> QueueMove:
        """Serve the queue from another shard; its state goes with it.

        In one transaction: the queue's shard changes, its version goes up (every coordinator
        refreshes it) and the old shard's epoch goes up, so the old owner's next write fails
        and it rebuilds without the queue. Its stored state (leases, recovery points) is what
        the new shard's owner loads; leases keep their tokens, so a consumer acks them there.
        """
        with translate_errors(f"moving queue {name!r}"), self._engine.begin() as conn:
            count = self._shard_count(conn)
            if not 0 <= shard < count:
                raise QueueConfigError([("shard", f"shard {shard} does not exist: this "
                                                  f"installation has shards 0..{count - 1}")])
            current = _lock_queue(conn, name)
            if current is None or current.deleted_at is not None:
                raise UnknownQueueError(name)
            old = int(current.shard)
            if old == shard:
                return QueueMove(name, old, shard, int(current.version))
            _refuse_moving_parts(current.definition)
            _fence(conn, old)
            version = conn.execute(sql.MOVE_QUEUE, {"queue_name": name, "the_shard": shard,
                                                    "now": _to_datetime(now)}).scalar_one()
            conn.execute(sql.MOVE_QUEUE_CONSUMERS, {"queue_name": name, "the_shard": shard})
        return QueueMove(name, old, shard, int(version))

    @staticmethod
    def _shard_count(conn: Connection) -> int:
        count = conn.execute(sql.SELECT_SHARD_COUNT).scalar_one_or_none()
        if count is None:
            raise StoreError("the database has no installation row: run `qlayer db upgrade`",
                             retryable=False)
        return int(count)

    def delete_queue(
        self, name: str, now: float, *, expected_version: int | None = None
    ) -> int:
        """Soft-delete a live queue and drop its stored state; returns the new version.

        Raises `UnknownQueueError` when there is no live queue of that name. The owning
        coordinator sees the new version, stops serving the queue and forgets it in its next
        batch (which also removes anything it wrote for the queue in between).
        """
        with translate_errors(f"deleting queue {name!r}"), self._engine.begin() as conn:
            current = _lock_queue(conn, name)
            if current is None or current.deleted_at is not None:
                raise UnknownQueueError(name)
            if expected_version is not None and current.version != expected_version:
                raise QueueVersionConflictError(name, expected_version, current.version)
            self._forget(conn, {name})
            return int(
                conn.execute(
                    sql.SOFT_DELETE_QUEUE, {"queue_name": name, "now": _to_datetime(now)}
                ).scalar_one()
            )

    def request_purge(self, name: str, now: float, filter: str | None = None) -> int:
        """Ask the owning coordinator to empty a live queue, or with ``filter`` (an expression
        the caller has validated) to acknowledge the entries matching it; returns the new
        version.

        A request made while another is pending joins it: the pending one's entries are
        acknowledged too (a purge of everything covers any filter; two filters are OR-ed),
        so no request is lost to the one after it.

        Emptying needs the journal's end offsets and the coordinator's in-memory view, so the
        store only records the request; the coordinator completes it with
        `WriteBatch.forget_queue` + new recovery points + `WriteBatch.purge_done`.
        """
        with translate_errors(f"purging queue {name!r}"), self._engine.begin() as conn:
            current = _lock_queue(conn, name)
            if current is None or current.deleted_at is not None:
                raise UnknownQueueError(name)
            pending = current.purge_requested_at is not None and (
                current.purged_at is None or current.purged_at < current.purge_requested_at)
            if pending:
                filter = joined_filters(current.purge_filter, filter)
            return int(
                conn.execute(
                    sql.REQUEST_PURGE, {"queue_name": name, "now": _to_datetime(now),
                                        "the_filter": filter}
                ).scalar_one()
            )

    def request_reset(self, name: str, target: str, now: float) -> int:
        """Ask the owning coordinator to move a live queue's positions to ``target`` (the
        canonical text of a `layer.domain.positions.ResetTarget`); returns the new version.
        A later request replaces a pending one: positions move to the newest target."""
        with translate_errors(f"resetting queue {name!r}"), self._engine.begin() as conn:
            current = _lock_queue(conn, name)
            if current is None or current.deleted_at is not None:
                raise UnknownQueueError(name)
            return int(conn.execute(sql.REQUEST_RESET, {
                "queue_name": name, "now": _to_datetime(now), "the_target": target,
            }).scalar_one())

    def get_queue(self, name: str, *, include_deleted: bool = False) -> QueueRecord | None:
        statement = sql.SELECT_QUEUES.where(queues.c.name == name)
        if not include_deleted:
            statement = statement.where(queues.c.deleted_at.is_(None))
        with translate_errors(f"reading queue {name!r}"), self._engine.connect() as conn:
            row = conn.execute(statement).one_or_none()
        return None if row is None else _queue_record(row)

    def queues_per_shard(self) -> dict[int, int]:
        """Live queues counted by shard, without reading their definitions (`qlayer
        coordinators` and the warning of `qlayer stats` at a thousand queues)."""
        with translate_errors("counting queues by shard"), self._engine.connect() as conn:
            return {int(shard): int(n) for shard, n in conn.execute(sql.QUEUES_PER_SHARD)}

    def partitioned_queues(self) -> list[tuple[str, int, int]]:
        """``(name, first part's shard, parts)`` of every live queue of several parts."""
        with translate_errors("listing partitioned queues"), self._engine.connect() as conn:
            return [(str(n), int(s), int(k)) for n, s, k in conn.execute(
                sql.PARTITIONED_QUEUES)]

    def list_queues(self, *, include_deleted: bool = False) -> list[QueueRecord]:
        statement = sql.SELECT_QUEUES
        if not include_deleted:
            statement = statement.where(queues.c.deleted_at.is_(None))
        with translate_errors("listing queues"), self._engine.connect() as conn:
            return [_queue_record(row) for row in conn.execute(statement)]


# --- batch writers: one statement per kind, rows sorted by key -----------------------------------
# Sorting gives every transaction the same lock order, so two writers that share rows (a regex
# consumer seen by two coordinators) cannot deadlock.


def _latest_entries(result: Iterable[Sequence[Any]], runs: Iterable[Sequence[Any]]
                    ) -> dict[str, list[EntryRow]]:
    """Entries of rows and runs (`SELECT_ENTRIES_*`, `SELECT_RUNS_*`): per queue, one row per
    entry in bookmark order, the latest write (highest ``seq``) of each."""
    latest: dict[tuple[str, str, int, int], tuple[int, EntryRow]] = {
        (row[0], row[1], row[2], row[3]): (row[12], EntryRow(
            queue=row[0],
            topic=row[1],
            partition=row[2],
            offset=row[3],
            state=row[4],
            delivery_count=row[5],
            cancel_count=row[6],
            lease_consumer=row[7],
            lease_token=row[8],
            lease_deadline=_to_seconds_or_none(row[9]),
            available_at=_to_seconds_or_none(row[10]),
            reason=row[11],
        ))
        for row in result
    }
    for (queue, topic, partition, offsets, state, delivery_count, cancel_count, consumer, tokens,
         deadline, seq, point) in runs:
        token_of = tokens.split(",") if tokens is not None else None
        seconds = _to_seconds_or_none(deadline)
        for i, offset in enumerate(offsets):
            if offset < point:
                continue
            key = (queue, topic, partition, offset)
            known = latest.get(key)
            if known is not None and known[0] > seq:
                continue
            latest[key] = (seq, EntryRow(
                queue=queue, topic=topic, partition=partition, offset=offset, state=state,
                delivery_count=delivery_count, cancel_count=cancel_count,
                lease_consumer=consumer,
                lease_token=token_of[i] if token_of is not None else None,
                lease_deadline=seconds, available_at=None, reason=None))
    out: dict[str, list[EntryRow]] = {}
    for key in sorted(latest):
        out.setdefault(key[0], []).append(latest[key][1])
    return out


def _split_passed_entries(batch: WriteBatch) -> tuple[dict[EntryKey, EntryRow], set[EntryKey]]:
    """Leave out writes of done entries that this batch's recovery points pass.

    Such a row would be written only for the prune below to remove it again, along with every
    earlier row about the entry (e.g. its lease): on the happy path an acked entry costs no row.
    """
    if not batch.recovery_points:
        return batch.entries, batch.entry_deletes
    upserts: dict[EntryKey, EntryRow] = {}
    points = batch.recovery_points
    for key, row in batch.entries.items():
        # A plain tuple finds a PartitionKey (a named tuple) in the dict: equal and same hash.
        passed_at = points.get((row.queue, row.topic, row.partition))  # type: ignore[call-overload]
        if passed_at is None or key.offset >= passed_at or row.state not in DONE_STATES:
            upserts[key] = row
    return upserts, batch.entry_deletes


#: What entries of one run share: (queue, topic, partition, state, delivery count, cancel count,
#: lease holder, lease deadline).
RunKey = tuple[str, str, int, str, int, int, str | None, float | None]


@dataclass(frozen=True, slots=True)
class EntryRun:
    """Entries one write leaves in the same state with the same lease fields, as one row."""

    key: RunKey
    offsets: list[int]
    tokens: list[str] | None

    @property
    def queue(self) -> str:
        return self.key[0]


def runs_of(rows: Iterable[EntryRow], smallest: int = 2
            ) -> tuple[list[EntryRun], list[EntryRow]]:
    """Split a batch's entry rows into runs (LEASED or ACKED entries of one partition sharing
    every field but their offset and token) and the rows that stay rows of their own: other
    states, delayed or expired entries, and groups smaller than ``smallest``.

    A token that holds a comma cannot be joined with others; its entry keeps its own row.
    """
    groups: dict[RunKey, list[EntryRow]] = {}
    singles: list[EntryRow] = []
    for row in rows:
        state = row.state
        if (state == "LEASED" or state == "ACKED") and row.available_at is None \
                and row.reason is None and (row.lease_token is None or "," not in row.lease_token):
            key: RunKey = (row.queue, row.topic, row.partition, state, row.delivery_count,
                           row.cancel_count, row.lease_consumer, row.lease_deadline)
            group = groups.get(key)
            if group is None:
                groups[key] = [row]
            else:
                group.append(row)
        else:
            singles.append(row)
    runs: list[EntryRun] = []
    for run_key, group in groups.items():
        if len(group) < smallest:
            singles.extend(group)
            continue
        group.sort(key=lambda row: row.offset)
        tokens = ([row.lease_token or "" for row in group] if run_key[3] == "LEASED" else None)
        runs.append(EntryRun(run_key, [row.offset for row in group], tokens))
    return runs, singles


def _insert_runs(conn: Executor, runs: list[EntryRun], moment: datetime) -> int:
    if not runs:
        return 0
    runs = sorted(runs, key=lambda run: (run.key[:3], run.offsets[0]))
    conn.execute(
        sql.INSERT_RUNS,
        {
            "queue": [run.key[0] for run in runs],
            "topic": [run.key[1] for run in runs],
            "partition": [run.key[2] for run in runs],
            "first_offset": [run.offsets[0] for run in runs],
            "last_offset": [run.offsets[-1] for run in runs],
            "offsets": ["{" + ",".join(map(str, run.offsets)) + "}" for run in runs],
            "state": [run.key[3] for run in runs],
            "delivery_count": [run.key[4] for run in runs],
            "cancel_count": [run.key[5] for run in runs],
            "lease_consumer": [run.key[6] for run in runs],
            "lease_tokens": [",".join(run.tokens) if run.tokens is not None else None
                             for run in runs],
            "lease_deadline": [_to_datetime_or_none(run.key[7]) for run in runs],
            "updated_at": [moment] * len(runs),
        },
    )
    return 1


def _delete_entries(conn: Executor, keys: Iterable[EntryKey]) -> int:
    ordered = sorted(keys)
    if not ordered:
        return 0
    conn.execute(sql.DELETE_ENTRIES, _columns(ordered, ("queue", "topic", "partition", "offset")))
    return 1


def _upsert_entries(conn: Executor, rows: Iterable[EntryRow], moment: datetime) -> int:
    ordered = sorted(rows, key=lambda row: row.key)
    if not ordered:
        return 0
    conn.execute(
        sql.UPSERT_ENTRIES,
        {
            "queue": [row.queue for row in ordered],
            "topic": [row.topic for row in ordered],
            "partition": [row.partition for row in ordered],
            "offset": [row.offset for row in ordered],
            "state": [row.state for row in ordered],
            "delivery_count": [row.delivery_count for row in ordered],
            "cancel_count": [row.cancel_count for row in ordered],
            "lease_consumer": [row.lease_consumer for row in ordered],
            "lease_token": [row.lease_token for row in ordered],
            "lease_deadline": [_to_datetime_or_none(row.lease_deadline) for row in ordered],
            "available_at": [_to_datetime_or_none(row.available_at) for row in ordered],
            "reason": [row.reason for row in ordered],
            "updated_at": [moment] * len(ordered),
        },
    )
    return 1


def _upsert_recovery_points(
    conn: Executor, points: Mapping[PartitionKey, int], admitted: Mapping[PartitionKey, int],
    moment: datetime,
) -> int:
    """Recovery points, each with its admitted position when the batch has one (the stored
    one is kept otherwise)."""
    if not points:
        return 0
    ordered = sorted(points.items())
    params = _columns([key for key, _ in ordered], ("queue", "topic", "partition"))
    params["offset"] = [offset for _, offset in ordered]
    params["admitted_to"] = [admitted.get(key) for key, _ in ordered]
    params["updated_at"] = [moment] * len(ordered)
    conn.execute(sql.UPSERT_RECOVERY_POINTS, params)
    return 1


def _upsert_input_positions(conn: Executor, shard: str,
                            positions: Mapping[tuple[str, int], int], moment: datetime) -> int:
    if not positions:
        return 0
    ordered = sorted(positions.items())
    conn.execute(sql.UPSERT_INPUT_POSITIONS, {
        "shard": [shard] * len(ordered),
        "topic": [topic for (topic, _), _ in ordered],
        "partition": [partition for (_, partition), _ in ordered],
        "next_offset": [offset for _, offset in ordered],
        "updated_at": [moment] * len(ordered),
    })
    return 1


def _prune_below(conn: Executor, points: Mapping[PartitionKey, int]) -> Result | None:
    """The prunes; the second one's result says how many entry rows went (read it once the
    statements have run)."""
    if not points:
        return None
    ordered = sorted(points.items())
    params = _columns([key for key, _ in ordered], ("queue", "topic", "partition"))
    params["offset"] = [offset for _, offset in ordered]
    conn.execute(sql.PRUNE_RUNS_BELOW_RECOVERY_POINTS, params)
    return conn.execute(sql.PRUNE_BELOW_RECOVERY_POINTS, params)


def _consumer_row(row: Any) -> ConsumerRow:
    """A `consumers` or `consumer_spans` row (the parts have no client info and are never
    asked to be evicted: the home row is)."""
    mapping = row._mapping
    evict = mapping.get("evict_requested_at")
    return ConsumerRow(
        consumer_id=row.consumer_id,
        session_id=row.session_id,
        queue=row.queue,
        is_regex=row.is_regex,
        delivery_topic=row.delivery_topic,
        session_timeout_ms=row.session_timeout_ms,
        subscribed_at=_to_seconds(row.subscribed_at),
        last_heartbeat_at=_to_seconds(row.last_heartbeat_at),
        max_backlog=row.max_backlog,
        filter=row.filter,
        client_info=mapping.get("client_info"),
        evict_requested_at=_to_seconds_or_none(evict),
        delivery_format=row.delivery_format,
        secret_hash=row.secret_sha256,
        shard=row.shard,
        principal=row.principal,
        credential_hash=row.credential_sha256,
        credit_home=row.credit_home,
        transactional_id=mapping.get("transactional_id"),
    )


def _write_spans(conn: Executor, batch: WriteBatch) -> tuple[int, Result | None]:
    """Send the batch's statements on session parts (`consumer_spans`, protocol 8); returns
    how many, and the upsert's result (the ids of the parts it wrote)."""
    statements = 0
    written: Result | None = None
    if batch.span_deletes:
        ended = sorted(batch.span_deletes.items())
        conn.execute(sql.DELETE_SPAN_SESSIONS, {"consumer": [c for c, _ in ended],
                                                "part": [p for _, (p, _s) in ended],
                                                "session": [s for _, (_p, s) in ended]})
        statements += 1
    if batch.spans:
        ordered = [batch.spans[consumer_id] for consumer_id in sorted(batch.spans)]
        written = conn.execute(sql.UPSERT_CONSUMER_SPANS, {
            "consumer_id": [row.consumer_id for row in ordered],
            "shard": [row.shard for row in ordered],
            "session_id": [row.session_id for row in ordered],
            "credit_home": [row.credit_home for row in ordered],
            "queue": [row.queue for row in ordered],
            "is_regex": [row.is_regex for row in ordered],
            "max_backlog": [row.max_backlog for row in ordered],
            "filter": [row.filter for row in ordered],
            "delivery_topic": [row.delivery_topic for row in ordered],
            "session_timeout_ms": [row.session_timeout_ms for row in ordered],
            "subscribed_at": [_to_datetime(row.subscribed_at) for row in ordered],
            "last_heartbeat_at": [_to_datetime(row.last_heartbeat_at) for row in ordered],
            "delivery_format": [row.delivery_format for row in ordered],
            "secret_sha256": [row.secret_hash for row in ordered],
            "principal": [row.principal for row in ordered],
            "credential_sha256": [row.credential_hash for row in ordered],
            "transactional_id": [row.transactional_id for row in ordered],
        })
        statements += 1
    if batch.span_heartbeats:
        beats = sorted(batch.span_heartbeats.items())
        conn.execute(sql.HEARTBEAT_SPANS, {
            "consumer": [consumer_id for consumer_id, _ in beats],
            "part": [part for _, (part, _at) in beats],
            "at": [_to_datetime(at) for _, (_part, at) in beats],
        })
        statements += 1
    return statements, written


def _write_consumers(conn: Executor, batch: WriteBatch) -> tuple[int, Result | None]:
    """Send the batch's consumer statements; returns how many, and the upsert's result (the
    ids of the rows it wrote)."""
    statements = 0
    written: Result | None = None
    if batch.consumer_deletes:
        conn.execute(sql.DELETE_CONSUMERS, {"consumer_ids": sorted(batch.consumer_deletes)})
        statements += 1
    if batch.session_deletes:
        ended = sorted(batch.session_deletes.items())
        conn.execute(sql.DELETE_CONSUMER_SESSIONS, {"consumer": [c for c, _ in ended],
                                                    "session": [s for _, s in ended]})
        statements += 1
    if batch.consumers:
        ordered = [batch.consumers[consumer_id] for consumer_id in sorted(batch.consumers)]
        written = conn.execute(
            sql.UPSERT_CONSUMERS,
            {
                "consumer_id": [row.consumer_id for row in ordered],
                "session_id": [row.session_id for row in ordered],
                "queue": [row.queue for row in ordered],
                "is_regex": [row.is_regex for row in ordered],
                "max_backlog": [row.max_backlog for row in ordered],
                "filter": [row.filter for row in ordered],
                "delivery_topic": [row.delivery_topic for row in ordered],
                "session_timeout_ms": [row.session_timeout_ms for row in ordered],
                "subscribed_at": [_to_datetime(row.subscribed_at) for row in ordered],
                "last_heartbeat_at": [_to_datetime(row.last_heartbeat_at) for row in ordered],
                "client_info": [
                    None if row.client_info is None else dict(row.client_info) for row in ordered
                ],
                "delivery_format": [row.delivery_format for row in ordered],
                "secret_sha256": [row.secret_hash for row in ordered],
                "shard": [row.shard for row in ordered],
                "principal": [row.principal for row in ordered],
                "credential_sha256": [row.credential_hash for row in ordered],
                "credit_home": [row.credit_home for row in ordered],
                "transactional_id": [row.transactional_id for row in ordered],
            },
        )
        statements += 1
    if batch.heartbeats:
        beats = sorted(batch.heartbeats.items())
        conn.execute(
            sql.HEARTBEAT_CONSUMERS,
            {
                "consumer": [consumer_id for consumer_id, _ in beats],
                "at": [_to_datetime(at) for _, at in beats],
            },
        )
        statements += 1
    return statements, written


def _increment_counters(
    conn: Executor, counters: Mapping[str, Mapping[str, int]], moment: datetime
) -> int:
    touched = sorted(queue for queue, counts in counters.items() if any(counts.values()))
    if not touched:
        return 0
    params: dict[str, list[Any]] = {"queue": touched}
    for name in COUNTER_NAMES:
        params[name] = [counters[queue].get(name, 0) for queue in touched]
    params["updated_at"] = [moment] * len(touched)
    conn.execute(sql.INCREMENT_COUNTERS, params)
    return 1


def _mark_purged(conn: Executor, purges: Mapping[str, float],
                 acked: Mapping[str, int]) -> int:
    if not purges:
        return 0
    ordered = sorted(purges.items())
    conn.execute(
        sql.MARK_PURGED,
        {
            "queue": [name for name, _ in ordered],
            "requested_at": [_to_datetime(at) for _, at in ordered],
            "acked": [acked.get(name, 0) for name, _ in ordered],
        },
    )
    return 1


def _mark_reset(conn: Executor, resets: Mapping[str, float]) -> int:
    if not resets:
        return 0
    ordered = sorted(resets.items())
    conn.execute(sql.MARK_RESET, {"queue": [name for name, _ in ordered],
                                  "requested_at": [_to_datetime(at) for _, at in ordered]})
    return 1


def _forget_partitions(conn: Executor, partitions: Iterable[PartitionKey]) -> int:
    ordered = sorted(partitions)
    if not ordered:
        return 0
    params = _columns(ordered, ("queue", "topic", "partition"))
    conn.execute(sql.FORGET_PARTITION_ENTRIES, params)
    conn.execute(sql.FORGET_PARTITION_RUNS, params)
    return 2


def joined_filters(pending: str | None, new: str | None) -> str | None:
    """The filter of two purge requests taken as one: None (everything) wins."""
    if pending is None or new is None:
        return None
    if pending == new:
        return new
    return f"({pending}) OR ({new})"


def _lock_queue(conn: Connection, name: str) -> Row[Any] | None:
    """The queue's row, locked until commit so concurrent CLI writes serialise."""
    return conn.execute(sql.SELECT_QUEUE_FOR_UPDATE, {"queue_name": name}).one_or_none()


def _placement_fields(definition: Mapping[str, Any]) -> tuple[Any, Any]:
    return definition.get("shard"), definition.get("shard_group")


def _placement(name: str, definition: Mapping[str, Any], count: int) -> int:
    explicit, group = _placement_fields(definition)
    parts = parts_in(definition)
    if parts > count:
        raise QueueConfigError([("parts", (
            f"{parts} parts need {parts} shards and this installation has {count}: each part "
            "is served by a shard of its own (`qlayer db upgrade --shards N` sets the count "
            "of a new database)"))])
    try:
        return shard_for(name, shard=explicit, shard_group=group, shard_count=count)
    except ValueError as exc:
        raise QueueConfigError([("shard", str(exc))]) from None


def _refuse_moving_parts(definition: Mapping[str, Any]) -> None:
    """A queue of several parts is not moved (yet): its consumers' sessions span the parts'
    shards, and a move would end them under their leases (docs/coordinator.md,
    "Partitioned queues")."""
    parts = parts_in(definition)
    if parts > 1:
        raise QueueConfigError([("shard", (
            f"a queue of {parts} parts cannot be moved yet: its consumers' sessions span the "
            "parts' shards and would end under their leases. Create a queue with the "
            "placement you want over the same journal, move the consumers to it, then "
            "delete this one (docs/coordinator.md, 'Partitioned queues')"))])




def _fence(conn: Connection, shard: int) -> None:
    """Bump the shard's epoch: whoever runs it must take it again before writing."""
    conn.execute(sql.FENCE_SHARD, {"the_shard": shard_key(shard)})


@contextmanager
def _fenced_as(shard: str, owner_id: str, epoch: int) -> Iterator[None]:
    """The guard's refusal (`statements.HOLD_SHARD`) as `FencedError`; a database without the
    guard's function (older than revision 0012) as one clear line."""
    try:
        yield
    except sa_exc.DBAPIError as error:
        sqlstate = getattr(error.orig, "sqlstate", None)
        if sqlstate == sql.FENCED_SQLSTATE:
            raise FencedError(shard, owner_id, epoch) from error
        if sqlstate == _UNDEFINED_FUNCTION and "qlayer_hold_shard" in str(error.orig):
            raise StoreError("the database's qlayer schema is older than this coordinator "
                             "(no function qlayer_hold_shard): run `qlayer db upgrade`",
                             retryable=False) from error
        raise


# SQLSTATE undefined_function.
_UNDEFINED_FUNCTION = "42883"


def _holder_params(shard: str, owner_id: str, epoch: int, now: datetime) -> dict[str, Any]:
    return {"the_shard": shard, "the_owner_id": owner_id, "the_epoch": epoch, "now": now}


def _columns(keys: list[Any], names: tuple[str, ...]) -> dict[str, list[Any]]:
    """Transpose named tuples into one list per column, the shape ``unnest`` reads."""
    return {name: [getattr(key, name) for key in keys] for name in names}


# --- row mapping ---------------------------------------------------------------------------------


def _ownership(row: Row[Any]) -> Ownership:
    return Ownership(
        shard=row.shard,
        owner_id=row.owner_id,
        epoch=int(row.epoch),
        acquired_at=_to_seconds(row.acquired_at),
        heartbeat_at=_to_seconds(row.heartbeat_at),
        lag=None if row.lag is None else int(row.lag),
        reported_at=_to_seconds_or_none(row.reported_at),
        counters={str(k): int(v) for k, v in (row.counters or {}).items()},
    )


def _queue_record(row: Row[Any]) -> QueueRecord:
    return QueueRecord(
        name=row.name,
        definition=row.definition,
        version=int(row.version),
        created_at=_to_seconds(row.created_at),
        updated_at=_to_seconds(row.updated_at),
        deleted_at=_to_seconds_or_none(row.deleted_at),
        purge_requested_at=_to_seconds_or_none(row.purge_requested_at),
        purged_at=_to_seconds_or_none(row.purged_at),
        shard=int(row.shard),
        purge_filter=row.purge_filter,
        purge_acked=None if row.purge_acked is None else int(row.purge_acked),
        reset_to=row.reset_to,
        reset_requested_at=_to_seconds_or_none(row.reset_requested_at),
        reset_done_at=_to_seconds_or_none(row.reset_done_at),
        positions_from=row.positions_from,
    )


@contextmanager
def recording_statements(engine: Engine) -> Iterator[list[str]]:
    """Record every SQL statement the engine sends inside the block (tests, benchmarks).

    An ``executemany`` counts once per parameter set, because the driver sends one statement
    per set; the list therefore measures statements the server runs, honestly.
    """
    sent: list[str] = []

    def _record(
        conn: Connection,
        cursor: Any,
        statement: str,
        parameters: Any,
        context: Any,
        executemany: bool,
    ) -> None:
        repeat = len(parameters) if executemany else 1
        sent.extend([statement] * repeat)

    event.listen(engine, "before_cursor_execute", _record)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", _record)
