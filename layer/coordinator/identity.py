"""Session identity (protocol 5, docs/security.md "Session identity"): which control and ack
records may act for a session.

A Subscribe carries a fresh secret (``qlayer.secret``); the shard keeps its SHA-256 with the
session (`Session.secret_hash`, and in PostgreSQL). Every later record of a proven session
must carry the secret back (``qlayer.proof``): one hash and one constant-time compare per
record, never per ack item. A session that gave no secret (a consumer older than protocol 5,
allowed while ``require_identity`` is off) is unproven and behaves as before, but nothing
unproven can take over or act for a proven session.

Refused records are counted per kind and reason (``identity_refused_<kind>_<reason>``) and
logged at most once a minute per consumer id (records of unknown sessions: once a minute per
kind, whatever ids they make up); they change nothing and are not answered: an
answer would go to the victim's delivery topic, or make the forger's.
"""

from __future__ import annotations

import logging
from collections import Counter
from enum import StrEnum

from layer.coordinator.authorize import Refusals
from layer.coordinator.sessions import Session
from layer.protocol import InputHeaders, proves, secret_problem
from layer.protocol.headers import PROOF, SECRET, header_value, secret_hash

log = logging.getLogger(__name__)

__all__ = ["LOG_INTERVAL", "Identity", "Refusal", "SubscribeIdentity"]

#: Seconds between two log lines about one consumer id's refused records.
LOG_INTERVAL = 60.0
#: Consumer ids whose last log time is remembered; past it the oldest are forgotten (a flood
#: of random ids must not grow the map without bound).
_MAX_REMEMBERED = 10_000


class Refusal(StrEnum):
    """Why a record was not acted on (the last part of its counter's name)."""

    #: A proven session's record without ``qlayer.proof``.
    NO_PROOF = "no_proof"
    #: A proven session's record whose ``qlayer.proof`` is not its secret.
    WRONG_PROOF = "wrong_proof"
    #: A record naming no live session of this shard (an unknown consumer or session id).
    UNKNOWN_SESSION = "unknown_session"
    #: A Subscribe without ``qlayer.secret`` to a coordinator that requires one.
    NO_SECRET = "no_secret"
    #: A ``qlayer.secret`` too short or too long.
    BAD_SECRET = "bad_secret"
    #: A Subscribe for a consumer id with a live proven session, without its proof.
    SESSION_LIVE = "session_live"


class SubscribeIdentity:
    """What the identity check decided for one Subscribe: the new session's secret hash
    (None: unproven), or why it is refused (``refusal`` and ``message``)."""

    __slots__ = ("message", "refusal", "secret_hash")

    def __init__(self, secret_hash: bytes | None = None, refusal: Refusal | None = None,
                 message: str | None = None) -> None:
        self.secret_hash = secret_hash
        self.refusal = refusal
        self.message = message


class Identity:
    """The identity checks of one shard, with their counters and rate-limited log."""

    def __init__(self, counters: Counter[str], require: bool,
                 refusals: Refusals | None = None) -> None:
        self.counters = counters
        self.require = require
        self.refusals = refusals if refusals is not None else Refusals()
        self._logged: dict[str, float] = {}

    def admits(self, session: Session, headers: InputHeaders, kind: str, now: float) -> bool:
        """Whether a record of ``kind`` naming ``session`` (its consumer and session id) may
        act for it: always for an unproven session; for a proven one, when it proves the
        secret. A refusal is counted and logged."""
        expected = session.secret_hash
        if expected is None or proves(headers, expected):
            return True
        reason = (Refusal.NO_PROOF if header_value(headers, PROOF) is None
                  else Refusal.WRONG_PROOF)
        self.refuse(kind, reason, session.consumer_id, now,
                    "does not prove its session's secret")
        self.refusals.count(kind, reason.value, session.principal)
        return False

    def subscribe(self, consumer_id: str, existing: Session | None, headers: InputHeaders,
                  now: float, timeout: float) -> SubscribeIdentity:
        """The identity of a new session of ``consumer_id`` (``existing``: its live session on
        this shard, if any). Refused: a secret that is not one, no secret when one is
        required, a live proven session whose secret the Subscribe does not prove (its
        leases and deliveries stay with it)."""
        secret = header_value(headers, SECRET)
        if secret is not None:
            problem = secret_problem(secret)
            if problem is not None:
                return self._refused(consumer_id, Refusal.BAD_SECRET, now, problem)
        elif self.require:
            return self._refused(
                consumer_id, Refusal.NO_SECRET, now,
                f"this coordinator requires a session secret: send the header {SECRET} "
                "(protocol 5, docs/protocol.md §5.6)")
        if existing is not None and existing.secret_hash is not None and not proves(
                headers, existing.secret_hash):
            return self._refused(
                consumer_id, Refusal.SESSION_LIVE, now,
                f"consumer id {consumer_id!r} has a live session and this Subscribe does not "
                f"prove its secret (header {PROOF}); it ends when that session does (an "
                f"Unsubscribe, or no heartbeat for {timeout:g}s)")
        return SubscribeIdentity(None if secret is None else secret_hash(secret))

    def _refused(self, consumer_id: str, reason: Refusal, now: float, message: str
                 ) -> SubscribeIdentity:
        self.refuse("subscribe", reason, consumer_id, now, message)
        return SubscribeIdentity(refusal=reason, message=message)

    def refuse(self, kind: str, reason: Refusal, consumer_id: str, now: float,
               detail: str) -> None:
        """Count a record not acted on, and log it unless this consumer id's were logged
        within the last minute."""
        self.counters[f"identity_refused_{kind}_{reason.value}"] += 1
        self.log(kind, reason, consumer_id, now, detail,
                 f"counted as identity_refused_{kind}_{reason.value}")

    def logged_keys(self) -> int:
        """How many log limits are remembered (bounded; for tests)."""
        return len(self._logged)

    def log(self, kind: str, reason: Refusal, consumer_id: str, now: float, detail: str,
            counted: str) -> None:
        """Log a record not acted on, unless this consumer id's were logged within the last
        minute (``counted`` names its counter). Records of unknown sessions share one
        limit per kind: their consumer ids are whatever a vandal makes up."""
        key = (f"\0unknown {kind}" if reason is Refusal.UNKNOWN_SESSION else consumer_id)
        last = self._logged.get(key)
        if last is not None and now - last < LOG_INTERVAL:
            return
        if len(self._logged) >= _MAX_REMEMBERED:
            self._logged.clear()
        self._logged[key] = now
        log.warning("%s record of consumer %r not acted on (%s): %s (%s; logged at most once "
                    "a minute per consumer id)", kind, consumer_id, reason.value, detail, counted)
