"""Operator requests on a queue's row: acknowledge by filter, and move its positions.

- ``queues.purge_filter``: the filter of the pending purge request (`qlayer queue ack
  --filter`); NULL acknowledges every entry (`qlayer queue purge`), as before.
- ``queues.purge_acked``: how many entries the last completed request acknowledged, for
  `--wait` and `queue describe`.
- ``queues.reset_to``, ``reset_requested_at``, ``reset_done_at``: `qlayer queue reset` (and a
  changed ``recovery_point``) record where the queue's positions move to; the owning
  coordinator moves them and sets ``reset_done_at`` to the request's time.
- ``queues.positions_from``: the ``recovery_point`` setting the queue's positions were set
  from. AMPS restarts a queue at its RecoveryPoint when that setting changed; comparing the
  setting with this column is how the store tells. Existing queues are backfilled with their
  current setting, so upgrading moves nothing.

Downgrading drops the columns. A pending ack by filter would become a purge of the whole
queue under the previous revision's coordinator, so it is marked done (dropped) first; a
pending reset is dropped with its columns.

Revision ID: 0006_operator_requests
Revises: 0005_batch_shapes
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_operator_requests"
down_revision = "0005_batch_shapes"
branch_labels = None
depends_on = None

_TIMESTAMPTZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("queues", sa.Column("purge_filter", sa.Text(), nullable=True))
    op.add_column("queues", sa.Column("purge_acked", sa.BigInteger(), nullable=True))
    op.add_column("queues", sa.Column("reset_to", sa.Text(), nullable=True))
    op.add_column("queues", sa.Column("reset_requested_at", _TIMESTAMPTZ, nullable=True))
    op.add_column("queues", sa.Column("reset_done_at", _TIMESTAMPTZ, nullable=True))
    op.add_column("queues", sa.Column("positions_from", sa.Text(), nullable=True))
    op.execute("UPDATE queues SET positions_from = definition ->> 'recovery_point'")


def downgrade() -> None:
    op.execute("""
        UPDATE queues SET purged_at = purge_requested_at
        WHERE purge_filter IS NOT NULL
          AND (purged_at IS NULL OR purged_at < purge_requested_at)
    """)
    for column in ("positions_from", "reset_done_at", "reset_requested_at", "reset_to",
                   "purge_acked", "purge_filter"):
        op.drop_column("queues", column)
