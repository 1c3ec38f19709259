"""A least-recently-used cache bounded by an estimate of what its entries hold, in bytes.

``functools.lru_cache`` bounds entries, and one compiled filter may hold a thousand times what
another does (its LIKE patterns' RE2 programs and DFA caches): 1,024 entries of the heaviest
filter a consumer could send held gigabytes (issue 36). Each entry here carries its caller's
estimate of the bytes it keeps alive, and the least recently used entries leave once the sum
passes the budget; an entry larger than the whole budget is not kept at all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["BoundedCache"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """``get`` / ``put`` under a byte budget; safe to share between threads (the console and
    the SDK compile expressions off the coordinator's thread)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V, cost: int) -> None:
        """Keep ``value``, estimated to hold ``cost`` bytes; evicts the least recently used
        entries until the total fits the budget again."""
        if cost > self.budget:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, cost)
            self._bytes += cost
            while self._bytes > self.budget:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def bytes(self) -> int:
        """The estimated bytes held now (at most the budget)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
