"""Local Kafka (Maven jars, KRaft) and PostgreSQL for development, the demo and the tests."""

from layer.localstack.kafka import KAFKA_VERSION, KafkaConfig, KafkaNode
from layer.localstack.postgres import PostgresConfig, PostgresNode
from layer.localstack.process import LocalStackError
from layer.localstack.stack import Endpoints, LocalStack, NodeStatus, StackConfig

__all__ = [
    "KAFKA_VERSION",
    "Endpoints",
    "KafkaConfig",
    "KafkaNode",
    "LocalStack",
    "LocalStackError",
    "NodeStatus",
    "PostgresConfig",
    "PostgresNode",
    "StackConfig",
]
