"""Queue directory records: queue definitions on the compacted topic ``P`` + ``queues``.

- key: the queue name, UTF-8;
- value, format 2: ``{"format": 2, "shard": n, "shard_count": N, "definition": {...}}``, the
  definition as JSON (the snake_case fields of docs/queue-configuration.md) and ``shard`` the
  shard that serves the queue; format 1, the bare definition object, is still read (its shard
  is unknown);
- a tombstone (null value): the queue was deleted.

Plain JSON here; `layer.sdk.directory` turns a definition into a `QueueDefinition`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DIRECTORY_FORMAT", "DirectoryRecord", "decode_directory_record",
           "encode_directory_record"]

#: The directory record format this version writes.
DIRECTORY_FORMAT = 2


@dataclass(frozen=True)
class DirectoryRecord:
    name: str
    #: The definition as JSON; None for a tombstone.
    definition: dict[str, Any] | None
    shard: int | None = None
    shard_count: int | None = None


def encode_directory_record(name: str, definition: Mapping[str, Any] | None,
                            shard: int | None = None,
                            shard_count: int | None = None) -> tuple[bytes, bytes | None]:
    """(key, value) of a queue's record: format 2 with its shard, format 1 without one, a
    tombstone for no definition."""
    if definition is None:
        return name.encode(), None
    body: Mapping[str, Any] = definition
    if shard is not None:
        body = {"format": DIRECTORY_FORMAT, "shard": shard, "shard_count": shard_count,
                "definition": dict(definition)}
    return name.encode(), json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode_directory_record(key: bytes | None, value: bytes | None) -> DirectoryRecord:
    """Raises ``ValueError`` saying why when the record is not a directory record."""
    if not key:
        raise ValueError("directory record without a key (the queue name)")
    try:
        name = key.decode()
    except UnicodeDecodeError:
        raise ValueError(f"directory key is not UTF-8: {key[:40]!r}") from None
    if value is None:
        return DirectoryRecord(name, None)
    try:
        data = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"directory record of queue {name!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"directory record of queue {name!r} is not a JSON object")
    if "format" not in data:
        return DirectoryRecord(name, data)
    if data.get("format") != DIRECTORY_FORMAT or not isinstance(data.get("definition"), dict):
        raise ValueError(f"directory record of queue {name!r} has an unknown format "
                         f"{data.get('format')!r} (written by a newer qlayer?)")
    shard, count = data.get("shard"), data.get("shard_count")
    return DirectoryRecord(
        name, data["definition"],
        shard if isinstance(shard, int) and not isinstance(shard, bool) else None,
        count if isinstance(count, int) and not isinstance(count, bool) else None)
