"""Lease runs' offsets and tokens stored out of line without compression.

A run's ``offsets`` (8 bytes per message) and ``lease_tokens`` (33 bytes of random hex per
message) pass PostgreSQL's 2 kB TOAST threshold at a few dozen messages, and by default the
server then compresses them with pglz before storing them. Random hex barely compresses, and
pglz is slow: measured on this machine (1,000-message runs, `benchmarks/runs_storage.py`),
inserting a run cost the server 1.2–1.5 µs per message with the default storage and
0.20–0.27 µs with ``STORAGE EXTERNAL`` (out of line, uncompressed); in a throughput cell of
`benchmarks/bench.py` the server's time for the run inserts fell from 2.1–2.6 to 1.0–1.8 µs
per message. The coordinator waits for that insert in every iteration's transaction. Runs
live only until their messages are acknowledged, so the bytes not saved on disk are few and
short-lived.

``SET STORAGE`` changes how new values are stored; existing rows are read as before. The
downgrade puts back the default (``EXTENDED``: compressed, then out of line).

Revision ID: 0011_runs_stored_uncompressed
Revises: 0010_rejected_counter
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

revision = "0011_runs_stored_uncompressed"
down_revision = "0010_rejected_counter"
branch_labels = None
depends_on = None

COLUMNS = ("offsets", "lease_tokens")


def upgrade() -> None:
    for column in COLUMNS:
        op.execute(f"ALTER TABLE entry_runs ALTER COLUMN {column} SET STORAGE EXTERNAL")


def downgrade() -> None:
    for column in COLUMNS:
        op.execute(f"ALTER TABLE entry_runs ALTER COLUMN {column} SET STORAGE EXTENDED")
