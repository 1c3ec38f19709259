"""The console's queue list: search, sort and pages over every queue's figures. Pure: the
figures come from the console's last sampling, the query from the page's URL.

A thousand queues are listed 50 to a page (``per``, at most `MAX_PER_PAGE`); the search is a
case-insensitive substring of the queue's name; every column sorts, both ways, with the
queue's name as the tie-break so the order is stable across refreshes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

if TYPE_CHECKING:
    from layer.services.views import QueueStats

__all__ = ["DEFAULT_PER_PAGE", "MAX_PER_PAGE", "SORTS", "ListPage", "ListQuery", "list_page"]

DEFAULT_PER_PAGE = 50
MAX_PER_PAGE = 500
#: The search is cut to this many characters (a URL is not a place for an essay).
MAX_SEARCH = 200


def _counter(name: str) -> Callable[[QueueStats], Any]:
    return lambda s: s.counters.get(name, 0)


#: Column -> what it sorts by. ``oldest``: a queue with nothing available sorts as age 0.
SORTS: Mapping[str, Callable[[QueueStats], Any]] = {
    "name": lambda s: s.queue,
    "depth": lambda s: s.depth,
    "leased": lambda s: s.leased,
    "consumers": lambda s: s.consumers,
    "oldest": lambda s: s.oldest_available_age or 0.0,
    "enqueued": _counter("enqueued"),
    "delivered": _counter("delivered"),
    "acked": _counter("acked"),
    "dead_lettered": _counter("dead_lettered"),
}


@dataclass(frozen=True, slots=True)
class ListQuery:
    """What the page's URL asks for; anything it cannot read falls back to the default (the
    page says so in ``notes``)."""

    search: str = ""
    sort: str = "name"
    descending: bool = False
    page: int = 1
    per: int = DEFAULT_PER_PAGE
    notes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> ListQuery:
        notes: list[str] = []
        search = params.get("q", "").strip()[:MAX_SEARCH]
        sort = params.get("sort", "name")
        if sort not in SORTS:
            notes.append(f"unknown sort {sort!r}: sorted by name")
            sort = "name"
        order = params.get("order", "desc" if sort != "name" else "asc")
        if order not in ("asc", "desc"):
            notes.append(f"unknown order {order!r}: ascending")
            order = "asc"

        def number(key: str, default: int, top: int) -> int:
            text = params.get(key)
            if text is None or text == "":
                return default
            try:
                value = int(text)
            except ValueError:
                notes.append(f"{key}={text!r} is not a number: {default}")
                return default
            if not 1 <= value <= top:
                notes.append(f"{key} must be 1 to {top}: {min(max(value, 1), top)}")
            return min(max(value, 1), top)

        per = number("per", DEFAULT_PER_PAGE, MAX_PER_PAGE)
        page = number("page", 1, 10**9)
        return cls(search, sort, order == "desc", page, per, tuple(notes))

    def url(self, **changes: Any) -> str:
        """This query's URL with some fields changed (``page=2``, ``sort="depth"``): the
        default of each field is left out, so the URLs stay short."""
        values = {"q": self.search, "sort": self.sort,
                  "order": "desc" if self.descending else "asc", "page": self.page,
                  "per": self.per}
        if "sort" in changes:
            # A new column starts on page 1, the way it most likely helps: largest first for
            # figures, A to Z for names; the same column again turns the order round.
            column = changes.pop("sort")
            same = column == self.sort
            values["order"] = (("asc" if self.descending else "desc") if same
                               else ("asc" if column == "name" else "desc"))
            values["sort"] = column
            values["page"] = 1
        values.update(changes)
        defaults = {"q": "", "sort": "name", "page": 1, "per": DEFAULT_PER_PAGE,
                    "order": "asc" if values["sort"] == "name" else "desc"}
        kept = {k: v for k, v in values.items() if v != defaults[k]}
        return "/queues" + ("?" + urlencode(kept) if kept else "")


@dataclass(frozen=True, slots=True)
class ListPage:
    rows: list[QueueStats]
    total: int
    """Every queue."""
    matched: int
    """The queues the search matches."""
    page: int
    pages: int
    query: ListQuery

    @property
    def first(self) -> int:
        """The 1-based position of the first row shown (0 with none)."""
        return (self.page - 1) * self.query.per + 1 if self.rows else 0

    @property
    def last(self) -> int:
        return self.first + len(self.rows) - 1 if self.rows else 0


def list_page(stats: Sequence[QueueStats], query: ListQuery) -> ListPage:
    """The page of queues ``query`` asks for. A page past the last shows the last."""
    needle = query.search.casefold()
    matched = [s for s in stats if needle in s.queue.casefold()] if needle else list(stats)
    key = SORTS[query.sort]
    # Name first, then the column (a stable sort keeps the names' order among equals), so
    # equal figures keep A to Z whichever way the column runs.
    matched.sort(key=lambda s: s.queue)
    matched.sort(key=key, reverse=query.descending)
    pages = max(1, math.ceil(len(matched) / query.per))
    page = min(query.page, pages)
    start = (page - 1) * query.per
    return ListPage(matched[start:start + query.per], len(stats), len(matched), page, pages,
                    query)
