"""A per-queue total of the entries consumers rejected, apart from those that expired.

``queue_counters.rejected`` counts entries that left the queue because a consumer rejected
them (REJECT, AMPS's ``expire`` acknowledgement). Until this revision they were counted in
``expired`` too, so on a queue with neither limits nor expiration ``expired`` equalled
``dead_lettered`` and read as if messages had timed out (issue 16). From now on ``expired``
counts the entries that left unprocessed for any other reason (max_deliveries, max_cancels,
message expiration, a deleted journal, a record too large to deliver); ``dead_lettered`` still
counts those of both that went to a dead-letter topic.

Existing queues start at 0 rejected, and their ``expired`` keeps the rejections counted before
the upgrade (the two cannot be told apart afterwards; the events can: REJECTED). Downgrading
adds ``rejected`` back into ``expired`` and drops the column.

Revision ID: 0010_rejected_counter
Revises: 0009_session_secrets
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_rejected_counter"
down_revision = "0009_session_secrets"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("queue_counters", sa.Column("rejected", sa.BigInteger(), nullable=False,
                                              server_default=sa.text("0")))


def downgrade() -> None:
    op.execute("UPDATE queue_counters SET expired = expired + rejected")
    op.drop_column("queue_counters", "rejected")
