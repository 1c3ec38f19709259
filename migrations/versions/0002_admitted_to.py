"""Recovery points remember how far each partition was admitted (`admitted_to`).

A restarted coordinator re-reads the journal from the recovery point and admits those records
again; without knowing where the previous incarnation had got to, it counted them as newly
enqueued, so `enqueued` grew by the replayed records on every restart.

Revision ID: 0002_admitted_to
Revises: 0001_initial
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_admitted_to"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("recovery_points", sa.Column("admitted_to", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("recovery_points", "admitted_to")
