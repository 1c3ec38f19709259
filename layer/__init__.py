"""qlayer: AMPS-style message queues on Apache Kafka."""

__version__ = "0.1.0"
