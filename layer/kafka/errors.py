"""Kafka driver errors become qlayer errors here, at the adapter boundary.

Every call into confluent-kafka in `layer.kafka` goes through `translated` (or catches the
same `DRIVER_ERRORS` itself), so a caller only ever sees a `KafkaAdapterError`: a coordinator
that catches `QlayerError` cannot be killed by a broker that went away. The error keeps what
librdkafka said about it (its code, and whether it is retriable, fatal or needs the
transaction aborted), because the transactional writer's recovery depends on it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from contextlib import contextmanager

from confluent_kafka import KafkaError, KafkaException

from layer.domain.errors import QlayerError

__all__ = [
    "DRIVER_ERRORS",
    "DeliveryFailed",
    "KafkaAdapterError",
    "RetentionGap",
    "driver_error",
    "translated",
]

#: What confluent-kafka raises besides `KafkaException`: a full local queue (BufferError), a
#: closed client (RuntimeError), the admin client's futures (their TimeoutError, which is the
#: built-in one, and CancelledError). Not TypeError or ValueError: those are qlayer's bugs.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    KafkaException, BufferError, RuntimeError, TimeoutError, concurrent.futures.CancelledError)


class KafkaAdapterError(QlayerError):
    """A Kafka operation failed; the message says which and why.

    ``code`` is librdkafka's error name (``_TIMED_OUT``, ``_TRANSPORT``, ...) when it gave
    one. ``retriable``: the same call may succeed later (timeouts, a broker away). ``fatal``:
    the client can do nothing more and must be replaced. ``abortable``: the current Kafka
    transaction can only be aborted."""

    def __init__(self, message: str, *, code: str | None = None, retriable: bool = False,
                 fatal: bool = False, abortable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retriable = retriable
        self.fatal = fatal
        self.abortable = abortable


class DeliveryFailed(KafkaAdapterError):
    """Records could not be written (after the producer's own retries)."""


class RetentionGap(KafkaAdapterError):
    """A partition's position is below its log start: retention deleted unread records.

    The coordinator rebuilds from its stored state on any adapter error, and its start-up
    reports entries lost to retention (reason ``retention``); so this never passes silently.
    """


def driver_error(what: str, exc: BaseException,
                 kind: type[KafkaAdapterError] = KafkaAdapterError) -> KafkaAdapterError:
    """The qlayer error for a driver's exception: ``what`` failed, and librdkafka's verdict."""
    if isinstance(exc, KafkaAdapterError):
        return exc
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if isinstance(error, KafkaError):
        return kind(f"{what}: {error.str()} ({error.name()})", code=error.name(),
                    retriable=error.retriable(), fatal=error.fatal(),
                    abortable=error.txn_requires_abort())
    if isinstance(exc, BufferError | TimeoutError):
        # The local queue is full, or a wait ran out: both may pass.
        return kind(f"{what}: {str(exc) or type(exc).__name__}", retriable=True)
    return kind(f"{what}: {str(exc) or type(exc).__name__}")


@contextmanager
def translated(what: str, kind: type[KafkaAdapterError] = KafkaAdapterError) -> Iterator[None]:
    """Run a block of driver calls; a driver error leaves it as ``kind`` (from the original)."""
    try:
        yield
    except KafkaAdapterError:
        raise
    except DRIVER_ERRORS as exc:
        raise driver_error(what, exc, kind) from exc
