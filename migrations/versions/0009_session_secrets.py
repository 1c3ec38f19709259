"""Session identity (protocol 5): the SHA-256 of each consumer session's secret.

``consumers.secret_sha256`` holds the hash of the ``qlayer.secret`` a session's Subscribe
carried (docs/security.md, "Session identity"), so a coordinator that restarts, or takes a
queue over, still asks that session's later records for their proof, and still refuses a
Subscribe that would take the consumer id over without it. Never the secret itself.

Existing sessions (written by an older coordinator) get NULL: unproven, as they were. Downgrading
drops the column: every session becomes unproven, which an older coordinator expects.

Revision ID: 0009_session_secrets
Revises: 0008_shard_counters
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_session_secrets"
down_revision = "0008_shard_counters"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("consumers", sa.Column("secret_sha256", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.drop_column("consumers", "secret_sha256")
