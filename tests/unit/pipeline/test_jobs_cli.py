"""The job's exit statuses: 1 is kept for violations, so usage errors and failures are 2."""

from __future__ import annotations

import pytest

from layer.pipeline.jobs import run


def test_a_malformed_kafka_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(["--kafka-option", "security.protocol", "reconcile", "--queue", "Q",
             "--journal", "orders"])
    assert exited.value.code == 2
    assert "--kafka-option takes KEY=VALUE; got security.protocol" in capsys.readouterr().err


def test_reconcile_needs_its_queue_and_journal(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(["reconcile", "--queue", "Q"])
    assert exited.value.code == 2
    assert "--journal" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--since", "soon", "lifecycle"], "neither epoch milliseconds, an ISO-8601 time"),
    (["--since", "1h", "--start-ms", "5", "lifecycle"], "give --since or --start-ms, not both"),
    (["--since", "1h", "--until", "2h", "metrics"], "must be after --since"),
])
def test_a_bad_range_is_a_usage_error(args: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
