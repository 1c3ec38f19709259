"""A regex subscription over queues of several shards (protocol 8, issue 31): one backlog,
held as credit the consumer moves between the shards. Through the public SDK, a real
coordinator, broker and database."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from layer.sdk import Message, QueueConsumer
from layer.settings import Settings
from tests.support.coordinator import put_queues, running_coordinator
from tests.support.processes import produce_numbers

pytestmark = pytest.mark.integration


def test_a_regex_consumer_over_two_shards_holds_one_backlog_and_gets_everything_once(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """The issue's case: two queues on different shards, each allowing 10 per subscription;
    a regex consumer with max_backlog=2 holds 2 across them (it held 4 before protocol 8),
    and gets all 20 messages, each once, from both."""
    topics = {"RxOne": journal("one"), "RxTwo": journal("two")}
    put_queues(settings, *({"name": q, "underlying_topic": t, "shard": i,
                            "max_per_subscription_backlog": 10}
                           for i, (q, t) in enumerate(topics.items())))
    with running_coordinator(settings):
        for topic in topics.values():
            produce_numbers(settings.bootstrap_servers, topic, 10)
        with QueueConsumer("^Rx(One|Two)$", regex=True, max_backlog=2,
                           bootstrap_servers=settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix) as consumer:
            assert sorted(g.queue for g in consumer.grants) == ["RxOne", "RxTwo"]
            held: list[Message] = []
            deadline = time.monotonic() + 30
            while len(held) < 2 and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is not None:
                    held.append(message)
            assert len(held) == 2
            # Nothing more comes while two are held, whichever shards they came from.
            assert consumer.receive(timeout=2.0) is None
            got = [(m.queue, str(m.bookmark)) for m in held]
            for message in held:
                message.ack()
            deadline = time.monotonic() + 60
            while len(got) < 20 and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is not None:
                    got.append((message.queue, str(message.bookmark)))
                    message.ack()
            assert Counter(q for q, _ in got) == {"RxOne": 10, "RxTwo": 10}
            assert len(set(got)) == 20, "a message was delivered twice"
            assert consumer.receive(timeout=1.0) is None
            assert consumer.stats.credit_moves > 0  # the credit went where the work was
