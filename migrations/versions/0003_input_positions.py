"""The coordinator's read positions in the control and ack topics (`input_positions`).

They were committed to Kafka after each iteration's writes, so a coordinator that stopped
between its PostgreSQL commit and that Kafka commit read those acks again after the restart
and answered their consumers DUPLICATE for acks it had applied. Written in the same
transaction as the acks' effects, they are read again exactly where the applied ones end.

Revision ID: 0003_input_positions
Revises: 0002_admitted_to
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_input_positions"
down_revision = "0002_admitted_to"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "input_positions",
        sa.Column("shard", sa.Text(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("shard", "topic", "partition",
                                name=op.f("pk_input_positions")),
        sa.CheckConstraint("partition >= 0 AND next_offset >= 0",
                           name=op.f("ck_input_positions_input_position_valid")),
    )


def downgrade() -> None:
    op.drop_table("input_positions")
