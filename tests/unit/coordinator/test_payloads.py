"""The payload cache: records held while a queue holds their entry, within a byte budget."""

from __future__ import annotations

from layer.coordinator.payloads import MemoryPool, PayloadCache, record_size
from layer.domain.states import Bookmark
from layer.kafka import JournalRecord


def _record(offset: int, size: int = 100) -> JournalRecord:
    return JournalRecord("orders", 0, offset, b"k", b"x" * size, 0, [("h", b"v")])


def test_records_are_kept_within_the_budget_and_dropped_past_it() -> None:
    cache = PayloadCache(budget=3 * record_size(_record(0)))
    for offset in range(5):
        cache.hold(Bookmark("orders", 0, offset), _record(offset))
    kept = [o for o in range(5) if cache.get(Bookmark("orders", 0, o)) is not None]
    assert kept == [0, 1, 2]  # first come, first kept
    assert cache.missing([Bookmark("orders", 0, o) for o in range(5)]) == [
        Bookmark("orders", 0, 3), Bookmark("orders", 0, 4)]
    # Past the budget nothing at all is kept for a record: its entry knows where it is.
    assert len(cache) == 3 and cache.dropped == 2
    # A freed record makes room: a re-read record's bytes are kept again, once.
    cache.release(Bookmark("orders", 0, 0))
    assert cache.fill(Bookmark("orders", 0, 3), _record(3))
    assert not cache.fill(Bookmark("orders", 0, 3), _record(3))
    assert not cache.fill(Bookmark("orders", 0, 4), _record(4))  # no room left
    cache.release(Bookmark("orders", 0, 4))  # done without its bytes: nothing to free
    assert cache.bytes == 3 * record_size(_record(0))


def test_a_record_several_queues_hold_stays_until_the_last_lets_go() -> None:
    cache = PayloadCache(budget=10_000)
    bookmark = Bookmark("orders", 0, 7)
    for _ in range(3):  # three queues over one journal
        cache.hold(bookmark, _record(7))
    assert cache.bytes == record_size(_record(7))
    cache.release(bookmark)
    cache.release(bookmark)
    assert cache.get(bookmark) is not None
    cache.release(bookmark)
    assert cache.get(bookmark) is None and len(cache) == 0 and cache.bytes == 0
    cache.release(bookmark)  # releasing what is not held changes nothing
    assert cache.bytes == 0


def test_shard_loops_of_one_process_share_one_budget() -> None:
    size = record_size(_record(0))
    pool = MemoryPool(budget=3 * size)
    busy = PayloadCache(budget=3 * size, pool=pool)
    quiet = PayloadCache(budget=3 * size, pool=pool)
    for offset in range(2):
        busy.hold(Bookmark("orders", 0, offset), _record(offset))
    quiet.hold(Bookmark("jobs", 0, 0), _record(0))
    quiet.hold(Bookmark("jobs", 0, 1), _record(1))  # the pool is full: held without bytes
    assert pool.used == 3 * size
    assert quiet.missing([Bookmark("jobs", 0, 1)]) == [Bookmark("jobs", 0, 1)]
    busy.release(Bookmark("orders", 0, 0))
    assert pool.used == 2 * size
    busy.clear()  # a loop rebuilding gives its bytes back
    assert pool.used == size and len(busy) == 0


def test_the_budget_counts_what_a_held_record_really_costs() -> None:
    """record_size must not undercount: a budget is a bound on the process's memory."""
    import os
    import tracemalloc

    from layer.domain.expressions import RawDocument

    count = 20_000
    cache = PayloadCache(budget=10**12)
    documents = []  # the engine keeps each entry's unparsed document beside the record
    tracemalloc.start()
    try:
        for i in range(count):
            r = JournalRecord("journal", i % 8, 1000 + i // 8, str(i).encode(), os.urandom(200),
                              1_700_000_000_000, [("h", b"v")])
            cache.hold(Bookmark(r.topic, r.partition, r.offset), r)
            documents.append(RawDocument(r.value))
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    counted = cache.bytes
    assert 0.8 * used <= counted <= 1.25 * used, (used, counted)
