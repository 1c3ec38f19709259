"""Exactly-once processing (protocol 9, issue 34; docs/sdk.md "Exactly-once processing").

``consumers.transactional_id`` and ``consumer_spans.transactional_id``: the Kafka
``transactional.id`` a session settles its messages with, NULL for a session that settles
outside transactions (every session before 0016). A shard that takes a session over reads it
here, so it can fence that id before it breaks any of the session's leases. The downgrade
drops the columns: the sessions that had one are then plain ones, whose leases are broken
without a fence (their consumers keep settling, at-least-once).

Revision ID: 0016_transactional_sessions
Revises: 0015_consumer_spans
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_transactional_sessions"
down_revision = "0015_consumer_spans"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("consumers", sa.Column("transactional_id", sa.Text(), nullable=True))
    op.add_column("consumer_spans", sa.Column("transactional_id", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("consumer_spans", "transactional_id")
    op.drop_column("consumers", "transactional_id")
