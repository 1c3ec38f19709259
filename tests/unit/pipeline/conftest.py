from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from layer.pipeline.io import local_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One SparkSession for every pipeline test (unit and integration share it: a JVM takes
    `spark.jars` once, so it carries the Kafka source from the start)."""
    session = local_session()
    yield session
    session.stop()
