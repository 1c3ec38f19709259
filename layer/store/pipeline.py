"""One PostgreSQL round trip for a transaction (psycopg's pipeline mode).

A coordinator iteration writes its batch in a dozen statements; sent one by one, each waits for
the server's answer before the next goes (a round trip each, and on a loaded machine a thread
switch each). In pipeline mode they are all sent, then the answers read at once; with the
BEGIN, the guard (`statements.HOLD_SHARD`, which raises rather than returning nothing) and the
COMMIT (`Pipeline.commit`) sent as statements of the same pipeline, the whole transaction is one
round trip. (The connection is in autocommit mode for it: psycopg's own BEGIN in a pipeline is
synced at once, a round trip of its own.) The statements
are the same SQLAlchemy constructs, compiled once for the connection's dialect, with their bind
processors applied as SQLAlchemy would; a statement's result is read after the pipeline has
synced (`Pending`). Drivers without pipeline mode run the statements one by one (`Direct`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Protocol

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import Executable

__all__ = ["CompiledCache", "Direct", "Executor", "Pipeline", "Result", "executor_for"]


class Result(Protocol):
    """What the commit path reads of a statement's result, once it is available."""

    @property
    def rowcount(self) -> int: ...

    def scalar_one(self) -> Any: ...

    def scalar_one_or_none(self) -> Any: ...


class Executor(Protocol):
    def execute(self, statement: Executable, params: Mapping[str, Any] | None = None
                ) -> Result: ...

    def commit(self) -> None: ...


class Direct:
    """A transaction's statements run one by one through SQLAlchemy (their results are
    available at once), between an explicit BEGIN and COMMIT (the connection is in autocommit
    mode, as for `Pipeline`)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def execute(self, statement: Executable, params: Mapping[str, Any] | None = None) -> Result:
        result: Result = self._conn.execute(statement, params)
        return result

    def commit(self) -> None:
        self._conn.exec_driver_sql("COMMIT")

    def __enter__(self) -> Direct:
        self._conn.exec_driver_sql("BEGIN")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is not None:
            _roll_back(self._conn.connection.driver_connection)


class Pending:
    """A pipelined statement's cursor: read it once the pipeline has synced."""

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    @property
    def rowcount(self) -> int:
        return int(self._cursor.rowcount)

    def scalar_one(self) -> Any:
        row = self._cursor.fetchone()
        if row is None or self._cursor.fetchone() is not None:
            raise ValueError("expected exactly one row")
        return row[0]

    def scalar_one_or_none(self) -> Any:
        row = self._cursor.fetchone()
        return None if row is None else row[0]


# A statement compiled for a dialect: its SQL, the compiled form (which knows the statement's
# own literal parameters) and the bind processors of its parameters.
_Compiled = tuple[str, Any, dict[str, Callable[[Any], Any]]]


#: Compiled statements, per statement and dialect (each `Store` keeps one).
CompiledCache = dict[tuple[int, int], tuple[Executable, _Compiled]]


class Pipeline:
    """Statements sent without waiting; `__exit__` syncs (raising the first error)."""

    def __init__(self, conn: Connection, cache: CompiledCache) -> None:
        self._conn = conn
        self._dialect = conn.dialect
        self._pg: Any = conn.connection.driver_connection
        self._pipeline: Any = None
        self._cache = cache

    def _compiled(self, statement: Executable) -> _Compiled:
        key = (id(statement), id(self._dialect))
        found = self._cache.get(key)
        if found is None or found[0] is not statement:
            compiled: Any = statement.compile(dialect=self._dialect)  # type: ignore[attr-defined]
            processors = {name: p for name, p in compiled._bind_processors.items()
                          if p is not None}
            found = self._cache[key] = (statement, (compiled.string, compiled, processors))
        return found[1]

    def execute(self, statement: Executable, params: Mapping[str, Any] | None = None) -> Result:
        text, compiled, processors = self._compiled(statement)
        values = compiled.construct_params(params or {})
        for name, process in processors.items():
            if name in values:
                values[name] = process(values[name])
        cursor = self._pg.cursor()
        # What SQLAlchemy's own execution tells its listeners (statement counters, tracing).
        self._conn.dispatch.before_cursor_execute(self._conn, cursor, text, values, None, False)
        try:
            cursor.execute(text, values)
        except self._errors as error:
            raise _translated(error, self._errors, text, values) from error
        return Pending(cursor)

    @property
    def _errors(self) -> type[Exception]:
        errors: type[Exception] = self._dialect.dbapi.Error  # type: ignore[union-attr]
        return errors

    def commit(self) -> None:
        """Queue the COMMIT behind the statements; `__exit__` syncs, so the whole transaction
        is one round trip. After an error the server skips every statement up to the sync, this
        COMMIT included, and `__exit__` rolls the transaction back."""
        self._send("COMMIT")

    def _send(self, command: str) -> None:
        cursor = self._pg.cursor()
        try:
            cursor.execute(command)
        except self._errors as error:
            raise _translated(error, self._errors, command, None) from error

    def __enter__(self) -> Pipeline:
        # The connection is in autocommit mode and the transaction is begun by a statement of
        # the pipeline: psycopg begins its own transactions with a BEGIN that it syncs at once
        # (so that it knows the transaction started), a round trip of its own.
        if not self._pg.autocommit:
            raise ValueError("a Pipeline needs a connection in autocommit mode")
        self._pipeline = self._pg.pipeline()
        self._pipeline.__enter__()
        try:
            self._send("BEGIN")
        except BaseException:
            self._leave(None)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            self._leave(kind, value, traceback)
        except BaseException:
            _roll_back(self._pg)
            raise
        if kind is not None:
            _roll_back(self._pg)

    def _leave(self, kind: type[BaseException] | None, value: BaseException | None = None,
               traceback: TracebackType | None = None) -> None:
        pipeline, self._pipeline = self._pipeline, None
        try:
            pipeline.__exit__(kind, value, traceback)
        except self._errors as error:
            # The server's answer to a pipelined statement (a constraint, a lost connection):
            # the same SQLAlchemy error a statement run by itself raises.
            raise _translated(error, self._errors, None, None) from error


def _roll_back(driver: Any) -> None:
    """End the transaction a failed pipeline left open (or failed) on the server. Best effort:
    a connection that broke is discarded by the pool anyway."""
    try:
        if driver.info.transaction_status != 0:  # not IDLE
            driver.execute("ROLLBACK")
    except Exception:  # the first error is the one to raise
        pass


def _translated(error: Exception, base: type[Exception], statement: str | None,
                params: Any) -> sa_exc.StatementError:
    """A driver error as the SQLAlchemy error class SQLAlchemy would raise for it."""
    return sa_exc.DBAPIError.instance(statement, params, error, base)


def executor_for(conn: Connection, cache: CompiledCache) -> Pipeline | Direct:
    """One transaction, begun on entering and committed by `commit()`, on a connection in
    autocommit mode: a pipeline on psycopg connections (pipeline mode needs libpq 14+), else
    the statements one by one."""
    driver = conn.connection.driver_connection
    supported = getattr(type(driver), "pipeline", None) is not None
    if supported:
        try:
            import psycopg

            supported = psycopg.Pipeline.is_supported()
        except (ImportError, AttributeError):
            supported = False
    return Pipeline(conn, cache) if supported else Direct(conn)
