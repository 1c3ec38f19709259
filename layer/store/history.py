"""The console's chart history in PostgreSQL (0014; docs/console.md, "History"): samples of
queues' figures, written in one statement per sampling, read back once when a console starts,
and deleted past the console's retention."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import NamedTuple

from sqlalchemy import Engine

from layer.store import statements as sql
from layer.store.errors import translate_errors

__all__ = ["TOTALS", "ConsoleSamples", "SampleRow"]

#: The queue name the installation's totals are stored under (no queue is named '').
TOTALS = ""


class SampleRow(NamedTuple):
    queue: str
    sampled_at: float
    depth: int
    leased: int
    consumers: int
    counters: dict[str, int]


class ConsoleSamples:
    """``console_samples`` behind a narrow API; ``engine`` is the store's."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def write(self, rows: Sequence[SampleRow]) -> int:
        """Store ``rows`` in one statement; returns how many were given."""
        if not rows:
            return 0
        batch = {
            "queue": [r.queue for r in rows],
            "sampled_at": [datetime.fromtimestamp(r.sampled_at, UTC) for r in rows],
            "depth": [r.depth for r in rows],
            "leased": [r.leased for r in rows],
            "consumers": [r.consumers for r in rows],
            "counters": [json.dumps(r.counters, sort_keys=True) for r in rows],
        }
        with translate_errors("writing the console's samples"), self._engine.begin() as conn:
            conn.execute(sql.INSERT_CONSOLE_SAMPLES, batch)
        return len(rows)

    def since(self, moment: float) -> list[SampleRow]:
        """Every sample taken at or after ``moment``, oldest first."""
        with translate_errors("reading the console's samples"), self._engine.connect() as conn:
            found = conn.execute(sql.SELECT_CONSOLE_SAMPLES_SINCE,
                                 {"since": datetime.fromtimestamp(moment, UTC)}).all()
        return [SampleRow(queue, at.timestamp(), int(depth), int(leased), int(consumers),
                          {str(k): int(v) for k, v in counters.items()})
                for queue, at, depth, leased, consumers, counters in found]

    def forget_before(self, moment: float) -> int:
        """Delete the samples older than ``moment``; returns how many."""
        with translate_errors("deleting old console samples"), self._engine.begin() as conn:
            result = conn.execute(sql.DELETE_CONSOLE_SAMPLES_BEFORE,
                                  {"before": datetime.fromtimestamp(moment, UTC)})
        return int(result.rowcount or 0)
