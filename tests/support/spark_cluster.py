"""A Spark standalone cluster on this machine: a master and workers started from the pip
installation of pyspark with ``spark-class`` (the JVMs the ``sbin`` scripts would start, but
as child processes whose PIDs we hold, so the test stops exactly them)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyspark

__all__ = ["StandaloneCluster", "spark_bin", "standalone_cluster"]


def spark_bin(tool: str) -> Path:
    """``spark-class``, ``spark-submit``, ... of the installed pyspark."""
    return Path(pyspark.__file__).parent / "bin" / tool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class StandaloneCluster:
    master_url: str
    web_url: str
    pids: tuple[int, ...]


def _alive_workers(web_url: str) -> int:
    """Workers the master counts alive; 0 while it cannot say. A master that has just bound
    its web UI may answer ``/json/`` with its HTML page before the JSON view is attached (seen
    once in CI: a JSONDecodeError that failed the test): not ready yet either."""
    try:
        with urllib.request.urlopen(f"{web_url}/json/", timeout=2) as answer:
            return int(json.load(answer).get("aliveworkers", 0))
    except (OSError, ValueError):
        return 0


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextmanager
def standalone_cluster(base: Path, *, workers: int = 1, cores: int = 2, memory: str = "1g",
                       env: Mapping[str, str] | None = None, ready_timeout: float = 120.0
                       ) -> Iterator[StandaloneCluster]:
    """A master and ``workers`` workers (``cores`` and ``memory`` each) on free loopback ports;
    logs and the workers' directories under ``base``. Every process is stopped on exit."""
    port, web = _free_port(), _free_port()
    spark_class = str(spark_bin("spark-class"))
    environment = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_DAEMON_MEMORY": "256m",
                   "SPARK_LOG_DIR": str(base), **(env or {})}
    base.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        def start(name: str, *args: str) -> subprocess.Popen[bytes]:
            log = stack.enter_context((base / f"{name}.log").open("wb"))
            # spark-class execs the JVM: the child's PID is the JVM's.
            process = subprocess.Popen([spark_class, *args], env=environment, stdout=log,
                                       stderr=subprocess.STDOUT)
            stack.callback(_stop, process)
            return process

        master = start("master", "org.apache.spark.deploy.master.Master", "--host",
                       "127.0.0.1", "--port", str(port), "--webui-port", str(web))
        master_url, web_url = f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web}"
        started = [master]
        for i in range(workers):
            started.append(start(
                f"worker{i}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                "--cores", str(cores), "--memory", memory, "--webui-port", str(_free_port()),
                "--work-dir", str(base / f"worker{i}"), master_url))
        deadline = time.monotonic() + ready_timeout
        while _alive_workers(web_url) < workers:
            dead = [p.args for p in started if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join((base / f).read_text(errors="replace")[-2000:]
                                 for f in sorted(os.listdir(base)) if f.endswith(".log"))
                raise RuntimeError(f"standalone cluster not ready (exited: {dead}):\n{logs}")
            time.sleep(0.5)
        yield StandaloneCluster(master_url, web_url, tuple(p.pid for p in started))
