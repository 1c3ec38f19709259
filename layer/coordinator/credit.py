"""Credit a consumer granted a shard (protocol 8, DESIGN §6 "Credit, granted by the
consumer"): what a session's part here holds, its grant and what waits for it, reported in its
answers and, when its consumer's ledger (`layer.sdk.credit`) would act on a change, in a credit
notice after the step's deliveries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from layer.coordinator.sessions import Session
from layer.kafka import OutgoingRecord
from layer.protocol.batch import BATCH, encode_delivery_batch
from layer.protocol.headers import SESSION, SHARD, credit_report_header

if TYPE_CHECKING:
    from layer.coordinator.core import ShardCore

__all__ = ["Credit"]

#: A credit notice's value: a delivery batch of no message.
_EMPTY_BATCH = encode_delivery_batch([])


class Credit:
    """The credited sessions of one `ShardCore` and their reports."""

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        #: Consumer ids whose session here holds credit its consumer granted: they are told
        #: what they hold and what waits whenever that changes (`notices`).
        self.credited: set[str] = set()

    def report(self, session: Session) -> tuple[int, int, int]:
        """``(held, grant, waiting)`` of a session's part on this shard: the leases it holds in
        every queue here (those it drains too), its grant, and the entries available in the
        queues it takes from where at least one is one it may take now (its filter, key
        groups, barriers: `QueueEngine.credit_view`), else 0 for that queue."""
        held = waiting = 0
        engines = self.core.engines
        consumer_id = session.consumer_id
        for name in session.every_queue:
            engine = engines.get(name)
            if engine is None:
                continue
            leases, available = engine.credit_view(consumer_id)
            held += leases
            restored = self.core.restored_leases.get(name)
            if restored:
                # Its leases restored from PostgreSQL that the replay has not reached: held
                # all the same (reported as free, their credit would be granted twice).
                waiting_replay = {(c, b) for c, b in restored if engine.restoring(b)}
                if len(waiting_replay) < len(restored):
                    restored.intersection_update(waiting_replay)
                held += sum(1 for c, _ in restored if c == consumer_id)
            if name in session.queues:
                waiting += available
        grant = session.max_backlog if session.max_backlog is not None else 1
        return held, grant, waiting

    def notices(self, replies: list[OutgoingRecord]) -> None:
        """Tell each credited session what changed since it was last told that its consumer
        acts on (work came to wait or stopped waiting, a grant was applied, leases held past
        the grant were settled): an empty delivery batch with a ``qlayer.credit-report``
        header, after this step's deliveries. Its consumer moves its credit on these
        (`layer.sdk.credit`)."""
        sessions = self.core.sessions
        for consumer_id in list(self.credited):
            session = sessions.get(consumer_id)
            if session is None or session.home is None:
                self.credited.discard(consumer_id)
                continue
            report = self.report(session)
            last = session.reported
            # Only what its consumer's ledger acts on: where work starts or stops waiting, a
            # grant applied, and leases settled while more are held than granted (credit
            # coming back). Deliveries within the grant need no word: at full speed a notice
            # per step per shard cost more than the credit it moves.
            if last is not None and not (
                    report[1] != last[1] or (report[2] > 0) != (last[2] > 0)
                    or (report[0] < last[0] and last[0] > report[1])):
                continue
            session.reported = report
            replies.append(OutgoingRecord(
                session.delivery_topic, _EMPTY_BATCH, consumer_id.encode(),
                [(BATCH, b"1"), (SESSION, session.session_id.encode()),
                 (SHARD, b"%d" % self.core.shard), credit_report_header(*report)],
                partition=0))
