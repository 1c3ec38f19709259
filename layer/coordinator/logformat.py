"""The coordinator's log formats: text for people, JSON (one object per line) for machines.

A log call passes its structured fields as ``extra=fields(queue=..., shard=..., epoch=...)``;
the text format shows only the message (which already names them), the JSON format adds each
field given as a key of its own, so a log pipeline can filter by queue, shard or epoch without
parsing sentences.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

__all__ = ["FIELDS", "LOG_FORMATS", "JsonFormatter", "configure", "fields"]

#: The structured fields a log line may carry (docs/operations.md, "Logs").
FIELDS = ("owner", "queue", "shard", "shards", "epoch", "epochs", "consumer", "reason")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def fields(**values: Any) -> dict[str, Any]:
    """``extra=`` for a log call: the given structured fields (None values left out)."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown log fields {sorted(unknown)}; known: {', '.join(FIELDS)}")
    return {f"qlayer_{k}": v for k, v in values.items() if v is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, the structured fields given, and ``error`` with the traceback, if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(f"qlayer_{name}")
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """Set up the root logger for a coordinator process (stderr)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, "
                         f"got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
