"""The console's queue list: search, sort and pages over a thousand queues (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from layer.console.listing import MAX_PER_PAGE, ListQuery, list_page
from layer.services.views import QueueStats


def stats(name: str, depth: int = 0, acked: int = 0, age: float | None = None) -> QueueStats:
    return QueueStats(queue=name, depth=depth, leased=0, consumers=0, oldest_available_age=age,
                      counters={"acked": acked}, partitions=[], sampled_at=0.0)


THOUSAND = [stats(f"Queue{i:04d}", depth=i % 7, acked=i) for i in range(1000)]


def test_the_first_page_is_fifty_queues_by_name_and_says_how_many_there_are() -> None:
    page = list_page(THOUSAND, ListQuery.parse({}))
    assert [s.queue for s in page.rows][:2] == ["Queue0000", "Queue0001"]
    assert (len(page.rows), page.total, page.matched, page.page, page.pages) == (50, 1000, 1000,
                                                                                 1, 20)
    assert (page.first, page.last) == (1, 50)


def test_search_is_a_case_insensitive_part_of_the_name() -> None:
    page = list_page(THOUSAND, ListQuery.parse({"q": "queue099"}))
    assert [s.queue for s in page.rows] == [f"Queue099{i}" for i in range(10)]
    assert (page.matched, page.total) == (10, 1000)
    assert list_page(THOUSAND, ListQuery.parse({"q": "nothing"})).rows == []


def test_sorting_by_a_figure_puts_the_largest_first_and_names_break_ties() -> None:
    page = list_page(THOUSAND, ListQuery.parse({"sort": "depth", "per": "3"}))
    assert [(s.queue, s.depth) for s in page.rows] == [
        ("Queue0006", 6), ("Queue0013", 6), ("Queue0020", 6)]
    up = list_page(THOUSAND, ListQuery.parse({"sort": "acked", "order": "asc", "per": "2"}))
    assert [s.queue for s in up.rows] == ["Queue0000", "Queue0001"]
    aged = [stats("A", age=None), stats("B", age=5.0), stats("C", age=50.0)]
    assert [s.queue for s in list_page(aged, ListQuery.parse({"sort": "oldest"})).rows] == [
        "C", "B", "A"]


def test_a_page_past_the_last_shows_the_last_and_bad_parameters_fall_back_with_a_note() -> None:
    page = list_page(THOUSAND, ListQuery.parse({"page": "99", "per": "100"}))
    assert (page.page, page.pages, page.rows[0].queue) == (10, 10, "Queue0900")
    query = ListQuery.parse({"sort": "colour", "order": "sideways", "per": "many",
                             "page": "0"})
    assert (query.sort, query.descending, query.per, query.page) == ("name", False, 50, 1)
    assert len(query.notes) == 4 and "unknown sort 'colour'" in query.notes[0]
    assert ListQuery.parse({"per": "100000"}).per == MAX_PER_PAGE


def test_urls_keep_what_is_not_the_default_and_a_column_clicked_twice_turns_round() -> None:
    query = ListQuery.parse({"q": "Jobs"})
    assert query.url() == "/queues?q=Jobs"
    by_depth = ListQuery.parse({"q": "Jobs", "sort": "depth", "page": "3"})
    assert by_depth.url(page=4) == "/queues?q=Jobs&sort=depth&page=4"
    # Clicking the sorted column again: ascending, back to page 1.
    assert by_depth.url(sort="depth") == "/queues?q=Jobs&sort=depth&order=asc"
    assert by_depth.url(sort="name") == "/queues?q=Jobs"
    assert ListQuery.parse({}).url(sort="name") == "/queues?order=desc"


@given(st.lists(st.tuples(st.sampled_from("abcXYZ"), st.integers(0, 5)), max_size=60),
       st.sampled_from(["name", "depth", "acked"]), st.booleans(), st.integers(1, 9))
def test_the_pages_together_hold_every_matching_queue_once_in_order(
        raw: list[tuple[str, int]], sort: str, descending: bool, per: int) -> None:
    queues = [stats(f"{letter}{i}", depth=d, acked=i) for i, (letter, d) in enumerate(raw)]
    first = list_page(queues, ListQuery.parse({"sort": sort, "per": str(per),
                                               "order": "desc" if descending else "asc"}))
    seen = []
    for number in range(1, first.pages + 1):
        seen += list_page(queues, ListQuery.parse({
            "sort": sort, "per": str(per), "order": "desc" if descending else "asc",
            "page": str(number)})).rows
    assert sorted(s.queue for s in seen) == sorted(s.queue for s in queues)
    keys = [s.queue if sort == "name" else (s.depth if sort == "depth" else s.counters["acked"])
            for s in seen]
    assert keys == sorted(keys, reverse=descending)
