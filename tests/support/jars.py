"""Resolve the jars the suite needs, once, before its workers start (`make jars`).

The local stack's brokers (the session's, and the secured, TLS, outage and soak ones) run from
the Kafka jars, and Spark's sessions load the Kafka source and spark-avro jars; both are
fetched with Maven into ~/.cache/qlayer the first time. Fetched here, before pytest-xdist
starts its workers, two workers never run Maven into one directory at once; with the cache
warm (as CI has it) this takes a fraction of a second.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from layer.localstack.kafka import KafkaConfig, ensure_jars
from layer.localstack.stack import default_cache_dir
from layer.pipeline.jars import ensure_spark_jars


def main() -> int:
    libs = ensure_jars(KafkaConfig(state_dir=Path(tempfile.gettempdir()),
                                   cache_dir=default_cache_dir()))
    spark = ensure_spark_jars()
    print(f"jars: Kafka in {libs}, Spark's Kafka source: {len(spark)} jars")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
