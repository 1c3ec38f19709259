"""Kafka record headers qlayer reads and writes, as confluent-kafka header lists.

Header values are ASCII/UTF-8 text; numbers are canonical decimal ASCII and times are
milliseconds since the Unix epoch. Kafka allows a header key more than once; qlayer appends its
headers after the original record's and, when reading, the **last** occurrence of a key wins.
Before appending delivery headers the delivery writer drops any stale ones the original record
carried (e.g. a record republished from a delivery topic), so a delivery never shows two.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from layer.protocol.bookmark import Bookmark
from layer.protocol.errors import ProtocolError, ProtocolErrorKind

__all__ = [
    "BARRIER",
    "BOOKMARK",
    "CONSUMER",
    "CREDENTIAL",
    "CREDIT",
    "CREDIT_REPORT",
    "DELIVERY_COUNT",
    "DELIVERY_HEADER_KEYS",
    "DELIVER_AT",
    "DLQ_BOOKMARK",
    "DLQ_DEAD_LETTERED_AT",
    "DLQ_DELIVERY_COUNT",
    "DLQ_DETAIL",
    "DLQ_HEADER_KEYS",
    "DLQ_LAST_CONSUMER",
    "DLQ_ORIGINAL_TOPIC",
    "DLQ_QUEUE",
    "DLQ_REASON",
    "DLQ_VALUE_OMITTED",
    "EXPIRATION",
    "FENCING",
    "FORWARDED",
    "LEASE",
    "LEASE_EXPIRES",
    "PROOF",
    "QUEUE",
    "REFUSAL",
    "REPLY",
    "SECRET",
    "SESSION",
    "SHARD",
    "SHARDS",
    "SPANS_SHARDS",
    "TRANSACTIONAL_ID",
    "DeadLetterInfo",
    "DeliveryInfo",
    "Headers",
    "InputHeaders",
    "RecordHeaders",
    "credit_home",
    "credit_report_header",
    "dead_letter_headers",
    "deliver_at_header",
    "delivery_headers",
    "encoded_delivery_headers",
    "expiration_header",
    "forwarded_headers",
    "forwarded_hops",
    "header_value",
    "is_reply",
    "new_session_secret",
    "parse_credit_report",
    "parse_dead_letter_headers",
    "parse_deliver_at",
    "parse_delivery_headers",
    "parse_expiration",
    "parse_shards",
    "proof_headers",
    "proves",
    "reply_headers",
    "reply_shard",
    "secret_hash",
    "secret_headers",
    "secret_problem",
    "shards_header",
    "transactional_id",
    "with_delivery_headers",
    "without_delivery_headers",
]

Headers = list[tuple[str, bytes]]
# A record's headers as confluent-kafka hands them over and accepts them back: a header may
# have a None (null) value, which is passed through unchanged.
RecordHeaders = list[tuple[str, bytes | None]]
# What confluent-kafka's Message.headers() returns: None when the record has none.
InputHeaders = Sequence[tuple[str, bytes | None]] | None

# --- on every delivery ------------------------------------------------------------------------
QUEUE = "qlayer.queue"
BOOKMARK = "qlayer.bookmark"
LEASE = "qlayer.lease"
LEASE_EXPIRES = "qlayer.lease-expires"
DELIVERY_COUNT = "qlayer.delivery-count"
BARRIER = "qlayer.barrier"
CONSUMER = "qlayer.consumer"
SESSION = "qlayer.session"
# --- on a coordinator reply written to a delivery topic -----------------------------------
REPLY = "qlayer.reply"
# The shard that answered (protocol 2): the consumer writes its control and ack records to
# that partition of the control and ack topics from then on.
SHARD = "qlayer.shard"
# --- on a control or ack record a coordinator passed on to the shard that serves it ---------
FORWARDED = "qlayer.forwarded"
# --- on a consumer's control and ack records (protocol 5, "Session identity") ----------------
# A Subscribe carries a fresh secret of its session; every later control and ack record of the
# session carries it back as its proof (a Subscribe may carry the proof of the live session it
# replaces). Only coordinators read the control and ack topics (docs/security.md).
SECRET = "qlayer.secret"
PROOF = "qlayer.proof"
# --- authorization (protocol 7, docs/security.md "Authorization") ----------------------------
# On a Subscribe: the credential of the consumer's principal (``NAME:SECRET``, issued by
# `qlayer security principal add`). Like the secret, read by coordinators only.
CREDENTIAL = "qlayer.credential"
# On a refused SubscribeResult: why, as a word a program can test (``not_authorized``); the
# status stays INVALID_REQUEST, so consumers of earlier protocols still read the reply.
REFUSAL = "qlayer.refusal"
NOT_AUTHORIZED = "not_authorized"
# --- credit (protocol 8): one backlog over several shards (docs/protocol.md §14) ----------------
# On a Subscribe or Replace: this shard's part of the session is granted credit by the consumer
# (its max_backlog is the grant); the value is the session's home shard, ASCII. A shard answers
# such a record itself, never passing it on.
CREDIT = "qlayer.credit"
# On the answer to such a record, and on a credit notice (an empty delivery batch): what the
# part holds, its grant and the entries waiting in its queues, ``held,grant,waiting`` ASCII.
CREDIT_REPORT = "qlayer.credit-report"
# On the refusal of a Subscribe without ``qlayer.credit`` whose queues are on several shards:
# ``qlayer.refusal: spans_shards`` and these shards, ``0,1`` ASCII; a protocol-8 consumer then
# subscribes on each of them with credit.
SHARDS = "qlayer.shards"
SPANS_SHARDS = "spans_shards"
# --- exactly-once processing (protocol 9, docs/protocol.md §15) ------------------------------
# On a Subscribe: the Kafka ``transactional.id`` the session settles with, UTF-8; it must end
# with ``.`` + the session id (so no session can name, and have fenced, another's producer).
# A Replace keeps its session's. The coordinator fences it before breaking any of its leases.
TRANSACTIONAL_ID = "qlayer.transactional-id"
# On a refused Subscribe: the consumer id's previous transactional session is being fenced;
# the same Subscribe is answered once it has ended (a consumer subscribes again shortly).
FENCING = "fencing"
#: The longest transactional.id accepted (Kafka has no limit of its own; this keeps records
#: and stored rows small).
MAX_TRANSACTIONAL_ID = 249
# --- on a record a producer publishes -------------------------------------------------------
DELIVER_AT = "qlayer.deliver-at"
# How long the message may wait in a queue, in ms from the record's timestamp (AMPS: "the
# expiration time set on the individual message"); it overrides the queue's `expiration`.
EXPIRATION = "qlayer.expiration"
# --- on a dead-letter record ----------------------------------------------------------------
DLQ_REASON = "qlayer.dlq.reason"
DLQ_DETAIL = "qlayer.dlq.detail"
#: On the dead letter of a record too large to write (reason ``too_large``, protocol 6): the
#: size of the value left out; the record itself stays in its journal at the bookmark.
DLQ_VALUE_OMITTED = "qlayer.dlq.value-omitted"
DLQ_QUEUE = "qlayer.dlq.queue"
DLQ_BOOKMARK = "qlayer.dlq.bookmark"
DLQ_ORIGINAL_TOPIC = "qlayer.dlq.original-topic"
DLQ_DELIVERY_COUNT = "qlayer.dlq.delivery-count"
DLQ_LAST_CONSUMER = "qlayer.dlq.last-consumer"
DLQ_DEAD_LETTERED_AT = "qlayer.dlq.dead-lettered-at"

DELIVERY_HEADER_KEYS = frozenset(
    {QUEUE, BOOKMARK, LEASE, LEASE_EXPIRES, DELIVERY_COUNT, BARRIER, CONSUMER, SESSION, REPLY}
)
DLQ_HEADER_KEYS = frozenset(
    {
        DLQ_REASON,
        DLQ_DETAIL,
        DLQ_VALUE_OMITTED,
        DLQ_QUEUE,
        DLQ_BOOKMARK,
        DLQ_ORIGINAL_TOPIC,
        DLQ_DELIVERY_COUNT,
        DLQ_LAST_CONSUMER,
        DLQ_DEAD_LETTERED_AT,
    }
)

_TRUE = b"1"
_FALSE = b"0"
# Same rule as bookmarks: one number, one spelling.
_CANONICAL_NUMBER = re.compile(rb"0|[1-9][0-9]{0,18}")


# --- reading -----------------------------------------------------------------------------------


def header_value(headers: InputHeaders, key: str) -> bytes | None:
    """The value of the last header named ``key`` (``None`` when absent or valueless)."""
    if not headers:
        return None
    found: bytes | None = None
    for name, value in headers:
        if name == key:
            found = value
    return found


def _last_values(headers: InputHeaders, keys: frozenset[str]) -> dict[str, bytes | None]:
    values: dict[str, bytes | None] = {}
    if headers:
        for name, value in headers:
            if name in keys:
                values[name] = value
    return values


def _required(values: dict[str, bytes | None], key: str) -> bytes:
    value = values.get(key)
    if value is None:
        raise ProtocolError(f"header {key} is missing", kind=ProtocolErrorKind.MISSING_HEADER)
    return value


def _text(key: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ProtocolError(
            f"header {key} is not UTF-8: {value[:40]!r}", kind=ProtocolErrorKind.BAD_HEADER
        ) from error


def _number(key: str, value: bytes) -> int:
    if _CANONICAL_NUMBER.fullmatch(value) is None:
        raise ProtocolError(
            f"header {key} must be a decimal number, got {value[:40]!r}",
            kind=ProtocolErrorKind.BAD_HEADER,
        )
    return int(value)


def _flag(key: str, value: bytes | None) -> bool:
    if value is None or value == _FALSE:
        return False
    if value == _TRUE:
        return True
    raise ProtocolError(
        f"header {key} must be 0 or 1, got {value[:40]!r}", kind=ProtocolErrorKind.BAD_HEADER
    )


def _bookmark(key: str, value: bytes) -> Bookmark:
    try:
        return Bookmark.parse(_text(key, value))
    except ProtocolError as error:
        raise ProtocolError(f"header {key}: {error.message}", kind=error.kind) from error


# --- deliveries --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliveryInfo:
    """What the ``qlayer.*`` headers of a delivered record say about its lease."""

    queue: str
    bookmark: Bookmark
    lease: str
    lease_expires_ms: int
    delivery_count: int
    barrier: bool = False
    consumer_id: str | None = None
    session_id: str | None = None


def delivery_headers(info: DeliveryInfo) -> Headers:
    """The ``qlayer.*`` headers of one delivery, to append to the original record's."""
    return encoded_delivery_headers(
        info.queue.encode(), info.bookmark.format().encode(), info.lease.encode(),
        info.lease_expires_ms, info.delivery_count, info.barrier,
        None if info.consumer_id is None else info.consumer_id.encode(),
        None if info.session_id is None else info.session_id.encode())


def encoded_delivery_headers(queue: bytes, bookmark: bytes, lease: bytes, lease_expires_ms: int,
                             delivery_count: int, barrier: bool, consumer_id: bytes | None,
                             session_id: bytes | None) -> Headers:
    """`delivery_headers` from values already encoded: the coordinator encodes a queue's name
    and a consumer's ids once, not once per delivery."""
    headers: Headers = [
        (QUEUE, queue),
        (BOOKMARK, bookmark),
        (LEASE, lease),
        (LEASE_EXPIRES, b"%d" % lease_expires_ms),
        (DELIVERY_COUNT, b"%d" % delivery_count),
        (BARRIER, _TRUE if barrier else _FALSE),
    ]
    if consumer_id is not None:
        headers.append((CONSUMER, consumer_id))
    if session_id is not None:
        headers.append((SESSION, session_id))
    return headers


def without_delivery_headers(headers: InputHeaders) -> RecordHeaders:
    """A record's own headers, without ``qlayer.*`` delivery headers a previous hop added."""
    return _without(headers, DELIVERY_HEADER_KEYS)


def _without(headers: InputHeaders, keys: frozenset[str]) -> RecordHeaders:
    return [(key, value) for key, value in headers or () if key not in keys]


def with_delivery_headers(original: InputHeaders, info: DeliveryInfo) -> RecordHeaders:
    """The original record's headers, minus stale delivery headers, plus this delivery's."""
    headers = _without(original, DELIVERY_HEADER_KEYS)
    headers.extend(delivery_headers(info))
    return headers


def parse_delivery_headers(headers: InputHeaders) -> DeliveryInfo:
    """Read a delivery's ``qlayer.*`` headers; ``ProtocolError`` names a missing or bad one."""
    values = _last_values(headers, DELIVERY_HEADER_KEYS)
    consumer = values.get(CONSUMER)
    session = values.get(SESSION)
    return DeliveryInfo(
        queue=_text(QUEUE, _required(values, QUEUE)),
        bookmark=_bookmark(BOOKMARK, _required(values, BOOKMARK)),
        lease=_text(LEASE, _required(values, LEASE)),
        lease_expires_ms=_number(LEASE_EXPIRES, _required(values, LEASE_EXPIRES)),
        delivery_count=_number(DELIVERY_COUNT, _required(values, DELIVERY_COUNT)),
        barrier=_flag(BARRIER, values.get(BARRIER)),
        consumer_id=None if consumer is None else _text(CONSUMER, consumer),
        session_id=None if session is None else _text(SESSION, session),
    )


# --- replies -----------------------------------------------------------------------------------


def reply_headers(shard: int | None = None) -> Headers:
    """Headers of a coordinator reply on a delivery topic (the value is a ReplyRecord), with
    the shard that answered."""
    if shard is None:
        return [(REPLY, _TRUE)]
    return [(REPLY, _TRUE), (SHARD, b"%d" % shard)]


def reply_shard(headers: InputHeaders) -> int | None:
    """The ``qlayer.shard`` of a reply: where its consumer's control and ack records go.
    None when absent or not a shard number (a reply from a protocol-1 coordinator)."""
    value = header_value(headers, SHARD)
    if value is None or not value.isdigit() or len(value) > 4:
        return None
    return int(value)


def forwarded_hops(headers: InputHeaders) -> int:
    """How many coordinators passed this control or ack record on already (0: none)."""
    value = header_value(headers, FORWARDED)
    if value is None or not value.isdigit() or len(value) > 3:
        return 0
    return int(value)


def forwarded_headers(hops: int) -> Headers:
    """Headers of a record passed on to another shard's partition, ``hops`` times so far."""
    return [(FORWARDED, b"%d" % hops)]


def is_reply(headers: InputHeaders) -> bool:
    """True for a coordinator reply, false for a delivered message."""
    return header_value(headers, REPLY) == _TRUE


# --- session identity (protocol 5) -------------------------------------------------------------

#: Bounds of a session secret, in bytes: short enough to hash per record for nothing, long
#: enough that it cannot be guessed (the SDK sends 32 random bytes as 64 hex characters).
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 256


def new_session_secret() -> bytes:
    """A fresh session secret: 32 random bytes (`secrets`), as 64 lowercase hex characters."""
    return secrets.token_hex(32).encode("ascii")


def secret_problem(value: bytes) -> str | None:
    """Why a ``qlayer.secret`` (or ``qlayer.proof``) value cannot be a session secret."""
    if not MIN_SECRET_BYTES <= len(value) <= MAX_SECRET_BYTES:
        return (f"header {SECRET} must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, "
                f"got {len(value)}")
    return None


def secret_hash(secret: bytes) -> bytes:
    """What a coordinator keeps of a session secret (in memory and in PostgreSQL): its SHA-256.
    The secret itself is never stored."""
    return hashlib.sha256(secret).digest()


def secret_headers(secret: bytes) -> Headers:
    """The header of a Subscribe that starts a session with this secret."""
    return [(SECRET, secret)]


def proof_headers(secret: bytes) -> Headers:
    """The header of a record that proves its session's secret (every control and ack record
    after the Subscribe; a Subscribe taking over its consumer id's live session)."""
    return [(PROOF, secret)]


def proves(headers: InputHeaders, expected: bytes) -> bool:
    """Whether the record's ``qlayer.proof`` is the secret whose `secret_hash` is ``expected``
    (one hash and one constant-time compare per record)."""
    value = header_value(headers, PROOF)
    if value is None or not MIN_SECRET_BYTES <= len(value) <= MAX_SECRET_BYTES:
        return False
    return hmac.compare_digest(hashlib.sha256(value).digest(), expected)


# --- delayed delivery --------------------------------------------------------------------------


def deliver_at_header(deliver_at_ms: int) -> tuple[str, bytes]:
    """Publish header asking qlayer to hold the message until this time (ms since epoch)."""
    if deliver_at_ms < 0:
        raise ValueError(f"deliver_at_ms must not be negative (got {deliver_at_ms})")
    return (DELIVER_AT, b"%d" % deliver_at_ms)


def parse_deliver_at(headers: InputHeaders) -> int | None:
    """The ``qlayer.deliver-at`` time of a published record, or ``None`` when it has none."""
    value = header_value(headers, DELIVER_AT)
    return None if value is None else _number(DELIVER_AT, value)


#: The longest per-message expiration: 366 days, so a value in seconds by mistake for ms
#: (or a runaway number) is refused rather than silently meaning "never".
MAX_EXPIRATION_MS = 366 * 24 * 3600 * 1000


def expiration_header(expiration_ms: int) -> tuple[str, bytes]:
    """Publish header giving the message its own expiration: it leaves any queue (expired,
    dead-lettered where the queue says so) once it is this many ms older than its record's
    timestamp and not leased."""
    if not 1 <= expiration_ms <= MAX_EXPIRATION_MS:
        raise ValueError(
            f"expiration_ms must be 1..{MAX_EXPIRATION_MS} (366 days); got {expiration_ms}")
    return (EXPIRATION, b"%d" % expiration_ms)


def parse_expiration(headers: InputHeaders) -> int | None:
    """The ``qlayer.expiration`` of a published record (ms), or ``None`` when it has none."""
    value = header_value(headers, EXPIRATION)
    if value is None:
        return None
    ms = _number(EXPIRATION, value)
    if not 1 <= ms <= MAX_EXPIRATION_MS:
        raise ProtocolError(
            f"header {EXPIRATION} must be 1..{MAX_EXPIRATION_MS} ms (366 days), got {ms}",
            kind=ProtocolErrorKind.BAD_HEADER,
        )
    return ms


# --- dead letters ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterInfo:
    """Why and from where a record was dead-lettered (its ``qlayer.dlq.*`` headers)."""

    reason: str  # an ExpiryReason value
    queue: str
    bookmark: Bookmark
    delivery_count: int
    dead_lettered_at_ms: int
    last_consumer: str | None = None
    detail: str | None = None  # e.g. the consumer's REJECT reason

    @property
    def original_topic(self) -> str:
        return self.bookmark.topic


def dead_letter_headers(original: InputHeaders, info: DeadLetterInfo) -> RecordHeaders:
    """Headers of a dead-letter record: the original record's (without delivery or older
    dead-letter headers) plus ``qlayer.dlq.*``."""
    headers = _without(original, DELIVERY_HEADER_KEYS | DLQ_HEADER_KEYS)
    headers += [
        (DLQ_REASON, info.reason.encode()),
        (DLQ_QUEUE, info.queue.encode()),
        (DLQ_BOOKMARK, info.bookmark.format().encode()),
        (DLQ_ORIGINAL_TOPIC, info.bookmark.topic.encode()),
        (DLQ_DELIVERY_COUNT, b"%d" % info.delivery_count),
        (DLQ_DEAD_LETTERED_AT, b"%d" % info.dead_lettered_at_ms),
    ]
    if info.last_consumer is not None:
        headers.append((DLQ_LAST_CONSUMER, info.last_consumer.encode()))
    if info.detail is not None:
        headers.append((DLQ_DETAIL, info.detail.encode()))
    return headers


def parse_dead_letter_headers(headers: InputHeaders) -> DeadLetterInfo:
    """Read a dead-letter record's ``qlayer.dlq.*`` headers (for ``qlayer dlq`` and redrive)."""
    values = _last_values(headers, DLQ_HEADER_KEYS)
    last_consumer = values.get(DLQ_LAST_CONSUMER)
    detail = values.get(DLQ_DETAIL)
    return DeadLetterInfo(
        reason=_text(DLQ_REASON, _required(values, DLQ_REASON)),
        queue=_text(DLQ_QUEUE, _required(values, DLQ_QUEUE)),
        bookmark=_bookmark(DLQ_BOOKMARK, _required(values, DLQ_BOOKMARK)),
        delivery_count=_number(DLQ_DELIVERY_COUNT, _required(values, DLQ_DELIVERY_COUNT)),
        dead_lettered_at_ms=_number(DLQ_DEAD_LETTERED_AT, _required(values, DLQ_DEAD_LETTERED_AT)),
        last_consumer=None if last_consumer is None else _text(DLQ_LAST_CONSUMER, last_consumer),
        detail=None if detail is None else _text(DLQ_DETAIL, detail),
    )


# --- credit (protocol 8) -------------------------------------------------------------------------


def credit_home(headers: InputHeaders) -> int | None:
    """The home shard a Subscribe or Replace names in ``qlayer.credit``; None when absent
    (a session of one shard, served as before protocol 8) or not a shard number."""
    value = header_value(headers, CREDIT)
    if value is None or not _CANONICAL_NUMBER.fullmatch(value) or len(value) > 4:
        return None
    return int(value)


def transactional_id(headers: InputHeaders) -> str | None:
    """The ``qlayer.transactional-id`` of a Subscribe (protocol 9); None when absent. Raises
    ValueError when it is not UTF-8 text of 1 to `MAX_TRANSACTIONAL_ID` characters."""
    value = header_value(headers, TRANSACTIONAL_ID)
    if value is None:
        return None
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{TRANSACTIONAL_ID} is not UTF-8 text") from None
    if not 0 < len(text) <= MAX_TRANSACTIONAL_ID or not text.isprintable():
        raise ValueError(f"{TRANSACTIONAL_ID} must be 1 to {MAX_TRANSACTIONAL_ID} printable "
                         "characters")
    return text


def credit_report_header(held: int, grant: int, waiting: int) -> tuple[str, bytes]:
    return (CREDIT_REPORT, b"%d,%d,%d" % (held, grant, waiting))


def parse_credit_report(headers: InputHeaders) -> tuple[int, int, int] | None:
    """``(held, grant, waiting)`` of a ``qlayer.credit-report`` header; None when absent or
    not three numbers."""
    value = header_value(headers, CREDIT_REPORT)
    if value is None:
        return None
    parts = value.split(b",")
    if len(parts) != 3 or not all(_CANONICAL_NUMBER.fullmatch(p) for p in parts):
        return None
    held, grant, waiting = (int(p) for p in parts)
    return held, grant, waiting


def shards_header(shards: list[int]) -> tuple[str, bytes]:
    return (SHARDS, ",".join(str(s) for s in sorted(shards)).encode())


def parse_shards(headers: InputHeaders) -> list[int]:
    """The shards of a ``qlayer.shards`` header (empty when absent or malformed)."""
    value = header_value(headers, SHARDS)
    if not value:
        return []
    parts = value.split(b",")
    if not all(_CANONICAL_NUMBER.fullmatch(p) and len(p) <= 4 for p in parts):
        return []
    return sorted({int(p) for p in parts})
