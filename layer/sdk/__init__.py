"""The consumer SDK: QueueConsumer and QueuePublisher (DESIGN §7). Needs only Kafka.

Guide with examples: ``docs/sdk.md``; the wire protocol underneath: ``docs/protocol.md``.
"""

from layer.sdk.acks import AckBatcher
from layer.sdk.config import ClientConfig
from layer.sdk.consumer import ConsumerStats, OnError, QueueConsumer
from layer.sdk.directory import (
    QueueDirectory,
    QueueDirectoryWriter,
    delete_queue_definition,
    publish_queue_definitions,
    sync_queue_definitions,
)
from layer.sdk.errors import (
    AckFailure,
    ConsumerClosedError,
    InvalidFilterError,
    InvalidSubscriptionError,
    LeaseLostError,
    MessageSettledError,
    NoCoordinatorError,
    NoPublishTargetError,
    NotAuthorizedError,
    PublishError,
    SessionEndedError,
    TransactionAbortedError,
    UnknownQueueError,
)
from layer.sdk.message import Message
from layer.sdk.publisher import QueuePublisher
from layer.sdk.transaction import Transaction

__all__ = [
    "AckBatcher",
    "AckFailure",
    "ClientConfig",
    "ConsumerClosedError",
    "ConsumerStats",
    "InvalidFilterError",
    "InvalidSubscriptionError",
    "LeaseLostError",
    "Message",
    "MessageSettledError",
    "NoCoordinatorError",
    "NoPublishTargetError",
    "NotAuthorizedError",
    "OnError",
    "PublishError",
    "QueueConsumer",
    "QueueDirectory",
    "QueueDirectoryWriter",
    "QueuePublisher",
    "SessionEndedError",
    "Transaction",
    "TransactionAbortedError",
    "UnknownQueueError",
    "delete_queue_definition",
    "publish_queue_definitions",
    "sync_queue_definitions",
]
