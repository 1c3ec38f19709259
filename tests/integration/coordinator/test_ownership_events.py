"""The events topic says which coordinator owns each queue, and when a clean stop gives it up."""

from __future__ import annotations

import pytest

from layer.protocol import EventType
from layer.settings import Settings
from tests.support.coordinator import EventReader, put_queues, running_coordinator

pytestmark = pytest.mark.integration


def test_ownership_acquired_on_start_and_lost_on_a_clean_stop(settings: Settings) -> None:
    put_queues(settings, {"name": "A", "underlying_topic": "a-journal"},
               {"name": "B", "underlying_topic": "b-journal"})
    with running_coordinator(settings, owner_id="first") as coordinator:
        events = EventReader(settings)
        acquired = events.read_until(lambda es: {
            e.queue for e in es if e.type is EventType.OWNERSHIP_ACQUIRED} == {"A", "B"})
        # Each queue's shard has its own epoch.
        epochs = {name: loop.epoch for name in ("A", "B")
                  for loop in [coordinator.loop_for(name)] if loop is not None}
    lost = events.read_until(lambda es: {
        e.queue for e in es if e.type is EventType.OWNERSHIP_LOST} == {"A", "B"})
    events.close()
    owned = [e for e in acquired + lost if e.type in (EventType.OWNERSHIP_ACQUIRED,
                                                      EventType.OWNERSHIP_LOST)]
    assert {(e.queue, e.coordinator_id, e.coordinator_epoch) for e in owned} == {
        (name, "first", epoch) for name, epoch in epochs.items()}
