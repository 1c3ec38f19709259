"""The credit ledger (`layer.sdk.credit`): one backlog over several shards, exactly.

Example tests, and a state machine of model shards (a control inbox and an ack inbox each,
read in their own order; an output stream to the consumer, per shard in order and interleaved
across shards) driven by a consumer that keeps a `CreditLedger`. After every step: what the
shards hold together never exceeds the backlog, and each shard holds no more than the ledger
reserves for it. At the end everything published is delivered (credit never gets stuck).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layer.sdk.credit import CreditLedger, CreditReport


def test_one_shard_takes_the_whole_backlog_and_keeps_it() -> None:
    ledger = CreditLedger(5)
    assert ledger.initial([3]) == {3: 5}
    ledger.sent(3, "r1", 5)
    ledger.confirmed(3, "r1", CreditReport(held=0, grant=5, waiting=0))
    # Nothing waits, work waits, leases come and go: the grant never moves.
    for report in (CreditReport(5, 5, 9), CreditReport(0, 5, 0), CreditReport(2, 5, 1)):
        ledger.reported(3, report, delivered=1)
        assert ledger.plan() == {}


def test_initial_grants_split_the_backlog_and_never_exceed_it() -> None:
    ledger = CreditLedger(5)
    grants = ledger.initial([0, 1, 2])
    assert grants == {0: 2, 1: 2, 2: 1}
    for shard, grant in grants.items():
        ledger.sent(shard, f"s{shard}", grant)
    assert ledger.reserved() == 5
    with pytest.raises(ValueError, match="would reserve 6 of a backlog of 5"):
        ledger.sent(2, "more", 2)


def test_a_queue_moved_with_its_leases_reserves_past_the_backlog_for_a_moment_only() -> None:
    """`qlayer queue move` of a queue from shard 1 to shard 2 takes its held lease along:
    shard 2 reports it held while shard 1's grant still counts, so the reservations exceed the
    backlog until the consumer leaves shard 1. Meanwhile no grant adds to them (a grant that
    changes nothing is not refused: it crashed the consumer before), and once shard 1 is left
    the credit is exact again."""
    ledger = CreditLedger(2)
    for shard, grant in ledger.initial([0, 1]).items():
        ledger.sent(shard, f"s{shard}", grant)
        ledger.confirmed(shard, f"s{shard}", CreditReport(0, grant, 5 if shard else 0))
    ledger.add(2)
    ledger.sent(2, "join", 0)
    ledger.confirmed(2, "join", CreditReport(held=1, grant=0, waiting=9))
    assert ledger.reserved() == 3
    assert ledger.plan() == {2: 1}  # shard 2's grant covers the lease it holds
    for shard, grant in ledger.plan().items():
        ledger.sent(shard, f"p{shard}", grant)  # does not raise
    assert ledger.reserved() == 3
    with pytest.raises(ValueError, match="would reserve 4 of a backlog of 2"):
        ledger.sent(0, "more", 2)
    ledger.remove(1)  # the consumer left the part its queue moved away from
    assert ledger.reserved() <= 2
    for shard, grant in ledger.plan().items():
        ledger.sent(shard, f"q{shard}", grant)
    assert ledger.reserved() <= 2


def test_credit_moves_to_where_work_waits_only_after_the_other_shard_gives_it_back() -> None:
    ledger = CreditLedger(2)
    for shard, grant in ledger.initial([0, 1]).items():
        ledger.sent(shard, f"s{shard}", grant)
        ledger.confirmed(shard, f"s{shard}", CreditReport(0, grant, 0))
    # Shard 1 has work and shard 0 none: shard 1 wants 2, shard 0 is lowered to 0.
    ledger.reported(0, CreditReport(0, 1, 0))
    ledger.reported(1, CreditReport(1, 1, 4), delivered=1)
    assert ledger.plan() == {0: 0}
    ledger.sent(0, "lower", 0)
    assert ledger.reserved() == 2  # until shard 0 answers, it may still lease one
    assert ledger.plan() == {}  # nothing free yet: shard 1 stays at 1
    ledger.confirmed(0, "lower", CreditReport(0, 0, 0))
    assert ledger.free() == 1
    assert ledger.plan() == {1: 2}


def test_a_lowered_shard_keeps_its_reservation_while_it_holds_leases() -> None:
    ledger = CreditLedger(1)
    ledger.initial([0, 1])
    ledger.sent(0, "a", 1)
    ledger.confirmed(0, "a", CreditReport(1, 1, 0))
    ledger.sent(1, "b", 0)
    ledger.confirmed(1, "b", CreditReport(0, 0, 3))
    assert ledger.plan() == {0: 0}
    ledger.sent(0, "lower", 0)
    ledger.confirmed(0, "lower", CreditReport(held=1, grant=0, waiting=0))
    # The consumer acked, but the shard has not said so: the lease still counts.
    assert ledger.free() == 0 and ledger.plan() == {}
    ledger.reported(0, CreditReport(held=0, grant=0, waiting=0))
    assert ledger.plan() == {1: 1}


def test_a_remainder_goes_round_so_no_busy_shard_waits_forever() -> None:
    ledger = CreditLedger(1)
    ledger.initial([0, 1])
    for shard in (0, 1):
        ledger.sent(shard, f"s{shard}", 0)
        ledger.confirmed(shard, f"s{shard}", CreditReport(0, 0, 5))
    served = []
    requests = itertools.count()
    for _ in range(6):
        changes = ledger.plan()
        for shard, grant in changes.items():
            request = f"r{next(requests)}"
            ledger.sent(shard, request, grant)
            ledger.confirmed(shard, request, CreditReport(0, grant, 5))
        raised = [s for s, g in changes.items() if g == 1]
        if raised:
            served.append(raised[0])
            ledger.reported(raised[0], CreditReport(1, 1, 5), delivered=1)
            ledger.reported(raised[0], CreditReport(0, 1, 5))  # settled
    assert set(served) == {0, 1}


def test_a_refused_grant_frees_its_reservation() -> None:
    ledger = CreditLedger(3)
    ledger.initial([0, 1])
    ledger.sent(0, "a", 2)
    ledger.refused(0, "a")
    assert ledger.free() == 3
    ledger.remove(0)
    assert ledger.grants() == {1: 0}


# --- the machine -----------------------------------------------------------------------------


@dataclass
class ModelShard:
    """A shard's part of one session: it leases while it holds fewer than its grant."""

    available: int = 0
    grant: int = 0
    held: int = 0
    control: deque[tuple[str, int]] = field(default_factory=deque)
    acks: deque[int] = field(default_factory=deque)
    #: To the consumer, in order: ("confirm", request id, report) or ("report", n, report).
    out: deque[tuple[str, object, CreditReport]] = field(default_factory=deque)

    def report(self) -> CreditReport:
        return CreditReport(self.held, self.grant, self.available)

    def dispatch(self) -> None:
        n = min(self.available, self.grant - self.held)
        if n > 0:
            self.available -= n
            self.held += n
            self.out.append(("report", n, self.report()))


class CreditMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger: CreditLedger | None = None
        self.shards: dict[int, ModelShard] = {}
        self.holding: dict[int, int] = {}
        self.requests = itertools.count()
        self.published = 0
        self.acked = 0

    @rule(backlog=st.integers(0, 6), count=st.integers(1, 4))
    @precondition(lambda self: self.ledger is None)
    def subscribe(self, backlog: int, count: int) -> None:
        self.ledger = CreditLedger(backlog)
        self.shards = {s: ModelShard() for s in range(count)}
        self.holding = dict.fromkeys(self.shards, 0)
        for shard, grant in self.ledger.initial(list(self.shards)).items():
            self._send(shard, grant)

    def _send(self, shard: int, grant: int) -> None:
        assert self.ledger is not None
        request = f"r{next(self.requests)}"
        self.ledger.sent(shard, request, grant)
        self.shards[shard].control.append((request, grant))

    def _pick(self, data: st.DataObject, which: list[int]) -> int:
        return data.draw(st.sampled_from(sorted(which)))

    @rule(data=st.data(), n=st.integers(1, 5))
    @precondition(lambda self: self.ledger is not None)
    def publish(self, data: st.DataObject, n: int) -> None:
        shard = self._pick(data, list(self.shards))
        model = self.shards[shard]
        was_waiting = model.available
        model.available += n
        self.published += n
        model.dispatch()
        if not was_waiting and model.available:
            # Work waits and the part may lease no more: the shard says so (a credit notice).
            model.out.append(("report", 0, model.report()))

    @rule(data=st.data())
    @precondition(lambda self: any(s.control for s in self.shards.values()))
    def shard_reads_control(self, data: st.DataObject) -> None:
        shard = self._pick(data, [k for k, s in self.shards.items() if s.control])
        model = self.shards[shard]
        request, grant = model.control.popleft()
        model.grant = grant
        model.out.append(("confirm", request, model.report()))
        model.dispatch()

    @rule(data=st.data())
    @precondition(lambda self: any(s.acks for s in self.shards.values()))
    def shard_reads_acks(self, data: st.DataObject) -> None:
        shard = self._pick(data, [k for k, s in self.shards.items() if s.acks])
        model = self.shards[shard]
        model.held -= model.acks.popleft()
        model.out.append(("report", 0, model.report()))  # the credit notice
        model.dispatch()

    @rule(data=st.data())
    @precondition(lambda self: any(s.out for s in self.shards.values()))
    def consumer_reads(self, data: st.DataObject) -> None:
        assert self.ledger is not None
        shard = self._pick(data, [k for k, s in self.shards.items() if s.out])
        kind, what, report = self.shards[shard].out.popleft()
        if kind == "confirm":
            assert isinstance(what, str)
            self.ledger.confirmed(shard, what, report)
        else:
            assert isinstance(what, int)
            self.holding[shard] += what
            self.ledger.reported(shard, report, delivered=what)
        self._plan()

    def _plan(self) -> None:
        assert self.ledger is not None
        for shard, grant in self.ledger.plan().items():
            self._send(shard, grant)

    @rule(data=st.data())
    @precondition(lambda self: any(self.holding.values()))
    def consumer_acks(self, data: st.DataObject) -> None:
        shard = self._pick(data, [k for k, n in self.holding.items() if n])
        n = data.draw(st.integers(1, self.holding[shard]))
        self.holding[shard] -= n
        self.acked += n
        self.shards[shard].acks.append(n)

    @invariant()
    def one_backlog(self) -> None:
        if self.ledger is None:
            return
        assert sum(s.held for s in self.shards.values()) <= self.ledger.backlog
        assert self.ledger.reserved() <= self.ledger.backlog
        for shard, model in self.shards.items():
            assert model.held <= self.ledger.shards[shard].reservation

    def teardown(self) -> None:
        """Everything published reaches the consumer: credit never gets stuck."""
        if self.ledger is None or self.ledger.backlog == 0:
            return
        for _ in range(10_000):
            moved = False
            for shard, model in self.shards.items():
                if self.holding[shard]:
                    self.acked += self.holding[shard]
                    model.acks.append(self.holding[shard])
                    self.holding[shard] = 0
                while model.control:
                    request, grant = model.control.popleft()
                    model.grant = grant
                    model.out.append(("confirm", request, model.report()))
                    model.dispatch()
                    moved = True
                while model.acks:
                    model.held -= model.acks.popleft()
                    model.out.append(("report", 0, model.report()))
                    model.dispatch()
                    moved = True
                while model.out:
                    kind, what, report = model.out.popleft()
                    if kind == "confirm":
                        assert isinstance(what, str)
                        self.ledger.confirmed(shard, what, report)
                    else:
                        assert isinstance(what, int)
                        self.holding[shard] += what
                        self.ledger.reported(shard, report, delivered=what)
                    self._plan()
                    self.one_backlog()
                    moved = True
            if not moved and not any(self.holding.values()):
                break
        assert self.acked == self.published


TestCreditMachine = CreditMachine.TestCase
