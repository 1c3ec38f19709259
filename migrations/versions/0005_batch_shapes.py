"""Coordinator v2 batch shapes (DESIGN §3, §5 version 2): lease state as runs, and each
consumer's delivery format.

- ``entry_writes``: a sequence; every write of an entry's state takes its next value, so a
  restart can tell which of several rows about one entry is the latest.
- ``entries.seq``: existing rows are numbered in bookmark order (each entry has one row, so
  their order does not matter).
- ``entry_runs``: one row per group of entries of one (queue, partition) that one write left
  in the same state with the same lease fields (LEASED to one consumer, or ACKED). The
  happy path writes these instead of a row per message.
- ``event_outbox``: each iteration's events, written in the transaction that commits what
  they describe and deleted once published (DESIGN §2), so every state change has one event.
- ``consumers.delivery_format``: ``batch`` (delivery batches, protocol 3) or ``record`` (one
  record per message, as before; existing sessions keep it).

Downgrading writes every run back as one ``entries`` row per offset (the latest write of each
entry wins), then drops the table, the column and the sequence.

Revision ID: 0005_batch_shapes
Revises: 0004_shards
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005_batch_shapes"
down_revision = "0004_shards"
branch_labels = None
depends_on = None

_TIMESTAMPTZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.execute("CREATE SEQUENCE entry_writes")
    op.add_column("entries", sa.Column("seq", sa.BigInteger(), nullable=False,
                                       server_default=sa.text("nextval('entry_writes')")))
    op.create_table(
        "entry_runs",
        sa.Column("seq", sa.BigInteger(), nullable=False,
                  server_default=sa.text("nextval('entry_writes')")),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("first_offset", sa.BigInteger(), nullable=False),
        sa.Column("last_offset", sa.BigInteger(), nullable=False),
        sa.Column("offsets", postgresql.ARRAY(sa.BigInteger()), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("delivery_count", sa.Integer(), nullable=False),
        sa.Column("cancel_count", sa.Integer(), nullable=False),
        sa.Column("lease_consumer", sa.Text(), nullable=True),
        sa.Column("lease_tokens", sa.Text(), nullable=True),
        sa.Column("lease_deadline", _TIMESTAMPTZ, nullable=True),
        sa.Column("updated_at", _TIMESTAMPTZ, nullable=False),
        sa.CheckConstraint("state IN ('LEASED', 'ACKED')", name="run_state_known"),
        sa.CheckConstraint(
            "partition >= 0 AND first_offset >= 0 AND last_offset >= first_offset",
            name="run_bookmarks_valid"),
        sa.CheckConstraint(
            "(state = 'LEASED' AND lease_consumer IS NOT NULL AND lease_tokens IS NOT NULL "
            "AND lease_deadline IS NOT NULL) "
            "OR (state <> 'LEASED' AND lease_consumer IS NULL AND lease_tokens IS NULL "
            "AND lease_deadline IS NULL)",
            name="run_lease_iff_leased"),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("entry_runs_by_partition", "entry_runs",
                    ["queue", "topic", "partition", "last_offset"])
    op.create_table(
        "event_outbox",
        sa.Column("batch_id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("shard", sa.Text(), nullable=False),
        sa.Column("events", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", _TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("batch_id"),
    )
    op.create_index("event_outbox_by_shard", "event_outbox", ["shard", "batch_id"])
    op.add_column("consumers", sa.Column("delivery_format", sa.Text(), nullable=False,
                                         server_default=sa.text("'record'")))
    op.create_check_constraint("delivery_format_known", "consumers",
                               "delivery_format IN ('batch', 'record')")


def downgrade() -> None:
    # Each offset of each run, with the run's fields; where an `entries` row says something
    # later (a higher seq), the row stays.
    op.execute("""
        WITH expanded AS (
            SELECT DISTINCT ON (r.queue, r.topic, r.partition, o.off)
                   r.queue, r.topic, r.partition, o.off AS "offset", r.state, r.delivery_count,
                   r.cancel_count, r.lease_consumer,
                   split_part(r.lease_tokens, ',', o.position::int) AS lease_token,
                   r.lease_deadline, r.updated_at, r.seq
            FROM entry_runs r,
                 unnest(r.offsets) WITH ORDINALITY AS o(off, position)
            ORDER BY r.queue, r.topic, r.partition, o.off, r.seq DESC
        )
        INSERT INTO entries (queue, topic, partition, "offset", state, delivery_count,
                             cancel_count, lease_consumer, lease_token, lease_deadline,
                             updated_at, seq)
        SELECT queue, topic, partition, "offset", state, delivery_count, cancel_count,
               CASE WHEN state = 'LEASED' THEN lease_consumer END,
               CASE WHEN state = 'LEASED' THEN lease_token END,
               CASE WHEN state = 'LEASED' THEN lease_deadline END,
               updated_at, seq
        FROM expanded
        ON CONFLICT (queue, topic, partition, "offset") DO UPDATE SET
            state = excluded.state, delivery_count = excluded.delivery_count,
            cancel_count = excluded.cancel_count, lease_consumer = excluded.lease_consumer,
            lease_token = excluded.lease_token, lease_deadline = excluded.lease_deadline,
            available_at = NULL, reason = NULL, updated_at = excluded.updated_at
        WHERE entries.seq < excluded.seq
    """)
    # Events not published yet are published by a version-2 coordinator... which cannot read
    # them once this is undone: downgrade with every coordinator stopped after a clean stop.
    op.drop_index("event_outbox_by_shard", table_name="event_outbox")
    op.drop_table("event_outbox")
    op.drop_constraint("delivery_format_known", "consumers", type_="check")
    op.drop_column("consumers", "delivery_format")
    op.drop_index("entry_runs_by_partition", table_name="entry_runs")
    op.drop_table("entry_runs")
    op.drop_column("entries", "seq")
    op.execute("DROP SEQUENCE entry_writes")
