"""Authorization (protocol 7): principals, their grants, the installation's mode, and one
consumer registry across shards.

- ``principals``: who a consumer's credential proves it is (``qlayer security principal
  add``); only the SHA-256 of the credential's secret.
- ``grants``: the queues a principal may consume and the consumer ids it may use (name,
  prefix ending in ``*``, or ``*``), removed with their principal.
- ``installation.authorization_mode``: ``open`` (what no grant names is open to anyone, as
  Kafka's ``allow.everyone.if.no.acl.found=true``) or ``required``. Existing installations get
  ``open``: nothing changes for their consumers until an operator grants something.
- ``consumers.shard``: the shard holding the session. Only that shard writes the row, so a
  Subscribe another shard accepted for the same consumer id cannot overwrite or delete a live
  session (issue 36, finding 3). Existing rows get the shard of their queue (a regex
  subscription's rows stay NULL: the first shard that writes them takes them).
- ``consumers.principal`` / ``credential_sha256``: what the session's credential proved, so a
  restart keeps it and a revoked or rotated credential ends the session.

Downgrading drops all of it: an older coordinator knows no principals.

Revision ID: 0013_authorization
Revises: 0012_hold_shard_function
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_authorization"
down_revision = "0012_hold_shard_function"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("installation", sa.Column("authorization_mode", sa.Text(), nullable=False,
                                            server_default=sa.text("'open'")))
    op.create_check_constraint(op.f("ck_installation_authorization_mode_known"), "installation",
                               "authorization_mode IN ('open', 'required')")
    op.create_table(
        "principals",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("secret_sha256", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("issued_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_principals")),
    )
    op.create_table(
        "grants",
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("pattern", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["principal"], ["principals.name"], ondelete="CASCADE",
                                name=op.f("fk_grants_principal_principals")),
        sa.PrimaryKeyConstraint("principal", "kind", "pattern", name=op.f("pk_grants")),
        sa.CheckConstraint("kind IN ('queue', 'consumer_id')",
                           name=op.f("ck_grants_grant_kind_known")),
    )
    op.add_column("consumers", sa.Column("shard", sa.Integer(), nullable=True))
    op.add_column("consumers", sa.Column("principal", sa.Text(), nullable=True))
    op.add_column("consumers", sa.Column("credential_sha256", sa.LargeBinary(), nullable=True))
    op.execute("""
UPDATE consumers SET shard = queues.shard
FROM queues
WHERE NOT consumers.is_regex AND queues.name = consumers.queue AND queues.deleted_at IS NULL
""")


def downgrade() -> None:
    op.drop_column("consumers", "credential_sha256")
    op.drop_column("consumers", "principal")
    op.drop_column("consumers", "shard")
    op.drop_table("grants")
    op.drop_table("principals")
    op.drop_constraint(op.f("ck_installation_authorization_mode_known"), "installation",
                       type_="check")
    op.drop_column("installation", "authorization_mode")
