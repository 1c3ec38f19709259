"""Operator services: what each `qlayer` command does, over the store, settings and Kafka admin.

The CLI (`cli/`) parses arguments, calls one service method per command and renders the answer;
everything else (validation, diffs, waiting, error wording) lives here, so it is tested without
a terminal and reusable from scripts.


Each name is imported from its module on first use (`layer.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from layer.lazy import exports

if TYPE_CHECKING:
    from layer.services.consumers import (
        ConsumerInfo,
        ConsumerService,
        EvictionResult,
        NoSuchConsumerError,
    )
    from layer.services.queues import (
        AckResult,
        ApplyConflictError,
        ApplyPlan,
        ApplyResult,
        ConsumersAttachedError,
        FieldChange,
        InvalidFilterError,
        InvalidQueueFileError,
        NoSuchQueueError,
        PartitionFigures,
        PurgeResult,
        QueueChange,
        QueueDescription,
        QueueExistsError,
        QueueService,
        QueueSummary,
        ResetResult,
        WaitTimedOutError,
        plan_apply,
    )

__all__ = [
    "AckResult",
    "ApplyConflictError",
    "ApplyPlan",
    "ApplyResult",
    "ConsumerInfo",
    "ConsumerService",
    "ConsumersAttachedError",
    "EvictionResult",
    "FieldChange",
    "InvalidFilterError",
    "InvalidQueueFileError",
    "NoSuchConsumerError",
    "NoSuchQueueError",
    "PartitionFigures",
    "PurgeResult",
    "QueueChange",
    "QueueDescription",
    "QueueExistsError",
    "QueueService",
    "QueueSummary",
    "ResetResult",
    "WaitTimedOutError",
    "plan_apply",
]

__getattr__, __dir__ = exports(__name__, __all__, {
    "consumers": ("ConsumerInfo", "ConsumerService", "EvictionResult", "NoSuchConsumerError"),
    "queues": ("AckResult", "ApplyConflictError", "ApplyPlan", "ApplyResult",
        "ConsumersAttachedError", "FieldChange", "InvalidFilterError", "InvalidQueueFileError",
        "NoSuchQueueError", "PartitionFigures", "PurgeResult", "QueueChange", "QueueDescription",
        "QueueExistsError", "QueueService", "QueueSummary", "ResetResult", "WaitTimedOutError",
        "plan_apply"),
})
