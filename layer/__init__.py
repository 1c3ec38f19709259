"""qlayer: AMPS-style message queues on Apache Kafka.

``from layer import QueueConsumer, QueuePublisher`` — imported lazily, so tools that use only
the pure core (or the coordinator) do not load the Kafka client for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["QueueConsumer", "QueuePublisher", "__version__"]

if TYPE_CHECKING:
    from layer.sdk import QueueConsumer, QueuePublisher


def __getattr__(name: str) -> Any:
    if name in ("QueueConsumer", "QueuePublisher"):
        from layer import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'layer' has no attribute {name!r}")
