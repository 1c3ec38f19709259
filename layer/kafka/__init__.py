"""confluent-kafka adapters: journal reader, record writer, admin. Driver errors stop here."""

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
