"""The SQL of the Spark pipeline (docs/pipeline.md): replacing an output table in one
transaction, and reading a queue's final state for `reconcile`.

The pipeline's output tables are reports, not qlayer's state, and may live in another
database; the statements are here anyway so that every SQL text qlayer runs is in
``layer/store``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from sqlalchemy import Connection, func, literal, null, select, text, union_all
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.types import BigInteger, Integer, Text

from layer.domain.errors import QlayerError
from layer.store.tables import entries, entry_runs, queues, recovery_points

__all__ = [
    "ReportTableError",
    "check_table_name",
    "drop_staging",
    "final_state_query",
    "merge_table",
    "queue_definition_query",
    "replace_table",
]

# A table name, optionally schema-qualified, that needs no quoting: the name is spliced into
# DDL (PostgreSQL cannot bind identifiers), so anything else is refused.
_TABLE_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")


class ReportTableError(QlayerError, ValueError):
    """An output table name the pipeline will not splice into SQL."""


def check_table_name(name: str) -> str:
    """``name`` if it is ``table`` or ``schema.table`` of letters, digits and underscores."""
    if not _TABLE_NAME.match(name):
        raise ReportTableError(
            f"table {name!r}: give a name of letters, digits and underscores, optionally "
            "schema-qualified (reports.queue_metrics)")
    return name


def _quoted(column: str) -> str:
    return '"' + column.replace('"', '""') + '"'


def replace_table(conn: Connection, table: str, staging: str, columns: Sequence[str]) -> None:
    """Make ``table`` hold exactly the rows of ``staging``, then drop ``staging``; run it in
    one transaction (the caller's ``conn.begin()``).

    Readers in other connections see the old rows until the transaction commits and the new
    ones after, never an empty or half table: the rows are replaced with DELETE + INSERT,
    which are MVCC (a TRUNCATE would show an empty table to a reader whose snapshot is older
    than it). The table stays the same object, so its grants and indexes stay. ``EXCLUSIVE``
    lets readers through but makes a second writer wait for this one: two DELETE + INSERTs
    interleaved would each keep the other's rows. A table that does not exist yet is the
    staging table renamed.
    """
    check_table_name(table)
    check_table_name(staging)
    exists = conn.execute(text("SELECT to_regclass(:name) IS NOT NULL"),
                          {"name": table}).scalar_one()
    if not exists:
        conn.execute(text(f"ALTER TABLE {staging} RENAME TO {table.rsplit('.', 1)[-1]}"))
        return
    names = ", ".join(_quoted(c) for c in columns)
    conn.execute(text(f"LOCK TABLE {table} IN EXCLUSIVE MODE"))
    conn.execute(text(f"DELETE FROM {table}"))
    conn.execute(text(f"INSERT INTO {table} ({names}) SELECT {names} FROM {staging}"))
    conn.execute(text(f"DROP TABLE {staging}"))


def merge_table(conn: Connection, table: str, staging: str, columns: Sequence[str],
                keys: Sequence[str], *, deleted: str | None = None,
                null_safe: bool = False) -> None:
    """Make ``table``'s rows whose ``keys`` are in ``staging`` the rows of ``staging`` (the
    others stay), then drop ``staging``; in one transaction (the caller's). What an
    incremental stream writes: only the rows its micro-batch changed. A table that does not
    exist yet is the staging table renamed.

    ``deleted`` names a boolean column of ``staging`` (not of ``table``): its true rows only
    delete their keys (a metrics window or a view group that has nothing left). With
    ``null_safe`` a null key matches a null key (a view's group of payloads without the field);
    it is off for keys that are never null, whose equality the planner can hash.
    """
    check_table_name(table)
    check_table_name(staging)
    kept = [c for c in columns if c != deleted]
    names = ", ".join(_quoted(c) for c in kept)
    exists = conn.execute(text("SELECT to_regclass(:name) IS NOT NULL"),
                          {"name": table}).scalar_one()
    if not exists:
        conn.execute(text(f"ALTER TABLE {staging} RENAME TO {table.rsplit('.', 1)[-1]}"))
        if deleted is not None:
            conn.execute(text(f"DELETE FROM {table} WHERE {_quoted(deleted)}"))
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {_quoted(deleted)}"))
        return
    equal = "IS NOT DISTINCT FROM" if null_safe else "="
    match = " AND ".join(f"t.{_quoted(k)} {equal} s.{_quoted(k)}" for k in keys)
    only_rows = "" if deleted is None else f" WHERE NOT {_quoted(deleted)}"
    conn.execute(text(f"LOCK TABLE {table} IN EXCLUSIVE MODE"))
    conn.execute(text(f"DELETE FROM {table} AS t USING {staging} AS s WHERE {match}"))
    conn.execute(text(f"INSERT INTO {table} ({names}) SELECT {names} FROM {staging}{only_rows}"))
    conn.execute(text(f"DROP TABLE {staging}"))


def drop_staging(conn: Connection, staging: str) -> None:
    """Drop a staging table whose swap did not happen (no reader ever reads one)."""
    conn.execute(text(f"DROP TABLE IF EXISTS {check_table_name(staging)}"))


def _literal_sql(statement: ClauseElement) -> str:
    """A statement as PostgreSQL text with its values inlined (Spark's JDBC ``query`` option
    takes no parameters; SQLAlchemy quotes the values)."""
    compiled = statement.compile(
        dialect=postgresql.dialect(),  # type: ignore[no-untyped-call]
        compile_kwargs={"literal_binds": True})
    return str(compiled)


def final_state_query(queue: str) -> str:
    """One statement, so one snapshot, giving what PostgreSQL knows of ``queue``'s entries:
    its recovery points (``kind`` ``recovery_point``: every entry below ``offset`` is done)
    and every stored write of an entry (``kind`` ``entry``: an `entries` row, or one offset
    of an `entry_runs` run) with its ``state`` and ``seq`` (the latest write of an entry
    wins, docs/storage.md). Columns: kind, topic, partition, offset, state, seq."""
    points = select(
        literal("recovery_point", Text).label("kind"), recovery_points.c.topic,
        recovery_points.c.partition, recovery_points.c.offset,
        null().cast(Text).label("state"), null().cast(BigInteger).label("seq"),
    ).where(recovery_points.c.queue == queue)
    rows = select(
        literal("entry", Text).label("kind"), entries.c.topic, entries.c.partition,
        entries.c.offset, entries.c.state, entries.c.seq,
    ).where(entries.c.queue == queue)
    runs = select(
        literal("entry", Text).label("kind"), entry_runs.c.topic,
        entry_runs.c.partition.cast(Integer).label("partition"),
        func.unnest(entry_runs.c.offsets).label("offset"), entry_runs.c.state,
        entry_runs.c.seq,
    ).where(entry_runs.c.queue == queue)
    return _literal_sql(union_all(points, rows, runs))


def queue_definition_query(queue: str) -> str:
    """The live definition of ``queue`` as JSON text (column ``definition``), no row if there
    is none."""
    statement = select(queues.c.definition.cast(Text).label("definition")).where(
        (queues.c.name == queue) & queues.c.deleted_at.is_(None))
    return _literal_sql(statement)
