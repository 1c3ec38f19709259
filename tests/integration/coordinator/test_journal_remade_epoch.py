"""A journal deleted while its shard reads it and made again is read by the same owner, when
the broker restarted during the old journal's life (found by the fault soak: the shard never
read the journal made again until it changed owner; docs/coordinator.md, "A journal deleted
while read").

A broker restart raises every partition's leader epoch (KIP-320); a topic made again starts
at epoch 0. librdkafka (2.16) keeps the epoch it cached for a partition across the topic's
deletion and across an unassign and assign of the same partition, so it takes the new
topic's metadata for stale, and every fetch is answered UNKNOWN_LEADER_EPOCH and retried,
without an error to the application, for ever. A broker that never restarted leaves the
epochs at 0 and hides it (test_journal_remade.py passes either way): so the broker here is
this module's own (a `KafkaNode` in a temporary directory), restarted once after its journals
were made. PostgreSQL is the session's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from layer.kafka import KafkaAdapterError
from layer.localstack.kafka import KafkaNode
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)
from tests.support.kafka import broker_of_its_own, create_topic

from .test_options_expiry_and_backoff import core

__all__ = ["core"]

# One xdist group (`--dist loadgroup`): its broker of its own, restarted, on one worker.
# Alone (after the parallel workers, `make test`): a broker of its own killed or restarted,
# and how the coordinator rides it out, in time. Beside five busy workers on two cores the
# process's own loop was held up for most of a minute (issue 35's parallel runs).
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("remade-epoch"), pytest.mark.alone]

#: The shapes of the soak: the journal made again at once (the broker creates a topic on its
#: first use; the coordinator's own lag-offset commit did, before the fix), while the shard
#: still reads it; or seconds later, once the shard found it gone.
SHAPES = ("at-once", "later")
CORES = ("python", "native")
RECORDS = 100


@pytest.fixture(scope="module")
def restarted_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaNode]:
    """A broker of this module alone, stopped (by its PID) when the module ends."""
    # Below Linux's ephemeral range, as test_broker_outage's broker (tests/support/ports.py).
    with broker_of_its_own(tmp_path_factory.mktemp("remade-stack"), 26_092) as node:
        yield node


@pytest.fixture(scope="module")
def journals(restarted_broker: KafkaNode) -> dict[tuple[str, str], str]:
    """One journal per shape and core, made before the broker restarts and written after it:
    its records carry a leader epoch above 0, as the soak's did."""
    bootstrap = restarted_broker.config.bootstrap_servers
    names = {(shape, core): f"doomed-{shape}-{core}-{os.urandom(4).hex()}"
             for shape in SHAPES for core in CORES}
    for name in names.values():
        create_topic(bootstrap, name, 1)
    restarted_broker.down()
    restarted_broker.up()
    for name in names.values():
        produce(bootstrap, name, [b'{"old": %d}' % i for i in range(RECORDS)], partition=0)
        # The premise: otherwise the journal made again would be read with or without the fix.
        assert _leader_epoch_of_last_record(bootstrap, name) > 0
    return names


@pytest.mark.parametrize("made_again", SHAPES)
def test_a_journal_made_again_after_a_broker_restart_is_read_by_the_same_owner(
        restarted_broker: KafkaNode, journals: dict[tuple[str, str], str], database_url: str,
        core: str, made_again: str) -> None:
    bootstrap = restarted_broker.config.bootstrap_servers
    settings = Settings(bootstrap_servers=bootstrap, database_url=database_url,
                        topic_prefix=f"qr{os.urandom(4).hex()}.")
    doomed = journals[(made_again, core)]
    put_queues(settings, {"name": "Doomed", "underlying_topic": doomed, "lease_period": "60s",
                          "shard": 0})
    with running_coordinator(settings, core=core) as coordinator:
        assert wait_for_counters(settings, "Doomed", timeout=60, enqueued=RECORDS)[
            "enqueued"] == RECORDS
        with Consumers(settings) as pool:
            # Some entries leased, the others queued, as in the soak.
            holder = pool.subscribe("Doomed", max_backlog=10)
            assert len(holder.receive(10)) == 10
            admin = AdminClient({"bootstrap.servers": bootstrap})
            for future in admin.delete_topics([doomed]).values():
                future.result(30)
            if made_again == "at-once":
                wait_until(lambda: _made(bootstrap, doomed), timeout=60)
            # Published only once the shard expired the old entries: records published to a
            # journal made again before the shard looks cannot be told from the old ones.
            assert wait_for_counters(settings, "Doomed", timeout=60,
                                     journal_deleted=RECORDS)["journal_deleted"] == RECORDS
            if made_again == "later":
                wait_until(lambda: _made(bootstrap, doomed), timeout=60)
            produce(bootstrap, doomed, [b'{"new": %d}' % i for i in range(RECORDS)],
                    partition=0)
            # Before the fix: 100 for ever, and nothing logged.
            assert wait_for_counters(settings, "Doomed", timeout=60, enqueued=2 * RECORDS)[
                "enqueued"] == 2 * RECORDS
            holder.unsubscribe()
            fresh = pool.subscribe("Doomed", max_backlog=10)
            got: list[bytes] = []
            while len(got) < RECORDS:
                batch = fresh.receive(min(10, RECORDS - len(got)), timeout=60)
                fresh.ack(batch)
                got.extend(d.value or b"" for d in batch)
            assert sorted(got) == sorted(b'{"new": %d}' % i for i in range(RECORDS))
        assert coordinator.counters["iteration_failures"] == 0


def _made(bootstrap: str, name: str) -> bool | None:
    """Make the topic again; None while the broker is still deleting it."""
    try:
        create_topic(bootstrap, name, 1, exist_ok=True)
    except KafkaException:
        time.sleep(0.1)
        return None
    return True


def _leader_epoch_of_last_record(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"epoch-{topic}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, RECORDS - 1)])
        found = wait_until(lambda: _records(consumer.poll(0.5)), timeout=30)
        return found[0].leader_epoch() or 0
    finally:
        consumer.close()


def _records(message: Message | None) -> list[Message]:
    return [message] if message is not None and message.error() is None else []


def test_the_lag_offset_commit_never_makes_a_deleted_journal_again(
        bootstrap_servers: str, unique_name: Callable[[str], str]) -> None:
    # The session's broker creates topics on first use (auto.create.topics.enable), as the
    # soak's did: the commit's metadata request about the journal (`KafkaAdmin.ping`) made it
    # again 0.4 s after it was deleted, while the shard still read it.
    from layer.kafka.admin import KafkaAdmin

    journal = unique_name("deleted")
    admin = KafkaAdmin({"bootstrap.servers": bootstrap_servers})
    with pytest.raises(KafkaAdapterError, match="Unknown topic or partition"):
        admin.commit_group_offsets(unique_name("group"), {(journal, 0): 5})
    # Made by this test, so by nobody before: the broker sends its auto-creation request
    # before it answers the metadata request, so a topic it made would be there already.
    create_topic(bootstrap_servers, journal, 1)
    admin.delete_topics([journal])
