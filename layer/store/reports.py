"""The SQL of the Spark pipeline (docs/pipeline.md): replacing an output table in one
transaction.

The pipeline's output tables are reports, not qlayer's state, and may live in another
database; the statements are here anyway so that every SQL text qlayer runs is in
``layer/store``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from sqlalchemy import Connection, text

from layer.domain.errors import QlayerError

__all__ = [
    "ReportTableError",
    "check_table_name",
    "drop_staging",
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


def drop_staging(conn: Connection, staging: str) -> None:
    """Drop a staging table whose swap did not happen (no reader ever reads one)."""
    conn.execute(text(f"DROP TABLE IF EXISTS {check_table_name(staging)}"))
