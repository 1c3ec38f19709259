"""Kafka driver errors become qlayer errors here, at the adapter boundary.

Every call into confluent-kafka in `layer.kafka` goes through `translated` (or catches the
same `DRIVER_ERRORS` itself), so a caller only ever sees a `KafkaAdapterError`: a coordinator
that catches `QlayerError` cannot be killed by a broker that went away. The error keeps what
librdkafka said about it (its code, and whether it is retriable, fatal or needs the
transaction aborted), because the transactional writer's recovery depends on it.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from layer.domain.errors import QlayerError

__all__ = [
    "DRIVER_ERRORS",
    "DeliveryFailed",
    "KafkaAdapterError",
    "LoginWatch",
    "RetentionGap",
    "driver_error",
    "security_problem",
    "translated",
]

#: librdkafka's names of a broker's refusals by ACL (docs/security.md).
AUTHORIZATION_CODES = frozenset({
    "TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED",
    "CLUSTER_AUTHORIZATION_FAILED", "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
})
_TIMINGS = re.compile(r"\s*\(after \d+ms[^)]*\)")

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


#: librdkafka's codes for "no broker could be reached".
_UNREACHABLE = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN"})


def driver_error(what: str, exc: BaseException,
                 kind: type[KafkaAdapterError] = KafkaAdapterError,
                 config: Mapping[str, Any] | None = None,
                 login: LoginWatch | None = None) -> KafkaAdapterError:
    """The qlayer error for a driver's exception: ``what`` failed, and librdkafka's verdict.

    With the client's ``config`` (and its `LoginWatch`), a refused login or a missing ACL is
    said as `security_problem` says it."""
    if isinstance(exc, KafkaAdapterError):
        return exc
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if config is not None:
        code = error.name() if isinstance(error, KafkaError) else None
        line = security_problem(what, config, code,
                                login.failure if login is not None else None)
        if line is not None:
            # Not retriable: a password or an ACL does not fix itself.
            return kind(line, code=code or "_AUTHENTICATION")
    if isinstance(error, KafkaError):
        where = ""
        if config is not None and error.name() in _UNREACHABLE:
            # "Broker transport failure" alone does not say which Kafka was asked.
            where = (f"; no broker answered at {config.get('bootstrap.servers')} "
                     "(--bootstrap-servers or QLAYER_BOOTSTRAP_SERVERS)")
        return kind(f"{what}: {error.str()} ({error.name()}){where}", code=error.name(),
                    retriable=error.retriable(), fatal=error.fatal(),
                    abortable=error.txn_requires_abort())
    if isinstance(exc, BufferError | TimeoutError):
        # The local queue is full, or a wait ran out: both may pass.
        return kind(f"{what}: {str(exc) or type(exc).__name__}", retriable=True)
    return kind(f"{what}: {str(exc) or type(exc).__name__}")


class LoginWatch:
    """A client's ``error_cb`` that keeps the last login failure (SASL or TLS handshake).

    A wrong password does not fail a call with its reason: librdkafka reports the refused login
    to ``error_cb`` and the call fails later as "broker transport failure" or a time-out. A
    caller that saw such a failure polls its client (which serves the callback) and asks
    `security_problem` for the line to show instead.
    """

    def __init__(self) -> None:
        self.failure: str | None = None

    def __call__(self, error: KafkaError) -> None:
        if error.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL):
            # "sasl_plaintext://h:p/bootstrap: SASL authentication error: ... (after 3ms ...)"
            self.failure = _TIMINGS.sub("", error.str()).split(": ", 1)[-1]


def security_problem(what: str, config: Mapping[str, Any], code: str | None,
                     login_failure: str | None = None) -> str | None:
    """One line for a refused login or a missing ACL, naming the broker, the user and the fix;
    None for any other failure. ``config`` is the client's librdkafka properties."""
    servers = config.get("bootstrap.servers", "?")
    user = config.get("sasl.username")
    protocol = str(config.get("security.protocol", "PLAINTEXT")).upper()
    who = f"user {user!r}" if user else f"an unauthenticated {protocol} client"
    if login_failure is not None and "SSL" in login_failure and not user:
        # No login was tried: the client did not trust the broker's certificate (or the
        # broker speaks no TLS there).
        return (f"{what}: the TLS handshake with Kafka at {servers} failed: {login_failure}. "
                "Check ssl.ca.location (the CA that signed the broker's certificate) and "
                "security.protocol in the kafka: settings (config file or QLAYER_KAFKA); "
                "docs/security.md")
    if login_failure is not None:
        mechanism = config.get("sasl.mechanism", "")
        return (f"{what}: Kafka at {servers} refused the login of {who}"
                f"{f' ({mechanism})' if mechanism else ''}: {login_failure}. Check "
                "sasl.username / sasl.password (or the TLS files) in the kafka: settings "
                "(config file or QLAYER_KAFKA) and that the user exists on the cluster")
    if code in AUTHORIZATION_CODES:
        return (f"{what}: Kafka at {servers} does not allow {who} this ({code}). An admin "
                "grants the rights of its role with `qlayer security acls ... --apply` "
                "(docs/security.md)")
    return None


@contextmanager
def translated(what: str, kind: type[KafkaAdapterError] = KafkaAdapterError) -> Iterator[None]:
    """Run a block of driver calls; a driver error leaves it as ``kind`` (from the original)."""
    try:
        yield
    except KafkaAdapterError:
        raise
    except DRIVER_ERRORS as exc:
        raise driver_error(what, exc, kind) from exc
