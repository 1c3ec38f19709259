"""A Postgres output table is replaced in one transaction: a reader never sees it empty or
half written (docs/pipeline.md, "Output: Parquet or Postgres"), against the real PostgreSQL."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from layer.pipeline.io import parse_sink, write_table

pytestmark = pytest.mark.integration


def test_a_reader_sees_the_old_rows_or_the_new_ones_never_an_empty_or_half_table(
    spark: SparkSession, database_url: str,
) -> None:
    sink = parse_sink(database_url, "atomic_output")
    # Several partitions: Spark's JDBC writer commits each one on its own.
    old = spark.range(20_000, numPartitions=4).select(F.col("id"), F.lit("old").alias("tag"))
    new = spark.range(30_000, numPartitions=4).select(F.col("id"), F.lit("new").alias("tag"))
    write_table(old, sink)

    engine = sqlalchemy.create_engine(database_url)
    with engine.begin() as db:
        # What an operator adds to a report table: it must survive the rewrites.
        db.execute(sqlalchemy.text("CREATE INDEX atomic_output_by_tag ON atomic_output (tag)"))

    seen: set[tuple[int, int]] = set()
    polls = 0
    stop = threading.Event()

    def poll() -> None:
        nonlocal polls
        with engine.connect() as reader:
            while not stop.is_set():
                counts = reader.execute(sqlalchemy.text(
                    "SELECT count(*) FILTER (WHERE tag = 'old'), "
                    "count(*) FILTER (WHERE tag = 'new') FROM atomic_output")).one()
                reader.commit()
                seen.add((int(counts[0]), int(counts[1])))
                polls += 1

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        write_table(new, sink)
        write_table(old, sink)
        write_table(new, sink)
    finally:
        stop.set()
        reader.join()

    assert polls > 0
    assert seen <= {(20_000, 0), (0, 30_000)}, sorted(seen)
    with engine.connect() as db:
        final = db.execute(sqlalchemy.text(
            "SELECT count(*), count(DISTINCT id) FROM atomic_output WHERE tag = 'new'")).one()
        index = db.execute(sqlalchemy.text(
            "SELECT count(*) FROM pg_indexes WHERE indexname = 'atomic_output_by_tag'")).scalar()
        leftovers = db.execute(sqlalchemy.text(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'atomic_output_staging_%'")
        ).scalar()
    engine.dispose()
    assert tuple(final) == (30_000, 30_000)
    assert index == 1
    assert leftovers == 0
