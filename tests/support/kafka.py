"""Kafka helpers for tests: real admin calls against the session's broker."""

from __future__ import annotations

import time

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic


def create_topic(bootstrap_servers: str, name: str, partitions: int = 3, *,
                 exist_ok: bool = False, config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions,
                                            replication_factor=1, config=config or {})])
    try:
        futures[name].result(timeout=30)
    except KafkaException as exc:
        if not (exist_ok and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS):
            raise
    # Creation is acknowledged before every partition has a leader; wait for that.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        md = admin.list_topics(topic=name, timeout=5)
        topic = md.topics.get(name)
        if (topic is not None and topic.error is None and len(topic.partitions) == partitions
                and all(p.leader >= 0 for p in topic.partitions.values())):
            return
        time.sleep(0.1)
    raise TimeoutError(f"topic {name} has no leaders after 30s")
