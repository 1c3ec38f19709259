"""librdkafka's log lines through `ClientLog`: a line that repeats is said once a window."""

from __future__ import annotations

import logging

import pytest

from layer.kafka.logs import ClientLog

REFUSED = "127.0.0.1:9092/1: Connect to ipv4#127.0.0.1:9092 failed: Connection refused " \
          "(after {}ms in state CONNECT)"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_line_is_counted_and_told_with_the_next_one_past_the_window(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = ClientLog(logging.getLogger("test.client"), window=60.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.client"):
        # confluent-kafka's call: log(level, "%s [%s] %s", facility, client, text)
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", REFUSED.format(0))
        for i in range(100):
            clock.now += 0.1
            # Other clients and other timings: the same failure.
            log.log(logging.ERROR, "%s [%s] %s", "FAIL", f"rdkafka#consumer-{i % 7}",
                    REFUSED.format(i))
        log.log(logging.INFO, "%s [%s] %s", "FAIL", "rdkafka#producer-1",
                "127.0.0.1:9092/1: Disconnected (after 5ms in state UP)")
        clock.now += 60.0
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", REFUSED.format(3))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0] == f"FAIL [rdkafka#producer-1] {REFUSED.format(0)}"
    assert "Disconnected" in lines[1]
    assert lines[2].endswith("(and 100 more like it in the last 60s, from this process's "
                             "Kafka clients)")
    assert caplog.records[0].levelno == logging.ERROR


def test_debugging_output_passes_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    log = ClientLog(logging.getLogger("test.debug"))
    with caplog.at_level(logging.DEBUG, logger="test.debug"):
        for _ in range(3):
            log.log(logging.DEBUG, "%s [%s] %s", "SEND", "rdkafka#producer-1", "Sent Metadata")
    assert len(caplog.records) == 3
