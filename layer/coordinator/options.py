"""How a coordinator process behaves, and the small values its parts share."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from layer.coordinator.payloads import DEFAULT_PAYLOAD_BUDGET

__all__ = ["CORES", "CoordinatorOptions", "LeaseTokens", "LoopStats", "default_owner_id"]


def default_owner_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class CoordinatorOptions:
    """How one coordinator process behaves; every field has a sane default."""

    owner_id: str = field(default_factory=default_owner_id)
    #: Kafka's session timeout for the coordinators' group: a process silent this long loses
    #: its shards to the others (the broker allows 6 s to 30 min by default). Heartbeats come
    #: from librdkafka's own thread, so a long iteration does not count as silence.
    group_session_timeout: float = 6.0
    #: A stable name for this process in the coordinators' group (Kafka static membership,
    #: ``group.instance.id``): restarted under the same name, it takes its shards back at
    #: once instead of after ``group_session_timeout``. None: dynamic membership.
    instance_id: str | None = None
    #: Session timeout for consumers that give none.
    default_session_timeout: float = 30.0
    poll_timeout: float = 0.02
    #: A shard that had no input in its last iteration runs again in a round only when its
    #: inputs have a record (looked at without waiting, every round) or after this long, for
    #: its timers: lease deadlines, delays, session timeouts, refreshes and delivery reports
    #: are at most this late. An iteration costs about 0.15 ms even with nothing to do, and a
    #: process runs every shard it owns (16 by default, most without a queue): run every
    #: round, they cost an idle process 11 % of a core, and a busy one an empty iteration of
    #: each other shard for every iteration of its busy one. 0: every shard, every round.
    idle_shard_interval: float = 0.1
    max_batch: int = 20_000
    #: How often queue definitions, purge and evict requests are looked up again.
    refresh_interval: float = 2.0
    #: How often the cluster's topics are listed for new journal partitions and topics (a
    #: metadata request over every topic, which stalls the loop on a large cluster).
    topic_check_interval: float = 10.0
    #: How often recovery points are committed as each queue's consumer-group offsets.
    group_commit_interval: float = 5.0
    #: At most how often (s) a shard commits its applied ack and control positions to the
    #: coordinator's Kafka group. Restart reads on from the positions stored in PostgreSQL;
    #: the group's are a fallback (a database from before 0003) and for lag tools. Each
    #: commit costs the broker ~0.5 ms of CPU; committing after every iteration was ~150
    #: commits a second at 1,000 msg/s. 0: after every iteration.
    offset_commit_interval: float = 1.0
    #: Kafka transactions fence a zombie coordinator's producer (DESIGN §6); off by default:
    #: the epoch check in PostgreSQL already fences everything a zombie could decide, and a
    #: transaction makes every iteration wait for its commit (docs/coordinator.md, "Kafka
    #: transactions").
    transactional: bool = False
    #: Without transactions, deliveries and event batches are not waited for; when the
    #: producer never empties, a flush this often (s) confirms the event batches sent.
    confirm_interval: float = 1.0
    #: How long one fence of a transactional consumer's producer may take (protocol 9,
    #: `layer.coordinator.fences`; made on a thread of the shard's) before it is tried again
    #: later, its session's leases held meanwhile.
    fence_timeout: float = 5.0
    #: How often each shard's lag and the process's shards are written for `qlayer coordinators`.
    report_interval: float = 2.0
    #: Bytes of journal records kept in memory; past it, records are re-read when needed.
    payload_budget: int = DEFAULT_PAYLOAD_BUDGET
    #: Allocations between cyclic garbage collections, set for the process by `run()`
    #: (Python's default is 700); 0 leaves the process's setting alone.
    gc_threshold: int = 100_000
    #: Once started, collect and freeze (`gc.freeze()`) what the start-up left, so later full
    #: collections do not walk it (a 64 ms pause of the loop, 5 ms after the freeze). Off for
    #: a coordinator sharing its process with other work that comes and goes (tests): what
    #: is frozen is never collected.
    gc_freeze: bool = True
    #: Which shard core decides: ``native`` (the Rust port, `native/`), ``python`` (the
    #: reference) or ``auto`` (native when the extension is installed).
    core: str = "auto"
    #: Serve Prometheus metrics, /healthz and /readyz on this port (0: one the system
    #: chooses); None: no endpoint (`layer.coordinator.metrics`).
    metrics_port: int | None = None
    #: The address the metrics endpoint listens on.
    metrics_host: str = "0.0.0.0"
    #: Refuse a Subscribe without a session secret (protocol 5, docs/security.md "Session
    #: identity"). Off, a session without one is unproven: it behaves as before protocol 5,
    #: but none of its records can take over or act for a proven session.
    require_identity: bool = False
    #: Seconds a delivery topic stays after the last session that used it ended (unsubscribed,
    #: timed out, evicted); then the owner of shard 0 deletes it (`layer.coordinator.topicsweep`).
    #: 0: never deleted.
    delivery_topic_retention: float = 3600.0

    def __post_init__(self) -> None:
        if self.delivery_topic_retention < 0:
            raise ValueError("delivery_topic_retention must be 0 (never delete) or more, got "
                             f"{self.delivery_topic_retention}")
        if self.core not in CORES:
            raise ValueError(f"core must be one of {', '.join(CORES)}, got {self.core!r}")

    @property
    def native_core(self) -> bool:
        """Whether shards run the native core (``native`` requires the extension)."""
        from layer.domain.native import native_available

        if self.core == "native" and not native_available():
            raise RuntimeError("core 'native' needs the qlayer_native extension: run "
                               "`make install` (or `pip install ./native`)")
        return self.core == "native" or (self.core == "auto" and native_available())


#: The shard cores a coordinator can run (`CoordinatorOptions.core`).
CORES = ("auto", "native", "python")


@dataclass
class LoopStats:
    """What one iteration did (for logs, tests and benchmarks)."""

    journal_records: int = 0
    control_records: int = 0
    ack_items: int = 0
    deliveries: int = 0
    dead_letters: int = 0
    replies: int = 0
    events: int = 0
    statements: int = 0


class LeaseTokens:
    """Unguessable lease tokens (128 random bits from the OS, as hex), drawn a block at a time.

    The same source as ``secrets.token_hex(16)``, without a system call per lease: drawing
    each token alone was a fortieth of the coordinator's time.
    """

    #: The native engine draws tokens of this kind itself, from the same OS source.
    os_random = True

    def __init__(self, block: int = 4096) -> None:
        self._block = block
        self._pool = ""
        self._next = 0

    def __call__(self) -> str:
        if self._next >= len(self._pool):
            self._pool = os.urandom(16 * self._block).hex()
            self._next = 0
        token = self._pool[self._next:self._next + 32]
        self._next += 32
        return token
