"""`--output`: where each form of target goes (no Spark needed)."""

from __future__ import annotations

import pytest

from layer.pipeline.io import OutputError, Sink, parse_sink, store_url
from layer.store.reports import ReportTableError, check_table_name


@pytest.mark.parametrize(("target", "sink"), [
    ("/data/lifecycle", Sink(path="/data/lifecycle")),
    ("s3a://audit/2026-01-01", Sink(path="s3a://audit/2026-01-01")),
    ("postgresql://report:s3cret@db.internal:5433/reports",
     Sink(jdbc_url="jdbc:postgresql://db.internal:5433/reports", table="t", user="report",
          password="s3cret")),
    ("postgresql+psycopg://postgres@127.0.0.1:25432/qlayer?sslmode=require",
     Sink(jdbc_url="jdbc:postgresql://127.0.0.1:25432/qlayer?sslmode=require", table="t",
          user="postgres")),
    ("jdbc:postgresql://db/reports?user=r", Sink(jdbc_url="jdbc:postgresql://db/reports?user=r",
                                                 table="t")),
])
def test_a_target_is_a_parquet_directory_or_a_postgres_table(target: str, sink: Sink) -> None:
    assert parse_sink(target, "t") == sink


def test_the_password_is_not_shown() -> None:
    sink = parse_sink("postgresql://report:s3cret@db/reports", "metrics")
    assert sink.describe() == "jdbc:postgresql://db/reports table metrics"


@pytest.mark.parametrize(("target", "message"), [
    ("postgresql://db.internal", "names no database"),
    ("jdbc:mysql://db/reports", "only jdbc:postgresql:// URLs are supported"),
])
def test_targets_that_cannot_work_are_refused(target: str, message: str) -> None:
    with pytest.raises(OutputError, match=message):
        parse_sink(target, "t")


@pytest.mark.parametrize(("target", "url"), [
    ("postgresql://report:s3cret@db.internal:5433/reports",
     "postgresql+psycopg://report:s3cret@db.internal:5433/reports"),
    ("jdbc:postgresql://db/reports?user=r&password=pw&sslmode=require",
     "postgresql+psycopg://r:pw@db/reports?sslmode=require"),
])
def test_the_swap_connects_where_spark_writes(target: str, url: str) -> None:
    # The staging table and the table are in one database: the swap's connection is the
    # JDBC writer's, with qlayer's driver.
    assert store_url(parse_sink(target, "t")).render_as_string(hide_password=False) == url


@pytest.mark.parametrize("table", ["metrics; DROP TABLE x", "a.b.c", "1st", "my-table", ""])
def test_a_table_name_that_would_need_quoting_is_refused(table: str) -> None:
    with pytest.raises(ReportTableError, match="letters, digits and underscores"):
        check_table_name(table)
