"""Errors of the Postgres store.

Driver and SQLAlchemy errors never leave `layer.store`: the store turns them into these, so the
coordinator and the CLI catch qlayer errors only (DESIGN §9: driver errors become qlayer errors at
the adapter boundary).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import exc as sa_exc

from layer.domain.errors import QlayerError

__all__ = ["FencedError", "QueueVersionConflictError", "StoreError", "translate_errors"]


class StoreError(QlayerError):
    """A PostgreSQL operation failed; nothing of the failed transaction was written.

    ``retryable`` is true for failures that say nothing about the request itself (connection
    lost, server shutting down, deadlock, serialization failure): the caller may simply try the
    same work again. False means the request was refused (a constraint, a bad statement) and
    repeating it will fail the same way.
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class FencedError(StoreError):
    """The caller no longer owns the shard under the epoch it holds; nothing was written.

    Raised by guarded writes after another coordinator took the shard over (or the owner
    released it). The zombie must stop working on the shard: its in-memory state is stale.
    """

    def __init__(self, shard: str, owner_id: str, epoch: int) -> None:
        super().__init__(
            f"fenced: {owner_id!r} no longer owns shard {shard!r} at epoch {epoch}",
            retryable=False,
        )
        self.shard = shard
        self.owner_id = owner_id
        self.epoch = epoch


class QueueVersionConflictError(StoreError):
    """A queue definition changed since the caller read it (optimistic concurrency)."""

    def __init__(self, name: str, expected: int, actual: int | None) -> None:
        found = "it does not exist" if actual is None else f"it is at version {actual}"
        super().__init__(
            f"queue {name!r} changed: expected version {expected}, but {found}",
            retryable=False,
        )
        self.name = name
        self.expected = expected
        self.actual = actual


# SQLSTATE classes that mean "try again", not "your request is wrong": serialization failure,
# deadlock, connection exceptions, operator intervention (admin shutdown, crash shutdown).
_RETRYABLE_SQLSTATE_PREFIXES = ("40001", "40P01", "08", "57P")


def _is_retryable(error: sa_exc.SQLAlchemyError) -> bool:
    if isinstance(error, sa_exc.DBAPIError):
        if error.connection_invalidated:
            return True
        sqlstate = getattr(error.orig, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate.startswith(_RETRYABLE_SQLSTATE_PREFIXES)
        return isinstance(error, sa_exc.OperationalError)
    return isinstance(error, sa_exc.TimeoutError | sa_exc.DisconnectionError)


@contextmanager
def translate_errors(action: str) -> Iterator[None]:
    """Re-raise SQLAlchemy / psycopg errors from the block as `StoreError` naming the action."""
    try:
        yield
    except sa_exc.SQLAlchemyError as error:
        detail = getattr(error, "orig", None) or error
        first_line = str(detail).strip().splitlines()[0] if str(detail).strip() else repr(detail)
        raise StoreError(f"{action}: {first_line}", retryable=_is_retryable(error)) from error
