"""Per-queue counters of journal records read with a fault that stays with the record.

- ``queue_counters.unparseable``: records whose value the queue's own filter, priority or
  barrier read and could not parse as JSON. They are decided as the reference says (a filter
  that cannot be evaluated is false, a priority that cannot be evaluated is the lowest); this
  is how an operator sees them.
- ``queue_counters.deletes``: Kafka tombstones (deletes) passed over: "Only publish messages
  are added to the queue."
- ``queue_counters.malformed_headers``: ``qlayer.deliver-at`` or ``qlayer.expiration``
  headers that could not be read and were ignored.

Before this revision these were counted only inside the coordinator process. Existing queues
start at 0. Downgrading drops the columns.

Revision ID: 0007_input_counters
Revises: 0006_operator_requests
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_input_counters"
down_revision = "0006_operator_requests"
branch_labels = None
depends_on = None

_COLUMNS = ("unparseable", "deletes", "malformed_headers")


def upgrade() -> None:
    for name in _COLUMNS:
        op.add_column("queue_counters", sa.Column(name, sa.BigInteger(), nullable=False,
                                                  server_default=sa.text("0")))


def downgrade() -> None:
    for name in reversed(_COLUMNS):
        op.drop_column("queue_counters", name)
