"""Authorization of one shard's Subscribes and sessions (protocol 7; docs/security.md,
"Authorization"), over the catalog's `Entitlements`.

A Subscribe is authorized once, when it arrives: its credential (header ``qlayer.credential``)
names a principal, which must own the consumer id and be granted the queues. Every later
record of the session is bound to it by the session secret (protocol 5), so acks and
heartbeats cost nothing more. A catalog load that finds a principal removed, its credential
rotated or a grant revoked ends the sessions that relied on it (`revoked`).

Refusals are counted by kind, reason and principal (`Refusals`): the principal label is a
known principal's name, ``anonymous``, or ``unknown`` (a credential naming no principal: its
name is whatever the sender made up, so it never becomes a label).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Final

from layer.coordinator.sessions import Session
from layer.domain.authorization import CredentialError, Entitlements, parse_credential
from layer.protocol import InputHeaders
from layer.protocol.headers import CREDENTIAL, header_value

__all__ = ["ANONYMOUS", "UNKNOWN", "Authorization", "Refusals", "Verdict"]

#: The principal label of a session or record without a credential.
ANONYMOUS: Final = "anonymous"
#: The principal label of a credential that named no principal (or proved none).
UNKNOWN: Final = "unknown"


class Refusals:
    """Records not acted on, by (kind, reason, principal), for ``/metrics`` and ``qlayer stats``
    (`layer.coordinator.metrics`). Kept by the process across rebuilds of the shard, like its
    other counters."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()

    def count(self, kind: str, reason: str, principal: str | None, n: int = 1) -> None:
        self.counts[(kind, reason, principal or ANONYMOUS)] += n


@dataclass(frozen=True, slots=True)
class Verdict:
    """What authorization decided for a Subscribe: who it is, or why it is refused. ``hold``:
    the refusal may be the catalog's age (a principal or grant added a moment ago); the shard
    asks for a fresh catalog and decides again before it answers."""

    principal: str | None = None
    credential_hash: bytes | None = None
    reason: str | None = None
    message: str | None = None
    label: str = ANONYMOUS

    @property
    def refused(self) -> bool:
        return self.reason is not None


class Authorization:
    """The authorization decisions of one shard (pure: the catalog is passed in)."""

    def subscribe(self, entitlements: Entitlements, consumer_id: str,
                  headers: InputHeaders) -> Verdict:
        """Who a Subscribe is, and whether it may use its consumer id."""
        raw = header_value(headers, CREDENTIAL)
        principal: str | None = None
        credential_hash: bytes | None = None
        if raw is None:
            if entitlements.required:
                return Verdict(reason="no_credential", message=(
                    f"this installation requires a credential (header {CREDENTIAL}; the SDK's "
                    "credential= or QLAYER_CREDENTIAL): docs/security.md, 'Authorization'"))
        else:
            try:
                credential = parse_credential(raw)
            except CredentialError as exc:
                return Verdict(reason="bad_credential", label=UNKNOWN,
                               message=f"the credential is malformed: {exc}")
            proved = entitlements.authenticate(credential)
            if proved is None:
                return Verdict(reason="wrong_credential", label=UNKNOWN, message=(
                    "the credential was not accepted (unknown principal or a secret that is "
                    "not its current one: `qlayer security principal rotate` issues a new one)"))
            principal, credential_hash = proved.name, proved.secret_sha256
        label = principal or ANONYMOUS
        if not entitlements.may_use_id(principal, consumer_id):
            owner = entitlements.owner_of(consumer_id)
            if owner is None:
                why = (f"consumer id {consumer_id!r} is granted to no principal, and this "
                       "installation requires one")
            elif principal is None:
                why = f"consumer id {consumer_id!r} belongs to a principal: give its credential"
            else:
                why = f"consumer id {consumer_id!r} belongs to another principal"
            return Verdict(principal, credential_hash, "consumer_id_not_granted", (
                f"{_who(principal)} may not subscribe as {consumer_id!r}: {why} (`qlayer "
                "security grant PRINCIPAL --consumer-id PATTERN`)"), label)
        return Verdict(principal, credential_hash, label=label)

    @staticmethod
    def queue_refusal(entitlements: Entitlements, principal: str | None, queue: str
                      ) -> str | None:
        """Why ``principal`` may not consume ``queue`` (a name), or None."""
        if entitlements.may_consume(principal, queue):
            return None
        return (f"{_who(principal)} may not consume queue {queue!r} (`qlayer security grant "
                "PRINCIPAL --queue PATTERN`)")

    @staticmethod
    def revoked(entitlements: Entitlements, session: Session) -> str | None:
        """Why a live session may not go on (its principal removed, its credential rotated,
        its consumer id no longer its principal's, or an anonymous session in an installation
        that now requires credentials), or None. Queues it lost its grant for are the caller's
        (`Control.revoke`)."""
        if session.principal is not None:
            if not entitlements.current(session.principal, session.credential_hash):
                return (f"the credential of principal {session.principal!r} was revoked or "
                        "rotated")
        elif entitlements.required:
            return "this installation now requires a credential"
        if not entitlements.may_use_id(session.principal, session.consumer_id):
            return f"consumer id {session.consumer_id!r} is no longer granted to it"
        return None


def _who(principal: str | None) -> str:
    return f"principal {principal!r}" if principal is not None else "a consumer without a " \
        "credential"
