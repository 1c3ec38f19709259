"""The journal records the coordinator holds in memory until every queue is done with them.

The journal is the store (DESIGN §2): payloads are never copied into PostgreSQL. A record read
from a journal is kept while at least one queue holds it as a live entry, so that it can be
delivered (and redelivered, and dead-lettered) without reading Kafka again; the count of
holders is kept per record. After a restart the journals are re-read from the recovery points,
which brings back every record a live entry needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layer.domain.states import Bookmark
from layer.kafka.records import JournalRecord


@dataclass
class PayloadCache:
    """Records by bookmark, with the number of queues that still hold each."""

    _records: dict[Bookmark, JournalRecord] = field(default_factory=dict)
    _holders: dict[Bookmark, int] = field(default_factory=dict)
    bytes: int = 0

    def hold(self, bookmark: Bookmark, record: JournalRecord) -> None:
        held = self._holders.get(bookmark)
        if held is None:
            self._records[bookmark] = record
            self._holders[bookmark] = 1
            self.bytes += len(record.value or b"") + len(record.key or b"")
        else:
            self._holders[bookmark] = held + 1

    def get(self, bookmark: Bookmark) -> JournalRecord | None:
        return self._records.get(bookmark)

    def release(self, bookmark: Bookmark) -> None:
        """One queue is done with the record; the last one frees it."""
        held = self._holders.get(bookmark)
        if held is None:
            return
        if held > 1:
            self._holders[bookmark] = held - 1
            return
        del self._holders[bookmark]
        record = self._records.pop(bookmark)
        self.bytes -= len(record.value or b"") + len(record.key or b"")

    def clear(self) -> None:
        self._records.clear()
        self._holders.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)
