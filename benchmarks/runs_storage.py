"""What PostgreSQL's server spends to insert lease runs, by the columns' storage strategy.

    .venv/bin/python benchmarks/runs_storage.py --database-url postgresql://postgres@127.0.0.1:15432/postgres

A run's ``offsets`` and ``lease_tokens`` pass the 2 kB TOAST threshold at a few dozen
messages; by default (``EXTENDED``) the server compresses them with pglz first. This inserts
the same runs (40 × 1,000 messages: 1,000 offsets and 1,000 random 32-hex tokens each, the
shape of an at-least-once iteration) into a scratch table under each strategy and prints the
best of five transactions, in µs per message. Migration 0011 chose ``EXTERNAL``.
"""
from __future__ import annotations

import argparse
import os
import time

import psycopg

RUNS, MESSAGES = 40, 1_000
VARIANTS = {
    "EXTENDED (pglz, the default)": [],
    "EXTENDED with lz4": ["SET COMPRESSION lz4"],
    "EXTERNAL (0011)": ["SET STORAGE EXTERNAL"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:15432/postgres")
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    runs = [("{" + ",".join(str(r * MESSAGES + i) for i in range(MESSAGES)) + "}",
             ",".join(os.urandom(16).hex() for _ in range(MESSAGES))) for r in range(RUNS)]
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        for name, alters in VARIANTS.items():
            conn.execute("DROP TABLE IF EXISTS qlayer_runs_storage_bench")
            conn.execute("CREATE TABLE qlayer_runs_storage_bench (seq bigserial PRIMARY KEY, "
                         "offsets bigint[] NOT NULL, lease_tokens text)")
            for alter in alters:
                for column in ("offsets", "lease_tokens"):
                    conn.execute(f"ALTER TABLE qlayer_runs_storage_bench ALTER COLUMN {column} "
                                 f"{alter}")
            best = float("inf")
            for _ in range(args.repetitions):
                conn.execute("TRUNCATE qlayer_runs_storage_bench")
                started = time.perf_counter()
                with conn.transaction():
                    for offsets, tokens in runs:
                        conn.execute("INSERT INTO qlayer_runs_storage_bench (offsets, "
                                     "lease_tokens) VALUES (%s::bigint[], %s)", (offsets, tokens))
                best = min(best, time.perf_counter() - started)
            print(f"{name:30} {best * 1e6 / (RUNS * MESSAGES):6.2f} µs per message")
        conn.execute("DROP TABLE qlayer_runs_storage_bench")


if __name__ == "__main__":
    main()
