"""The protocol's one error type.

Everything that reads bytes or headers from Kafka raises ``ProtocolError`` for bad input and
nothing else, so a reader loop can count, log and skip a malformed record with one ``except``.
"""

from __future__ import annotations

from enum import StrEnum

from layer.domain.errors import QlayerError

__all__ = ["ProtocolError", "ProtocolErrorKind"]


class ProtocolErrorKind(StrEnum):
    """What was wrong, as a stable label for counters and logs."""

    EMPTY = "empty"
    TOO_SHORT = "too_short"
    WRONG_MAGIC = "wrong_magic"
    UNKNOWN_FINGERPRINT = "unknown_fingerprint"
    WRONG_SCHEMA = "wrong_schema"
    TRUNCATED = "truncated"
    TRAILING_BYTES = "trailing_bytes"
    MALFORMED = "malformed"
    ENCODE = "encode"
    BAD_HEADER = "bad_header"
    MISSING_HEADER = "missing_header"
    BAD_BOOKMARK = "bad_bookmark"
    BAD_TOPIC_NAME = "bad_topic_name"


class ProtocolError(QlayerError, ValueError):
    """Bytes, a header or a name that does not follow the qlayer wire protocol.

    ``kind`` says what was wrong (see ``ProtocolErrorKind``); the message says it for people.
    """

    def __init__(self, message: str, *, kind: ProtocolErrorKind) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
