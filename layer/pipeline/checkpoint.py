"""What the incremental `metrics` and `views` streams keep under their checkpoint besides
Spark's own offsets and state: rows in parts, and the stream's definition.

A part is what one micro-batch reads and rewrites whole: a metrics window's samples, or the
members of a views bucket (docs/pipeline.md, "Incremental metrics and views"). Spark's state
store keeps each entry's events; these parts keep what is keyed by something else than the
entry (a window, a group), so a micro-batch reads only the parts its entries touch, never
the history.

Layout: ``<root>/part=<p>/v=<batch id>/`` holds part ``p`` as micro-batch ``batch id`` wrote
it (an empty directory: the part has no rows). A micro-batch reads each part's latest version
*before* its own id and writes its own version beside it, so a micro-batch that Spark runs again
after a crash (same id, same input, the state of the batch before) reads what the first attempt
read and overwrites what it wrote: a part is never half old, half new, and nothing is counted
twice. Versions older than the one read are removed when a part is written (the one read stays
until the next write: the batch may still be run again).

Files are reached through Hadoop's FileSystem (local disk, HDFS, S3), so the checkpoint may be
on any filesystem Spark writes to.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

__all__ = ["PART", "PartStore", "exists", "read_text", "read_version", "stale_versions",
           "write_text"]

#: The column holding a row's part (a long: a window's start in epoch ms, a bucket number).
PART: Final = "part"
_VERSION: Final = re.compile(r"^v=(\d+)$")
_PART_DIR: Final = re.compile(r"^part=(-?\d+)$")
#: The copy of PART that `partitionBy` turns into directories (it leaves the files without it).
_SPLIT: Final = "_part_dir"


def read_version(versions: Iterable[int], batch_id: int) -> int | None:
    """The version of a part that micro-batch ``batch_id`` reads: the latest one written by an
    earlier micro-batch (one written by an attempt of this very batch is not committed)."""
    earlier = [v for v in versions if v < batch_id]
    return max(earlier) if earlier else None


def stale_versions(versions: Iterable[int], batch_id: int) -> list[int]:
    """The versions of a part to remove once micro-batch ``batch_id`` has written its own:
    those older than the one it read (that one stays: the batch may be run again)."""
    read = read_version(versions, batch_id)
    return sorted(v for v in versions if read is not None and v < read)


def _filesystem(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Hadoop's FileSystem for ``path`` and its Path class (reached through the JVM: PySpark
    has no Python API for it)."""
    jvm: Any = spark._jvm
    make = jvm.org.apache.hadoop.fs.Path
    return make(path).getFileSystem(spark._jsc.hadoopConfiguration()), make


def exists(spark: SparkSession, path: str) -> bool:
    fs, make = _filesystem(spark, path)
    return bool(fs.exists(make(path)))


def read_text(spark: SparkSession, path: str) -> str | None:
    """A small UTF-8 file's text, or None when there is none."""
    fs, make = _filesystem(spark, path)
    if not fs.exists(make(path)):
        return None
    stream = fs.open(make(path))
    try:
        jvm: Any = spark._jvm
        return str(jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
    finally:
        stream.close()


def write_text(spark: SparkSession, path: str, text: str) -> None:
    """Write a small UTF-8 file (replacing it)."""
    fs, make = _filesystem(spark, path)
    data = bytearray(text.encode())
    stream = fs.create(make(path), True)
    try:
        stream.write(data, 0, len(data))
    finally:
        stream.close()


class PartStore:
    """Parts of rows under ``root`` (a directory of the checkpoint), each row with a `PART`."""

    def __init__(self, spark: SparkSession, root: str) -> None:
        self.spark = spark
        self.root = root.rstrip("/")
        self._fs, self._path = _filesystem(spark, self.root)

    def _names(self, path: str) -> list[str]:
        found = self._path(path)
        if not self._fs.exists(found):
            return []
        return [status.getPath().getName() for status in self._fs.listStatus(found)]

    def _versions(self, part: int) -> list[int]:
        return [int(m.group(1)) for name in self._names(f"{self.root}/part={part}")
                if (m := _VERSION.match(name))]

    def parts(self) -> list[int]:
        """Every part the store holds."""
        return sorted(int(m.group(1)) for name in self._names(self.root)
                      if (m := _PART_DIR.match(name)))

    def read(self, parts: Iterable[int], batch_id: int, schema: StructType) -> DataFrame:
        """The rows of ``parts`` as micro-batch ``batch_id`` sees them (``schema``: the rows'
        columns, `PART` among them); a part never written has none."""
        paths = []
        for part in sorted(set(parts)):
            version = read_version(self._versions(part), batch_id)
            if version is None:
                continue
            path = f"{self.root}/part={part}/v={version}"
            if any(name.endswith(".parquet") for name in self._names(path)):
                paths.append(path)
        if not paths:
            return self.spark.createDataFrame([], schema)
        return self.spark.read.schema(schema).parquet(*paths)

    def write(self, rows: DataFrame, parts: Sequence[int], batch_id: int) -> None:
        """Make ``rows`` (each with a `PART` among ``parts``) the content of ``parts`` from
        micro-batch ``batch_id`` on; a part of ``parts`` without a row becomes empty."""
        incoming = f"{self.root}/_incoming/batch={batch_id}"
        # One file per part: a part is read whole, and small.
        (rows.withColumn(_SPLIT, F.col(PART)).repartition(_SPLIT)
         .write.mode("overwrite").partitionBy(_SPLIT).parquet(incoming))
        for part in sorted(set(parts)):
            target = self._path(f"{self.root}/part={part}/v={batch_id}")
            self._fs.delete(target, True)  # an earlier attempt of this batch
            written = self._path(f"{incoming}/{_SPLIT}={part}")
            self._fs.mkdirs(target.getParent())
            if self._fs.exists(written):
                self._fs.rename(written, target)
            else:
                self._fs.mkdirs(target)
            for version in stale_versions(self._versions(part), batch_id):
                self._fs.delete(self._path(f"{self.root}/part={part}/v={version}"), True)
        self._fs.delete(self._path(incoming), True)

    def drop(self, parts: Iterable[int]) -> None:
        """Remove ``parts`` whole (a metrics window the watermark has closed)."""
        for part in parts:
            self._fs.delete(self._path(f"{self.root}/part={part}"), True)
