"""Helpers shared by the benchmarks: scratch databases, topics, the machine, broker log sizes."""

from __future__ import annotations

import contextlib
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from layer.kafka.logs import logged
from layer.store.migrate import upgrade


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient(logged({"bootstrap.servers": bootstrap}))
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    time.sleep(1.0)  # leaders elected


def delete_topics(bootstrap: str, names: list[str]) -> None:
    if not names:
        return
    admin = AdminClient(logged({"bootstrap.servers": bootstrap}))
    for future in admin.delete_topics(names).values():
        with contextlib.suppress(Exception):
            future.result(30)


def delete_cell_topics(bootstrap: str, names: list[str], prefixes: list[str]) -> None:
    """Delete a cell's topics: ``names`` and every topic under one of ``prefixes`` (the
    coordinator's control, ack, events and delivery topics). A benchmark run makes thousands of
    partitions; left behind, they make the development broker slow to start (each partition's
    log is loaded at start-up) and bring it near its open-file limit."""
    admin = AdminClient(logged({"bootstrap.servers": bootstrap}))
    existing = admin.list_topics(timeout=30).topics
    delete_topics(bootstrap, [t for t in existing
                              if t in names or any(t.startswith(p) for p in prefixes)])


def drop_database(url: str) -> None:
    """Drop a scratch database (`scratch_database`), closing what is still connected."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    with psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password,
                         dbname="postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{u.database}" WITH (FORCE)')


def share_group_from_earliest(bootstrap: str, group: str) -> None:
    """Share groups start at the log end by default; a benchmark group must see what is there."""
    admin = AdminClient(logged({"bootstrap.servers": bootstrap}))
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=[
        ConfigEntry("share.auto.offset.reset", "earliest",
                    incremental_operation=AlterConfigOpType.SET)])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)


def broker_log_dir(bootstrap: str) -> Path | None:
    """The broker's first log directory, if it is on this machine (the local stack's is)."""
    admin = AdminClient(logged({"bootstrap.servers": bootstrap}))
    try:
        broker = next(iter(admin.list_topics(timeout=10).brokers))
        resource = ConfigResource(ResourceType.BROKER, str(broker))
        configs = admin.describe_configs([resource])[resource].result(30)
        entry = configs.get("log.dirs") or configs.get("log.dir")
        if entry is None or entry.value is None:
            return None
        path = Path(str(entry.value).split(",")[0])
    except Exception:
        return None
    return path if path.is_dir() else None


def topic_log_bytes(log_dir: Path | None, topics: list[str], prefixes: list[str]) -> int | None:
    """Bytes in the `.log` segments of the given topics (and topics under the given prefixes).

    Index files are preallocated, so only the segments count: they grow by exactly what the
    broker appended (record batches, compressed or not, with their headers).
    """
    if log_dir is None:
        return None
    total = 0
    wanted = set(topics)
    for part in log_dir.iterdir():
        topic, _, index = part.name.rpartition("-")
        if not index.isdigit():
            continue
        if topic in wanted or any(topic.startswith(p) for p in prefixes):
            for segment in part.glob("*.log"):
                with contextlib.suppress(OSError):
                    total += segment.stat().st_size
    return total


def scratch_database(admin_url: str) -> str:
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(admin_url)
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password,
                         dbname="postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
    url = u.set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    return url


def database_rows(url: str) -> int:
    """Rows inserted, updated and deleted in this database so far (pg_stat_database).

    The statistics are flushed by each backend at most once a second, so callers wait a
    little before reading the figure after a run.
    """
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    with psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password,
                         dbname=u.database, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT tup_inserted + tup_updated + tup_deleted FROM "
                           "pg_stat_database WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0


def percentile(sorted_samples: list[float], q: float) -> float:
    if not sorted_samples:
        return float("nan")
    index = min(len(sorted_samples) - 1, int(len(sorted_samples) * q))
    return sorted_samples[index]


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f"{int(line.split()[1]) // 1024} MiB"
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory": memory,
            "python": platform.python_version(), "platform": platform.platform()}


class Feeder:
    """Records of ``size`` random bytes produced to one journal as fast as the harness can,
    keyed by their number; ``produced`` counts them."""

    def __init__(self, bootstrap: str, topic: str, size: int) -> None:
        self.topic = topic
        self.produced = 0
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self._padding = os.urandom(size)

    def produce(self, n: int) -> None:
        """``n`` more records, flushed."""
        for i in range(n):
            self._producer.produce(self.topic, self._padding,
                                   key=str(self.produced + i).encode())
            if i % 1000 == 0:
                self._producer.poll(0)
        self._producer.flush(60)
        self.produced += n
