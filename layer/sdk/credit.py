"""One backlog over several shards: the consumer's credit ledger (protocol 8). Pure.

A subscription whose queues live on several shards holds one backlog (AMPS: one
``max_backlog`` across the matched queues). The consumer holds it as credit and grants it to
the shards (AMQP link credit, Qpid's consumer credit): each shard's part of the session has
``max_backlog`` equal to its grant, and a shard leases only while it holds fewer leases than
its grant. The invariant kept here, at every instant:

    sum over shards of reservation(shard) <= backlog

where a shard's *reservation* bounds what it may hold at that instant:

- every grant the shard may be applying: the last one it confirmed (the answer to that
  Subscribe or Replace) and each one sent since and not yet confirmed (control records of
  one partition are read in order, so a confirmation supersedes every grant sent before it);
- the leases it reported holding in its latest report (a delivery batch, an answer or a
  credit notice, each saying ``held``, ``grant`` and ``waiting``): after a grant is lowered
  the shard leases nothing more until its leases are settled below the new grant, so what it
  holds never exceeds ``max(held reported, grants it may apply)``.

Credit comes back only by a report: an acknowledgement the consumer sent may not have been
read yet, and until it is, the shard still counts the lease.

Where the credit goes (`CreditLedger.plan`): to the shards that report entries waiting for the
subscription, an equal share each (the remainder going round, one delivery at a time, so no
shard waits forever behind a busy one); a shard with nothing waiting is lowered to nothing
only when another shard needs its credit. With one shard every unit of credit sits there and
nothing ever moves: the single-shard path sends no credit record at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CreditLedger", "CreditReport", "ShardCredit"]


@dataclass(frozen=True, slots=True)
class CreditReport:
    """What a shard says about its part of the session (`qlayer.credit`, protocol 8)."""

    #: Leases the session holds on the shard (at-most-once backlog slots included).
    held: int
    #: The grant the shard applies (the part's ``max_backlog``).
    grant: int
    #: Entries available in the part's queues when one of them is one the part may take now
    #: (its filter, key groups, barriers), else 0: where work waits for it.
    waiting: int


@dataclass(slots=True)
class ShardCredit:
    """The ledger's view of one shard."""

    #: The grant the shard last confirmed (None: no confirmation yet).
    applied: int | None = None
    #: Grants sent and not yet confirmed, by request id, in the order sent.
    pending: dict[str, int] = field(default_factory=dict)
    #: Leases reported held (the latest report); a bound until the next report.
    held: int = 0
    #: Entries reported waiting (the latest report); None: nothing reported yet.
    waiting: int | None = None
    #: Deliveries received since this shard last took the remainder (fairness).
    delivered: int = 0

    @property
    def grant(self) -> int:
        """The grant the shard will apply once every record sent to it is read."""
        if self.pending:
            return next(reversed(self.pending.values()))
        return self.applied or 0

    @property
    def reservation(self) -> int:
        """What the shard may hold at this instant (see the module's docstring)."""
        return max(self.held, self.applied or 0, *self.pending.values(), 0)


class CreditLedger:
    """The credit of one subscription across the shards serving its queues."""

    def __init__(self, backlog: int) -> None:
        if backlog < 0:
            raise ValueError(f"backlog must be 0 or more, got {backlog}")
        self.backlog = backlog
        self.shards: dict[int, ShardCredit] = {}
        #: The shard that takes the remainder of an uneven share next (rotates).
        self._turn = 0

    # --- what the ledger knows --------------------------------------------------------------

    def reserved(self) -> int:
        return sum(s.reservation for s in self.shards.values())

    def free(self) -> int:
        return self.backlog - self.reserved()

    def grants(self) -> dict[int, int]:
        """Each shard's grant once every record sent is read."""
        return {shard: credit.grant for shard, credit in self.shards.items()}

    # --- events -------------------------------------------------------------------------------

    def add(self, shard: int) -> None:
        """A shard joins the subscription with no credit (its Subscribe carries a grant from
        `initial` or `plan`)."""
        self.shards.setdefault(shard, ShardCredit())

    def remove(self, shard: int) -> None:
        """The shard's part of the session ended (its leases broke): its credit is free."""
        self.shards.pop(shard, None)

    def initial(self, shards: list[int]) -> dict[int, int]:
        """Grants for the first Subscribe to each shard: the free credit split evenly, the
        remainder to the first shards. Call `sent` for each before sending."""
        for shard in shards:
            self.add(shard)
        free = max(self.free(), 0)
        grants: dict[int, int] = {}
        if not shards:
            return grants
        base, extra = divmod(free, len(shards))
        for i, shard in enumerate(shards):
            grants[shard] = base + (1 if i < extra else 0)
        return grants

    def sent(self, shard: int, request_id: str, grant: int) -> None:
        """A Subscribe or Replace carrying ``grant`` is about to go to ``shard``. Raises
        ``ValueError`` if it would break the invariant: reserve more than the backlog where
        it reserved less. (Reservations may already exceed it for a moment, not by a grant:
        a queue moved to another shard takes its leases along, which the new shard reports
        held while the old part's grant is still counted until that part is left.)"""
        credit = self.shards[shard]
        before = self.reserved()
        after = before - credit.reservation + max(credit.reservation, grant)
        if grant < 0 or (after > self.backlog and after > before):
            raise ValueError(f"grant {grant} to shard {shard} would reserve {after} of a "
                             f"backlog of {self.backlog} (shards: {self.shards})")
        credit.pending[request_id] = grant

    def refused(self, shard: int, request_id: str) -> None:
        """The shard refused a Subscribe or Replace: that grant will never apply."""
        credit = self.shards.get(shard)
        if credit is not None:
            credit.pending.pop(request_id, None)

    def confirmed(self, shard: int, request_id: str, report: CreditReport) -> None:
        """The shard's answer to the Subscribe or Replace ``request_id``: it applies that
        grant, and every one sent before it is superseded."""
        credit = self.shards.get(shard)
        if credit is None:
            return
        if request_id in credit.pending:
            ids = list(credit.pending)
            for earlier in ids[: ids.index(request_id) + 1]:
                del credit.pending[earlier]
        credit.applied = report.grant
        credit.held = report.held
        credit.waiting = report.waiting

    def reported(self, shard: int, report: CreditReport, delivered: int = 0) -> None:
        """A delivery batch or a credit notice from ``shard`` (``delivered`` messages in it).
        The report's grant is not a confirmation (it may predate a grant in flight), so only
        ``held`` and ``waiting`` are taken; a grant no longer pending that the shard applies
        is kept as applied."""
        credit = self.shards.get(shard)
        if credit is None:
            return
        credit.held = report.held
        credit.waiting = report.waiting
        credit.delivered += delivered
        if not credit.pending:
            credit.applied = report.grant

    # --- where credit goes ------------------------------------------------------------------

    def plan(self) -> dict[int, int]:
        """New grants to send (shard -> grant): raises where work waits, taken from free
        credit, and lowers where nothing waits when a shard with work needs that credit. The
        caller sends them (`sent` first) and calls `plan` again on the next report."""
        if len(self.shards) == 1:
            busy = list(self.shards)  # all the credit sits on the one shard, and stays there
        else:
            busy = sorted(s for s, c in self.shards.items() if c.waiting)
        if not busy:
            return {}
        targets = self._targets(busy)
        changes: dict[int, int] = {}
        free = self.free()
        starving = False
        for shard in busy:  # raises first, from what is free
            credit = self.shards[shard]
            new = min(targets[shard], credit.reservation + max(free, 0))
            if new > credit.grant:
                changes[shard] = new
                free -= max(new, credit.reservation) - credit.reservation
            starving = starving or max(new, credit.grant) < targets[shard]
        if starving:
            # Lower what sits above its target; the credit comes back with the answers.
            for shard, credit in self.shards.items():
                target = targets.get(shard, 0)
                if credit.grant > target and shard not in changes:
                    changes[shard] = target
        return changes

    def _targets(self, busy: list[int]) -> dict[int, int]:
        """An equal share of the backlog for each busy shard; the remainder goes to the busy
        shard whose turn it is, and the turn moves on once that shard has delivered."""
        base, extra = divmod(self.backlog, len(busy))
        if extra:
            holder = busy[self._turn % len(busy)]
            if self.shards[holder].delivered > 0:
                self._turn += 1
                for credit in self.shards.values():
                    credit.delivered = 0
        targets = {s: base for s in busy}
        for i in range(extra):
            targets[busy[(self._turn + i) % len(busy)]] += 1
        return targets
