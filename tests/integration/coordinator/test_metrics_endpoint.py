"""The coordinator's metrics endpoint, health checks, JSON logs and trace context, on the real
broker and PostgreSQL: the figures an operator would look at, scraped over HTTP."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from layer.protocol import TopicNames
from layer.sdk import QueueConsumer
from layer.settings import Settings
from tests.support.coordinator import put_queues, running_coordinator, wait_until
from tests.support.processes import CoordinatorSubprocess
from tests.support.tcpproxy import TcpProxy

pytestmark = pytest.mark.integration

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"

Samples = list[tuple[str, dict[str, str], float]]


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(port: int) -> Samples:
    status, body = get(port, "/metrics")
    assert status == 200
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples]


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` with these labels; None when there is none."""
    found = [v for n, got, v in samples
             if n == name and all(got.get(k) == want for k, want in labels.items())]
    return sum(found) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("core", "delivery_format"),
                         [("native", "batch"), ("python", "record")])
def test_the_figures_an_operator_checks(
    settings: Settings, journal: Callable[..., str], core: str, delivery_format: str
) -> None:
    topic = journal("Work", partitions=2)
    put_queues(settings, {"name": "Work", "underlying_topic": topic})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    for i in range(20):
        producer.produce(topic, json.dumps({"n": i}).encode(), key=b"k%d" % i,
                         headers=[("traceparent", TRACEPARENT.encode()),
                                  ("tracestate", TRACESTATE.encode())])
    assert producer.flush(30) == 0
    with running_coordinator(settings, core=core, metrics_port=0,
                             report_interval=0.3) as coordinator:
        port = coordinator.metrics_port
        assert port
        assert get(port, "/healthz")[0] == 200

        def metric(name: str, **labels: str) -> float | None:
            return value(scrape(port), name, **labels)

        # Published with no consumer: all 20 are in the queue, available.
        wait_until(lambda: metric("qlayer_queue_depth", queue="Work") == 20, what="depth 20")
        samples = scrape(port)
        assert value(samples, "qlayer_queue_available", queue="Work") == 20
        assert value(samples, "qlayer_queue_enqueued_total", queue="Work") == 20
        assert value(samples, "qlayer_queue_acked_total", queue="Work") == 0
        assert value(samples, "qlayer_coordinator_info", core=core) == 1
        # The queue's shard: run by this process, at the epoch it holds.
        shard = int(value(samples, "qlayer_queue_shard", queue="Work") or 0)
        epoch = coordinator.loops[shard].epoch
        assert epoch is not None
        assert value(samples, "qlayer_shard_epoch", shard=str(shard)) == epoch
        assert value(samples, "qlayer_shard_owner_info", shard=str(shard),
                     owner=coordinator.options.owner_id) == 1
        status, body = get(port, "/readyz")
        assert status == 200, body
        assert json.loads(body)["shards"] == coordinator.shards

        with QueueConsumer("Work", settings.bootstrap_servers, max_backlog=5,
                           consumer_id="metrics-c1", topic_prefix=settings.topic_prefix,
                           delivery_format=delivery_format) as consumer:  # type: ignore[arg-type]
            held = [wait_until(lambda: consumer.receive(timeout=1.0), timeout=30,
                               what="a delivery") for _ in range(5)]
            # The trace context came through with the record (either delivery format).
            assert {(m.traceparent, m.tracestate) for m in held} == {(TRACEPARENT, TRACESTATE)}
            wait_until(lambda: metric("qlayer_consumer_backlog", queue="Work",
                                      consumer="metrics-c1") == 5, what="backlog 5")
            assert metric("qlayer_queue_leased", queue="Work") == 5
            for m in held:
                m.ack()
            done = 5
            while done < 20:
                m = wait_until(lambda: consumer.receive(timeout=1.0), timeout=30,
                               what="a delivery")
                assert m.traceparent == TRACEPARENT
                m.ack()
                done += 1
            wait_until(lambda: metric("qlayer_queue_acked_total", queue="Work") == 20,
                       timeout=30, what="20 acked")
            samples = scrape(port)
            assert value(samples, "qlayer_queue_depth", queue="Work") == 0
            assert value(samples, "qlayer_consumer_backlog", queue="Work",
                         consumer="metrics-c1") == 0
            assert value(samples, "qlayer_consumer_ack_items_total", consumer="metrics-c1") == 20
            assert value(samples, "qlayer_ack_items_total", status="OK") == 20

        # A record on the ack topic that is not an ack: counted by reason, nothing else.
        malformed = Producer({"bootstrap.servers": settings.bootstrap_servers})
        malformed.produce(TopicNames(settings.topic_prefix).ack, b"\x00not an ack", partition=0)
        assert malformed.flush(30) == 0
        wait_until(lambda: metric("qlayer_malformed_records_total", reason="ack_record") == 1,
                   timeout=30, what="the malformed ack record counted")
        samples = scrape(port)
        assert value(samples, "qlayer_malformed_records_total", reason="control_record") == 0
        assert (value(samples, "qlayer_shard_iteration_phase_seconds_count",
                      shard=str(shard), phase="deciding") or 0) > 0
        assert (value(samples, "process_resident_memory_bytes") or 0) > 0
        assert get(port, "/readyz")[0] == 200


def test_readiness_follows_postgres_and_the_log_is_json(
    settings: Settings, journal: Callable[..., str], tmp_path: Path
) -> None:
    """A real `qlayer coordinator run --metrics-port ... --log-format json`, whose PostgreSQL
    is reached through a proxy the test cuts and restores."""
    put_queues(settings, {"name": "Work", "underlying_topic": journal("Work")})
    url = make_url(settings.database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxy.start()
    proxied = settings.model_copy(update={"database_url": url.set(
        host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)})
    port = free_port()
    process = CoordinatorSubprocess(proxied, tmp_path, "metrics-json", "--metrics-port",
                                    str(port), "--metrics-host", "127.0.0.1", "--log-format",
                                    "json", "--core", "python")

    def ready() -> int:
        try:
            return get(port, "/readyz")[0]
        except OSError:
            return 0  # not listening yet

    try:
        # Ready once the group assigned it shards and it runs them (it is alone).
        wait_until(lambda: ready() == 200 and json.loads(get(port, "/readyz")[1])["shards"],
                   timeout=60, what="/readyz 200 with the shards running")
        assert get(port, "/healthz")[0] == 200
        proxy.cut()
        wait_until(lambda: ready() == 503, timeout=30, what="/readyz 503 without PostgreSQL")
        reasons = json.loads(get(port, "/readyz")[1])["reasons"]
        assert any("PostgreSQL" in r for r in reasons), reasons
        # Alive all the same: it rides the outage out by itself.
        assert get(port, "/healthz")[0] == 200
        proxy.start()
        wait_until(lambda: ready() == 200, timeout=60, what="/readyz 200 again")
    finally:
        process.stop()
        proxy.cut()
    lines = [line for line in process.log.read_text().splitlines() if line.strip()]
    assert lines
    objects = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= o.keys() for o in objects)
    took = [o for o in objects if o["message"].startswith("coordinator metrics-json took")]
    assert len(took) == 1, took  # one line for the shards it took at start, with why
    assert took[0]["owner"] == "metrics-json"
    assert sorted(took[0]["shards"]) == list(range(len(took[0]["shards"])))
    assert len(took[0]["epochs"]) == len(took[0]["shards"])
    assert took[0]["reason"] == "assigned by the coordinators' group"
