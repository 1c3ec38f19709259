"""The rules an ack item must keep (docs/protocol.md §6): which fields go with which type."""

from __future__ import annotations

import pytest

from layer.protocol.records import (
    MAX_RELEASE_DELAY_MS,
    MAX_RENEW_MS,
    AckItem,
    AckType,
    ack_item_problem,
)


def item(kind: AckType, **fields: object) -> AckItem:
    return AckItem(queue="Jobs", bookmark="jobs/0/5", lease="t", type=kind,
                   **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("delay_ms", [1, 30_000, MAX_RENEW_MS])
def test_a_renew_may_carry_its_length(delay_ms: int) -> None:
    assert ack_item_problem(item(AckType.RENEW, delay_ms=delay_ms)) is None


@pytest.mark.parametrize("delay_ms", [0, -5, MAX_RENEW_MS + 1])
def test_a_renew_length_out_of_bounds_is_refused(delay_ms: int) -> None:
    problem = ack_item_problem(item(AckType.RENEW, delay_ms=delay_ms))
    assert problem is not None and "between 1 and" in problem and "12 hours" in problem


def test_release_delays_and_reject_reasons_keep_their_rules() -> None:
    assert ack_item_problem(item(AckType.RELEASE, delay_ms=0)) is None
    assert ack_item_problem(item(AckType.RELEASE, delay_ms=MAX_RELEASE_DELAY_MS)) is None
    for bad in (-1, MAX_RELEASE_DELAY_MS + 1, 10**18):
        problem = ack_item_problem(item(AckType.RELEASE, delay_ms=bad)) or ""
        assert "between 0 and 86400000 (24 hours)" in problem
    assert "RELEASE and RENEW" in (ack_item_problem(item(AckType.ACCEPT, delay_ms=5)) or "")
    assert "only allowed with REJECT" in (
        ack_item_problem(item(AckType.RENEW, reason="x")) or "")
    assert ack_item_problem(item(AckType.REJECT, reason="bad")) is None
