"""The pipeline against a real coordinator run, through Spark's Kafka source on local[2].

A queue sees a rejection, a release past max_cancels (both dead-lettered), a lease that
expires and is redelivered, plain acks, and two messages still waiting when the run ends. The
jobs must agree exactly with the coordinator's own counters; `reconcile` must agree exactly
with the journal, the events and PostgreSQL, and name each disagreement: an ACKED event the
events topic lost, forged events for a waiting message and for a record never written, a
duplicated ACKED event (exit status 3), also when the job file runs with spark-submit on a
standalone cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from layer.pipeline import jobs as jobs_module
from layer.pipeline import transforms
from layer.pipeline.io import read_events
from layer.pipeline.jars import ensure_spark_jars
from layer.pipeline.jobs import EventSource, run_lifecycle, run_reconcile
from layer.pipeline.transforms import Outcome, Violation
from layer.protocol import AckType, Codec, Event, EventType, TopicNames
from layer.protocol.bookmark import Bookmark
from layer.services.views import FAULT_COUNTERS
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    TopicReader,
    TopicRecord,
    counters,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
)
from tests.support.spark_cluster import spark_bin, standalone_cluster

pytestmark = pytest.mark.integration


def coordinator_run(settings: Settings, work: str) -> dict[str, int]:
    """Drive the queue through its cases; the counters once the coordinator has stopped."""
    # Long enough that no lease runs out before the acks below are applied on a loaded
    # machine (a 1 s lease expired m0 before its REJECT arrived in CI), short for m2's expiry.
    put_queues(settings, {"name": "Work", "underlying_topic": work, "max_cancels": 1,
                          "lease_period": "4s"})
    produce(settings.bootstrap_servers, work, [f"m{i}".encode() for i in range(8)],
            keys=[f"k{i}".encode() for i in range(8)])
    with running_coordinator(settings), Consumers(settings) as pool:
        worker = pool.subscribe("Work", max_backlog=8)
        deliveries = {d.value: d for d in worker.receive(8)}
        worker.ack([deliveries[b"m0"]], AckType.REJECT, reason="bad payload")
        worker.ack([deliveries[b"m1"]], AckType.RELEASE)  # max_cancels 1: dead-lettered
        worker.ack([d for v, d in deliveries.items() if v not in (b"m0", b"m1", b"m2")])
        (again,) = worker.receive(1, timeout=20)  # m2's lease expired: delivered again
        assert again.value == b"m2"
        worker.ack([again])
        wait_for_counters(settings, "Work", acked=6, expired=1, rejected=1)
        worker.unsubscribe()
        # Nobody left to deliver to: these two stay pending.
        produce(settings.bootstrap_servers, work, [b"p0", b"p1"])
        wait_for_counters(settings, "Work", enqueued=10)
    return counters(settings, "Work")


def lossy_copy(settings: Settings, create_topic: Callable[..., str],
               unique_name: Callable[[str], str], records: list[TopicRecord],
               lost: Event) -> str:
    """A topic prefix whose events topic holds ``records`` less the one event ``lost``: the
    events topic as a reader that skipped it sees it."""
    prefix = unique_name("lossy") + "."
    topic = create_topic(TopicNames(prefix).events, 1)
    codec = Codec()
    values: list[bytes | None] = []
    for record in records:
        events = codec.decode_events(record.value)
        if lost not in events:
            values.append(record.value)
            continue
        batch = codec.decode_event_batch(record.value)
        kept = [codec.event_item(codec.encode_event(e)) for e in batch.events if e != lost]
        values.append(codec.encode_event_batch(batch.batch_id, batch.shard,
                                               codec.event_array(kept)))
    produce(settings.bootstrap_servers, topic, values, partition=0)
    return prefix


# A coordinator run, six Spark jobs and a standalone cluster's start: past the suite's 600 s
# on a loaded 2-core machine (it took 9-10 minutes once with the load average at 17).
@pytest.mark.timeout(1200)
def test_lifecycle_and_reconcile_agree_with_the_coordinator(
    spark: SparkSession, settings: Settings, journal: Callable[..., str],
    create_topic: Callable[..., str], unique_name: Callable[[str], str], tmp_path: Path,
) -> None:
    work = journal("Work")
    start_ms = int(time.time() * 1000) - 1000
    expected = coordinator_run(settings, work)
    assert expected["redelivered"] == 1 and expected["dead_lettered"] == 2  # the cases ran
    source = EventSource(settings.bootstrap_servers, settings.topic_prefix)

    table = run_lifecycle(spark, source, queue="Work", start_ms=start_ms).cache()
    rows = {r["bookmark"]: r for r in table.collect()}
    assert len(rows) == expected["enqueued"] == 10
    outcomes = Counter(r["outcome"] for r in rows.values())
    assert outcomes == {Outcome.ACKED: expected["acked"],
                        Outcome.DEAD_LETTERED: expected["dead_lettered"],
                        Outcome.PENDING: 2}
    assert sum(r["delivery_count"] for r in rows.values()) == expected["delivered"]
    assert sum(r["delivery_count"] > 1 for r in rows.values()) == expected["redelivered"]
    assert all(r["time_in_queue_ms"] >= 0 for r in rows.values() if r["outcome_ms"])
    reasons = Counter(r["outcome_reason"] for r in rows.values()
                      if r["outcome"] == Outcome.DEAD_LETTERED)
    assert reasons == {"rejected": 1, "max_cancels": 1}

    events = read_events(spark, source.events_topic, source.options())
    recomputed = transforms.counters(events).where("queue = 'Work'").collect()[0].asDict()
    # The pipeline recomputes the counters the events carry; the input-fault ones count
    # records that never became entries (none in this run).
    assert {k: expected[k] for k in FAULT_COUNTERS} == dict.fromkeys(FAULT_COUNTERS, 0)
    assert {k: v for k, v in recomputed.items() if k != "queue"} == {
        k: v for k, v in expected.items() if k not in FAULT_COUNTERS}

    # Three sources that agree: the journal, the events and PostgreSQL's final state.
    report = run_reconcile(spark, source, "Work", work, start_ms=start_ms,
                           store=settings.database_url)
    assert (report.done, report.pending, report.violations) == (8, 2, [])
    assert report.store_read
    table.unpersist()

    # An event batch published twice (the coordinator stopped between publishing it and
    # forgetting it, and the shard's next owner published it again): counted once.
    reader = TopicReader(settings.bootstrap_servers, source.events_topic)
    codec = Codec()
    records = reader.read_until(lambda rs: len(rs) > 0)
    while reader.read():
        pass
    reader.close()

    def acked_of_work(value: bytes | None) -> list[Event]:
        return [e for e in codec.decode_events(value)
                if e.type is EventType.ACKED and e.queue == "Work"]

    copy = next(r for r in records if acked_of_work(r.value))
    lost_ack = acked_of_work(copy.value)[0]
    assert lost_ack.bookmark is not None
    lossy = lossy_copy(settings, create_topic, unique_name, records, lost_ack)

    # The events topic without that one ACKED event: PostgreSQL still says the entry is done
    # (below its recovery point, or an ACKED row) and the audit names it.
    stored = recovery_points(settings, "Work")
    point = stored.get((lost_ack.bookmark.topic, lost_ack.bookmark.partition), 0)
    lost_violation = (Violation.STORE_DONE_NO_OUTCOME if lost_ack.bookmark.offset < point
                      else Violation.STORE_ACKED_NO_ACKED_EVENT)
    # And forged extra events: an ACKED for a message still waiting in PostgreSQL, and events
    # for a journal record that was never written.
    waiting = next(r["bookmark"] for r in rows.values() if r["outcome"] == Outcome.PENDING)
    waiting_at = Bookmark.parse(waiting)
    beyond = Bookmark(waiting_at.topic, waiting_at.partition, 10_000)
    forged_events = [replace(lost_ack, bookmark=waiting_at),
                     replace(lost_ack, type=EventType.ENQUEUED, bookmark=beyond,
                             consumer_id=None, delivery_count=None,
                             record_timestamp_ms=lost_ack.timestamp_ms)]
    produce(settings.bootstrap_servers, TopicNames(lossy).events, [codec.encode_event_batch(
        10**12 + 1, 0, codec.event_array([codec.event_item(codec.encode_event(e))
                                          for e in forged_events]))], partition=0)
    lossy_source = EventSource(settings.bootstrap_servers, lossy)
    lossy_report = run_reconcile(spark, lossy_source, "Work", work, start_ms=start_ms,
                                 store=settings.database_url)
    # The lost ACKED's entry and the waiting one are violations; the record never written
    # is not an entry of the journal's, so it is not counted as done or pending.
    assert (lossy_report.done, lossy_report.pending) == (7, 1)
    assert sorted((v.bookmark, v.violation) for v in lossy_report.violations) == sorted([
        (str(lost_ack.bookmark), lost_violation), (waiting, Violation.OUTCOME_NOT_IN_STORE),
        (str(beyond), Violation.UNKNOWN_RECORD)])

    events_topic = TopicNames(settings.topic_prefix).events
    produce(settings.bootstrap_servers, events_topic, [copy.value])
    same = run_reconcile(spark, source, "Work", work, start_ms=start_ms)
    assert (same.done, same.pending, same.violations) == (8, 2, [])

    # The same ACKED event in another batch is a second acknowledgement: a violation.
    ack = acked_of_work(copy.value)[0]
    forged = codec.encode_event_batch(10**12, 0, codec.event_array(
        [codec.event_item(codec.encode_event(ack))]))
    produce(settings.bootstrap_servers, events_topic, [forged])
    bookmark = str(ack.bookmark)

    # The job file, unchanged, through spark-submit on a standalone cluster (a master and a
    # worker with two executor JVMs): nothing may depend on one JVM's memory. PostgreSQL is
    # read by the executors through the JDBC driver shipped with --jars.
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    with standalone_cluster(tmp_path / "cluster", cores=2, memory="1g", env=env) as cluster:
        job = subprocess.run(
            [str(spark_bin("spark-submit")), "--master", cluster.master_url,
             "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1",
             "--conf", "spark.cores.max=2", "--conf", "spark.sql.shuffle.partitions=2",
             "--conf", "spark.ui.enabled=false",
             "--jars", ",".join(str(j) for j in ensure_spark_jars()), jobs_module.__file__,
             "--from-submit", "--bootstrap-servers", settings.bootstrap_servers,
             "--topic-prefix", settings.topic_prefix, "--start-ms", str(start_ms),
             "reconcile", "--queue", "Work", "--journal", work,
             "--store", settings.database_url],
            capture_output=True, text=True, timeout=600, check=False, env=env)
        executors = [p.name for p in (tmp_path / "cluster").glob("worker0/app-*/*")]
    assert job.returncode == 3, job.stderr[-3000:]  # 3: violations found
    assert job.stdout.splitlines() == ["Work: 7 done, 2 pending, 1 violations",
                                       f"acked_twice\tWork\t{bookmark}"]
    assert len(executors) == 2  # the application ran on the cluster's two executors
    assert all(not Path(f"/proc/{pid}").exists() for pid in cluster.pids)
