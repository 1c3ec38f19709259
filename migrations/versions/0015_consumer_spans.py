"""Sessions over several shards (protocol 8, issue 31; docs/coordinator.md "One backlog").

``consumers.credit_home``: set for a session whose consumer grants it credit (a subscription
over queues of several shards), its home shard. ``consumer_spans``: that session's parts on
the other shards, one row per (consumer id, shard), each written only by its shard and only
while the home row holds the same session. Rows written before 0015 are sessions of one shard
and stay as they are; the downgrade drops the parts (their consumers subscribe again when the
shards no longer know them) and the column.

Revision ID: 0015_consumer_spans
Revises: 0014_console_history
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_consumer_spans"
down_revision = "0014_console_history"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("consumers", sa.Column("credit_home", sa.Integer(), nullable=True))
    op.create_table(
        "consumer_spans",
        sa.Column("consumer_id", sa.Text(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("credit_home", sa.Integer(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("is_regex", sa.Boolean(), nullable=False),
        sa.Column("max_backlog", sa.Integer(), nullable=True),
        sa.Column("filter", sa.Text(), nullable=True),
        sa.Column("delivery_topic", sa.Text(), nullable=False),
        sa.Column("session_timeout_ms", sa.Integer(), nullable=False),
        sa.Column("subscribed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivery_format", sa.Text(), nullable=False),
        sa.Column("secret_sha256", sa.LargeBinary(), nullable=True),
        sa.Column("principal", sa.Text(), nullable=True),
        sa.Column("credential_sha256", sa.LargeBinary(), nullable=True),
        sa.CheckConstraint("max_backlog IS NULL OR max_backlog >= 0",
                           name=op.f("ck_consumer_spans_span_max_backlog_not_negative")),
        sa.CheckConstraint("session_timeout_ms > 0",
                           name=op.f("ck_consumer_spans_span_session_timeout_positive")),
        sa.PrimaryKeyConstraint("consumer_id", "shard", name=op.f("pk_consumer_spans")),
    )


def downgrade() -> None:
    op.drop_table("consumer_spans")
    op.drop_column("consumers", "credit_home")
