"""librdkafka's own lines never reach a CLI user raw (issue 33): every Kafka client qlayer
makes logs through Python logging (`layer.kafka.logs.logged`), and the CLI shows those lines
only with --debug. A Kafka that does not answer is the command's error message."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from layer.settings import Settings
from tests.integration.cli.conftest import Completed
from tests.support.coordinator import put_queues
from tests.support.ports import reserve_ports

pytestmark = pytest.mark.integration


def test_a_kafka_that_does_not_answer_is_one_error_line_not_librdkafkas(
        settings: Settings, run_cli: Callable[..., Completed]) -> None:
    put_queues(settings, {"name": "Jobs", "underlying_topic": "jobs"})  # stats asks Kafka
    with reserve_ports(24300, 1) as nothing:  # reserved, and nothing listens there
        silent = f"127.0.0.1:{nothing.first}"
        for args in (["stats"], ["view", "Jobs"], ["dlq", "list", "Jobs"]):
            done = run_cli(*args, env={"QLAYER_BOOTSTRAP_SERVERS": silent}, timeout=120)
            said = done.stdout + done.stderr
            assert "rdkafka#" not in said and "%3|" not in said and "%6|" not in said, (
                args, said)
        done = run_cli("stats", env={"QLAYER_BOOTSTRAP_SERVERS": silent}, timeout=120)
        assert done.code == 1
        assert silent in done.stderr and done.stderr.count("\n") <= 3, done.stderr
