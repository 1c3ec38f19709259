"""The ack batching policy: when buffered items go out (time passed in, no clock)."""

from __future__ import annotations

import pytest

from layer.protocol import AckItem, AckType
from layer.sdk import AckBatcher


def item(n: int, ack_type: AckType = AckType.ACCEPT) -> AckItem:
    return AckItem(queue="Q", bookmark=f"t/0/{n}", lease=f"l{n}", type=ack_type)


def test_a_full_batch_is_due_at_once() -> None:
    batcher = AckBatcher(max_items=3, max_delay=10.0)
    assert batcher.add(item(1), now=0.0) is False
    assert batcher.add(item(2), now=0.0) is False
    assert batcher.add(item(3), now=0.0) is True
    assert [i.bookmark for i in batcher.drain()] == ["t/0/1", "t/0/2", "t/0/3"]
    assert len(batcher) == 0 and not batcher.is_due(100.0)


def test_items_are_due_when_the_oldest_has_waited_the_interval() -> None:
    batcher = AckBatcher(max_items=100, max_delay=0.1)
    batcher.add(item(1), now=5.0)
    batcher.add(item(2), now=5.08)
    assert batcher.due_at() == pytest.approx(5.1)  # counted from the oldest, not the newest
    assert not batcher.is_due(5.09)
    assert batcher.is_due(5.1)
    batcher.drain()
    assert batcher.due_at() is None
    batcher.add(item(3), now=9.0)
    assert batcher.due_at() == pytest.approx(9.1)  # the clock restarts with the next item


def test_items_keep_their_order_and_split_into_batches_of_max_items() -> None:
    batcher = AckBatcher(max_items=2, max_delay=1.0)
    types = [AckType.ACCEPT, AckType.RELEASE, AckType.REJECT, AckType.RENEW, AckType.ACCEPT]
    for n, ack_type in enumerate(types):
        batcher.add(item(n, ack_type), now=0.0)
    batches = batcher.batches()
    assert [[i.type for i in batch] for batch in batches] == [types[:2], types[2:4], types[4:]]
    assert len(batcher) == 0


def test_a_zero_interval_sends_every_item_at_once() -> None:
    batcher = AckBatcher(max_items=500, max_delay=0.0)
    assert batcher.add(item(1), now=1.0) is True


@pytest.mark.parametrize(("size", "delay"), [(0, 0.1), (1, -0.1)])
def test_nonsense_settings_are_refused(size: int, delay: float) -> None:
    with pytest.raises(ValueError):
        AckBatcher(max_items=size, max_delay=delay)


def test_split_sends_accepts_of_batched_messages_apart_and_the_rest_in_order() -> None:
    batcher = AckBatcher(max_items=2, max_delay=1.0)
    accept = [AckItem("Q", f"t/0/{n}", f"tok{n}", AckType.ACCEPT) for n in range(3)]
    release = AckItem("Q", "t/0/9", "tok9", AckType.RELEASE, delay_ms=5)
    renew = AckItem("Q", "t/0/8", "tok8", AckType.RENEW)
    batcher.add(accept[0], 0.0, acceptable=True)
    batcher.add(release, 0.0)
    batcher.add(accept[1], 0.0, acceptable=True)
    batcher.add(renew, 0.0)
    batcher.add(accept[2], 0.0)  # an ACCEPT of a record-form delivery stays an item
    items, accepts = batcher.split()
    assert items == [[release, renew], [accept[2]]]
    assert accepts == [("Q", "t", 0, 0, "tok0"), ("Q", "t", 0, 1, "tok1")]
    assert len(batcher) == 0 and batcher.split() == ([], [])


def test_without_batched_messages_split_is_batches() -> None:
    batcher = AckBatcher(max_items=2, max_delay=1.0)
    items = [AckItem("Q", f"t/0/{n}", "x", AckType.ACCEPT) for n in range(3)]
    for item in items:
        batcher.add(item, 0.0)
    assert batcher.split() == ([items[:2], items[2:]], [])


def test_accepts_given_as_values_travel_apart_and_count_toward_the_batch() -> None:
    batcher = AckBatcher(max_items=3, max_delay=1.0)
    release = AckItem("Q", "t/0/9", "tok9", AckType.RELEASE, delay_ms=5)
    assert not batcher.add_accept(("Q", "t", 0, 1, "tok1"), 0.0)
    assert not batcher.add(release, 0.5)
    assert batcher.due_at() == 1.0, "the oldest of either kind sets the deadline"
    assert batcher.add_accept(("Q", "t", 1, 2, "tok2"), 0.6), "three waiting: a full batch"
    assert batcher.split() == ([[release]], [("Q", "t", 0, 1, "tok1"), ("Q", "t", 1, 2, "tok2")])
    # Drained (a session that ended), they come back as items, after the others.
    batcher.add(release, 2.0)
    batcher.add_accept(("Q", "t", 0, 3, "tok3"), 2.0)
    assert [(i.bookmark, i.type) for i in batcher.drain()] == [
        ("t/0/9", AckType.RELEASE), ("t/0/3", AckType.ACCEPT)]
