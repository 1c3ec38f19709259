"""One PostgreSQL round trip for a transaction (libpq's pipeline mode).

A coordinator iteration writes its batch in a dozen statements; sent one by one, each waits for
the server's answer before the next goes (a round trip each, and on a loaded machine a thread
switch each). In pipeline mode they are all sent, then the answers read at once; with the
BEGIN, the guard (`statements.HOLD_SHARD`, which raises rather than returning nothing) and the
COMMIT (`Pipeline.commit`) sent as statements of the same pipeline, the whole transaction is one
round trip. The connection is in autocommit mode for it (psycopg's own BEGIN in a pipeline is
synced at once, a round trip of its own), and the statements go to libpq directly, prepared
once per connection (psycopg's pipeline polls and flushes the socket for every statement).
The statements are the same SQLAlchemy constructs, compiled once for the connection's dialect,
with their bind processors applied as SQLAlchemy would and their parameters adapted by
psycopg's own adapters; a statement's result is read after the pipeline has synced
(`Pending`). Drivers without pipeline mode run the statements one by one (`Direct`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping
from selectors import EVENT_READ, EVENT_WRITE
from types import TracebackType
from typing import Any, Protocol

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import Executable

__all__ = ["CompiledCache", "Direct", "Executor", "Pipeline", "Result", "StatementsLost",
           "executor_for", "no_automatic_preparing"]

# What a generator run by psycopg's `Connection.wait` yields (the socket events to wait for)
# and is sent back (the events that happened): psycopg's own values, the selectors' flags.
WAIT_R = READY_R = EVENT_READ
READY_W = EVENT_WRITE
WAIT_RW = EVENT_READ | EVENT_WRITE


class Result(Protocol):
    """What the commit path reads of a statement's result, once it is available."""

    @property
    def rowcount(self) -> int: ...

    def scalar_one(self) -> Any: ...

    def scalar_one_or_none(self) -> Any: ...

    def scalars(self) -> Any: ...


class Executor(Protocol):
    def execute(self, statement: Executable, params: Mapping[str, Any] | None = None
                ) -> Result: ...

    def flush(self) -> None: ...

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

    def flush(self) -> None:
        """Nothing waits to be sent: each statement ran when it was executed."""

    def commit(self) -> None:
        self._conn.exec_driver_sql("COMMIT")

    def __enter__(self) -> Direct:
        self._conn.exec_driver_sql("BEGIN")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is not None:
            _roll_back(self._conn.connection.driver_connection)


# A statement compiled for a dialect: its SQL, the compiled form (which knows the statement's
# own literal parameters) and the bind processors of its parameters.
_Compiled = tuple[str, Any, dict[str, Callable[[Any], Any]]]


class StatementsLost(sa_exc.OperationalError):
    """The session's prepared statements were gone (deallocated behind the pipeline's back).
    The transaction wrote nothing; the next pipeline on the session prepares them again."""


# SQLSTATE invalid_sql_statement_name: "prepared statement ... does not exist".
_NO_SUCH_PREPARED_STATEMENT = "26000"


def no_automatic_preparing(dbapi_connection: Any, connection_record: Any) -> None:
    """A `connect` listener for engines a `Store` uses: psycopg's own automatic preparing off.

    psycopg deallocates *every* prepared statement of a session (DEALLOCATE ALL) after a
    rollback once it has prepared some of its own, and that would take the pipeline's with
    them. Only the commit path is hot enough to want prepared statements, and it prepares its
    own.
    """
    if hasattr(dbapi_connection, "prepare_threshold"):
        dbapi_connection.prepare_threshold = None


class _Session:
    """The statements one connection has prepared on its server, by SQL and parameter types.
    Names are never reused: one whose PREPARE the server skipped is simply never used again."""

    def __init__(self) -> None:
        self.names: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self.numbered = 0

    def new_name(self) -> bytes:
        self.numbered += 1
        return b"qlayer_%d" % self.numbered


class CompiledCache:
    """What a `Store` keeps between transactions: its statements compiled per dialect, and the
    statements each connection has prepared on its server."""

    def __init__(self) -> None:
        self.compiled: dict[tuple[int, int], tuple[Executable, _Compiled]] = {}
        self.sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()

    def compile(self, statement: Executable, dialect: Any) -> _Compiled:
        key = (id(statement), id(dialect))
        found = self.compiled.get(key)
        if found is None or found[0] is not statement:
            compiled: Any = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
            processors = {name: p for name, p in compiled._bind_processors.items()
                          if p is not None}
            found = self.compiled[key] = (statement, (compiled.string, compiled, processors))
        return found[1]


class Pending:
    """A pipelined statement's result: read it once the pipeline has synced."""

    def __init__(self, pipeline: Pipeline, index: int) -> None:
        self._pipeline = pipeline
        self._index = index

    def _result(self) -> Any:
        return self._pipeline.result(self._index)

    @property
    def rowcount(self) -> int:
        count = self._result().command_tuples
        return -1 if count is None else int(count)

    def _rows(self) -> list[tuple[Any, ...]]:
        result = self._result()
        transformer = self._pipeline.transformer
        transformer.set_pgresult(result)
        return [transformer.load_row(i, tuple) for i in range(result.ntuples)]

    def scalar_one(self) -> Any:
        rows = self._rows()
        if len(rows) != 1:
            raise ValueError("expected exactly one row")
        return rows[0][0]

    def scalar_one_or_none(self) -> Any:
        rows = self._rows()
        return rows[0][0] if rows else None

    def scalars(self) -> list[Any]:
        """The first column of every row."""
        return [row[0] for row in self._rows()]


class Pipeline:
    """A transaction's statements sent through libpq's pipeline mode as one batch: each
    `execute` only appends the statement to libpq's output buffer (preparing it on the server
    the first time the connection sends it); `__exit__` sends the sync, writes the buffer in as
    few writes as the socket takes, reads every answer, and raises the first error.

    This is psycopg's own pipeline, less its per-statement exchange with the server: psycopg
    polls and flushes the socket for every statement, so a dozen statements were a dozen
    wake-ups of the server's backend (on a loaded two-core machine, 45-225 µs each). Only the
    guard is flushed by itself (`flush`), so that the shard's ownership row is locked while the
    rest of the batch is composed.
    """

    def __init__(self, conn: Connection, cache: CompiledCache) -> None:
        from psycopg import pq
        from psycopg.adapt import Transformer

        self._conn = conn
        self._dialect = conn.dialect
        driver: Any = conn.connection.driver_connection
        self._pg = driver
        self._pgconn: Any = driver.pgconn
        self._cache = cache
        self._pq = pq
        self.transformer: Any = Transformer(self._pg)
        session = cache.sessions.get(driver)
        if session is None:
            session = cache.sessions[driver] = _Session()
        self._session = session
        # Prepared in this pipeline, not yet confirmed by the server: (key, its result's index).
        self._preparing: dict[tuple[bytes, tuple[int, ...]], tuple[bytes, int]] = {}
        self._sent = 0  # results the server owes
        self._results: list[Any] | None = None
        self._active = False

    def execute(self, statement: Executable, params: Mapping[str, Any] | None = None) -> Result:
        from psycopg._queries import PostgresQuery

        text, compiled, processors = self._cache.compile(statement, self._dialect)
        values = compiled.construct_params(params or {})
        for name, process in processors.items():
            if name in values:
                values[name] = process(values[name])
        # What SQLAlchemy's own execution tells its listeners (statement counters, tracing).
        self._conn.dispatch.before_cursor_execute(self._conn, None, text, values, None, False)
        query = PostgresQuery(self.transformer)
        try:
            query.convert(text, values)
        except self._errors as error:
            raise _translated(error, self._errors, text, values) from error
        key = (query.query, tuple(query.types))
        prepared = self._session.names.get(key)
        if prepared is None:
            pending = self._preparing.get(key)
            if pending is None:
                prepared = self._session.new_name()
                self._pgconn.send_prepare(prepared, query.query, param_types=query.types)
                self._preparing[key] = (prepared, self._sent)
                self._sent += 1
            else:
                prepared = pending[0]
        self._pgconn.send_query_prepared(prepared, query.params, param_formats=query.formats)
        self._sent += 1
        return Pending(self, self._sent - 1)

    def result(self, index: int) -> Any:
        if self._results is None:
            raise RuntimeError("a pipelined statement's result is read after the pipeline")
        return self._results[index]

    @property
    def _errors(self) -> type[Exception]:
        errors: type[Exception] = self._dialect.dbapi.Error  # type: ignore[union-attr]
        return errors

    def flush(self) -> None:
        """Send what is queued so far (the server starts on it), without waiting."""
        def flushed() -> Any:
            while self._pgconn.flush() != 0:
                ready = yield WAIT_RW
                if ready & READY_R:
                    self._pgconn.consume_input()

        self._wait(flushed())

    def commit(self) -> None:
        """Queue the COMMIT behind the statements; `__exit__` syncs, so the whole transaction
        is one round trip. After an error the server skips every statement up to the sync, this
        COMMIT included, and `__exit__` rolls the transaction back."""
        self._send(b"COMMIT")

    def _send(self, command: bytes) -> None:
        self._pgconn.send_query_params(command, None)
        self._sent += 1

    def _wait(self, gen: Any) -> Any:
        try:
            return self._pg.wait(gen)
        except self._errors as error:
            raise _translated(error, self._errors, None, None) from error

    def __enter__(self) -> Pipeline:
        # The connection is in autocommit mode and the transaction is begun by a statement of
        # the pipeline: psycopg begins its own transactions with a BEGIN that it syncs at once
        # (so that it knows the transaction started), a round trip of its own.
        if not self._pg.autocommit:
            raise ValueError("a Pipeline needs a connection in autocommit mode")
        if self._pgconn.transaction_status != self._pq.TransactionStatus.IDLE:
            raise ValueError("a Pipeline needs an idle connection")
        self._pgconn.enter_pipeline_mode()
        self._active = True
        self._send(b"BEGIN")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            self._leave()
        except BaseException:
            _roll_back(self._pg)
            if kind is None:
                raise
        if kind is not None:
            _roll_back(self._pg)

    def _leave(self) -> None:
        if not self._active:
            return
        self._active = False
        try:
            self._pgconn.pipeline_sync()
            results = self._wait(self._synced())
        finally:
            if self._pgconn.pipeline_status:
                with contextlib.suppress(Exception):
                    self._pgconn.exit_pipeline_mode()
                if self._pgconn.pipeline_status:
                    # Answers are still owed (the wait was interrupted): the session's state
                    # is unknown, so it is closed, and the pool discards it.
                    self._pg.close()
        self._results = results
        status = self._pq.ExecStatus
        for key, (name, index) in self._preparing.items():
            if results[index].status == status.COMMAND_OK:
                self._session.names[key] = name
        for result in results:
            if result.status == status.FATAL_ERROR:
                from psycopg import errors

                error = errors.error_from_result(result, encoding=self._pg.info.encoding)
                if error.sqlstate == _NO_SUCH_PREPARED_STATEMENT:
                    # Something deallocated the session's statements behind our back (a
                    # DISCARD ALL, a DEALLOCATE ALL): prepare them again next time.
                    self._session.names.clear()
                    raise StatementsLost(None, None, error) from error
                raise _translated(error, self._errors, None, None) from error

    def _synced(self) -> Any:
        """Send everything, then read one result per command sent, up to the sync."""
        pgconn = self._pgconn
        flushing = pgconn.flush() != 0
        while flushing:
            ready = yield WAIT_RW
            if ready & READY_R:
                pgconn.consume_input()
            if ready & READY_W:
                flushing = pgconn.flush() != 0
        results: list[Any] = []
        sync = self._pq.ExecStatus.PIPELINE_SYNC
        while True:
            while pgconn.is_busy():
                yield WAIT_R
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:
                continue  # the end of one command's results
            if result.status == sync:
                break
            results.append(result)
        if len(results) != self._sent:
            from psycopg import errors

            raise errors.InternalError(
                f"the pipeline answered {len(results)} results for {self._sent} commands")
        return results


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
