"""The coordinator's HTTP endpoint: Prometheus metrics, ``/healthz`` and ``/readyz``.

Nothing is counted here: a custom collector turns the latest `Snapshot` its process published
(once per report period, `layer.coordinator.figures`) into metric families at scrape time, so
the loop pays nothing per message and nothing per scrape. One `CollectorRegistry` per process
object (two coordinators in one Python process, as in the tests, each have their own), with
prometheus-client's process collector for the process's own CPU and memory.

HTTP is served from a daemon thread by the standard library's ``http.server``:
prometheus-client's own server serves only the registry, and ``/healthz`` and ``/readyz``
belong on the same port (docs/operations.md, "Metrics and health").

Imported only when ``--metrics-port`` is given: `qlayer` start-up never loads
prometheus-client.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from layer.coordinator.faults import split_refusal_key
from layer.coordinator.figures import Snapshot, by_consumer, by_queue
from layer.coordinator.phases import PHASE_BUCKETS_US, PHASES
from layer.protocol.records import AckStatus, SubscribeStatus

__all__ = [
    "QUEUE_TOTALS",
    "CoordinatorCollector",
    "MetricsServer",
    "metric_families",
    "metric_names",
]

log = logging.getLogger(__name__)

#: Stored per-queue totals exported as ``qlayer_queue_<name>_total`` (the rest of
#: `COUNTER_NAMES` are input faults, exported by reason).
QUEUE_TOTALS = {
    "enqueued": "Entries that entered the queue (journal records its filter accepted).",
    "delivered": "Leases given (deliveries), redeliveries included.",
    "redelivered": "Deliveries of an entry that had been delivered before.",
    "acked": "Entries acknowledged (ACCEPT, an ack by filter, a purge).",
    "released": "Entries released back to the queue by their consumer (RELEASE).",
    "lease_expired": "Leases that ended unsettled (deadline passed, consumer gone).",
    "dead_lettered": "Entries written to the dead-letter topic (REJECT, limits, expiry).",
    "expired": "Entries that left the queue unprocessed other than by a rejection "
               "(max_deliveries, max_cancels, expiration, a deleted journal, too large; "
               "dead-lettered or not).",
    "rejected": "Entries a consumer rejected (REJECT; dead-lettered or not).",
}
#: Input faults by reason label: stored counter name -> label value.
INPUT_FAULTS = {"unparseable": "unparseable", "deletes": "delete",
                "malformed_headers": "malformed_header"}
#: Malformed records by reason label: loop counter -> label value.
MALFORMED = {"malformed_ack_records": "ack_record",
             "malformed_control_records": "control_record",
             "oversized_ack_records": "oversized_ack_record",
             "oversized_control_records": "oversized_control_record",
             "malformed_deliver_at_headers": "deliver_at_header",
             "malformed_expiration_headers": "expiration_header"}
#: Records read and refused (not malformed) by reason label: loop counter -> label value.
REFUSED = {"unknown_session_heartbeats": "unknown_session_heartbeat",
           "unknown_session_unsubscribes": "unknown_session_unsubscribe",
           "forward_hops_exceeded": "forward_hops_exceeded",
           "invalid_ack_filters": "invalid_ack_filter",
           "invalid_resets": "invalid_reset",
           "invalid_queue_definitions": "invalid_queue_definition"}
#: Per-shard totals of the loop exported as ``qlayer_shard_<name>_total``.
SHARD_TOTALS = {
    "iterations": ("iterations", "Iterations of the shard loop."),
    "journal_records": ("journal_records", "Journal records read."),
    "deliveries": ("deliveries", "Messages delivered (leased and written)."),
    "delivery_records": ("delivery_records", "Kafka records written to delivery topics."),
    "transactions": ("postgres_transactions", "PostgreSQL transactions committed."),
    "statements": ("postgres_statements", "PostgreSQL statements in those transactions."),
    "iteration_failures": ("iteration_failures", "Iterations that failed (shard rebuilt)."),
    "session_timeouts": ("session_timeouts", "Consumer sessions that timed out."),
    "delivery_topics_deleted": ("delivery_topics_deleted", "Delivery topics deleted after "
                                "no session used them for --delivery-topic-retention."),
    "stalls": ("stalls", "Gaps of more than 5 s between two iterations."),
    "producers_fenced": ("producers_fenced", "Transactional consumers' producers fenced "
                         "before their leases broke (exactly-once processing)."),
    "sessions_fenced": ("sessions_fenced", "Transactional sessions ended after a fence, "
                        "once what they committed was applied."),
    "fence_failures": ("fence_failures", "Fences that failed and were tried again (their "
                       "sessions' leases held meanwhile)."),
}
#: Process-wide failure counters by kind label.
FAILURES = {"shard_failures": "shard", "round_failures": "round",
            "kafka_outages": "kafka_outage", "group_rejoins": "group_rejoin",
            "report_failures": "report"}


def metric_families(snapshot: Snapshot) -> Iterator[Metric]:
    """Every ``qlayer_*`` family of one snapshot (docs/operations.md lists them)."""
    s = snapshot
    info = GaugeMetricFamily("qlayer_coordinator_info", "This coordinator process: its owner "
                             "id and shard core (always 1).", labels=["owner", "core"])
    info.add_metric([s.owner_id, s.core], 1)
    yield info
    yield GaugeMetricFamily("qlayer_coordinator_ready", "1 when /readyz answers 200: the "
                            "process runs every shard assigned to it (or is a standby) and "
                            "reaches PostgreSQL and Kafka.", value=int(s.readiness.ready))
    yield GaugeMetricFamily("qlayer_coordinator_snapshot_timestamp_seconds", "When the "
                            "figures shown were taken (once per report period).",
                            value=s.taken_at)
    yield GaugeMetricFamily("qlayer_coordinator_shards", "Shards this process runs now.",
                            value=len(s.readiness.shards))
    failures = CounterMetricFamily("qlayer_coordinator_failures", "Failures of this process "
                                   "by kind (each retried; see the log).", labels=["kind"])
    for counter, kind in FAILURES.items():
        failures.add_metric([kind], s.process_counters.get(counter, 0))
    yield failures
    yield from _queue_families(s)
    yield from _consumer_families(s)
    yield from _shard_families(s)


def _queue_families(s: Snapshot) -> Iterator[Metric]:
    gauges = {
        "depth": "Entries in the queue not done yet: available, leased, delayed or inactive.",
        "available": "Entries ready for delivery now.",
        "leased": "Entries leased to a consumer and not settled yet.",
        "delayed": "Entries waiting for their delivery time (deliver-at, release delay).",
        "inactive": "Entries past target_queue_depth (not yet active).",
        "consumers": "Consumers subscribed to the queue.",
    }
    families = {name: GaugeMetricFamily(f"qlayer_queue_{name}", text, labels=["queue"])
                for name, text in gauges.items()}
    age = GaugeMetricFamily("qlayer_queue_oldest_available_age_seconds", "Age of the first "
                            "available entry in delivery order (0: none available).",
                            labels=["queue"])
    shard = GaugeMetricFamily("qlayer_queue_shard", "The shard that serves the queue.",
                              labels=["queue"])
    for q in by_queue(s.queues):
        for name, family in families.items():
            family.add_metric([q.queue], getattr(q, name))
        age.add_metric([q.queue], q.oldest_available_age or 0.0)
        shard.add_metric([q.queue], q.shard)
    yield from families.values()
    yield age
    yield shard
    counts = {name: CounterMetricFamily(f"qlayer_queue_{name}", text, labels=["queue"])
              for name, text in QUEUE_TOTALS.items()}
    faults = CounterMetricFamily("qlayer_queue_input_faults", "Journal records read with a "
                                 "fault that stays with the record, by reason.",
                                 labels=["queue", "reason"])
    served = {q.queue for q in s.queues}
    for queue in sorted(served):
        stored = s.totals.get(queue, {})
        for name, count in counts.items():
            count.add_metric([queue], stored.get(name, 0))
        for counter, reason in INPUT_FAULTS.items():
            faults.add_metric([queue, reason], stored.get(counter, 0))
    yield from counts.values()
    yield faults
    lag = GaugeMetricFamily("qlayer_queue_recovery_point_lag_records", "Journal records "
                            "between the queue's recovery point and the partition's end.",
                            labels=["queue", "topic", "partition"])
    for p in s.partitions:
        lag.add_metric([p.queue, p.topic, str(p.partition)], p.lag)
    yield lag


def _consumer_families(s: Snapshot) -> Iterator[Metric]:
    backlog = GaugeMetricFamily("qlayer_consumer_backlog", "Entries leased to the consumer "
                                "and not acknowledged yet.", labels=["queue", "consumer"])
    limit = GaugeMetricFamily("qlayer_consumer_max_backlog", "The consumer's backlog limit "
                              "in the queue.", labels=["queue", "consumer"])
    for c in by_consumer(s.consumers):
        backlog.add_metric([c.queue, c.consumer_id], c.backlog)
        limit.add_metric([c.queue, c.consumer_id], c.max_backlog)
    yield backlog
    yield limit
    acks = CounterMetricFamily("qlayer_consumer_ack_items", "Ack items (ACCEPT, RELEASE, "
                               "REJECT, RENEW) read from the consumer by this process.",
                               labels=["consumer"])
    for consumer, n in sorted(s.consumer_acks.items()):
        acks.add_metric([consumer], n)
    yield acks


def _shard_families(s: Snapshot) -> Iterator[Metric]:
    epoch = GaugeMetricFamily("qlayer_shard_epoch", "The epoch this process holds the shard "
                              "at (fencing; only shards it runs).", labels=["shard"])
    owner = GaugeMetricFamily("qlayer_shard_owner_info", "The shards this process runs "
                              "(always 1).", labels=["shard", "owner"])
    lag = GaugeMetricFamily("qlayer_shard_input_lag_records", "Records of the shard's inputs "
                            "(control and ack partitions, journals) not read yet.",
                            labels=["shard"])
    totals = {counter: CounterMetricFamily(f"qlayer_shard_{name}", text, labels=["shard"])
              for counter, (name, text) in SHARD_TOTALS.items()}
    malformed = CounterMetricFamily("qlayer_malformed_records", "Records that could not be "
                                    "read, by reason (counted, logged, skipped).",
                                    labels=["shard", "reason"])
    refused = CounterMetricFamily("qlayer_refused_records", "Records read and refused, by "
                                  "reason.", labels=["shard", "reason"])
    acks = CounterMetricFamily("qlayer_ack_items", "Ack items answered, by status (OK or "
                               "why refused).", labels=["shard", "status"])
    subscribes = CounterMetricFamily("qlayer_subscribe_requests", "Subscribe requests "
                                     "answered, by status.", labels=["shard", "status"])
    refusals = CounterMetricFamily(
        "qlayer_refusals", "Records and sessions refused or not acted on, by kind (subscribe, "
        "replace, heartbeat, unsubscribe, ack, control, session, queue), reason and principal "
        "(its name, 'anonymous' without a credential, 'unknown' for a credential naming "
        "none). Stored with the shard's input positions: exact across restarts.",
        labels=["shard", "kind", "reason", "principal"])
    phases = HistogramMetricFamily("qlayer_shard_iteration_phase_seconds", "Time each phase "
                                   "of a shard loop iteration took.", labels=["shard", "phase"])
    bounds = [f"{us / 1e6:g}" for us in PHASE_BUCKETS_US] + ["+Inf"]
    for f in s.shards:
        shard = str(f.shard)
        if f.epoch is not None:
            epoch.add_metric([shard], f.epoch)
            owner.add_metric([shard, s.owner_id], 1)
            if f.input_lag is not None:
                lag.add_metric([shard], f.input_lag)
        c = f.counters
        for counter, family in totals.items():
            family.add_metric([shard], c.get(counter, 0))
        for counter, reason in MALFORMED.items():
            malformed.add_metric([shard, reason], c.get(counter, 0))
        for counter, reason in REFUSED.items():
            refused.add_metric([shard, reason], c.get(counter, 0))
        for status in AckStatus:
            acks.add_metric([shard, status.value], c.get(f"ack_{status.value.lower()}", 0))
        for sub in SubscribeStatus:
            subscribes.add_metric([shard, sub.value], c.get(f"subscribe_{sub.value.lower()}", 0))
        for key, n in sorted(f.stored.items()):
            labels = split_refusal_key(key)
            if labels is not None:
                refusals.add_metric([shard, *labels], n)
        for i, phase in enumerate(PHASES):
            buckets = list(zip(bounds, f.phase_buckets[i], strict=True))
            phases.add_metric([shard, phase], buckets, f.phase_sums_us[i] / 1e6)
    yield epoch
    yield owner
    yield lag
    yield from totals.values()
    yield malformed
    yield refused
    yield acks
    yield subscribes
    yield refusals
    yield phases


def metric_names() -> set[str]:
    """Every sample name the endpoint shows (``_total``, ``_bucket`` ... included, and the
    process collector's), read back from the exposition of a snapshot with every family
    filled: for checks such as the Grafana dashboard's (tests/unit/coordinator)."""
    from prometheus_client.parser import text_string_to_metric_families

    from layer.coordinator.figures import (
        ConsumerFigures,
        PartitionLag,
        QueueFigures,
        Readiness,
        ShardFigures,
    )

    shard = ShardFigures(0, 1, 0, {}, tuple((0,) * (len(PHASE_BUCKETS_US) + 1) for _ in PHASES),
                         (0,) * len(PHASES),
                         stored={"refused:subscribe:queue_not_granted:anonymous": 0})
    snapshot = Snapshot(0.0, "x", "python", Readiness(True, (0,)),
                        queues=(QueueFigures("q", 0, 0, 0, 0, 0, 0, None),),
                        partitions=(PartitionLag("q", "t", 0, 0, 0),),
                        consumers=(ConsumerFigures("q", "c", 0, 1),), consumer_acks={"c": 0},
                        shards=(shard,))
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(lambda: snapshot))
    ProcessCollector(registry=registry)
    text = generate_latest(registry).decode()
    return {sample.name for family in text_string_to_metric_families(text)
            for sample in family.samples}


class CoordinatorCollector(Collector):
    """Reads the process's latest snapshot at scrape time (nothing before the first)."""

    def __init__(self, latest: Callable[[], Snapshot | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        snapshot = self._latest()
        if snapshot is not None:
            yield from metric_families(snapshot)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one port, served by a daemon thread.

    ``publish`` (the loop's thread) replaces the snapshot; requests read it. A snapshot older
    than ``stale_after`` makes ``/readyz`` answer 503: the loop has stopped reporting (stuck
    on a call that does not return)."""

    def __init__(self, host: str, port: int, *, stale_after: float = 15.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._snapshot: Snapshot | None = None
        self._stale_after = stale_after
        self._clock = clock
        self.registry.register(CoordinatorCollector(lambda: self._snapshot))
        ProcessCollector(registry=self.registry)
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="qlayer-metrics", daemon=True)

    @property
    def port(self) -> int:
        """The port served (the one given, or the one the system chose for 0)."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()
        log.info("metrics, /healthz and /readyz on port %d", self.port)

    def publish(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()  # waits for serve_forever, which must be running
        self._server.server_close()

    def readiness(self) -> tuple[int, dict[str, object]]:
        """``/readyz``'s status and body."""
        snapshot, now = self._snapshot, self._clock()
        if snapshot is None:
            return 503, {"ready": False, "reasons": ["starting: no report yet"]}
        r = snapshot.readiness
        reasons = list(r.reasons)
        age = now - snapshot.taken_at
        if age > self._stale_after:
            reasons.append(f"the coordinator's loop has not reported for {age:.0f}s")
        ready = r.ready and not reasons
        return (200 if ready else 503), {
            "ready": ready, "owner": snapshot.owner_id, "shards": list(r.shards),
            "standby": not r.shards, "reasons": reasons, "report_age_s": round(age, 3)}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    # Alive: the process runs. Kafka or PostgreSQL being away is not a reason
                    # to restart it; it rides outages out by itself (/readyz says so).
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                elif path == "/readyz":
                    status, body = server.readiness()
                    self._send(status, json.dumps(body).encode() + b"\n", "application/json")
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n",
                               "text/plain; charset=utf-8")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                # A scrape every few seconds is not news: debug only.
                log.debug("%s " + format, self.address_string(), *args)

        return Handler
