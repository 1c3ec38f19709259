"""Documents projected past the memory window (DESIGN §2): a filter is never decided on a
projection that did not keep what it reads. The entry's record is asked for again instead, and
the filter sees the real value once it comes back."""

from __future__ import annotations

import pytest

from layer.domain.engine import MAX_WANTED_DOCUMENTS
from layer.domain.expressions import RawDocument, parse_document, project

from .engine_helpers import bm, engine, leases, offsets_of, record, settle, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")

REGIONS = ["EU", "US", "EU", None, "US", "EU"]


def projected(queue_docs: list[object], fields: frozenset[str]) -> list[object]:
    return [project(doc, fields) if fields else None for doc in queue_docs]


def test_a_filter_subscribed_after_projection_gets_its_entries_once_they_are_read_again(
) -> None:
    queue = engine()
    docs = [{"region": r, "n": i} if r else {"n": i} for i, r in enumerate(REGIONS)]
    # Nothing read /region when these arrived past the window: nothing was kept.
    queue.enqueue([record(i, None) for i in range(len(docs))], 0.0, projected=frozenset())
    subscribe(queue, "eu", max_backlog=10, filter="/region = 'EU'")
    subscribe(queue, "nulls", max_backlog=10, filter="/region IS NULL")

    # Undecidable: nobody gets anything (`/region IS NULL` would take all six of them).
    assert queue.dispatch(0.0) == []
    wanted = queue.documents_wanted()
    assert wanted == [bm(i) for i in range(len(docs))]
    assert queue.documents_wanted() == [], "asked for once"

    fields = frozenset({"/region"})
    assert queue.refresh_documents({bm(i): project(d, fields) for i, d in enumerate(docs)},
                                   fields) == len(docs)
    got = {}
    for lease in leases(queue.dispatch(0.0)):
        got.setdefault(lease.consumer_id, []).append(lease.bookmark.offset)
    assert got == {"eu": [0, 2, 5], "nulls": [3]}
    assert queue.documents_wanted() == []


def test_whole_documents_and_projections_that_kept_the_fields_are_decided_at_once() -> None:
    queue = engine()
    fields = frozenset({"/region"})
    whole = RawDocument(b'{"region": "EU"}')
    kept = project({"region": "EU", "other": 1}, fields)
    queue.enqueue([record(0, whole), record(1, kept)], 0.0, projected=fields)
    subscribe(queue, "eu", max_backlog=10, filter="/region = 'EU'")

    assert offsets_of(queue.dispatch(0.0)) == [0, 1]
    assert queue.documents_wanted() == []


def test_only_entries_projected_without_the_field_are_asked_for() -> None:
    queue = engine()
    # Three projected when /region was read, then two when only /n was.
    queue.enqueue([record(i, {"region": "EU"}) for i in range(3)], 0.0,
                  projected=frozenset({"/region"}))
    queue.enqueue([record(3 + i, {"n": i}) for i in range(2)], 0.0, projected=frozenset({"/n"}))
    subscribe(queue, "eu", max_backlog=10, filter="/region = 'EU'")

    assert offsets_of(queue.dispatch(0.0)) == [0, 1, 2]
    assert queue.documents_wanted() == [bm(3), bm(4)]


def test_done_entries_are_not_asked_for_and_not_refreshed() -> None:
    queue = engine()
    queue.enqueue([record(i, None) for i in range(3)], 0.0, projected=frozenset())
    subscribe(queue, "any", max_backlog=1)
    (lease,) = leases(queue.dispatch(0.0))
    settle(queue, lease)
    subscribe(queue, "eu", max_backlog=10, filter="/region = 'EU'")
    queue.dispatch(0.0)  # 'any' leases offset 1: still live, it may come back
    assert queue.documents_wanted() == [bm(1), bm(2)]
    doc = {"region": "EU"}
    assert queue.refresh_documents({bm(0): doc, bm(1): doc, bm(2): doc},
                                   frozenset({"/region"})) == 2


def test_a_deep_queue_is_asked_for_a_bounded_number_at_a_time() -> None:
    queue = engine()
    total = MAX_WANTED_DOCUMENTS + 500
    queue.enqueue([record(i, None) for i in range(total)], 0.0, projected=frozenset())
    subscribe(queue, "eu", max_backlog=10, filter="/region = 'EU'")
    queue.dispatch(0.0)
    first = queue.documents_wanted()
    assert first == [bm(i) for i in range(MAX_WANTED_DOCUMENTS)]
    fields = frozenset({"/region"})
    queue.refresh_documents({b: {"region": "US"} for b in first}, fields)
    queue.dispatch(0.0)
    assert queue.documents_wanted() == [bm(i) for i in range(MAX_WANTED_DOCUMENTS, total)]


def test_a_barrier_waits_for_its_record_when_a_filter_cannot_tell_its_recipients() -> None:
    queue = engine(barrier_expression="/kind = 'barrier'")
    fields = frozenset({"/kind"})
    docs = [{"kind": "barrier", "region": "EU"}]
    queue.enqueue([record(0, project(docs[0], fields))], 0.0, projected=fields)
    subscribe(queue, "eu", max_backlog=1, filter="/region = 'EU'")
    subscribe(queue, "us", max_backlog=1, filter="/region = 'US'")

    assert queue.dispatch(0.0) == []
    assert queue.documents_wanted() == [bm(0)]
    both = frozenset({"/kind", "/region"})
    queue.refresh_documents({bm(0): project(docs[0], both)}, both)
    (barrier,) = queue.dispatch(0.0)
    assert [r.consumer_id for r in barrier.recipients] == ["eu"]  # type: ignore[attr-defined]


def test_an_admin_ack_by_filter_leaves_entries_it_cannot_decide() -> None:
    queue = engine()
    queue.enqueue([record(0, parse_document(b'{"region": "EU"}'))], 0.0)
    queue.enqueue([record(1, None)], 0.0, projected=frozenset())
    assert queue.ack_matching("/region = 'EU' OR /region IS NULL", 0.0) == 1
    assert [e.bookmark.offset for e in queue.view()] == [1]
