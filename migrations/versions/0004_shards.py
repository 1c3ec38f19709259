"""Shards (coordinator v2, DESIGN §3): a fixed shard count per installation, a shard per queue,
ownership by Kafka's group protocol instead of a TTL, and a registry of coordinator processes.

- ``installation``: one row, the shard count. Chosen here (``qlayer db upgrade --shards N``,
  default 16) and never changed by a later upgrade: every queue's placement depends on it.
- ``queues.shard``: existing queues are placed by the CRC-32 hash of their name (or of their
  ``shard_group``), as new ones are.
- ``ownership``: ``expires_at`` goes (the group protocol decides who runs a shard; the epoch
  still fences); ``lag`` and ``reported_at`` say how far behind each shard's owner is.
  Rows of the version-1 single shard ("default") are dropped, which fences a version-1
  coordinator still running against this database.
- ``input_positions`` of the single shard move to the shard that reads each partition
  (partition p of control and ack belongs to shard p mod N).
- ``coordinator_processes``: each running process, for ``qlayer coordinators``.

Revision ID: 0004_shards
Revises: 0003_input_positions
Create Date: 2026-11-24
"""

from __future__ import annotations

import zlib
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision = "0004_shards"
down_revision = "0003_input_positions"
branch_labels = None
depends_on = None

_TIMESTAMPTZ = sa.DateTime(timezone=True)
#: layer.domain.shards.DEFAULT_SHARD_COUNT, repeated: a revision must not change when the code
#: it was written with does.
_DEFAULT_SHARDS = 16
_MAX_SHARDS = 1024


def _shard_count() -> int:
    """``qlayer db upgrade --shards N`` passes it as a config attribute; plain Alembic as
    ``-x shards=N``."""
    config = context.config
    chosen = config.attributes.get("qlayer_shard_count")
    if chosen is None:
        chosen = context.get_x_argument(as_dictionary=True).get("shards")
    count = int(chosen) if chosen is not None else _DEFAULT_SHARDS
    if not 1 <= count <= _MAX_SHARDS:
        raise ValueError(f"the shard count must be between 1 and {_MAX_SHARDS}, got {count}")
    return count


def upgrade() -> None:
    count = _shard_count()
    op.create_table(
        "installation",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("shard_count", sa.Integer(), nullable=False),
        sa.Column("created_at", _TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_installation")),
        sa.CheckConstraint("id = 1", name=op.f("ck_installation_one_row")),
        sa.CheckConstraint(f"shard_count BETWEEN 1 AND {_MAX_SHARDS}",
                           name=op.f("ck_installation_shard_count_valid")),
    )
    conn = op.get_bind()
    conn.execute(sa.text("INSERT INTO installation (id, shard_count, created_at) "
                         "VALUES (1, :count, :now)"),
                 {"count": count, "now": datetime.now(UTC)})

    op.add_column("queues", sa.Column("shard", sa.Integer(), nullable=True))
    rows = conn.execute(sa.text("SELECT name, definition FROM queues")).all()
    for name, definition in rows:
        explicit = definition.get("shard") if isinstance(definition, dict) else None
        group = definition.get("shard_group") if isinstance(definition, dict) else None
        if isinstance(explicit, int) and 0 <= explicit < count:
            shard = explicit
        else:
            shard = zlib.crc32(str(group or name).encode()) % count
        conn.execute(sa.text("UPDATE queues SET shard = :shard WHERE name = :name"),
                     {"shard": shard, "name": name})
    op.alter_column("queues", "shard", nullable=False)
    op.create_check_constraint(op.f("ck_queues_shard_valid"), "queues", "shard >= 0")

    conn.execute(sa.text("DELETE FROM ownership"))
    op.drop_column("ownership", "expires_at")
    op.add_column("ownership", sa.Column("lag", sa.BigInteger(), nullable=True))
    op.add_column("ownership", sa.Column("reported_at", _TIMESTAMPTZ, nullable=True))

    # Version 1 read every partition as shard "default"; partition p now belongs to shard
    # p mod N. Where two partitions land on one shard each keeps its own row (the key has the
    # partition), so nothing is read twice or skipped.
    conn.execute(sa.text(
        "UPDATE input_positions SET shard = (partition % :count)::text WHERE shard = 'default'"),
        {"count": count})

    op.create_table(
        "coordinator_processes",
        sa.Column("owner_id", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("seen_at", _TIMESTAMPTZ, nullable=False),
        sa.Column("shards", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.PrimaryKeyConstraint("owner_id", name=op.f("pk_coordinator_processes")),
    )


def downgrade() -> None:
    op.drop_table("coordinator_processes")
    conn = op.get_bind()
    conn.execute(sa.text("DELETE FROM ownership"))
    op.drop_column("ownership", "reported_at")
    op.drop_column("ownership", "lag")
    op.add_column("ownership", sa.Column("expires_at", _TIMESTAMPTZ, nullable=False))
    # Back to one shard: the furthest position of each partition is not knowable per shard
    # any more than it was, and each partition has exactly one row, so only the name changes.
    conn.execute(sa.text("UPDATE input_positions SET shard = 'default'"))
    op.drop_constraint(op.f("ck_queues_shard_valid"), "queues", type_="check")
    op.drop_column("queues", "shard")
    op.drop_table("installation")
