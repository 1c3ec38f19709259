"""confluent-kafka adapters: journal reader, record writer, admin. Driver errors stop here.

Each name is imported from its module on first use (`layer.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from layer.lazy import exports

if TYPE_CHECKING:
    from layer.kafka.admin import KafkaAdmin, TopicSpec
    from layer.kafka.errors import DeliveryFailed, KafkaAdapterError, RetentionGap
    from layer.kafka.journal import BEGINNING, END, JournalReader
    from layer.kafka.records import Headers, JournalRecord, OutgoingRecord
    from layer.kafka.writer import RecordWriter

__all__ = [
    "BEGINNING",
    "END",
    "DeliveryFailed",
    "Headers",
    "JournalReader",
    "JournalRecord",
    "KafkaAdapterError",
    "KafkaAdmin",
    "OutgoingRecord",
    "RecordWriter",
    "RetentionGap",
    "TopicSpec",
]

__getattr__, __dir__ = exports(__name__, __all__, {
    "admin": ("KafkaAdmin", "TopicSpec"),
    "errors": ("DeliveryFailed", "KafkaAdapterError", "RetentionGap"),
    "journal": ("BEGINNING", "END", "JournalReader"),
    "records": ("Headers", "JournalRecord", "OutgoingRecord"),
    "writer": ("RecordWriter",),
})
