"""The console's chart history in PostgreSQL (issue 33; docs/console.md, "History").

``console_samples``: per queue (``''`` for the installation's totals) and moment, the depth,
leases, consumers and rated counters a console sampled. A console writes the samples in which
a queue's figures changed (and the one before), reads the last window back when it starts,
and deletes what is older than its retention. Nothing else reads or writes the table; the
downgrade drops it (the charts start empty again, as before 0014).

Revision ID: 0014_console_history
Revises: 0013_authorization
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0014_console_history"
down_revision = "0013_authorization"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_samples",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("sampled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("depth", sa.BigInteger(), nullable=False),
        sa.Column("leased", sa.BigInteger(), nullable=False),
        sa.Column("consumers", sa.Integer(), nullable=False),
        sa.Column("counters", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("queue", "sampled_at", name=op.f("pk_console_samples")),
    )
    op.create_index("console_samples_by_time", "console_samples", ["sampled_at"])


def downgrade() -> None:
    op.drop_index("console_samples_by_time", table_name="console_samples")
    op.drop_table("console_samples")
