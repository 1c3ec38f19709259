"""Kafka helpers for tests: real admin calls against the session's broker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from layer.localstack import StackConfig
from layer.localstack.kafka import KafkaNode
from tests.support.ports import reserve_ports


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


@contextmanager
def broker_of_its_own(state_dir: Path, ports_from: int, port: int | None = None
                      ) -> Iterator[KafkaNode]:
    """A broker for a test module alone (it stops or restarts it), in ``state_dir``, on two
    ports reserved from ``ports_from`` (or on ``port`` and the next, as given) until it stops:
    no other session or worker takes them while the broker is down (tests/support/ports.py).
    Stopped by its PID when the block ends."""
    reserved = None if port is not None else reserve_ports(ports_from, 2)
    first = port if port is not None else reserved.first  # type: ignore[union-attr]
    config = StackConfig.from_env({}, state_dir=state_dir, kafka_port=first,
                                  controller_port=first + 1)
    node = KafkaNode(config.kafka())
    try:
        node.up()
        yield node
    finally:
        node.down()
        if reserved is not None:
            reserved.release()
