"""Delivery topics of consumers that are gone are deleted after --delivery-topic-retention
(issue 16 item 5); a live consumer's topic never is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from layer import QueueConsumer
from layer.settings import Settings
from tests.support.coordinator import put_queues, running_coordinator

pytestmark = pytest.mark.integration

RETENTION = 2.0

#: A consumer without a consumer_id that subscribes, says its id, and waits to be killed.
VICTIM = textwrap.dedent("""
    import sys, time
    from layer import QueueConsumer
    consumer = QueueConsumer("Jobs", sys.argv[1], topic_prefix=sys.argv[2],
                             session_timeout=2.0, state_dir=sys.argv[3])
    print(consumer.consumer_id, flush=True)
    time.sleep(3600)
""")


def _topics(settings: Settings) -> set[str]:
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
    return set(admin.list_topics(timeout=10).topics)


def _wait_until_gone(settings: Settings, topics: set[str], within: float) -> set[str]:
    """The topics of ``topics`` still there after ``within`` seconds (none once all went)."""
    deadline = time.monotonic() + within
    left = topics & _topics(settings)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = topics & _topics(settings)
    return left


def test_topics_of_closed_and_killed_consumers_go_and_a_live_ones_stays(
    settings: Settings, journal: Callable[..., str], tmp_path: Path
) -> None:
    put_queues(settings, {"name": "Jobs", "underlying_topic": journal("jobs")})
    prefix = settings.topic_prefix
    with running_coordinator(settings, delivery_topic_retention=RETENTION):
        # Live by any clock: a 2 s session timeout (the victim's, below) was missed once by
        # this consumer's heartbeats beside five busy test workers on two cores (CI, stop 43);
        # its session ended, and its topic went after the retention, as it should.
        live = QueueConsumer("Jobs", settings.bootstrap_servers, topic_prefix=prefix,
                             consumer_id="keeper", session_timeout=60.0,
                             state_dir=tmp_path / "keeper")
        try:
            closed = QueueConsumer("Jobs", settings.bootstrap_servers, topic_prefix=prefix,
                                   state_dir=tmp_path / "closed")
            closed_topic = f"{prefix}delivery.{closed.consumer_id}"
            assert closed_topic in _topics(settings)
            # A made-up consumer id: no later process has it, so no secret is kept for one.
            assert not (tmp_path / "closed").exists()
            assert list((tmp_path / "keeper").iterdir()), "the session's secret is kept"
            closed.close()

            victim = subprocess.Popen(
                [sys.executable, "-c", VICTIM, settings.bootstrap_servers, prefix,
                 str(tmp_path / "victim")],
                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
            assert victim.stdout is not None
            killed_topic = f"{prefix}delivery.{victim.stdout.readline().strip()}"
            assert killed_topic in _topics(settings)
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            # SIGKILLed, it leaves no secret file behind (it kept none).
            assert not (tmp_path / "victim").exists()

            # Closed: retention (and one listing) after close. Killed: its 2 s session
            # timeout first. Both well within 30 s.
            assert _wait_until_gone(settings, {closed_topic, killed_topic}, 30.0) == set()
            # The live consumer kept heartbeating all along, many retentions long.
            assert f"{prefix}delivery.keeper" in _topics(settings)
            assert live.receive(timeout=0.5) is None  # still subscribed, nothing failed
        finally:
            live.close()
        assert not list((tmp_path / "keeper").iterdir()), "close() removes the secret"
        # Once it closed, its topic goes too.
        assert _wait_until_gone(settings, {f"{prefix}delivery.keeper"}, 30.0) == set()


def test_retention_zero_never_deletes(settings: Settings, journal: Callable[..., str],
                                      tmp_path: Path) -> None:
    put_queues(settings, {"name": "Jobs", "underlying_topic": journal("jobs")})
    with running_coordinator(settings, delivery_topic_retention=0.0):
        consumer = QueueConsumer("Jobs", settings.bootstrap_servers,
                                 topic_prefix=settings.topic_prefix, state_dir=tmp_path)
        topic = f"{settings.topic_prefix}delivery.{consumer.consumer_id}"
        consumer.close()
        # Past what a 2 s retention would take in the test above.
        assert _wait_until_gone(settings, {topic}, 8.0) == {topic}
