"""The metrics endpoint's pure parts: phase histograms, snapshot → exposition, readiness, the
JSON log format, and the Grafana dashboard against the names the exporter defines."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from layer.coordinator.figures import (
    ConsumerFigures,
    PartitionLag,
    QueueFigures,
    Readiness,
    ShardFigures,
    Snapshot,
)
from layer.coordinator.logformat import JsonFormatter, fields
from layer.coordinator.metrics import CoordinatorCollector, MetricsServer, metric_names
from layer.coordinator.phases import PHASE_BUCKETS_US, PHASES, PhaseTimes

ROOT = Path(__file__).resolve().parents[3]


def test_phase_times_fall_in_their_buckets_and_add_up_cumulatively() -> None:
    times = PhaseTimes()
    times.observe(50, 100, 101, 20_000_000, -5)  # a clock step backwards counts 0
    times.observe(150, 0, 0, 0, 0)
    polling = PHASES.index("polling")
    assert times.count == 2
    assert times.sums[polling] == 200
    # 50 µs in the first bucket (≤ 100), 150 µs in the second (≤ 250).
    assert times.cumulative(polling)[:3] == [1, 2, 2]
    assert times.cumulative(polling)[-1] == 2
    deciding = PHASES.index("deciding")
    assert times.cumulative(deciding)[0] == 2  # 100 µs is at the first bound, 0 too
    committing = PHASES.index("committing")
    assert times.cumulative(committing)[0] == 1  # 101 µs is past it
    encoding = PHASES.index("encoding")
    assert times.buckets[encoding][len(PHASE_BUCKETS_US)] == 1  # 20 s: only +Inf


def _snapshot(ready: bool = True, taken_at: float = 100.0) -> Snapshot:
    phases = PhaseTimes()
    phases.observe(300, 1_500, 2_000, 40, 80)
    shard = ShardFigures(
        shard=2, epoch=7, input_lag=3,
        counters={"iterations": 1, "malformed_ack_records": 2, "ack_ok": 5,
                  "ack_wrong_token": 1, "subscribe_ok": 1},
        phase_buckets=tuple(tuple(phases.cumulative(i)) for i in range(len(PHASES))),
        phase_sums_us=tuple(phases.sums))
    return Snapshot(
        taken_at=taken_at, owner_id="c-1", core="python",
        readiness=Readiness(ready, (2,), () if ready else ("PostgreSQL: refused",)),
        queues=(QueueFigures("Jobs", 2, available=4, leased=2, delayed=1, inactive=3,
                             consumers=1, oldest_available_age=12.5),),
        totals={"Jobs": {"enqueued": 10, "acked": 4, "unparseable": 1}},
        partitions=(PartitionLag("Jobs", "jobs", 0, recovery_point=4, end_offset=10),),
        consumers=(ConsumerFigures("Jobs", "w1", backlog=2, max_backlog=5),),
        consumer_acks={"w1": 5}, shards=(shard,), process_counters={"shard_failures": 1})


def _samples(snapshot: Snapshot) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_snapshot_reads_as_the_figures_a_user_checks() -> None:
    found = _samples(_snapshot())
    assert found[("qlayer_queue_depth", (("queue", "Jobs"),))] == 10  # 4 + 2 + 1 + 3
    assert found[("qlayer_queue_oldest_available_age_seconds", (("queue", "Jobs"),))] == 12.5
    assert found[("qlayer_queue_enqueued_total", (("queue", "Jobs"),))] == 10
    assert found[("qlayer_queue_acked_total", (("queue", "Jobs"),))] == 4
    assert found[("qlayer_queue_released_total", (("queue", "Jobs"),))] == 0
    assert found[("qlayer_queue_input_faults_total",
                  (("queue", "Jobs"), ("reason", "unparseable")))] == 1
    assert found[("qlayer_queue_recovery_point_lag_records",
                  (("partition", "0"), ("queue", "Jobs"), ("topic", "jobs")))] == 6
    assert found[("qlayer_consumer_backlog", (("consumer", "w1"), ("queue", "Jobs")))] == 2
    assert found[("qlayer_consumer_ack_items_total", (("consumer", "w1"),))] == 5
    assert found[("qlayer_shard_epoch", (("shard", "2"),))] == 7
    assert found[("qlayer_shard_owner_info", (("owner", "c-1"), ("shard", "2")))] == 1
    assert found[("qlayer_malformed_records_total",
                  (("reason", "ack_record"), ("shard", "2")))] == 2
    assert found[("qlayer_ack_items_total", (("shard", "2"), ("status", "WRONG_TOKEN")))] == 1
    assert found[("qlayer_coordinator_failures_total", (("kind", "shard"),))] == 1
    # 1.5 ms of deciding: not in the 1 ms bucket, in the 2.5 ms one; the sum in seconds.
    deciding = (("le", "0.001"), ("phase", "deciding"), ("shard", "2"))
    assert found[("qlayer_shard_iteration_phase_seconds_bucket", deciding)] == 0
    assert found[("qlayer_shard_iteration_phase_seconds_bucket",
                  (("le", "0.0025"), ("phase", "deciding"), ("shard", "2")))] == 1
    assert found[("qlayer_shard_iteration_phase_seconds_sum",
                  (("phase", "deciding"), ("shard", "2")))] == pytest.approx(0.0015)


def test_the_parts_of_a_queue_in_one_process_are_one_series_of_their_sums() -> None:
    """A process serving two parts of a queue of several parts (docs/coordinator.md,
    "Partitioned queues") shows the queue once: two series with the same labels are an
    invalid exposition that Prometheus refuses."""
    from dataclasses import replace

    one = _snapshot()
    snapshot = replace(
        one, queues=(*one.queues, QueueFigures("Jobs", 3, available=6, leased=1, delayed=0,
                                               inactive=0, consumers=1,
                                               oldest_available_age=30.0)),
        consumers=(*one.consumers, ConsumerFigures("Jobs", "w1", backlog=1, max_backlog=2)))
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    assert text.count('qlayer_queue_depth{queue="Jobs"}') == 1
    assert text.count('qlayer_consumer_backlog{consumer="w1",queue="Jobs"}') == 1
    found = _samples(snapshot)
    assert found[("qlayer_queue_depth", (("queue", "Jobs"),))] == 17  # 10 + 6 + 1
    assert found[("qlayer_queue_consumers", (("queue", "Jobs"),))] == 1
    assert found[("qlayer_queue_oldest_available_age_seconds", (("queue", "Jobs"),))] == 30.0
    assert found[("qlayer_queue_shard", (("queue", "Jobs"),))] == 2
    assert found[("qlayer_consumer_backlog", (("consumer", "w1"), ("queue", "Jobs")))] == 3


def test_nothing_is_shown_before_the_first_snapshot() -> None:
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(lambda: None))
    assert b"qlayer_" not in generate_latest(registry)


def test_readiness_is_the_snapshots_and_a_silent_loop_is_not_ready() -> None:
    now = [100.0]
    server = MetricsServer("127.0.0.1", 0, stale_after=15.0, clock=lambda: now[0])
    try:
        assert server.readiness()[0] == 503  # nothing reported yet
        server.publish(_snapshot())
        status, body = server.readiness()
        assert (status, body["shards"], body["standby"]) == (200, [2], False)
        server.publish(_snapshot(ready=False))
        status, body = server.readiness()
        assert (status, body["reasons"]) == (503, ["PostgreSQL: refused"])
        server.publish(_snapshot())
        now[0] = 130.0
        status, body = server.readiness()
        assert status == 503
        assert body["reasons"] == ["the coordinator's loop has not reported for 30s"]
    finally:
        server.close()


def test_a_json_log_line_is_one_object_with_its_fields() -> None:
    record = logging.LogRecord("layer.coordinator.shard", logging.WARNING, __file__, 1,
                               "shard %d did not run for %.1fs", (3, 6.25), None)
    record.__dict__.update(fields(shard=3, epoch=9, queue=None))
    line = JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["message"] == "shard 3 did not run for 6.2s"
    assert (data["level"], data["logger"], data["shard"], data["epoch"]) == (
        "WARNING", "layer.coordinator.shard", 3, 9)
    assert "queue" not in data
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", data["time"])
    with pytest.raises(ValueError, match="unknown log fields"):
        fields(shrad=1)


def test_the_grafana_dashboard_shows_only_metrics_the_exporter_defines() -> None:
    dashboard = json.loads((ROOT / "docker" / "grafana-dashboard.json").read_text())
    known = metric_names()
    expressions = [target["expr"] for panel in dashboard["panels"]
                   for target in panel["targets"]]
    expressions += [v["query"] for v in dashboard["templating"]["list"]
                    if v["type"] == "query"]
    used = {name for expr in expressions
            for name in re.findall(r"\b((?:qlayer|process)_[a-z_]+)\b", expr)}
    assert used, "the dashboard's expressions name no metric"
    assert used <= known, f"not defined by the exporter: {sorted(used - known)}"
    # Every queue figure the issue asks for is on it.
    for name in ("qlayer_queue_depth", "qlayer_queue_oldest_available_age_seconds",
                 "qlayer_queue_recovery_point_lag_records", "qlayer_consumer_backlog",
                 "qlayer_shard_epoch", "process_resident_memory_bytes"):
        assert name in used
