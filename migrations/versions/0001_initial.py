"""Initial schema: queue definitions, consumers, touched entries, recovery points, ownership,
queue counters.

Hand-written to match `layer.store.tables` exactly (a test compares the migrated database with
that metadata). `docs/storage.md` explains every column.

Revision ID: 0001_initial
Revises:
Create Date: 2025-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

_TIMESTAMPTZ = sa.DateTime(timezone=True)
_COUNTERS = (
    "enqueued",
    "delivered",
    "redelivered",
    "acked",
    "released",
    "lease_expired",
    "dead_lettered",
    "expired",
)


def upgrade() -> None:
    op.create_table(
        "queues",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("definition", postgresql.JSONB(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("updated_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("deleted_at", _TIMESTAMPTZ, nullable=True),
        sa.Column("purge_requested_at", _TIMESTAMPTZ, nullable=True),
        sa.Column("purged_at", _TIMESTAMPTZ, nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_queues")),
        sa.CheckConstraint("version >= 1", name=op.f("ck_queues_version_positive")),
    )
    op.create_table(
        "consumers",
        sa.Column("consumer_id", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("is_regex", sa.Boolean(), nullable=False),
        sa.Column("max_backlog", sa.Integer(), nullable=True),
        sa.Column("filter", sa.Text(), nullable=True),
        sa.Column("delivery_topic", sa.Text(), nullable=False),
        sa.Column("session_timeout_ms", sa.Integer(), nullable=False),
        sa.Column("subscribed_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("last_heartbeat_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("client_info", postgresql.JSONB(), nullable=True),
        sa.Column("evict_requested_at", _TIMESTAMPTZ, nullable=True),
        sa.PrimaryKeyConstraint("consumer_id", name=op.f("pk_consumers")),
        sa.CheckConstraint(
            "max_backlog IS NULL OR max_backlog >= 0",
            name=op.f("ck_consumers_max_backlog_not_negative"),
        ),
        sa.CheckConstraint(
            "session_timeout_ms > 0", name=op.f("ck_consumers_session_timeout_positive")
        ),
    )
    op.create_table(
        "entries",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("delivery_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("cancel_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("lease_consumer", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.Text(), nullable=True),
        sa.Column("lease_deadline", _TIMESTAMPTZ, nullable=True),
        sa.Column("available_at", _TIMESTAMPTZ, nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("updated_at", _TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("queue", "topic", "partition", "offset", name=op.f("pk_entries")),
        sa.CheckConstraint(
            "state IN ('AVAILABLE', 'LEASED', 'ACKED', 'EXPIRED')",
            name=op.f("ck_entries_state_known"),
        ),
        sa.CheckConstraint(
            'partition >= 0 AND "offset" >= 0', name=op.f("ck_entries_bookmark_valid")
        ),
        sa.CheckConstraint(
            "delivery_count >= 0", name=op.f("ck_entries_delivery_count_non_negative")
        ),
        sa.CheckConstraint("cancel_count >= 0", name=op.f("ck_entries_cancel_count_non_negative")),
        sa.CheckConstraint(
            "(state = 'LEASED' AND lease_consumer IS NOT NULL AND lease_token IS NOT NULL "
            "AND lease_deadline IS NOT NULL) "
            "OR (state <> 'LEASED' AND lease_consumer IS NULL AND lease_token IS NULL "
            "AND lease_deadline IS NULL)",
            name=op.f("ck_entries_lease_iff_leased"),
        ),
        sa.CheckConstraint(
            "reason IS NULL OR state = 'EXPIRED'", name=op.f("ck_entries_reason_only_when_expired")
        ),
    )
    op.create_table(
        "recovery_points",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("queue", "topic", "partition", name=op.f("pk_recovery_points")),
        sa.CheckConstraint(
            'partition >= 0 AND "offset" >= 0', name=op.f("ck_recovery_points_position_valid")
        ),
    )
    op.create_table(
        "ownership",
        sa.Column("shard", sa.Text(), nullable=False),
        sa.Column("owner_id", sa.Text(), nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("heartbeat_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("expires_at", _TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("shard", name=op.f("pk_ownership")),
        sa.CheckConstraint("epoch >= 1", name=op.f("ck_ownership_epoch_positive")),
    )
    op.create_table(
        "queue_counters",
        sa.Column("queue", sa.Text(), nullable=False),
        *(
            sa.Column(name, sa.BigInteger(), server_default=sa.text("0"), nullable=False)
            for name in _COUNTERS
        ),
        sa.Column("updated_at", _TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("queue", name=op.f("pk_queue_counters")),
        sa.CheckConstraint(
            " AND ".join(f"{name} >= 0" for name in _COUNTERS),
            name=op.f("ck_queue_counters_counts_non_negative"),
        ),
    )


def downgrade() -> None:
    for table in ("queue_counters", "ownership", "recovery_points", "entries", "consumers",
                  "queues"):
        op.drop_table(table)
