"""Every SQL statement qlayer runs, named, in one place.

Batched writes take whole columns as arrays and read them back with ``unnest(...)``: one
statement per kind of write whatever the batch size, with a fixed SQL text (compiled once by
SQLAlchemy, prepared once per connection by psycopg) and no limit on the number of bind
parameters. (psycopg's ``executemany`` without RETURNING would send one statement per row.)

Statements that take over or prove ownership are guarded compare-and-set updates: they only
touch the row when (owner_id, epoch) or the expiry says they may, and RETURNING tells the caller
whether they did.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Integer,
    LargeBinary,
    Text,
    any_,
    bindparam,
    case,
    cast,
    delete,
    func,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy import text as text_clause
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeDecorator, TypeEngine

from layer.store.tables import (
    COUNTER_NAMES,
    console_samples,
    consumer_spans,
    consumers,
    coordinator_processes,
    entries,
    entry_runs,
    event_outbox,
    grants,
    input_positions,
    installation,
    ownership,
    principals,
    queue_counters,
    queues,
    recovery_points,
)

_TIMESTAMP = DateTime(timezone=True)
_JSON = JSONB(none_as_null=True)


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _int_literal(values: list[Any]) -> str:
    if None in values:
        return "{" + ",".join("NULL" if v is None else str(int(v)) for v in values) + "}"
    return "{" + ",".join(map(str, map(int, values))) + "}"


def _text_literal(values: list[Any]) -> str:
    return "{" + ",".join("NULL" if v is None else _quoted(v) for v in values) + "}"


def _timestamp_literal(values: list[Any]) -> str:
    return "{" + ",".join("NULL" if v is None else '"' + v.isoformat() + '"'
                          for v in values) + "}"


class ArrayLiteral(TypeDecorator[list[Any]]):
    """A whole column sent as one PostgreSQL array literal (``{1,2,NULL}``) that the statement
    casts to a typed array.

    psycopg dumps a Python list element by element in Python, which was a third of the
    coordinator's commit time; the literal is built by ``str.join`` in C and parsed by the
    server. Only for scalar element types whose text form is unambiguous (integers, text,
    timestamps); booleans and JSON keep psycopg's own array dumping.
    """

    impl = Text
    cache_ok = True

    def __init__(self, element: str) -> None:
        super().__init__()
        self.element = element
        self._format = {"int": _int_literal, "text": _text_literal,
                        "timestamp": _timestamp_literal}[element]

    def process_bind_param(self, value: list[Any] | None, dialect: Dialect) -> str | None:
        return None if value is None else self._format(value)


def _literal_kind(type_: TypeEngine[Any]) -> str | None:
    if isinstance(type_, Boolean | JSONB):
        return None
    if isinstance(type_, Integer):  # BigInteger is an Integer
        return "int"
    if isinstance(type_, Text):
        return "text"
    if isinstance(type_, DateTime):
        return "timestamp"
    return None


def _column_param(name: str, type_: TypeEngine[Any]) -> ColumnElement[Any]:
    """A bind parameter holding one whole column of a batch, as a typed PostgreSQL array."""
    kind = _literal_kind(type_)
    if kind is None:
        return bindparam(name, type_=ARRAY(type_))
    return cast(bindparam(name, type_=ArrayLiteral(kind)), ARRAY(type_))


def _unnest(alias: str, columns: dict[str, TypeEngine[Any]]) -> TableValuedAlias:
    """``unnest(:a::T[], :b::U[], ...) AS alias(a, b, ...)``: a batch as a relation."""
    params = [_column_param(name, type_) for name, type_ in columns.items()]
    return func.unnest(*params).table_valued(*columns).render_derived(name=alias)


def _names_param(name: str) -> ColumnElement[Any]:
    return _column_param(name, Text())


# --- ownership ---------------------------------------------------------------------------------

# Take a shard: Kafka's group protocol assigned it to this process, so no condition; the epoch
# counts up on every take (a first take starts at 1), which fences the previous holder's
# writes, a process that lost the shard without noticing included.
_take_insert = pg_insert(ownership).values(
    shard=bindparam("the_shard"),
    owner_id=bindparam("the_owner_id"),
    epoch=1,
    acquired_at=bindparam("now"),
    heartbeat_at=bindparam("now"),
)
TAKE_SHARD: Final = _take_insert.on_conflict_do_update(
    index_elements=[ownership.c.shard],
    set_={
        "owner_id": _take_insert.excluded.owner_id,
        "epoch": ownership.c.epoch + 1,
        "acquired_at": _take_insert.excluded.acquired_at,
        "heartbeat_at": _take_insert.excluded.heartbeat_at,
        "lag": None,
        "reported_at": None,
    },
).returning(ownership.c.epoch)

# Bind names differ from column names: SQLAlchemy reserves those in UPDATE statements.
_holder = (
    (ownership.c.shard == bindparam("the_shard"))
    & (ownership.c.owner_id == bindparam("the_owner_id"))
    & (ownership.c.epoch == bindparam("the_epoch"))
)

# The row stays (owner_id NULL) so the next owner's epoch is still greater than every past one.
RELEASE: Final = (
    update(ownership)
    .where(_holder)
    .values(owner_id=None, heartbeat_at=bindparam("now"), lag=None, reported_at=None)
    .returning(ownership.c.epoch)
)

# A queue moved off a shard: its owner's next guarded write fails, so it rebuilds without the
# queue and cannot write for it after the new shard's owner starts to.
FENCE_SHARD: Final = (
    update(ownership)
    .where(ownership.c.shard == bindparam("the_shard"))
    .values(epoch=ownership.c.epoch + 1)
    .returning(ownership.c.epoch, ownership.c.owner_id)
)

REPORT_SHARD: Final = (
    update(ownership)
    .where(_holder)
    .values(heartbeat_at=bindparam("now"), reported_at=bindparam("now"),
            lag=bindparam("the_lag"))
    .returning(ownership.c.epoch)
)
# The same for many shards at once (executemany: no RETURNING).
REPORT_SHARDS: Final = (
    update(ownership)
    .where(_holder)
    .values(heartbeat_at=bindparam("now"), reported_at=bindparam("now"),
            lag=bindparam("the_lag"))
)

# A shard's fault and refusal counters grow in the iteration's own transaction, with the input
# positions of the records that made them (`layer.coordinator.faults`): exact across restarts.
# The guard (HOLD_SHARD) holds the row's lock already.
_shard_incs = _unnest("incs", {"counter": Text(), "increment": BigInteger()})
INCREMENT_SHARD_COUNTERS: Final = (
    update(ownership)
    .where(ownership.c.shard == bindparam("the_shard"))
    .values(counters=ownership.c.counters.op("||", return_type=JSONB)(
        select(func.jsonb_object_agg(
            _shard_incs.c.counter,
            func.coalesce(cast(ownership.c.counters[_shard_incs.c.counter].astext, BigInteger),
                          0) + _shard_incs.c.increment))
        .scalar_subquery()))
)

# First statement of every guarded transaction: `qlayer_hold_shard` (revision 0012) is the
# UPDATE of the shard's ownership row under the caller's owner id and epoch, which row-locks it
# until commit, so a takeover (whose upsert must lock the same row) waits for this transaction
# and cannot interleave with it. A takeover that committed first bumped the epoch: the function
# then raises SQLSTATE QLF01 (`FENCED_SQLSTATE`), and PostgreSQL skips every later statement of
# the pipeline, so the transaction writes nothing although it was sent whole.
HOLD_SHARD: Final = select(func.qlayer_hold_shard(
    bindparam("the_shard", type_=Text), bindparam("the_owner_id", type_=Text),
    bindparam("the_epoch", type_=BigInteger), bindparam("now", type_=_TIMESTAMP)))
FENCED_SQLSTATE: Final = "QLF01"

SELECT_OWNER: Final = select(ownership).where(
    ownership.c.shard == bindparam("the_shard"), ownership.c.owner_id.is_not(None)
)
SELECT_SHARD_COUNTERS: Final = select(ownership.c.counters).where(
    ownership.c.shard == bindparam("the_shard"))
SELECT_ALL_SHARD_COUNTERS: Final = select(ownership.c.shard, ownership.c.counters).order_by(
    ownership.c.shard)
SELECT_OWNERS: Final = (
    select(ownership).where(ownership.c.owner_id.is_not(None)).order_by(ownership.c.shard)
)

# --- batched writes (WriteBatch) ---------------------------------------------------------------

FORGET_ENTRIES: Final = delete(entries).where(entries.c.queue == any_(_names_param("queues")))
FORGET_RUNS: Final = delete(entry_runs).where(entry_runs.c.queue == any_(_names_param("queues")))
FORGET_RECOVERY_POINTS: Final = delete(recovery_points).where(
    recovery_points.c.queue == any_(_names_param("queues"))
)
FORGET_COUNTERS: Final = delete(queue_counters).where(
    queue_counters.c.queue == any_(_names_param("queues"))
)

_PARTITION_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "queue": Text(),
    "topic": Text(),
    "partition": Integer(),
}
_forgotten = _unnest("forgotten", _PARTITION_COLUMNS)
FORGET_PARTITION_ENTRIES: Final = delete(entries).where(
    entries.c.queue == _forgotten.c.queue,
    entries.c.topic == _forgotten.c.topic,
    entries.c.partition == _forgotten.c.partition,
)
_forgotten_runs = _unnest("forgotten", _PARTITION_COLUMNS)
FORGET_PARTITION_RUNS: Final = delete(entry_runs).where(
    entry_runs.c.queue == _forgotten_runs.c.queue,
    entry_runs.c.topic == _forgotten_runs.c.topic,
    entry_runs.c.partition == _forgotten_runs.c.partition,
)

_ENTRY_KEY_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "queue": Text(),
    "topic": Text(),
    "partition": Integer(),
    "offset": BigInteger(),
}
_gone = _unnest("gone", _ENTRY_KEY_COLUMNS)
DELETE_ENTRIES: Final = delete(entries).where(
    entries.c.queue == _gone.c.queue,
    entries.c.topic == _gone.c.topic,
    entries.c.partition == _gone.c.partition,
    entries.c.offset == _gone.c.offset,
)

ENTRY_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    **_ENTRY_KEY_COLUMNS,
    "state": Text(),
    "delivery_count": Integer(),
    "cancel_count": Integer(),
    "lease_consumer": Text(),
    "lease_token": Text(),
    "lease_deadline": _TIMESTAMP,
    "available_at": _TIMESTAMP,
    "reason": Text(),
    "updated_at": _TIMESTAMP,
}
_entry_rows = _unnest("batch", ENTRY_COLUMNS)
_entries_insert = pg_insert(entries).from_select(
    list(ENTRY_COLUMNS), select(*(_entry_rows.c[name] for name in ENTRY_COLUMNS))
)
UPSERT_ENTRIES: Final = _entries_insert.on_conflict_do_update(
    index_elements=[entries.c.queue, entries.c.topic, entries.c.partition, entries.c.offset],
    set_={
        name: _entries_insert.excluded[name]
        for name in ENTRY_COLUMNS
        if name not in _ENTRY_KEY_COLUMNS
    } | {"seq": func.nextval("entry_writes")},
)

# Runs: `offsets` comes as one array literal per run (``{4,5,9}``), a text column of the batch
# (unnest would flatten an array of arrays), cast back to bigint[] here.
RUN_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "queue": Text(),
    "topic": Text(),
    "partition": Integer(),
    "first_offset": BigInteger(),
    "last_offset": BigInteger(),
    "offsets": Text(),
    "state": Text(),
    "delivery_count": Integer(),
    "cancel_count": Integer(),
    "lease_consumer": Text(),
    "lease_tokens": Text(),
    "lease_deadline": _TIMESTAMP,
    "updated_at": _TIMESTAMP,
}
_run_rows = _unnest("batch", RUN_COLUMNS)
INSERT_RUNS: Final = pg_insert(entry_runs).from_select(
    list(RUN_COLUMNS),
    select(*(cast(_run_rows.c[name], ARRAY(BigInteger())) if name == "offsets"
             else _run_rows.c[name] for name in RUN_COLUMNS)),
)

RECOVERY_POINT_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "queue": Text(),
    "topic": Text(),
    "partition": Integer(),
    "offset": BigInteger(),
    "admitted_to": BigInteger(),
    "updated_at": _TIMESTAMP,
}
_rp_rows = _unnest("batch", RECOVERY_POINT_COLUMNS)
_rp_insert = pg_insert(recovery_points).from_select(
    list(RECOVERY_POINT_COLUMNS), select(*(_rp_rows.c[name] for name in RECOVERY_POINT_COLUMNS))
)
UPSERT_RECOVERY_POINTS: Final = _rp_insert.on_conflict_do_update(
    index_elements=[recovery_points.c.queue, recovery_points.c.topic, recovery_points.c.partition],
    set_={
        "offset": _rp_insert.excluded.offset,
        # A batch that moves only the recovery point keeps the admitted position it had.
        "admitted_to": func.coalesce(_rp_insert.excluded.admitted_to,
                                     recovery_points.c.admitted_to),
        "updated_at": _rp_insert.excluded.updated_at,
    },
)

# Everything below a recovery point is done (the engine moves it past done entries only) and
# never consulted again (restart reads the journal from the recovery point), so every row about
# an entry there goes, whatever state it names: with runs, an entry's latest write may be a run
# while an older row about it (a lease, a release) is superseded but still LEASED or AVAILABLE.
# A run goes once the point passes its last offset.
_passed = _unnest("passed", _ENTRY_KEY_COLUMNS)
PRUNE_BELOW_RECOVERY_POINTS: Final = delete(entries).where(
    entries.c.queue == _passed.c.queue,
    entries.c.topic == _passed.c.topic,
    entries.c.partition == _passed.c.partition,
    entries.c.offset < _passed.c.offset,
)
_passed_runs = _unnest("passed", _ENTRY_KEY_COLUMNS)
PRUNE_RUNS_BELOW_RECOVERY_POINTS: Final = delete(entry_runs).where(
    entry_runs.c.queue == _passed_runs.c.queue,
    entry_runs.c.topic == _passed_runs.c.topic,
    entry_runs.c.partition == _passed_runs.c.partition,
    entry_runs.c.last_offset < _passed_runs.c.offset,
)

DELETE_CONSUMERS: Final = delete(consumers).where(
    consumers.c.consumer_id == any_(_names_param("consumer_ids"))
)
_ended = _unnest("ended", {"consumer": Text(), "session": Text()})
DELETE_CONSUMER_SESSIONS: Final = delete(consumers).where(
    consumers.c.consumer_id == _ended.c.consumer, consumers.c.session_id == _ended.c.session
)

CONSUMER_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "consumer_id": Text(),
    "session_id": Text(),
    "queue": Text(),
    "is_regex": Boolean(),
    "max_backlog": Integer(),
    "filter": Text(),
    "delivery_topic": Text(),
    "session_timeout_ms": Integer(),
    "subscribed_at": _TIMESTAMP,
    "last_heartbeat_at": _TIMESTAMP,
    "client_info": _JSON,
    "delivery_format": Text(),
    "secret_sha256": LargeBinary(),
    "shard": Integer(),
    "principal": Text(),
    "credential_sha256": LargeBinary(),
    "credit_home": Integer(),
    "transactional_id": Text(),
}
_consumer_rows = _unnest("batch", CONSUMER_COLUMNS)
_consumers_insert = pg_insert(consumers).from_select(
    list(CONSUMER_COLUMNS), select(*(_consumer_rows.c[name] for name in CONSUMER_COLUMNS))
)
# One registry across shards (0013): a shard writes a consumer's row only when the row is its
# own, was written before 0013 (no shard), or holds a session that has ended (no heartbeat
# within its session timeout, by the writer's clock: the row's new last_heartbeat_at is the
# writer's now). A Subscribe another shard accepted for a live consumer id changes nothing
# stored; the rows written are returned, and a shard whose row was not written ends the session
# it accepted (`ShardCore.lost_claims`).
UPSERT_CONSUMERS: Final = _consumers_insert.on_conflict_do_update(
    index_elements=[consumers.c.consumer_id],
    set_={
        name: _consumers_insert.excluded[name]
        for name in CONSUMER_COLUMNS
        if name != "consumer_id"
    },
    where=or_(
        consumers.c.shard.is_(None),
        consumers.c.shard == _consumers_insert.excluded.shard,
        consumers.c.last_heartbeat_at
        + consumers.c.session_timeout_ms * literal_column("interval '1 millisecond'")
        < _consumers_insert.excluded.last_heartbeat_at,
    ),
).returning(consumers.c.consumer_id)

# A session's parts on shards other than its home (0015, protocol 8): each shard writes its own
# part, and only while the home row holds the same session, so a part of a session that ended
# (or was taken over) is never made again. The rows written are returned; a part not written
# ends (`ShardCore.lost_claims`).
SPAN_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "consumer_id": Text(),
    "shard": Integer(),
    "session_id": Text(),
    "credit_home": Integer(),
    "queue": Text(),
    "is_regex": Boolean(),
    "max_backlog": Integer(),
    "filter": Text(),
    "delivery_topic": Text(),
    "session_timeout_ms": Integer(),
    "subscribed_at": _TIMESTAMP,
    "last_heartbeat_at": _TIMESTAMP,
    "delivery_format": Text(),
    "secret_sha256": LargeBinary(),
    "principal": Text(),
    "credential_sha256": LargeBinary(),
    "transactional_id": Text(),
}
_span_rows = _unnest("spans", SPAN_COLUMNS)
_spans_insert = pg_insert(consumer_spans).from_select(
    list(SPAN_COLUMNS),
    select(*(_span_rows.c[name] for name in SPAN_COLUMNS)).where(
        select(consumers.c.consumer_id).where(
            consumers.c.consumer_id == _span_rows.c.consumer_id,
            consumers.c.session_id == _span_rows.c.session_id,
        ).exists()
    ),
)
UPSERT_CONSUMER_SPANS: Final = _spans_insert.on_conflict_do_update(
    index_elements=[consumer_spans.c.consumer_id, consumer_spans.c.shard],
    set_={name: _spans_insert.excluded[name] for name in SPAN_COLUMNS
          if name not in ("consumer_id", "shard")},
).returning(consumer_spans.c.consumer_id)
_ended_spans = _unnest("ended", {"consumer": Text(), "part": Integer(), "session": Text()})
DELETE_SPAN_SESSIONS: Final = delete(consumer_spans).where(
    consumer_spans.c.consumer_id == _ended_spans.c.consumer,
    consumer_spans.c.shard == _ended_spans.c.part,
    consumer_spans.c.session_id == _ended_spans.c.session,
)
_span_beats = _unnest("beats", {"consumer": Text(), "part": Integer(), "at": _TIMESTAMP})
HEARTBEAT_SPANS: Final = (
    update(consumer_spans)
    .where(consumer_spans.c.consumer_id == _span_beats.c.consumer,
           consumer_spans.c.shard == _span_beats.c.part)
    .values(last_heartbeat_at=func.greatest(consumer_spans.c.last_heartbeat_at,
                                            _span_beats.c.at))
)
SELECT_SPANS: Final = select(consumer_spans).order_by(consumer_spans.c.consumer_id,
                                                      consumer_spans.c.shard)

# Heartbeats are the most frequent consumer write and change one column: UPDATE ... FROM a batch.
# GREATEST keeps the time monotonic when a late heartbeat arrives after a newer subscribe.
# (Batch column names differ from the table's: SQLAlchemy reserves those in UPDATE statements.)
_beats = _unnest("beats", {"consumer": Text(), "at": _TIMESTAMP})
HEARTBEAT_CONSUMERS: Final = (
    update(consumers)
    .where(consumers.c.consumer_id == _beats.c.consumer)
    .values(last_heartbeat_at=func.greatest(consumers.c.last_heartbeat_at, _beats.c.at))
)

COUNTER_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "queue": Text(),
    **{name: BigInteger() for name in COUNTER_NAMES},
    "updated_at": _TIMESTAMP,
}
_counter_rows = _unnest("batch", COUNTER_COLUMNS)
_counters_insert = pg_insert(queue_counters).from_select(
    list(COUNTER_COLUMNS), select(*(_counter_rows.c[name] for name in COUNTER_COLUMNS))
)
INCREMENT_COUNTERS: Final = _counters_insert.on_conflict_do_update(
    index_elements=[queue_counters.c.queue],
    set_={
        **{
            name: queue_counters.c[name] + _counters_insert.excluded[name]
            for name in COUNTER_NAMES
        },
        "updated_at": _counters_insert.excluded.updated_at,
    },
)

_purges = _unnest("purges", {"queue": Text(), "requested_at": _TIMESTAMP,
                               "acked": BigInteger()})
MARK_PURGED: Final = (
    update(queues)
    .where(queues.c.name == _purges.c.queue)
    .values(
        purged_at=func.greatest(queues.c.purged_at, _purges.c.requested_at),
        # A request carried out twice (a refresh before the catalog showed it done) acked what
        # had arrived since the first time too: both counts are the request's. A completion
        # of an older request than the one recorded leaves the count alone.
        purge_acked=case(
            (queues.c.purged_at == _purges.c.requested_at,
             func.coalesce(queues.c.purge_acked, 0) + _purges.c.acked),
            ((queues.c.purged_at.is_(None)) | (queues.c.purged_at < _purges.c.requested_at),
             _purges.c.acked),
            else_=queues.c.purge_acked,
        ),
    )
)

_resets = _unnest("resets", {"queue": Text(), "requested_at": _TIMESTAMP})
MARK_RESET: Final = (
    update(queues)
    .where(queues.c.name == _resets.c.queue)
    .values(reset_done_at=func.greatest(queues.c.reset_done_at, _resets.c.requested_at))
)

# --- the events outbox -------------------------------------------------------------------------

INSERT_OUTBOX: Final = (
    pg_insert(event_outbox)
    .values(shard=bindparam("the_shard"), events=bindparam("events"),
            created_at=bindparam("now"))
    .returning(event_outbox.c.batch_id)
)
DELETE_PUBLISHED: Final = delete(event_outbox).where(
    event_outbox.c.shard == bindparam("the_shard"),
    event_outbox.c.batch_id <= bindparam("published"),
)
SELECT_OUTBOX: Final = (
    select(event_outbox.c.batch_id, event_outbox.c.events)
    .where(event_outbox.c.shard == bindparam("the_shard"))
    .order_by(event_outbox.c.batch_id)
)

# --- restart recovery --------------------------------------------------------------------------

_rp_of_entry = recovery_points.c
_ENTRIES_TO_RECOVER: Final = (
    select(
        entries.c.queue,
        entries.c.topic,
        entries.c.partition,
        entries.c.offset,
        entries.c.state,
        entries.c.delivery_count,
        entries.c.cancel_count,
        entries.c.lease_consumer,
        entries.c.lease_token,
        entries.c.lease_deadline,
        entries.c.available_at,
        entries.c.reason,
        entries.c.seq,
    )
    .select_from(
        entries.outerjoin(
            recovery_points,
            (_rp_of_entry.queue == entries.c.queue)
            & (_rp_of_entry.topic == entries.c.topic)
            & (_rp_of_entry.partition == entries.c.partition),
        )
    )
    .where(or_(_rp_of_entry.offset.is_(None), entries.c.offset >= _rp_of_entry.offset))
    .order_by(entries.c.queue, entries.c.topic, entries.c.partition, entries.c.offset)
)
SELECT_ENTRIES_TO_RECOVER: Final = _ENTRIES_TO_RECOVER.where(entries.c.queue == bindparam("queue"))
#: The same for several queues in one round trip (`qlayer stats`, the console's queue list).
SELECT_ENTRIES_OF_QUEUES: Final = _ENTRIES_TO_RECOVER.where(
    entries.c.queue.in_(bindparam("queues", expanding=True)))

# The runs a restart needs: those with an offset at or above their recovery point, with the
# point (the offsets below it are done and left out).
_RUNS_TO_RECOVER: Final = (
    select(
        entry_runs.c.queue,
        entry_runs.c.topic,
        entry_runs.c.partition,
        entry_runs.c.offsets,
        entry_runs.c.state,
        entry_runs.c.delivery_count,
        entry_runs.c.cancel_count,
        entry_runs.c.lease_consumer,
        entry_runs.c.lease_tokens,
        entry_runs.c.lease_deadline,
        entry_runs.c.seq,
        func.coalesce(_rp_of_entry.offset, 0),
    )
    .select_from(
        entry_runs.outerjoin(
            recovery_points,
            (_rp_of_entry.queue == entry_runs.c.queue)
            & (_rp_of_entry.topic == entry_runs.c.topic)
            & (_rp_of_entry.partition == entry_runs.c.partition),
        )
    )
    .where(or_(_rp_of_entry.offset.is_(None), entry_runs.c.last_offset >= _rp_of_entry.offset))
    .order_by(entry_runs.c.seq)
)
SELECT_RUNS_TO_RECOVER: Final = _RUNS_TO_RECOVER.where(entry_runs.c.queue == bindparam("queue"))
SELECT_RUNS_OF_QUEUES: Final = _RUNS_TO_RECOVER.where(
    entry_runs.c.queue.in_(bindparam("queues", expanding=True)))
#: One entry's row and the runs holding its offset (the console's message page).
SELECT_ENTRY_AT: Final = _ENTRIES_TO_RECOVER.where(
    entries.c.queue == bindparam("queue"), entries.c.topic == bindparam("topic"),
    entries.c.partition == bindparam("partition"), entries.c.offset == bindparam("offset"))
SELECT_RUNS_AT: Final = _RUNS_TO_RECOVER.where(
    entry_runs.c.queue == bindparam("queue"), entry_runs.c.topic == bindparam("topic"),
    entry_runs.c.partition == bindparam("partition"),
    entry_runs.c.first_offset <= bindparam("offset"),
    entry_runs.c.last_offset >= bindparam("offset"))

SELECT_RECOVERY_POINTS: Final = select(
    recovery_points.c.queue,
    recovery_points.c.topic,
    recovery_points.c.partition,
    recovery_points.c.offset,
    recovery_points.c.admitted_to,
).order_by(recovery_points.c.queue, recovery_points.c.topic, recovery_points.c.partition)

INPUT_POSITION_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "shard": Text(),
    "topic": Text(),
    "partition": Integer(),
    "next_offset": BigInteger(),
    "updated_at": _TIMESTAMP,
}
_ip_rows = _unnest("batch", INPUT_POSITION_COLUMNS)
_ip_insert = pg_insert(input_positions).from_select(
    list(INPUT_POSITION_COLUMNS), select(*(_ip_rows.c[name] for name in INPUT_POSITION_COLUMNS))
)
UPSERT_INPUT_POSITIONS: Final = _ip_insert.on_conflict_do_update(
    index_elements=[input_positions.c.shard, input_positions.c.topic,
                    input_positions.c.partition],
    set_={"next_offset": _ip_insert.excluded.next_offset,
          "updated_at": _ip_insert.excluded.updated_at},
)
SELECT_INPUT_POSITIONS: Final = select(
    input_positions.c.topic, input_positions.c.partition, input_positions.c.next_offset,
).where(input_positions.c.shard == bindparam("shard"))

SELECT_CONSUMERS: Final = select(consumers).order_by(consumers.c.consumer_id)
#: The delivery topics live sessions use, on every shard (the delivery-topic sweep keeps them).
SELECT_DELIVERY_TOPICS_IN_USE: Final = select(consumers.c.delivery_topic).distinct()
REQUEST_EVICTION: Final = (
    update(consumers)
    .where(consumers.c.consumer_id == bindparam("the_consumer_id"))
    .values(evict_requested_at=bindparam("moment"))
    .returning(consumers.c.consumer_id)
)

SELECT_COUNTERS: Final = select(queue_counters).order_by(queue_counters.c.queue)

# The maintenance form of the prunes, against the stored recovery points.
DELETE_DONE_BELOW_RECOVERY_POINTS: Final = delete(entries).where(
    entries.c.queue == recovery_points.c.queue,
    entries.c.topic == recovery_points.c.topic,
    entries.c.partition == recovery_points.c.partition,
    entries.c.offset < recovery_points.c.offset,
)
DELETE_RUNS_BELOW_RECOVERY_POINTS: Final = delete(entry_runs).where(
    entry_runs.c.queue == recovery_points.c.queue,
    entry_runs.c.topic == recovery_points.c.topic,
    entry_runs.c.partition == recovery_points.c.partition,
    entry_runs.c.last_offset < recovery_points.c.offset,
)

# --- queue definitions (CLI) -------------------------------------------------------------------

SELECT_QUEUES: Final = select(queues).order_by(queues.c.name)
QUEUES_PER_SHARD: Final = (
    select(queues.c.shard, func.count()).where(queues.c.deleted_at.is_(None))
    .group_by(queues.c.shard)
)
# Queues of several parts (`parts` > 1 in their definition): their parts are on the shards
# after their first part's (`layer.domain.shards.part_shards`).
PARTITIONED_QUEUES: Final = (
    select(queues.c.name, queues.c.shard, queues.c.definition["parts"].as_integer())
    .where(queues.c.deleted_at.is_(None))
    .where(func.jsonb_typeof(queues.c.definition["parts"]) == "number")
    .where(queues.c.definition["parts"].as_integer() > 1)
    .order_by(queues.c.name)
)
SELECT_QUEUE_FOR_UPDATE: Final = (
    select(queues).where(queues.c.name == bindparam("queue_name")).with_for_update()
)
INSERT_QUEUE: Final = (
    pg_insert(queues)
    .values(
        name=bindparam("queue_name"),
        definition=bindparam("new_definition", type_=JSONB),
        version=1,
        created_at=bindparam("now"),
        updated_at=bindparam("now"),
        shard=bindparam("the_shard"),
        positions_from=bindparam("the_positions_from"),
    )
    .on_conflict_do_nothing(index_elements=[queues.c.name])
    .returning(queues.c.version)
)
UPDATE_QUEUE_DEFINITION: Final = (
    update(queues)
    .where(queues.c.name == bindparam("queue_name"))
    .values(
        definition=bindparam("new_definition", type_=JSONB),
        version=queues.c.version + 1,
        updated_at=bindparam("now"),
        shard=bindparam("the_shard"),
    )
    .returning(queues.c.version)
)
# A definition whose recovery_point differs from the one the positions were set from: AMPS
# starts the queue over at the new point, so a reset to it is requested with the change.
UPDATE_QUEUE_DEFINITION_AND_RESET: Final = (
    update(queues)
    .where(queues.c.name == bindparam("queue_name"))
    .values(
        definition=bindparam("new_definition", type_=JSONB),
        version=queues.c.version + 1,
        updated_at=bindparam("now"),
        shard=bindparam("the_shard"),
        positions_from=bindparam("the_positions_from"),
        reset_to=bindparam("the_positions_from"),
        reset_requested_at=bindparam("now"),
    )
    .returning(queues.c.version)
)
# A deleted queue created again is a new queue: fresh created_at, no purge history.
RECREATE_QUEUE: Final = (
    update(queues)
    .where(queues.c.name == bindparam("queue_name"))
    .values(
        definition=bindparam("new_definition", type_=JSONB),
        version=queues.c.version + 1,
        created_at=bindparam("now"),
        updated_at=bindparam("now"),
        deleted_at=None,
        purge_requested_at=None,
        purged_at=None,
        purge_filter=None,
        purge_acked=None,
        reset_to=None,
        reset_requested_at=None,
        reset_done_at=None,
        positions_from=bindparam("the_positions_from"),
        shard=bindparam("the_shard"),
    )
    .returning(queues.c.version)
)
SOFT_DELETE_QUEUE: Final = (
    update(queues)
    .where(queues.c.name == bindparam("queue_name"))
    .values(
        version=queues.c.version + 1,
        updated_at=bindparam("now"),
        deleted_at=bindparam("now"),
    )
    .returning(queues.c.version)
)
REQUEST_PURGE: Final = (
    update(queues)
    .where(queues.c.name == bindparam("queue_name"))
    .values(
        version=queues.c.version + 1,
        updated_at=bindparam("now"),
        purge_requested_at=bindparam("now"),
        purge_filter=bindparam("the_filter"),
    )
    .returning(queues.c.version)
)
REQUEST_RESET: Final = (
    update(queues)
    .where(queues.c.name == bindparam("queue_name"))
    .values(
        version=queues.c.version + 1,
        updated_at=bindparam("now"),
        reset_to=bindparam("the_target"),
        reset_requested_at=bindparam("now"),
    )
    .returning(queues.c.version)
)


# A move changes nothing of the definition; the version goes up so every coordinator's refresh
# sees it (the old shard drops the queue, the new one loads it).
MOVE_QUEUE: Final = (
    update(queues)
    .where(queues.c.name == bindparam("queue_name"))
    .values(version=queues.c.version + 1, updated_at=bindparam("now"),
            shard=bindparam("the_shard"))
    .returning(queues.c.version)
)
# The sessions of a moved queue go with it (0013: only the shard a row names writes it).
MOVE_QUEUE_CONSUMERS: Final = (
    update(consumers)
    .where(consumers.c.queue == bindparam("queue_name"), consumers.c.is_regex.is_(False))
    .values(shard=bindparam("the_shard"))
)

# --- installation and coordinator processes ----------------------------------------------------

SELECT_SHARD_COUNT: Final = select(installation.c.shard_count).where(installation.c.id == 1)

# --- authorization (0013) ----------------------------------------------------------------------

SELECT_AUTHORIZATION_MODE: Final = select(installation.c.authorization_mode).where(
    installation.c.id == 1)
SET_AUTHORIZATION_MODE: Final = (
    update(installation).where(installation.c.id == 1)
    .values(authorization_mode=bindparam("the_mode"))
    .returning(installation.c.authorization_mode)
)
SELECT_PRINCIPALS: Final = select(principals).order_by(principals.c.name)
SELECT_GRANTS: Final = select(grants).order_by(grants.c.principal, grants.c.kind,
                                               grants.c.pattern)
INSERT_PRINCIPAL: Final = (
    pg_insert(principals)
    .values(name=bindparam("the_name"), secret_sha256=bindparam("the_hash"),
            created_at=bindparam("now"), issued_at=bindparam("now"))
    .on_conflict_do_nothing(index_elements=[principals.c.name])
    .returning(principals.c.name)
)
ROTATE_PRINCIPAL: Final = (
    update(principals).where(principals.c.name == bindparam("the_name"))
    .values(secret_sha256=bindparam("the_hash"), issued_at=bindparam("now"))
    .returning(principals.c.name)
)
DELETE_PRINCIPAL: Final = (
    delete(principals).where(principals.c.name == bindparam("the_name"))
    .returning(principals.c.name)
)
# Grants are checked for overlaps (a consumer id belongs to one principal) and written in one
# transaction that holds this lock, so two concurrent grants cannot both pass the check.
LOCK_GRANTS: Final = text_clause("LOCK TABLE grants IN SHARE ROW EXCLUSIVE MODE")
INSERT_GRANT: Final = (
    pg_insert(grants)
    .values(principal=bindparam("the_principal"), kind=bindparam("the_kind"),
            pattern=bindparam("the_pattern"), created_at=bindparam("now"))
    .on_conflict_do_nothing()
    .returning(grants.c.pattern)
)
DELETE_GRANT: Final = (
    delete(grants)
    .where(grants.c.principal == bindparam("the_principal"),
           grants.c.kind == bindparam("the_kind"), grants.c.pattern == bindparam("the_pattern"))
    .returning(grants.c.pattern)
)

_process_insert = pg_insert(coordinator_processes).values(
    owner_id=bindparam("the_owner_id"),
    host=bindparam("the_host"),
    pid=bindparam("the_pid"),
    started_at=bindparam("the_started_at"),
    seen_at=bindparam("now"),
    shards=bindparam("the_shards", type_=ARRAY(Integer)),
)
REPORT_PROCESS: Final = _process_insert.on_conflict_do_update(
    index_elements=[coordinator_processes.c.owner_id],
    set_={"seen_at": _process_insert.excluded.seen_at,
          "shards": _process_insert.excluded.shards},
)
FORGET_PROCESS: Final = delete(coordinator_processes).where(
    coordinator_processes.c.owner_id == bindparam("the_owner_id"))
FORGET_PROCESSES_SEEN_BEFORE: Final = delete(coordinator_processes).where(
    coordinator_processes.c.seen_at < bindparam("before"))
SELECT_PROCESSES: Final = select(coordinator_processes).order_by(
    coordinator_processes.c.owner_id)


# --- the console's chart history (0014) ----------------------------------------------------------

CONSOLE_SAMPLE_COLUMNS: Final[dict[str, TypeEngine[Any]]] = {
    "queue": Text(),
    "sampled_at": _TIMESTAMP,
    "depth": BigInteger(),
    "leased": BigInteger(),
    "consumers": Integer(),
    "counters": Text(),
}
_cs_rows = _unnest("batch", CONSOLE_SAMPLE_COLUMNS)
#: A batch of samples in one statement; a sample another console wrote for the same queue and
#: moment is kept (both sampled the same figures).
INSERT_CONSOLE_SAMPLES: Final = pg_insert(console_samples).from_select(
    list(CONSOLE_SAMPLE_COLUMNS),
    select(*(cast(_cs_rows.c[name], JSONB) if name == "counters" else _cs_rows.c[name]
             for name in CONSOLE_SAMPLE_COLUMNS)),
).on_conflict_do_nothing()
SELECT_CONSOLE_SAMPLES_SINCE: Final = (
    select(console_samples.c.queue, console_samples.c.sampled_at, console_samples.c.depth,
           console_samples.c.leased, console_samples.c.consumers, console_samples.c.counters)
    .where(console_samples.c.sampled_at >= bindparam("since", type_=_TIMESTAMP))
    .order_by(console_samples.c.sampled_at, console_samples.c.queue)
)
DELETE_CONSOLE_SAMPLES_BEFORE: Final = delete(console_samples).where(
    console_samples.c.sampled_at < bindparam("before", type_=_TIMESTAMP))
