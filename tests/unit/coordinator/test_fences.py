"""The shard's bookkeeping of fences (protocol 9, `layer.coordinator.fences`): pure, `now`
passed in."""

from __future__ import annotations

from layer.coordinator.fences import MAX_RETRY_PAUSE, Fences
from layer.protocol import SessionEndReason

TIMED_OUT = SessionEndReason.TIMED_OUT


def test_a_session_is_fenced_then_ends_once_its_ack_partition_is_read_past_the_fence() -> None:
    fences = Fences()
    assert fences.want("c", "s1", "p.c.s1", TIMED_OUT, "a lease ran out")
    assert not fences.want("c", "s1", "p.c.s1", SessionEndReason.EVICTED, "evicted")  # once
    (fence,) = fences.to_fence(0.0)
    assert (fence.transactional_id, fence.end) == ("p.c.s1", TIMED_OUT)  # the first reason
    fences.fenced(fence, 40)
    assert fences.to_fence(1.0) == []  # fenced: not again
    assert fences.ready(None) == []  # nothing known of the ack partition yet
    assert fences.ready(39) == []  # acks below the fence's end not all read
    assert fences.ready(40) == [fence]
    assert len(fences) == 0


def test_a_fence_that_fails_is_tried_again_later_each_time_later() -> None:
    fences = Fences()
    fences.want("c", "s1", "p.c.s1", TIMED_OUT, "")
    (fence,) = fences.to_fence(0.0)
    pauses = [fences.failed(fence, 0.0) for _ in range(8)]
    assert pauses[:3] == [0.5, 1.0, 2.0] and pauses[-1] == MAX_RETRY_PAUSE
    assert fences.to_fence(MAX_RETRY_PAUSE - 0.1) == []
    assert fences.to_fence(MAX_RETRY_PAUSE) == [fence]


def test_a_new_session_replaces_the_fence_of_an_old_one_and_forget_drops_only_its_own() -> None:
    fences = Fences()
    fences.want("c", "s1", "p.c.s1", TIMED_OUT, "")
    fences.forget("c", "s2")  # another session's end: this fence stays
    assert len(fences) == 1
    assert fences.want("c", "s2", "p.c.s2", TIMED_OUT, "")
    (fence,) = fences.to_fence(0.0)
    assert fence.session_id == "s2"
    old = fence
    fences.forget("c")
    fences.fenced(old, 3)  # a fence finished for a session no longer waiting: ignored
    assert fences.ready(10) == []
