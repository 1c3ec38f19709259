"""Shard-level counters of input faults and isolated poison input, per shard.

- ``ownership.counters`` (JSONB, ``{}`` by default): running totals of what a shard's owners
  refused or isolated that belongs to no queue's counters: malformed ack and control records,
  ack and subscribe refusals by status, records too large to deliver, journals deleted while
  read (issue 15 item 5; `layer.coordinator.shard.FAULT_COUNTERS`). Each owner adds what it
  counted to what it found there when it took the shard, and writes the sum with its periodic
  report; `qlayer stats` shows them.

- ``queue_counters.journal_deleted``: the queue's entries that left it because their journal
  partition was deleted while the queue read it (reason ``journal_deleted``): the queue's
  mark of a lost journal in ``qlayer stats`` and ``qlayer queue describe``.

Before this revision these were counted only inside the coordinator process. Existing shards
start at ``{}``, existing queues at 0. Downgrading drops the columns.

Revision ID: 0008_shard_counters
Revises: 0007_input_counters
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008_shard_counters"
down_revision = "0007_input_counters"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ownership", sa.Column("counters", postgresql.JSONB(), nullable=False,
                                         server_default=sa.text("'{}'::jsonb")))
    op.add_column("queue_counters", sa.Column("journal_deleted", sa.BigInteger(),
                                              nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    op.drop_column("queue_counters", "journal_deleted")
    op.drop_column("ownership", "counters")
