"""Spark in the tests: the shared session of a worker, and the Spark JVMs tests start of their
own.

A test that runs `qlayer pipeline ...` as a user does, or the standalone cluster's daemons,
driver and executors, starts a JVM that lives seconds to a minute: most of its CPU went to the
C2 compiler's threads and G1, not to the job (the CLI views test: 49 s of CPU, 31 s with C1
only and the serial collector, wall time unchanged). On two cores shared by six workers, CPU is
the suite's limit (issue 35), so those JVMs get ``SHORT_LIVED_JVM`` through
``spark-conf/spark-defaults.conf`` (``SPARK_CONF_DIR``) and ``SPARK_DAEMON_JAVA_OPTS``.

The shared session runs every pipeline test of a worker for a quarter of an hour: there C2
pays (the unit pipeline tests beside three busy processes: 299 s as is, 313 s with C1 only),
so it keeps the JVM's defaults.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tests/conftest.py imports this module: no PySpark for every test run
    from pyspark.sql import SparkSession

__all__ = ["SHORT_LIVED_JVM", "SPARK_CONF_DIR", "shared_session", "short_lived_spark_jvms"]

SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
SPARK_CONF_DIR = Path(__file__).resolve().parent / "spark-conf"


def short_lived_spark_jvms(environ: MutableMapping[str, str] = os.environ) -> None:
    """Spark JVMs started from this environment take ``SHORT_LIVED_JVM`` (a Spark
    configuration of the user's own, ``SPARK_CONF_DIR``, is left as it is)."""
    environ.setdefault("SPARK_CONF_DIR", str(SPARK_CONF_DIR))
    environ.setdefault("SPARK_DAEMON_JAVA_OPTS", SHORT_LIVED_JVM)


def shared_session() -> SparkSession:
    """The worker's one session (unit and integration tests share it: a JVM takes
    `spark.jars` once, so it carries the Kafka source from the start), with the JVM's own
    compilers: the explicit empty option wins over ``spark-defaults.conf``."""
    from layer.pipeline.io import local_session

    return local_session(extra_conf={"spark.driver.extraJavaOptions": ""})
