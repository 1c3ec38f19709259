"""Spark's Kafka source and Avro jars, fetched with Maven into a cache (like the broker's).

`spark.jars.packages` would resolve them with Ivy, which ignores Maven's settings (mirrors,
proxies); so Maven fetches them once, with `pom.xml` beside this file, into
``~/.cache/qlayer/spark-<pyspark version>/jars``, and Spark gets the files with `spark.jars`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

__all__ = ["PipelineSetupError", "ensure_spark_jars", "pyspark_version"]

_VERSIONED_JAR = re.compile(r"^(?P<artifact>.+?)-\d[\w.\-]*\.jar$")


class PipelineSetupError(RuntimeError):
    """The pipeline cannot start: a tool or a download is missing. The message says what to do."""


def pyspark_version() -> str:
    import pyspark

    return str(pyspark.__version__)


def _default_cache() -> Path:
    return Path(os.environ.get("QLAYER_CACHE_DIR", Path.home() / ".cache" / "qlayer"))


def _artifact(jar_name: str) -> str:
    found = _VERSIONED_JAR.match(jar_name)
    return found.group("artifact") if found else jar_name


def _bundled_artifacts() -> set[str]:
    """Artifacts pyspark already ships (Scala, Hadoop client, compression codecs...)."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    return {_artifact(p.name) for p in jars.glob("*.jar")}


def ensure_spark_jars(cache_dir: Path | None = None, version: str | None = None) -> list[Path]:
    """The jars to pass as `spark.jars`, fetched with Maven unless already cached.

    Only what pyspark lacks is kept: a second copy of a jar pyspark ships (another Scala
    library, another Hadoop client) would put two versions of the same classes on the
    classpath.
    """
    version = version or pyspark_version()
    jars = (cache_dir or _default_cache()) / f"spark-{version}" / "jars"
    marker = jars / ".complete"
    # The marker names the pom it was fetched with: a dependency added to the pom (the
    # Postgres driver) fetches again instead of running without it.
    stamp = f"{version} {_pom_digest()}\n"
    if not marker.exists() or marker.read_text() != stamp:
        _fetch(jars, version)
        marker.write_text(stamp)
    return sorted(jars.glob("*.jar"))


def _pom() -> Path:
    return Path(str(resources.files("layer.pipeline").joinpath("pom.xml")))


def _pom_digest() -> str:
    return hashlib.sha256(_pom().read_bytes()).hexdigest()[:16]


def _fetch(jars: Path, version: str) -> None:
    if shutil.which("mvn") is None:
        raise PipelineSetupError(
            "mvn not found: install Maven (apt-get install -y maven) so Spark's Kafka source "
            "can be fetched"
        )
    tmp = jars.with_name("jars.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pom = _pom()
    cmd = [
        "mvn", "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
        f"-Dspark.version={version}", "-DincludeScope=runtime", f"-DoutputDirectory={tmp}",
        *os.environ.get("QLAYER_MAVEN_ARGS", "").split(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise PipelineSetupError(
            f"downloading Spark {version}'s Kafka source from Maven Central failed; check "
            "network access (or QLAYER_MAVEN_ARGS for a mirror) and that the artifacts exist "
            f"for this pyspark version. mvn said: {' | '.join(last)}"
        )
    bundled = _bundled_artifacts()
    for jar in tmp.glob("*.jar"):
        if _artifact(jar.name) in bundled:
            jar.unlink()
    shutil.rmtree(jars, ignore_errors=True)
    tmp.rename(jars)


def main() -> int:
    """Print the jars comma-separated, for ``spark-submit --jars "$(python -m ...)"``."""
    try:
        found = ensure_spark_jars()
    except PipelineSetupError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(",".join(str(jar) for jar in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
