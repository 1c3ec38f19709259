"""The coordinator freezes what its start-up left, so a full collection does not walk it."""

from __future__ import annotations

import gc

from layer.coordinator.process import CoordinatorProcess


def test_the_start_up_objects_are_frozen_out_of_the_collectors_sight() -> None:
    before = gc.get_freeze_count()
    gc.unfreeze()
    try:
        garbage: list[object] = []
        garbage.append(garbage)  # a cycle the freeze must not keep
        del garbage
        CoordinatorProcess._freeze_start_up()
        assert gc.get_freeze_count() > 1000
        # What is frozen is no longer walked: a full collection sees only newer objects.
        assert len(gc.get_objects()) < gc.get_freeze_count()
    finally:
        gc.unfreeze()
        if before:
            gc.freeze()
