"""Who may consume which queue, under which consumer ids (protocol 7; docs/security.md,
"Authorization").

Kafka authenticates a client's *connection*, but a record carries no trace of who wrote it:
a coordinator reading the control topic cannot tell alice's Subscribe from bob's. So a
consumer proves who it is with a **credential** qlayer issued to its **principal**
(``qlayer security principal add``), sent in the ``qlayer.credential`` header of its
Subscribe; like the session secret, it is readable by coordinators only under the ACL recipe.
Only its SHA-256 is stored.

**Grants** (entitlements, as AMPS has per topic) say what a principal may do:

- ``queue`` grants: the queues it may consume;
- ``consumer_id`` grants: the consumer ids it may subscribe under. A consumer id belongs to at
  most one principal: grants of two principals never overlap (`overlapping`), so whoever
  holds an id, online or offline, is decided by the grants alone.

A pattern is a name (``Orders``), a prefix ending in ``*`` (``alice.*``: every name that starts
with ``alice.``), or ``*`` (every name): Kafka's LITERAL and PREFIXED resource patterns, which
operators who write Kafka ACLs know.

The **mode** is Kafka's ``allow.everyone.if.no.acl.found``, again because Kafka users know it:

- ``open`` (the default): a queue no grant matches may be consumed by anyone, with or
  without a credential, and a consumer id no grant matches may be used by anyone. Once a
  queue or consumer id is granted to a principal, only that principal may use it. A
  credential that is given must be valid.
- ``required``: every Subscribe needs a valid credential, an id granted to its principal and
  queues granted to it; nothing is open.

Everything here is pure: the coordinator builds an `Entitlements` from the store at each
catalog load and asks it per Subscribe (never per message or ack).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

__all__ = [
    "CREDENTIAL_SEPARATOR",
    "AuthorizationMode",
    "Credential",
    "CredentialError",
    "Entitlements",
    "Grant",
    "GrantKind",
    "NamePattern",
    "Principal",
    "credential_hash",
    "issue_credential",
    "overlapping",
    "parse_credential",
    "principal_name_problem",
]

#: Between the principal's name and the secret in a credential (``alice:3q2+...``). Not allowed
#: in a principal's name, so the last one splits a credential unambiguously.
CREDENTIAL_SEPARATOR: Final = ":"
#: Random bytes in a credential's secret (256 bits; 43 characters of unpadded base64url).
SECRET_BYTES: Final = 32
#: A credential longer than this is refused unread (the header is attacker-sized input).
MAX_CREDENTIAL_LENGTH: Final = 512
_NAME: Final = re.compile(r"[A-Za-z0-9._@+=-]{1,128}")
_PATTERN: Final = re.compile(r"[^*\s]{0,249}\*?")


class CredentialError(ValueError):
    """A credential that is not one (malformed); the message says why, for its holder."""


class AuthorizationMode(StrEnum):
    """Kafka's ``allow.everyone.if.no.acl.found``, for queues and consumer ids."""

    #: What no grant matches is open to anyone (with or without a credential).
    OPEN = "open"
    #: Every Subscribe needs a valid credential, and only what is granted is allowed.
    REQUIRED = "required"


class GrantKind(StrEnum):
    QUEUE = "queue"
    CONSUMER_ID = "consumer_id"


def principal_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a principal's name, or None."""
    if not _NAME.fullmatch(name):
        return (f"principal name {name!r} must be 1 to 128 characters of letters, digits and "
                "'._@+=-' (the Kafka user name it stands for, usually)")
    return None


@dataclass(frozen=True, slots=True)
class NamePattern:
    """A queue name or consumer id pattern: a literal name, a prefix ending in ``*``, or ``*``."""

    text: str

    def __post_init__(self) -> None:
        if not self.text or not _PATTERN.fullmatch(self.text) or self.text.count("*") > 1:
            raise ValueError(
                f"pattern {self.text!r}: give a name, a prefix ending in '*' (orders.*), or '*'; "
                "'*' may only end it, and it may hold no spaces")

    @property
    def prefix(self) -> str | None:
        """The prefix of a PREFIXED pattern (``''`` for ``*``), None for a literal name."""
        return self.text[:-1] if self.text.endswith("*") else None

    def matches(self, name: str) -> bool:
        prefix = self.prefix
        return name == self.text if prefix is None else name.startswith(prefix)

    def overlaps(self, other: NamePattern) -> bool:
        """Whether some name matches both."""
        mine, theirs = self.prefix, other.prefix
        if mine is None and theirs is None:
            return self.text == other.text
        if mine is None:
            return other.matches(self.text)
        if theirs is None:
            return self.matches(other.text)
        return mine.startswith(theirs) or theirs.startswith(mine)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Grant:
    principal: str
    kind: GrantKind
    pattern: NamePattern


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    #: SHA-256 of the credential's secret; the credential itself is never stored.
    secret_sha256: bytes


@dataclass(frozen=True, slots=True)
class Credential:
    principal: str
    secret: str

    def __str__(self) -> str:
        return f"{self.principal}{CREDENTIAL_SEPARATOR}{self.secret}"

    @property
    def sha256(self) -> bytes:
        return credential_hash(self.secret)


def issue_credential(principal: str) -> Credential:
    """A new credential for ``principal``, with a fresh random secret."""
    problem = principal_name_problem(principal)
    if problem is not None:
        raise CredentialError(problem)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).rstrip(b"=").decode()
    return Credential(principal, secret)


def credential_hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def parse_credential(value: bytes | str) -> Credential:
    """The credential a ``qlayer.credential`` header (or ``QLAYER_CREDENTIAL``) holds."""
    if len(value) > MAX_CREDENTIAL_LENGTH:
        raise CredentialError(f"a credential is at most {MAX_CREDENTIAL_LENGTH} characters")
    try:
        text = value.decode("utf-8") if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        raise CredentialError("a credential is UTF-8 text") from None
    name, separator, secret = text.strip().rpartition(CREDENTIAL_SEPARATOR)
    if not separator or not secret:
        raise CredentialError("a credential is 'PRINCIPAL:SECRET', as `qlayer security principal "
                              "add` printed it")
    problem = principal_name_problem(name)
    if problem is not None:
        raise CredentialError(problem)
    return Credential(name, secret)


def overlapping(grant: Grant, others: Iterable[Grant]) -> list[Grant]:
    """The consumer-id grants of *other* principals that ``grant`` would overlap (a consumer
    id belongs to one principal, so such a grant is refused). Queue grants may overlap: several
    principals may consume one queue."""
    if grant.kind is not GrantKind.CONSUMER_ID:
        return []
    return [g for g in others if g.kind is GrantKind.CONSUMER_ID
            and g.principal != grant.principal and g.pattern.overlaps(grant.pattern)]


@dataclass(frozen=True)
class Entitlements:
    """Principals and grants as one catalog load found them, and the decisions they make."""

    mode: AuthorizationMode = AuthorizationMode.OPEN
    principals: dict[str, Principal] = field(default_factory=dict)
    grants: tuple[Grant, ...] = ()

    @classmethod
    def of(cls, mode: AuthorizationMode, principals: Iterable[Principal],
           grants: Iterable[Grant]) -> Entitlements:
        return cls(mode, {p.name: p for p in principals}, tuple(grants))

    @property
    def required(self) -> bool:
        return self.mode is AuthorizationMode.REQUIRED

    def authenticate(self, credential: Credential) -> Principal | None:
        """The principal the credential proves, or None (unknown name or wrong secret: the two
        are not told apart, so a guess learns nothing about which names exist)."""
        principal = self.principals.get(credential.principal)
        expected = principal.secret_sha256 if principal is not None else bytes(32)
        ok = hmac.compare_digest(credential.sha256, expected)
        return principal if ok and principal is not None else None

    def current(self, name: str, secret_sha256: bytes | None) -> bool:
        """Whether a session authenticated as ``name`` with that credential still may be: the
        principal exists and its credential was not rotated since."""
        principal = self.principals.get(name)
        return (principal is not None and secret_sha256 is not None
                and hmac.compare_digest(principal.secret_sha256, secret_sha256))

    def owner_of(self, consumer_id: str) -> str | None:
        """The principal a consumer id belongs to (its consumer-id grant), if any."""
        for grant in self.grants:
            if grant.kind is GrantKind.CONSUMER_ID and grant.pattern.matches(consumer_id):
                return grant.principal
        return None

    def may_use_id(self, principal: str | None, consumer_id: str) -> bool:
        owner = self.owner_of(consumer_id)
        if owner is not None:
            return owner == principal
        return not self.required

    def granted(self, principal: str | None, queue: str) -> bool:
        return principal is not None and any(
            g.kind is GrantKind.QUEUE and g.principal == principal and g.pattern.matches(queue)
            for g in self.grants)

    def restricted(self, queue: str) -> bool:
        """Whether some principal was granted the queue (so it is not open to everyone)."""
        return any(g.kind is GrantKind.QUEUE and g.pattern.matches(queue) for g in self.grants)

    def may_consume(self, principal: str | None, queue: str) -> bool:
        if self.granted(principal, queue):
            return True
        return not self.required and not self.restricted(queue)

    def of_principal(self, principal: str) -> list[Grant]:
        return [g for g in self.grants if g.principal == principal]
