"""What a deep queue with a small ``target_queue_depth`` costs the engine in memory.

Offers RECORDS journal records (each with its own document, as the coordinator offers them)
to one queue with ``target_queue_depth`` DEPTH, on the Python and the native engine, and
reports what the engine keeps afterwards: Python allocations still held (tracemalloc, which
sees the documents and the Python engine's columns) and the process's resident set growth
(which also sees the native engine's own allocations).
docs/benchmarks-target-depth.md has the figures.

    .venv/bin/python benchmarks/bench_target_depth.py [--records 200000] [--depth 100]

Runs against whatever ``layer`` the interpreter imports, so the same script measures the code
before a change (another checkout's interpreter) and after it.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import tracemalloc
from typing import Any

from layer.domain.definitions import QueueDefinition
from layer.domain.engine import QueueEngine, random_tokens
from layer.domain.entries import OfferedRecord
from layer.domain.expressions import RawDocument


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def _engine(native: bool, depth: int) -> Any:
    import random

    definition = QueueDefinition.model_validate(
        {"name": "Deep", "underlying_topic": "Work", "target_queue_depth": depth})
    tokens = random_tokens(random.Random(1))
    if native:
        from layer.domain.native import NativeQueueEngine

        return NativeQueueEngine(definition, tokens=tokens)
    return QueueEngine(definition, tokens=tokens)


def _offer(engine: Any, records: int, batch: int = 1_000) -> None:
    # Built batch by batch and dropped after: what stays is what the engine keeps.
    for start in range(0, records, batch):
        engine.enqueue([OfferedRecord("Work", 0, o, None,
                                      RawDocument(b'{"n": %d, "pad": "%s"}' % (o, b"x" * 64)),
                                      1_700_000_000.0 + o / 1000)
                        for o in range(start, min(start + batch, records))], 0.0)
        engine.drain()


def measure(native: bool, records: int, depth: int) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    engine = _engine(native, depth)
    gc.collect()
    traced_before, _ = tracemalloc.get_traced_memory()
    rss_before = _rss_kib()
    _offer(engine, records)
    gc.collect()
    traced_after, _ = tracemalloc.get_traced_memory()
    rss_after = _rss_kib()
    tracemalloc.stop()
    stats = engine.stats()
    return {
        "engine": "native" if native else "python",
        "records": records,
        "depth": depth,
        "held_python_bytes": traced_after - traced_before,
        "rss_growth_kib": rss_after - rss_before,
        "available": stats.available,
        "inactive_in_memory": stats.inactive,
        "not_read": getattr(stats, "not_read", None),
        "recovery_points": {f"{t}/{p}": o for (t, p), o in engine.recovery_points().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--depth", type=int, default=100)
    parser.add_argument("--engine", choices=["python", "native", "both"], default="both")
    args = parser.parse_args()
    engines = [False, True] if args.engine == "both" else [args.engine == "native"]
    for native in engines:
        # One engine per process would be cleaner for RSS; the Python engine runs first and
        # frees what it held, and RSS growth is read as a delta either way.
        print(json.dumps(measure(native, args.records, args.depth)))


if __name__ == "__main__":
    main()
