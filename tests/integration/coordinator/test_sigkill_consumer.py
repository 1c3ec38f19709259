"""A consumer process killed with SIGKILL mid-lease (the Work / WorkToDo example).

At-least-once: its leases break when its session times out and the messages go to the
others. At-most-once: what it was given is gone with it and is never delivered again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from layer import QueueConsumer
from layer.settings import Settings
from tests.support.coordinator import put_queues, running_coordinator

pytestmark = pytest.mark.integration

VICTIM = textwrap.dedent("""
    import sys, time
    from layer import QueueConsumer
    consumer = QueueConsumer("WorkToDo", sys.argv[1], topic_prefix=sys.argv[2],
                             max_backlog=5, session_timeout=float(sys.argv[3]),
                             consumer_id=sys.argv[4] or None)
    seen = []
    deadline = time.monotonic() + 60
    while len(seen) < 5 and time.monotonic() < deadline:
        msg = consumer.receive(timeout=1.0)
        if msg is not None:
            seen.append(msg.bookmark)
    for bookmark in seen:
        print(bookmark, flush=True)
    print("HOLDING", flush=True)
    time.sleep(3600)  # never acks: killed by the test
""")


def start_victim(settings: Settings, session_timeout: float = 3.0,
                 consumer_id: str = "") -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, settings.bootstrap_servers,
                             settings.topic_prefix, str(session_timeout), consumer_id],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None
    held: list[str] = []
    for line in proc.stdout:
        if line.strip() == "HOLDING":
            return proc, held
        held.append(line.strip())
    raise AssertionError(f"victim consumer exited early with {proc.wait()}")


@pytest.mark.parametrize("semantics", ["at-least-once", "at-most-once"])
def test_killed_consumer(settings: Settings, journal: Callable[..., str], semantics: str) -> None:
    topic = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": topic, "semantics": semantics,
                          "lease_period": "60s"})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    total = 30
    for i in range(total):
        producer.produce(topic, f"job {i}".encode())
    assert producer.flush(30) == 0
    with running_coordinator(settings):
        victim, held = start_victim(settings)
        assert len(held) == 5
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        killed_at = time.monotonic()
        got: dict[str, int] = {}
        redelivered_after: list[float] = []
        workers = [QueueConsumer("WorkToDo", settings.bootstrap_servers,
                                 topic_prefix=settings.topic_prefix, max_backlog=3)
                   for _ in range(2)]
        try:
            expected = total if semantics == "at-least-once" else total - len(held)
            # Well past the victim's 3 s session timeout, far short of the 60 s lease.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (len(got) < expected
                                                   or semantics == "at-most-once"):
                for w in workers:
                    msg = w.receive(timeout=0.2)
                    if msg is None:
                        continue
                    bookmark = str(msg.bookmark)
                    assert bookmark not in got, "a message was delivered twice"
                    got[bookmark] = msg.delivery_count
                    if bookmark in held:
                        redelivered_after.append(time.monotonic() - killed_at)
                    msg.ack()
                if semantics == "at-most-once" and len(got) >= expected \
                        and time.monotonic() - killed_at > 8:
                    break
        finally:
            for w in workers:
                w.close()
    if semantics == "at-least-once":
        assert set(held) <= set(got), "the killed consumer's messages were not redelivered"
        assert all(got[b] == 2 for b in held)
        assert max(redelivered_after) < 20
        assert len(got) == total
    else:
        assert not set(held) & set(got), "at-most-once redelivered a message"
        assert len(got) == total - len(held)


def test_a_killed_consumer_back_under_its_id_gets_its_leases_broken_at_once(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """A crashed consumer's leases end before its session timeout when it comes back with the
    same consumer id (docs/protocol.md §8): its new session replaces the old one, whose leases
    break at once and are delivered again, here to the restarted process itself."""
    topic = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": topic, "lease_period": "5m"})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    for i in range(5):
        producer.produce(topic, f"job {i}".encode())
    assert producer.flush(30) == 0
    with running_coordinator(settings):
        # A session timeout and a lease period far beyond the test's waits.
        victim, held = start_victim(settings, session_timeout=120.0, consumer_id="worker-7")
        assert len(held) == 5
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        back = QueueConsumer("WorkToDo", settings.bootstrap_servers,
                             topic_prefix=settings.topic_prefix, max_backlog=5,
                             consumer_id="worker-7")
        try:
            got: dict[str, int] = {}
            deadline = time.monotonic() + 30
            while len(got) < 5 and time.monotonic() < deadline:
                msg = back.receive(timeout=0.5)
                if msg is not None:
                    got[str(msg.bookmark)] = msg.delivery_count
                    msg.ack()
        finally:
            back.close()
    assert set(got) == set(held)
    assert set(got.values()) == {2}, "delivered again under a new lease"
