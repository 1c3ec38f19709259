"""qlayer's PostgreSQL schema as SQLAlchemy Core tables (DESIGN §3).

The Alembic revisions in `migrations/versions` create exactly these tables; a test compares the
migrated database with `metadata`, so a change here needs a new revision. `docs/storage.md`
says why each column exists.

Times are ``timestamptz``; callers pass epoch seconds and the store converts, so no decision
depends on the database clock.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Sequence,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

__all__ = [
    "COUNTER_NAMES",
    "DONE_STATES",
    "ENTRY_STATES",
    "consumer_spans",
    "consumers",
    "coordinator_processes",
    "entries",
    "entry_runs",
    "entry_writes",
    "event_outbox",
    "grants",
    "input_positions",
    "installation",
    "metadata",
    "ownership",
    "principals",
    "queue_counters",
    "queues",
    "recovery_points",
]

# The entry states of DESIGN §1. An untouched entry (never delivered) has no row at all: it is
# AVAILABLE by default, rebuilt from the journal on restart.
ENTRY_STATES: Final = ("AVAILABLE", "LEASED", "ACKED", "EXPIRED")
# States an entry never leaves: a recovery point may pass them and their rows may then go.
DONE_STATES: Final = ("ACKED", "EXPIRED")
# Per-queue totals kept in `queue_counters`, for `qlayer stats` after a restart.
COUNTER_NAMES: Final = (
    "enqueued",
    "delivered",
    "redelivered",
    "acked",
    "released",
    "lease_expired",
    "dead_lettered",
    "expired",
    # Journal records read with a fault that stays with the record (0007): a value the queue's
    # filter, priority or barrier could not parse as JSON (the filter false, the priority
    # lowest), a delete (a tombstone: never an entry), a qlayer header that could not be read
    # (ignored).
    "unparseable",
    "deletes",
    "malformed_headers",
    # Entries that left the queue because their journal partition was deleted while the
    # queue read it (0008, reason journal_deleted): the queue's mark of a lost journal.
    "journal_deleted",
    # Entries consumers rejected (0010); `expired` counts the other ways out unprocessed.
    "rejected",
)

# Explicit constraint names, so the hand-written migration and this metadata name every
# constraint identically (and a later revision can drop one by name).
metadata = MetaData(
    naming_convention={
        "pk": "pk_%(table_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    }
)


def _ts(name: str, nullable: bool) -> Column[datetime]:
    return Column(name, DateTime(timezone=True), nullable=nullable)


def _states_sql(states: tuple[str, ...]) -> str:
    return ", ".join(f"'{state}'" for state in states)


# One row: what the installation was created with (`qlayer db upgrade --shards N`).
installation = Table(
    "installation",
    metadata,
    Column("id", Integer, primary_key=True),
    # Fixed for the installation's life: each queue's placement and each partition's shard
    # (partition p of control and ack belongs to shard p mod shard_count) depend on it.
    Column("shard_count", Integer, nullable=False),
    _ts("created_at", nullable=False),
    # Who may consume what (0013, docs/security.md "Authorization"): `open` (what no grant
    # names is open to anyone) or `required` (a credential and a grant for everything). In the
    # database, not a coordinator flag, so every coordinator applies the same rule.
    Column("authorization_mode", Text, nullable=False, server_default=text("'open'")),
    CheckConstraint("id = 1", name="one_row"),
    CheckConstraint("shard_count BETWEEN 1 AND 1024", name="shard_count_valid"),
    CheckConstraint("authorization_mode IN ('open', 'required')",
                    name="authorization_mode_known"),
)

# Principals (0013): who a consumer's credential says it is. Only the SHA-256 of the
# credential's secret is kept; `qlayer security principal add|rotate` prints the credential once.
principals = Table(
    "principals",
    metadata,
    Column("name", Text, primary_key=True),
    Column("secret_sha256", LargeBinary, nullable=False),
    _ts("created_at", nullable=False),
    # When the current credential was issued (a rotation ends the sessions of the old one).
    _ts("issued_at", nullable=False),
)

# Grants (0013): the queues a principal may consume and the consumer ids it may use. A name
# pattern is a name, a prefix ending in '*', or '*' (`layer.domain.authorization.NamePattern`).
grants = Table(
    "grants",
    metadata,
    Column("principal", Text, ForeignKey("principals.name", ondelete="CASCADE"),
           primary_key=True),
    Column("kind", Text, primary_key=True),
    Column("pattern", Text, primary_key=True),
    _ts("created_at", nullable=False),
    CheckConstraint("kind IN ('queue', 'consumer_id')", name="grant_kind_known"),
)

queues = Table(
    "queues",
    metadata,
    Column("name", Text, primary_key=True),
    # The QueueDefinition as pydantic dumps it (mode="json"); the store does not interpret it.
    Column("definition", JSONB, nullable=False),
    # Bumped on every change of the row (definition, deletion, purge request), so a coordinator
    # can poll (name, version) cheaply and reload only what changed.
    Column("version", BigInteger, nullable=False),
    # A re-created queue (deleted, then created again) gets a new created_at: the coordinator
    # treats that as a new queue and forgets the old one's state.
    _ts("created_at", nullable=False),
    _ts("updated_at", nullable=False),
    # Soft delete keeps `version` monotonic across delete + re-create (so no poller can miss a
    # change) and leaves a record of what was deleted and when.
    _ts("deleted_at", nullable=True),
    # `qlayer queue purge` asks; the owning coordinator empties the queue and records
    # purged_at = purge_requested_at. A purge is pending while purged_at is older or null.
    _ts("purge_requested_at", nullable=True),
    _ts("purged_at", nullable=True),
    # `qlayer queue ack --filter` (0006): the filter of the pending request; NULL acknowledges
    # every entry (a purge). Two requests before the coordinator gets to them are joined (OR).
    Column("purge_filter", Text, nullable=True),
    # How many entries the last completed purge or ack acknowledged (for `--wait`).
    Column("purge_acked", BigInteger, nullable=True),
    # `qlayer queue reset` (0006), or a changed `recovery_point`: where the queue's positions
    # move (beginning, end, an ISO timestamp, or topic:partition:offset,...). Pending while
    # reset_done_at is null or older than reset_requested_at, as with purges.
    Column("reset_to", Text, nullable=True),
    _ts("reset_requested_at", nullable=True),
    _ts("reset_done_at", nullable=True),
    # The `recovery_point` setting the positions were set from (0006): AMPS starts a queue
    # over at its RecoveryPoint when that setting changed, and this is how a change is seen.
    Column("positions_from", Text, nullable=True),
    # The shard whose coordinator serves the queue (DESIGN §3). `qlayer queue move` changes it
    # and bumps the old shard's epoch in the same transaction.
    Column("shard", Integer, nullable=False),
    CheckConstraint("version >= 1", name="version_positive"),
    CheckConstraint("shard >= 0", name="shard_valid"),
)

consumers = Table(
    "consumers",
    metadata,
    Column("consumer_id", Text, primary_key=True),
    # A consumer that reconnects with a new session id starts afresh: leases of the old session
    # are broken.
    Column("session_id", Text, nullable=False),
    # A queue name, or a regex over queue names when is_regex.
    Column("queue", Text, nullable=False),
    Column("is_regex", Boolean, nullable=False),
    # NULL: the consumer gave none (the engine then applies DESIGN §4's default of 1).
    Column("max_backlog", Integer, nullable=True),
    Column("filter", Text, nullable=True),
    Column("delivery_topic", Text, nullable=False),
    Column("session_timeout_ms", Integer, nullable=False),
    _ts("subscribed_at", nullable=False),
    _ts("last_heartbeat_at", nullable=False),
    # What the SDK says about itself (language, version, host, pid), for `qlayer consumers`.
    Column("client_info", JSONB, nullable=True),
    # `qlayer consumers evict`: set by the CLI; the owning coordinator breaks the consumer's
    # leases, tells it so (SessionEnded EVICTED) and deletes the row.
    _ts("evict_requested_at", nullable=True),
    # How the consumer's deliveries are written (0005): `batch` (protocol 3) or `record`.
    Column("delivery_format", Text, nullable=False, server_default=text("'record'")),
    # 0 is a session that takes only barrier messages (AMPS; docs/protocol.md §4.1).
    # SHA-256 of the session's secret (0008, protocol 5); NULL: the session gave none. Only
    # the hash: a database reader cannot act for the session.
    Column("secret_sha256", LargeBinary, nullable=True),
    # The shard whose coordinator holds the session (0013): only that shard writes the row,
    # so a Subscribe another shard accepted can neither overwrite nor delete a live session
    # (`statements.UPSERT_CONSUMERS`). NULL: written before 0013.
    Column("shard", Integer, nullable=True),
    # The principal the session's credential proved (0013), NULL for an anonymous session,
    # and the SHA-256 of that credential's secret: a rotated credential ends the session.
    Column("principal", Text, nullable=True),
    Column("credential_sha256", LargeBinary, nullable=True),
    # Protocol 8 (0015): the session's home shard when it holds credit granted by its consumer
    # (a subscription over queues of several shards); NULL: a session of one shard.
    Column("credit_home", Integer, nullable=True),
    # Protocol 9 (0016): the Kafka transactional.id the session settles with (exactly-once
    # processing); a shard fences it before breaking any of its leases. NULL: not transactional.
    Column("transactional_id", Text, nullable=True),
    CheckConstraint("max_backlog IS NULL OR max_backlog >= 0", name="max_backlog_not_negative"),
    CheckConstraint("session_timeout_ms > 0", name="session_timeout_positive"),
    CheckConstraint("delivery_format IN ('batch', 'record')", name="delivery_format_known"),
)

#: The parts of a session on shards other than its home (0015, protocol 8): a subscription
#: whose queues are on several shards has one session (one id, one secret) with a part on
#: each; the home part is its `consumers` row (which keeps one consumer id to one session),
#: the others are here, each written only by its own shard, and only while the home row holds
#: the same session (`statements.UPSERT_CONSUMER_SPANS`). ``max_backlog`` is the credit the
#: consumer granted that shard. The columns mean what they mean in `consumers`.
consumer_spans = Table(
    "consumer_spans",
    metadata,
    Column("consumer_id", Text, primary_key=True),
    Column("shard", Integer, primary_key=True),
    Column("session_id", Text, nullable=False),
    Column("credit_home", Integer, nullable=False),
    Column("queue", Text, nullable=False),
    Column("is_regex", Boolean, nullable=False),
    Column("max_backlog", Integer, nullable=True),
    Column("filter", Text, nullable=True),
    Column("delivery_topic", Text, nullable=False),
    Column("session_timeout_ms", Integer, nullable=False),
    _ts("subscribed_at", nullable=False),
    _ts("last_heartbeat_at", nullable=False),
    Column("delivery_format", Text, nullable=False),
    Column("secret_sha256", LargeBinary, nullable=True),
    Column("principal", Text, nullable=True),
    Column("credential_sha256", LargeBinary, nullable=True),
    Column("transactional_id", Text, nullable=True),
    CheckConstraint("max_backlog IS NULL OR max_backlog >= 0",
                    name="span_max_backlog_not_negative"),
    CheckConstraint("session_timeout_ms > 0", name="span_session_timeout_positive"),
)

#: Every write of an entry's state takes the next value, whether it is an `entries` row or an
#: `entry_runs` row: on restart the latest write of each entry wins (0005).
entry_writes = Sequence("entry_writes", metadata=metadata)

entries = Table(
    "entries",
    metadata,
    # The bookmark (topic/partition/offset) within one queue: many queues may view one journal.
    Column("queue", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("offset", BigInteger, primary_key=True),
    Column("state", Text, nullable=False),
    Column("delivery_count", Integer, nullable=False, server_default=text("0")),
    Column("cancel_count", Integer, nullable=False, server_default=text("0")),
    Column("lease_consumer", Text, nullable=True),
    Column("lease_token", Text, nullable=True),
    _ts("lease_deadline", nullable=True),
    # Delayed release / back-off: the entry is AVAILABLE but not deliverable before this time.
    _ts("available_at", nullable=True),
    # Why an EXPIRED entry left the queue (max_deliveries, reject, expiration, retention...).
    Column("reason", Text, nullable=True),
    _ts("updated_at", nullable=False),
    Column("seq", BigInteger, nullable=False, server_default=text("nextval('entry_writes')")),
    CheckConstraint(f"state IN ({_states_sql(ENTRY_STATES)})", name="state_known"),
    CheckConstraint('partition >= 0 AND "offset" >= 0', name="bookmark_valid"),
    CheckConstraint("delivery_count >= 0", name="delivery_count_non_negative"),
    CheckConstraint("cancel_count >= 0", name="cancel_count_non_negative"),
    # A lease exists exactly while the entry is LEASED: a half-written lease is a bug, not state.
    CheckConstraint(
        "(state = 'LEASED' AND lease_consumer IS NOT NULL AND lease_token IS NOT NULL "
        "AND lease_deadline IS NOT NULL) "
        "OR (state <> 'LEASED' AND lease_consumer IS NULL AND lease_token IS NULL "
        "AND lease_deadline IS NULL)",
        name="lease_iff_leased",
    ),
    CheckConstraint("reason IS NULL OR state = 'EXPIRED'", name="reason_only_when_expired"),
)

# Runs (DESIGN §3 version 2): the entries of one (queue, partition) that one write left in the
# same state with the same lease fields -- typically those leased to one consumer in one
# iteration, or acked together -- in one row. `entries` keeps the exceptions (released,
# delayed, expired, a lease alone). The offsets need not be contiguous: fairness interleaves
# consumers entry by entry.
entry_runs = Table(
    "entry_runs",
    metadata,
    Column("seq", BigInteger, primary_key=True,
           server_default=text("nextval('entry_writes')")),
    Column("queue", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    # The smallest and largest of `offsets`: a run is pruned when its recovery point passes
    # `last_offset`, and read on restart while it does not.
    Column("first_offset", BigInteger, nullable=False),
    Column("last_offset", BigInteger, nullable=False),
    Column("offsets", ARRAY(BigInteger), nullable=False),
    Column("state", Text, nullable=False),
    Column("delivery_count", Integer, nullable=False),
    Column("cancel_count", Integer, nullable=False),
    Column("lease_consumer", Text, nullable=True),
    # The lease tokens of `offsets`, in order, joined by ",".
    Column("lease_tokens", Text, nullable=True),
    _ts("lease_deadline", nullable=True),
    _ts("updated_at", nullable=False),
    CheckConstraint("state IN ('LEASED', 'ACKED')", name="run_state_known"),
    CheckConstraint("partition >= 0 AND first_offset >= 0 AND last_offset >= first_offset",
                    name="run_bookmarks_valid"),
    CheckConstraint(
        "(state = 'LEASED' AND lease_consumer IS NOT NULL AND lease_tokens IS NOT NULL "
        "AND lease_deadline IS NOT NULL) "
        "OR (state <> 'LEASED' AND lease_consumer IS NULL AND lease_tokens IS NULL "
        "AND lease_deadline IS NULL)",
        name="run_lease_iff_leased",
    ),
    Index("entry_runs_by_partition", "queue", "topic", "partition", "last_offset"),
)

# The transactional outbox of events (DESIGN §2): each iteration's events, written in the
# transaction that commits what they describe, published to the events topic after it, and
# deleted once published (by the shard's next transaction). A new owner publishes what it finds.
event_outbox = Table(
    "event_outbox",
    metadata,
    Column("batch_id", BigInteger, primary_key=True, autoincrement=True),
    Column("shard", Text, nullable=False),
    # The EventBatch's `events` array, Avro-encoded (docs/protocol.md §4.4b).
    Column("events", LargeBinary, nullable=False),
    _ts("created_at", nullable=False),
    Index("event_outbox_by_shard", "shard", "batch_id"),
)

recovery_points = Table(
    "recovery_points",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    # Every entry of this queue below this offset is done; restart reads the journal from here.
    Column("offset", BigInteger, nullable=False),
    # The next offset not yet admitted: a restart re-admits [offset, admitted_to) without
    # counting those entries as enqueued again. NULL: not known (written before 0002).
    Column("admitted_to", BigInteger, nullable=True),
    _ts("updated_at", nullable=False),
    CheckConstraint('partition >= 0 AND "offset" >= 0', name="position_valid"),
)

input_positions = Table(
    "input_positions",
    metadata,
    Column("shard", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    # The next offset of a control or ack topic partition to read. It is written in the
    # transaction that writes what the records below it did, so a restart applies no ack
    # twice (which would answer the consumer DUPLICATE for an ack that was applied).
    Column("next_offset", BigInteger, nullable=False),
    _ts("updated_at", nullable=False),
    CheckConstraint("partition >= 0 AND next_offset >= 0", name="input_position_valid"),
)

ownership = Table(
    "ownership",
    metadata,
    # The shard number as text (`layer.domain.shards.shard_key`).
    Column("shard", Text, primary_key=True),
    # NULL after a clean release; the row stays so the epoch keeps counting up.
    Column("owner_id", Text, nullable=True),
    # Incremented on every takeover and on every move of a queue off the shard; every guarded
    # write names it (fencing). Who may take a shard is Kafka's group protocol's decision.
    Column("epoch", BigInteger, nullable=False),
    _ts("acquired_at", nullable=False),
    # Last guarded write or report of the owner.
    _ts("heartbeat_at", nullable=False),
    # Journal records the owner had not read yet at `reported_at` (`qlayer coordinators`).
    Column("lag", BigInteger, nullable=True),
    _ts("reported_at", nullable=True),
    # Running totals of the shard's input faults and isolated poison input, name -> count
    # (0008; `layer.coordinator.shard.FAULT_COUNTERS`), written with the owner's report.
    Column("counters", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    CheckConstraint("epoch >= 1", name="epoch_positive"),
)

# Running coordinator processes, each reporting every few seconds (`qlayer coordinators`).
coordinator_processes = Table(
    "coordinator_processes",
    metadata,
    Column("owner_id", Text, primary_key=True),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    _ts("started_at", nullable=False),
    _ts("seen_at", nullable=False),
    # The shards the group assigned it at `seen_at`.
    Column("shards", ARRAY(Integer), nullable=False),
)

queue_counters = Table(
    "queue_counters",
    metadata,
    Column("queue", Text, primary_key=True),
    *(
        Column(name, BigInteger, nullable=False, server_default=text("0"))
        for name in COUNTER_NAMES
    ),
    _ts("updated_at", nullable=False),
    CheckConstraint(
        " AND ".join(f"{name} >= 0" for name in COUNTER_NAMES), name="counts_non_negative"
    ),
)

# The console's chart history (0014, docs/console.md "History"): per queue, a sample of its
# figures each time they changed (with the sample before the change, so a rate is not smeared
# over an idle stretch); queue '' is the installation's totals, sampled every time. Kept for
# the console's `--history-retention`, so charts survive a console restart.
console_samples = Table(
    "console_samples",
    metadata,
    Column("queue", Text, primary_key=True),
    Column("sampled_at", DateTime(timezone=True), primary_key=True),
    Column("depth", BigInteger, nullable=False),
    Column("leased", BigInteger, nullable=False),
    Column("consumers", Integer, nullable=False),
    # The rated counters (`layer.console.history.CHARTED_RATES`) at that moment.
    Column("counters", JSONB, nullable=False),
    Index("console_samples_by_time", "sampled_at"),
)
