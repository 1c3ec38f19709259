"""A shard's running totals of faults and refusals, exact across restarts.

What a shard refused or isolated that no queue's counters hold (malformed records, refusals by
status and reason, records too large to deliver, deleted journals...) is kept in PostgreSQL
(``ownership.counters``, 0008) and shown by ``qlayer stats`` and ``/metrics``. Until issue 36 an
owner wrote its totals with its periodic report: what it counted after its last report was lost
with a crash, and the records it had counted but not yet stored its input position past were
read again by the next owner and counted twice.

Now each iteration's increments are written by the iteration's own transaction, with the input
positions of the records that caused them (`WriteBatch.shard_counts`): a record's count and its
position are stored together or not at all, so a record read again after a crash is counted
once. `FaultLedger` tracks what was counted, what was put in a batch, and what was committed.
"""

from __future__ import annotations

from collections import Counter
from typing import Final

from layer.coordinator.authorize import Refusals

__all__ = ["FAULT_COUNTERS", "FAULT_PREFIXES", "REFUSED_PREFIX", "FaultLedger",
           "is_fault_counter", "refusal_key", "split_refusal_key"]

#: The shard's counters kept in PostgreSQL and shown by `qlayer stats`. Names starting with
#: one of `FAULT_PREFIXES` are kept too (ack and subscribe refusals by status, identity).
FAULT_COUNTERS: Final = (
    "malformed_ack_records", "malformed_control_records", "oversized_ack_records",
    "oversized_control_records", "forward_hops_exceeded", "unknown_session_heartbeats",
    "unknown_session_unsubscribes", "unanswerable_replies", "too_large", "barrier_refused",
    "journal_deleted", "journals_deleted", "retention_expired", "delivery_without_payload",
    "dead_letter_without_payload", "invalid_queue_definitions",
    "malformed_deliver_at_headers", "malformed_expiration_headers", "sessions_revoked",
    "registry_conflicts", "replies_split")
FAULT_PREFIXES: Final = ("ack_", "subscribe_", "identity_refused_")
#: Not faults, though they share a prefix.
_NOT_FAULTS: Final = frozenset({"ack_ok", "ack_items", "ack_duplicate_forwarded", "subscribe_ok"})
#: Refusals by kind, reason and principal are kept under ``refused:KIND:REASON:PRINCIPAL``
#: (a principal's name holds no ':').
REFUSED_PREFIX: Final = "refused:"


def is_fault_counter(name: str) -> bool:
    return name in FAULT_COUNTERS or (name.startswith(FAULT_PREFIXES)
                                      and name not in _NOT_FAULTS)


def refusal_key(kind: str, reason: str, principal: str) -> str:
    return f"{REFUSED_PREFIX}{kind}:{reason}:{principal}"


def split_refusal_key(key: str) -> tuple[str, str, str] | None:
    """(kind, reason, principal) of a `refusal_key`, None for any other counter name."""
    if not key.startswith(REFUSED_PREFIX):
        return None
    parts = key[len(REFUSED_PREFIX):].split(":", 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


class FaultLedger:
    """One shard's fault counters: the stored totals when this process took the shard, what
    it committed since, and what it counted that no transaction has stored yet."""

    def __init__(self, counters: Counter[str], refusals: Refusals) -> None:
        self._counters = counters
        self._refusals = refusals
        self._base: dict[str, int] = {}
        self._committed: Counter[str] = Counter()
        # The counts already accounted for: committed, or dropped with a failed iteration.
        self._mark: dict[str, int] = {}
        # The fault counters' names among the loop's counters, found again only when a new
        # name appears (`pending` runs every iteration: no scan of every counter each time).
        self._known = 0
        self._fault_names: list[str] = []

    def _now(self) -> dict[str, int]:
        counters = self._counters
        if len(counters) != self._known:
            self._known = len(counters)
            self._fault_names = [k for k in counters if is_fault_counter(k)]
        counts = {k: n for k in self._fault_names if (n := counters[k])}
        if self._refusals.counts:
            counts.update((refusal_key(*key), n)
                          for key, n in self._refusals.counts.items() if n)
        return counts

    def take(self, stored: dict[str, int]) -> None:
        """The shard was taken (again): what is stored is the truth; anything counted before
        and not committed belongs to records the new epoch reads again."""
        self._base = dict(stored)
        self._committed = Counter()
        self._mark = self._now()

    def pending(self) -> dict[str, int]:
        """Increments counted and not yet committed, for the iteration's batch."""
        mark = self._mark
        return {k: n - mark.get(k, 0) for k, n in self._now().items() if n > mark.get(k, 0)}

    def committed(self, increments: dict[str, int]) -> None:
        """The iteration's transaction stored ``increments``."""
        for k, n in increments.items():
            self._committed[k] += n
            self._mark[k] = self._mark.get(k, 0) + n

    def totals(self) -> dict[str, int]:
        """What is stored for the shard: its totals at take plus what was committed since."""
        totals = dict(self._base)
        for k, n in self._committed.items():
            totals[k] = totals.get(k, 0) + n
        return totals
