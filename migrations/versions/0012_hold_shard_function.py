"""The ownership guard as a function that raises, so a shard iteration commits in one round trip.

Every guarded transaction of a coordinator (one per loop iteration) starts with the guard: an
UPDATE of the shard's ownership row that finds it only under the caller's owner id and epoch,
and row-locks it until the commit (a takeover waits for the transaction; a takeover that
committed first bumped the epoch). Until this revision the guard ran alone, and its answer was
read before anything else was sent: with the implicit BEGIN and the COMMIT, four round trips
to the server per iteration. With the guard in the pipeline, one (`benchmarks/commit_bench.py
--before c5aeb39` on this machine: p50 2.54 -> 1.60 ms for a 7-message iteration).

``qlayer_hold_shard`` does the same UPDATE and raises SQLSTATE ``QLF01`` when the row is not
held, so the guard, the iteration's statements and the COMMIT can be sent at once (psycopg's
pipeline mode): a fenced coordinator's statements are then never executed, because PostgreSQL
skips every statement of a pipeline after an error, and the transaction is rolled back.

Revision ID: 0012_hold_shard_function
Revises: 0011_runs_stored_uncompressed
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

revision = "0012_hold_shard_function"
down_revision = "0011_runs_stored_uncompressed"
branch_labels = None
depends_on = None

# The SQLSTATE `layer.store.errors` turns into FencedError (class "QL" is no PostgreSQL class).
FENCED_SQLSTATE = "QLF01"


def upgrade() -> None:
    op.execute(f"""
CREATE FUNCTION qlayer_hold_shard(the_shard text, the_owner_id text, the_epoch bigint,
                                  the_now timestamptz) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    held bigint;
BEGIN
    UPDATE ownership SET heartbeat_at = the_now
     WHERE shard = the_shard AND owner_id = the_owner_id AND epoch = the_epoch
    RETURNING epoch INTO held;
    IF held IS NULL THEN
        RAISE EXCEPTION 'shard % is not held by % at epoch %', the_shard, the_owner_id,
            the_epoch USING ERRCODE = '{FENCED_SQLSTATE}';
    END IF;
    RETURN held;
END
$$
""")


def downgrade() -> None:
    op.execute("DROP FUNCTION qlayer_hold_shard(text, text, bigint, timestamptz)")
