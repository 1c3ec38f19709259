"""Domain error types shared by the pure core.

Adapters (Kafka, Postgres, CLI) translate driver errors into these at their boundary, so a
caller of qlayer only ever needs to catch ``QlayerError``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "ExpressionError",
    "GrantConflictError",
    "PrincipalExistsError",
    "QlayerError",
    "QueueConfigError",
    "UnknownConsumerError",
    "UnknownPrincipalError",
    "UnknownQueueError",
]


class QlayerError(Exception):
    """Base class of every error qlayer raises on purpose."""


class ExpressionError(QlayerError, ValueError):
    """A filter, priority or barrier expression that cannot be compiled.

    ``position`` is the 0-based character offset of the problem in ``text`` (``None`` when the
    problem is not tied to one place); ``line`` and ``column`` are 1-based, for people.
    """

    def __init__(
        self,
        message: str,
        *,
        text: str,
        position: int | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.text = text
        self.position = position
        self.line = line
        self.column = column


class QueueConfigError(QlayerError, ValueError):
    """A queue definition (or queue file) with one or more problems.

    All problems are collected before raising, so an operator fixes a file in one pass.
    ``problems`` is a list of ``(field, message)``; ``field`` is the snake_case field name, or
    ``"queues[2].lease_period"`` style paths for a queue file, or ``""`` for the whole document.
    """

    def __init__(
        self, problems: Iterable[tuple[str, str]], *, subject: str = "queue definition"
    ) -> None:
        self.problems: list[tuple[str, str]] = list(problems)
        self.subject = subject
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.problems:
            return f"invalid {self.subject}"
        lines = [_render_problem(field, message) for field, message in self.problems]
        if len(lines) == 1:
            return lines[0]
        return f"{len(lines)} problems in {self.subject}:\n" + "\n".join(
            f"  - {line}" for line in lines
        )


def _render_problem(field: str, message: str) -> str:
    if not field:
        return message
    parent, _, leaf = field.rpartition(".")
    if f"'{leaf}'" in message:
        # The message already names the field ("unknown field 'lease_perod' ..."): say the
        # enclosing place only, instead of repeating the name.
        return f"{parent}: {message}" if parent else message
    return f"{field}: {message}"


class UnknownQueueError(QlayerError, LookupError):
    """A queue name (or regex) that matches no defined queue."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown queue {name!r}")
        self.name = name


class UnknownConsumerError(QlayerError, LookupError):
    """A consumer id (subscription) the engine does not know, e.g. after it was evicted."""

    def __init__(self, consumer_id: str) -> None:
        super().__init__(f"unknown consumer {consumer_id!r}")
        self.consumer_id = consumer_id


class UnknownPrincipalError(QlayerError, LookupError):
    """A principal name no ``qlayer security principal add`` made (or one since removed)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown principal {name!r}: `qlayer security principal list` "
                         "shows the principals")
        self.name = name


class PrincipalExistsError(QlayerError, ValueError):
    """``principal add`` of a name that exists; rotating its credential is a separate act."""

    def __init__(self, name: str) -> None:
        super().__init__(f"principal {name!r} exists: `qlayer security principal rotate "
                         f"{name}` issues it a new credential")
        self.name = name


class GrantConflictError(QlayerError, ValueError):
    """A consumer-id grant that would give one consumer id to two principals."""

    def __init__(self, pattern: str, principal: str, others: Iterable[tuple[str, str]]) -> None:
        held = ", ".join(f"{p!r} of principal {who!r}" for who, p in others)
        super().__init__(
            f"consumer id pattern {pattern!r} for principal {principal!r} overlaps {held}: a "
            "consumer id belongs to one principal (revoke the other grant first, or choose a "
            "prefix that does not overlap)")
        self.pattern = pattern
        self.principal = principal
