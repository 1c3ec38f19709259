"""Errors the SDK raises. All are :class:`~layer.domain.errors.QlayerError`, so one ``except``
catches everything qlayer raises on purpose; each says what happened and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from layer.domain.errors import ExpressionError, QlayerError
from layer.domain.errors import UnknownQueueError as DomainUnknownQueueError
from layer.protocol.records import AckStatus, AckType, SessionEndReason

__all__ = [
    "AckFailure",
    "ConsumerClosedError",
    "InvalidFilterError",
    "InvalidSubscriptionError",
    "LeaseLostError",
    "MessageSettledError",
    "NoCoordinatorError",
    "NoPublishTargetError",
    "NotAuthorizedError",
    "PublishError",
    "SessionEndedError",
    "TransactionAbortedError",
    "UnknownQueueError",
]


class UnknownQueueError(DomainUnknownQueueError):
    """The coordinator knows no queue of that name (or none matches the regex).

    A subclass of the domain's error, so code catching either works. ``detail`` is the
    coordinator's own explanation, when it gave one.
    """

    def __init__(self, name: str, detail: str | None = None) -> None:
        super().__init__(name)
        self.detail = detail
        text = f"unknown queue {name!r}"
        if detail:
            text += f": {detail}"
        text += "; define it with `qlayer queue apply` (or check the spelling and topic_prefix)"
        self.args = (text,)


class InvalidFilterError(ExpressionError):
    """A subscription filter that does not parse (checked locally, or refused by the
    coordinator). ``position``/``line``/``column`` point at the problem when known."""


class InvalidSubscriptionError(QlayerError, ValueError):
    """The coordinator refused the subscription for another reason (``INVALID_REQUEST``):
    a regex that does not compile, a bad delivery topic, a negative backlog..."""


class NotAuthorizedError(InvalidSubscriptionError, PermissionError):
    """The coordinator refused the subscription for authorization (protocol 7,
    docs/security.md "Authorization"): no credential where one is required, a credential it did
    not accept, or a consumer id or queue not granted to the credential's principal. Not
    retriable: an operator's grant fixes it. A subclass of `InvalidSubscriptionError`, which
    code written before protocol 7 catches."""


class NoCoordinatorError(QlayerError, TimeoutError):
    """No coordinator answered in time (a Subscribe, Replace or RENEW went unanswered)."""


@dataclass(frozen=True, slots=True)
class AckFailure:
    """One acknowledgement item that was not applied as asked."""

    queue: str
    bookmark: str
    type: AckType
    status: AckStatus
    message: str | None = None

    def describe(self) -> str:
        text = f"{self.type.name} of {self.queue} {self.bookmark}: {self.status.value}"
        return f"{text} ({self.message})" if self.message else text


class LeaseLostError(QlayerError):
    """Acknowledgements were not applied: the lease had expired or was broken (the entry may
    already be with another consumer), the token was wrong, the entry was unknown or already
    acknowledged. ``failures`` lists each item with the coordinator's status.

    At-least-once still holds: an entry whose lease was lost is redelivered, so the usual
    response is to log it and carry on (make handlers idempotent).
    """

    def __init__(self, failures: Sequence[AckFailure]) -> None:
        self.failures: tuple[AckFailure, ...] = tuple(failures)
        if len(self.failures) == 1:
            text = f"acknowledgement not applied: {self.failures[0].describe()}"
        else:
            shown = "; ".join(f.describe() for f in self.failures[:5])
            more = len(self.failures) - 5
            text = f"{len(self.failures)} acknowledgements not applied: {shown}"
            if more > 0:
                text += f"; and {more} more"
        super().__init__(text)

    @property
    def status(self) -> AckStatus:
        """Status of the first failure (the only one, for a refused RENEW)."""
        return self.failures[0].status


class SessionEndedError(QlayerError):
    """The coordinator ended this consumer's session (evicted by an operator, or timed out /
    forgotten when transparent resubscription is off). Every lease of the session is broken.
    Create a new ``QueueConsumer`` to continue."""

    def __init__(self, reason: SessionEndReason, message: str | None = None) -> None:
        self.reason = reason
        self.detail = message
        text = f"the coordinator ended this consumer's session: {reason.value}"
        if message:
            text += f" ({message})"
        super().__init__(text)


class TransactionAbortedError(QlayerError):
    """The transaction did not commit: nothing it produced is visible to ``read_committed``
    readers and nothing it settled is settled. Its messages stay leased to this consumer
    until their leases end (and are then delivered again), unless ``fenced``: then this
    session's producer was fenced by the coordinator (a lease ran out, the session timed out
    or was evicted), its leases are ended and the consumer subscribes again."""

    def __init__(self, message: str, *, fenced: bool = False) -> None:
        super().__init__(message)
        self.fenced = fenced


class ConsumerClosedError(QlayerError, RuntimeError):
    """The consumer was closed; create a new one."""


class MessageSettledError(QlayerError, RuntimeError):
    """A message was acknowledged, released or rejected twice (or renewed after that)."""


class NoPublishTargetError(QlayerError, ValueError):
    """A publish to a queue's name that has no single journal to go to: the queue reads a
    regular expression and has no ``default_publish_target``."""

    def __init__(self, queue: str, detail: str) -> None:
        self.queue = queue
        super().__init__(detail)


class PublishError(QlayerError):
    """Records could not be written to Kafka (after the producer's own retries)."""

    def __init__(self, failures: Sequence[str]) -> None:
        self.failures = tuple(failures)
        shown = "; ".join(self.failures[:5])
        more = f" and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
        super().__init__(f"{len(self.failures)} record(s) not written: {shown}{more}")
