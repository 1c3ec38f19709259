"""A real single-node Apache Kafka (KRaft combined mode) run with `java` from Maven Central jars.

Maven fetches the broker and tool jars named in `pom.xml` once into a cache outside the repo
(`~/.cache/qlayer/kafka-<version>/libs` by default); the broker then runs as a plain child
process whose data, config and log live in the stack's state directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from layer.localstack.process import (
    LocalStackError,
    pid_alive,
    port_open,
    read_end,
    read_pid,
    tail,
    terminate,
    wait_until,
)
from layer.localstack.tls import ensure_tls_files

KAFKA_VERSION = "4.3.1"
_BROKER_MAIN = "kafka.Kafka"
#: Seconds a starting broker's TLS listener may lag its plain one before it counts as missing.
_LISTENER_GRACE = 30.0
_STORAGE_TOOL = "kafka.tools.StorageTool"
_FEATURE_TOOL = "org.apache.kafka.tools.FeatureCommand"

_LOG4J2 = """\
Configuration:
  Appenders:
    Console:
      name: STDOUT
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Logger:
      - name: kafka
        level: INFO
      - name: org.apache.kafka
        level: WARN
      - name: state.change.logger
        level: WARN
    Root:
      level: INFO
      AppenderRef:
        - ref: STDOUT
"""


@dataclass(frozen=True)
class KafkaConfig:
    state_dir: Path
    cache_dir: Path
    host: str = "127.0.0.1"
    port: int = 9092
    controller_port: int = 9093
    heap: str = "768m"
    #: A second listener, SASL_PLAINTEXT with SCRAM-SHA-512, and the KRaft StandardAuthorizer
    #: (docs/security.md): None (the default) leaves the broker as it always was, one
    #: PLAINTEXT listener and no authorizer.
    sasl_port: int | None = None
    #: A TLS listener (SSL, no login, no authorizer of its own), its CA and certificate made
    #: in the state directory (`layer.localstack.tls`): None (the default) for none.
    ssl_port: int | None = None

    @property
    def ssl_bootstrap_servers(self) -> str | None:
        return None if self.ssl_port is None else f"{self.host}:{self.ssl_port}"

    @property
    def tls_dir(self) -> Path:
        """Where the TLS listener's CA (``ca.pem``) and keystore (``broker.pem``) are."""
        return self.state_dir / "kafka" / "tls"

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def sasl_bootstrap_servers(self) -> str | None:
        return None if self.sasl_port is None else f"{self.host}:{self.sasl_port}"

    @property
    def libs_dir(self) -> Path:
        return self.cache_dir / f"kafka-{KAFKA_VERSION}" / "libs"


#: The broker's own SCRAM user on the SASL listener, a super user: tools and tests that must
#: see everything over SASL use it (its password is in the state directory, `admin.password`).
ADMIN_USER = "admin"
SCRAM_MECHANISM = "SCRAM-SHA-512"


def listener_properties(c: KafkaConfig) -> list[str]:
    """The listener (and, with a SASL listener, authorizer) lines of server.properties.

    Without `sasl_port`: one PLAINTEXT listener, no authorizer (every other use of the stack).
    With it, a second listener takes SCRAM-SHA-512 logins and the StandardAuthorizer checks
    every request against the ACLs, denying what no ACL allows. The PLAINTEXT listener stays:
    its principal is User:ANONYMOUS, a super user, because the broker talks to its own
    controller through it and because a local operator's tools need a door that always opens.
    It is bound to loopback like everything in the local stack; a real cluster has no such
    listener (docs/security.md).
    """
    listeners = [f"PLAINTEXT://{c.host}:{c.port}"]
    advertised = [f"PLAINTEXT://{c.host}:{c.port}"]
    protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
    if c.sasl_port is not None:
        listeners.append(f"SASL_PLAINTEXT://{c.host}:{c.sasl_port}")
        advertised.append(f"SASL_PLAINTEXT://{c.host}:{c.sasl_port}")
        protocols.append("SASL_PLAINTEXT:SASL_PLAINTEXT")
    tls: list[str] = []
    if c.ssl_port is not None:
        listeners.append(f"SSL://{c.host}:{c.ssl_port}")
        advertised.append(f"SSL://{c.host}:{c.ssl_port}")
        protocols.append("SSL:SSL")
        tls = ["listener.name.ssl.ssl.keystore.type=PEM",
               f"listener.name.ssl.ssl.keystore.location={c.tls_dir / 'broker.pem'}",
               # Clients are not asked for certificates: TLS here is the channel's privacy
               # and the broker's identity; who the client is stays SASL's question.
               "listener.name.ssl.ssl.client.auth=none"]
    lines = [
        f"listeners={','.join(listeners)},CONTROLLER://{c.host}:{c.controller_port}",
        f"advertised.listeners={','.join(advertised)}",
        f"listener.security.protocol.map={','.join(protocols)}",
        *tls,
    ]
    if c.sasl_port is None:
        return lines
    return [
        *lines,
        f"sasl.enabled.mechanisms={SCRAM_MECHANISM}",
        # The broker only checks SCRAM logins here (inter-broker traffic is PLAINTEXT), so its
        # login module needs no credentials of its own.
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config="
        "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        f"super.users=User:ANONYMOUS;User:{ADMIN_USER}",
        "allow.everyone.if.no.acl.found=false",
    ]


def sasl_client_config(c: KafkaConfig, user: str, password: str) -> dict[str, str]:
    """librdkafka properties of a client logging in on the SASL listener as ``user``."""
    if c.sasl_bootstrap_servers is None:
        raise LocalStackError("this Kafka has no SASL listener: start it with --secure")
    return {"bootstrap.servers": c.sasl_bootstrap_servers,
            "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": SCRAM_MECHANISM,
            "sasl.username": user, "sasl.password": password}


def _pom_path() -> Path:
    return Path(str(resources.files("layer.localstack").joinpath("pom.xml")))


def ensure_jars(config: KafkaConfig) -> Path:
    """Fetch the broker jars with Maven unless they are already cached. Returns the libs dir."""
    libs = config.libs_dir
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("mvn") is None:
        raise LocalStackError(
            "mvn not found: install Maven (apt-get install -y maven) so the Kafka jars can be "
            "fetched"
        )
    tmp = libs.with_name("libs.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [
        "mvn", "-q", "-B", "-f", str(_pom_path()),
        "dependency:copy-dependencies", f"-DoutputDirectory={tmp}",
    ]
    extra = os.environ.get("QLAYER_MAVEN_ARGS", "").split()
    proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise LocalStackError(
            "downloading the Kafka jars from Maven Central failed; check network access to Maven "
            f"Central (or QLAYER_MAVEN_ARGS for a mirror). mvn said: {' | '.join(last)}"
        )
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text(KAFKA_VERSION + "\n")
    return libs


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise LocalStackError(
            "java not found: install a JDK 17+ (apt-get install -y openjdk-17-jdk-headless) "
            "or set JAVA_HOME"
        )
    return found


def out_of_files_hint(log_end: str, partitions: int) -> str:
    """What to do when the broker stopped for want of open files (each partition holds one)."""
    if "Too many open files" not in log_end:
        return ""
    return (f"\nThe broker ran out of open files; its data holds {partitions:,} partitions. "
            "Start it empty with `qlayer dev down --wipe` then `qlayer dev up`, or raise its "
            "limit (ulimit -n) before starting it.")


class KafkaNode:
    """Start, stop and inspect one local broker. Every method is idempotent."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        self.dir = config.state_dir / "kafka"
        self.data_dir = self.dir / "data"
        self.pid_file = self.dir / "kafka.pid"
        self.log_file = self.dir / "kafka.log"
        self.properties = self.dir / "server.properties"
        #: When this process first saw the plain listener open while waiting for the broker.
        self._plain_open_since: float | None = None

    def pid(self) -> int | None:
        return read_pid(self.pid_file)

    def running(self) -> bool:
        return self.pid() is not None and port_open(self.config.host, self.config.port)

    def _log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except OSError:
            return 0

    def _classpath(self) -> str:
        return str(self.config.libs_dir / "*")

    def _write_config(self) -> None:
        c = self.config
        self.dir.mkdir(parents=True, exist_ok=True)
        # Replication factor 1 everywhere: there is one broker. Share groups (KIP-932) are on by
        # default in a freshly formatted 4.2+ cluster; their state topic also needs RF 1.
        self.properties.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@{c.host}:{c.controller_port}",
                    *listener_properties(c),
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    f"log.dirs={self.data_dir}",
                    "num.partitions=1",
                    "auto.create.topics.enable=true",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=10",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "transaction.state.log.num.partitions=4",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "share.coordinator.state.topic.num.partitions=4",
                    "group.initial.rebalance.delay.ms=0",
                    "group.share.min.record.lock.duration.ms=1000",
                    "log.flush.interval.messages=9223372036854775807",
                    "",
                ]
            )
        )
        (self.dir / "log4j2.yaml").write_text(_LOG4J2)

    def _format(self, java: str) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        cluster_id = uuid.uuid4().hex[:22]
        proc = subprocess.run(
            [java, "-cp", self._classpath(), _STORAGE_TOOL, "format",
             "-t", cluster_id, "-c", str(self.properties)],
            capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            raise LocalStackError(
                f"formatting Kafka storage in {self.data_dir} failed: {proc.stderr.strip()[-300:]}"
            )

    def up(self, timeout: float = 90.0) -> str:
        """Start the broker unless it already runs. Returns the bootstrap servers."""
        c = self.config
        if self.running():
            self._check_listeners()
            self.ensure_admin_user()
            return c.bootstrap_servers
        if self.pid() is None:
            ports = [c.port, c.controller_port] + ([c.sasl_port] if c.sasl_port else []) + (
                [c.ssl_port] if c.ssl_port else [])
            for port in ports:
                if port_open(c.host, port):
                    raise LocalStackError(
                        f"port {c.host}:{port} is busy but not by this stack's Kafka; stop "
                        "whatever uses it or choose other ports "
                        "(QLAYER_DEV_KAFKA_PORT, --kafka-port)"
                    )
        java = _java()
        ensure_jars(c)
        if c.ssl_port is not None:
            ensure_tls_files(c.tls_dir, c.host)
        self._write_config()
        self._format(java)
        if self.pid() is None:
            log = self.log_file.open("ab")
            proc = subprocess.Popen(
                [java, f"-Xmx{c.heap}", f"-Xms{c.heap}", "-XX:+UseG1GC",
                 f"-Dlog4j2.configurationFile={self.dir / 'log4j2.yaml'}",
                 "-Djava.awt.headless=true",
                 "-cp", self._classpath(), _BROKER_MAIN, str(self.properties)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.dir,
            )
            log.close()
            self.pid_file.write_text(f"{proc.pid}\n")
        try:
            # A broker with thousands of partitions loads each one's log before it listens
            # (minutes on a busy machine): waited for as long as its log keeps growing.
            wait_until(
                self._ready, timeout, f"Kafka on {c.bootstrap_servers}",
                alive=lambda: self.pid() is not None,
                on_death=self._death_report,
                progress=self._log_size, longest=timeout * 10,
            )
        except LocalStackError as exc:
            raise LocalStackError(
                f"{exc}. It holds {self.partitions():,} partitions (each loaded at start-up); "
                f"it still runs as pid {self.pid()} and may yet become ready (`qlayer dev "
                f"status`). `qlayer dev down --wipe` starts it empty. Last lines of "
                f"{self.log_file}:\n{tail(self.log_file)}") from None
        self.ensure_admin_user()
        return c.bootstrap_servers

    def _check_listeners(self) -> None:
        """A running broker has the listeners asked for: one started without the SASL listener
        is not silently taken for a secured one."""
        c = self.config
        if c.ssl_port is not None and not port_open(c.host, c.ssl_port):
            raise LocalStackError(
                f"the running Kafka (pid {self.pid()}) has no TLS listener on "
                f"{c.host}:{c.ssl_port}: stop it (`qlayer dev down`) and start it with "
                "`qlayer dev up --tls`")
        if c.sasl_port is not None and not port_open(c.host, c.sasl_port):
            raise LocalStackError(
                f"the running Kafka (pid {self.pid()}) has no SASL listener on "
                f"{c.host}:{c.sasl_port}: stop it (`qlayer dev down`) and start it with "
                "`qlayer dev up --secure`")

    @property
    def admin_password_file(self) -> Path:
        return self.dir / "admin.password"

    def admin_password(self) -> str:
        """The SASL admin user's password, made once per state directory (mode 0600)."""
        path = self.admin_password_file
        if not path.exists():
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(18) + "\n")
        return path.read_text().strip()

    def ensure_admin_user(self) -> None:
        """With a SASL listener: the super user `admin` exists with the state dir's password."""
        if self.config.sasl_port is not None:
            self.set_scram_user(ADMIN_USER, self.admin_password())

    def set_scram_user(self, user: str, password: str, timeout: float = 30.0) -> None:
        """Create or change a SCRAM-SHA-512 user (through the PLAINTEXT listener, a super user's
        door) and wait until the SASL listener accepts its login."""
        from confluent_kafka.admin import (  # type: ignore[attr-defined]
            AdminClient,
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialUpsertion,
        )

        c = self.config
        if c.sasl_port is None:
            raise LocalStackError("this Kafka has no SASL listener: start it with --secure")
        admin = AdminClient({"bootstrap.servers": c.bootstrap_servers})
        upsert = UserScramCredentialUpsertion(
            user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode())
        try:
            for future in admin.alter_user_scram_credentials([upsert]).values():
                future.result(timeout=timeout)
        except Exception as exc:
            raise LocalStackError(f"cannot create SCRAM user {user!r} on "
                                  f"{c.bootstrap_servers}: {exc}") from exc
        # The credential reaches the SASL listener once the broker applied the metadata record.
        wait_until(lambda: self._can_log_in(user, password), timeout,
                   f"a SASL login of {user!r} on {c.sasl_bootstrap_servers}")

    def _can_log_in(self, user: str, password: str) -> bool:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({**sasl_client_config(self.config, user, password),
                             "socket.timeout.ms": 2000})
        try:
            # Listing topics needs no ACL (an unauthorized client sees no topics), so this
            # fails only when the login does.
            admin.list_topics(timeout=2.0)
        except Exception:
            return False
        return True

    def _death_report(self) -> str:
        return f"Last lines of {self.log_file}:\n{tail(self.log_file)}{self.death_hint()}"

    def death_hint(self) -> str:
        """A hint for a broker that stopped for want of open files, else "".

        The cause is logged well before the last lines (a failed log directory's partitions
        follow it, one line of 100 KB per list), so the log's last MBs are searched."""
        return out_of_files_hint(read_end(self.log_file, 4 << 20), self.partitions())

    def _ready(self) -> bool:
        c = self.config
        if not port_open(c.host, c.port):
            return False
        if c.ssl_port is not None and not port_open(c.host, c.ssl_port):
            # The broker opens its listeners one after another: on a loaded machine the TLS
            # one came after the plain one was already answering (a parallel test run). Only
            # a TLS port still closed well after the plain one opened means a broker started
            # without it.
            if self._plain_open_since is None:
                self._plain_open_since = time.monotonic()
            if time.monotonic() - self._plain_open_since < _LISTENER_GRACE:
                return False
            raise LocalStackError(
                f"the running Kafka (pid {self.pid()}) has no TLS listener on "
                f"{c.host}:{c.ssl_port} {_LISTENER_GRACE:g}s after its plain one opened: stop "
                "it (`qlayer dev down`) and start it with `qlayer dev up --tls`")
        if c.sasl_port is not None and not port_open(c.host, c.sasl_port):
            return False
        # A listening socket is not yet a serving broker: ask for metadata.
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.config.bootstrap_servers,
                             "socket.timeout.ms": 2000})
        try:
            md = admin.list_topics(timeout=2.0)
        except Exception:
            return False
        return bool(md.brokers)

    def down(self, timeout: float = 30.0) -> bool:
        """Stop the broker. True when one was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        terminate(pid, timeout)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self, timeout: float = 10.0) -> int | None:
        """SIGKILL the broker, as a crash would (fault-injection tests, the soak); returns the
        PID it had (None when none ran) once it is gone. Its data stays: `up` starts it again
        on the same data directory and port, after recovering the logs it did not close."""
        pid = self.pid()
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while pid_alive(pid):
            if time.monotonic() > deadline:
                raise LocalStackError(f"Kafka (pid {pid}) still runs {timeout:.0f}s after SIGKILL")
            time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return pid

    def partitions(self) -> int:
        """How many partition directories the broker's data holds (one open file each)."""
        try:
            return sum(1 for entry in self.data_dir.iterdir()
                       if entry.is_dir() and entry.name.rpartition("-")[2].isdigit())
        except OSError:
            return 0

    def open_file_limit(self) -> int | None:
        """The running broker's limit on open files (None when stopped or unknown).

        Each partition keeps at least one file open; the broker stops near this limit."""
        pid = self.pid()
        if pid is None:
            return None
        try:
            limits = Path(f"/proc/{pid}/limits").read_text()
        except OSError:
            return None
        for line in limits.splitlines():
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return int(soft) if soft.isdigit() else None
        return None

    def wipe(self) -> bool:
        """Delete the stopped broker's data: every topic and the cluster's metadata.

        The next `up` formats an empty broker. The log moves to kafka.log.1, so the reason for
        a wipe stays readable. True when there was data. Refuses while the broker runs.
        """
        pid = self.pid()
        if pid is not None:
            raise LocalStackError(f"Kafka (pid {pid}) still runs: stop it before wiping its data")
        had = self.data_dir.exists()
        if had:
            shutil.rmtree(self.data_dir)
        if self.log_file.exists():
            self.log_file.replace(self.log_file.with_name(self.log_file.name + ".1"))
        return had

    def features(self) -> dict[str, int]:
        """Finalized feature levels the broker reports (share.version >= 1: share groups on)."""
        proc = subprocess.run(
            [_java(), "-cp", self._classpath(), _FEATURE_TOOL,
             "--bootstrap-server", self.config.bootstrap_servers, "describe"],
            capture_output=True, text=True, check=False, timeout=60,
        )
        if proc.returncode != 0:
            raise LocalStackError(f"kafka features tool failed: {proc.stderr.strip()[-300:]}")
        levels: dict[str, int] = {}
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 8 and parts[0] == "Feature:":
                name = parts[1]
                level = parts[parts.index("FinalizedVersionLevel:") + 1]
                try:
                    levels[name] = int(level)
                except ValueError:
                    continue  # metadata.version reports "4.3-IV0", not a number
        return levels


def tool_command(config: KafkaConfig, main_class: str, *args: str) -> list[str]:
    """A java command line for one of Kafka's tools (perf tools, console tools) on this stack."""
    return [_java(), "-cp", str(config.libs_dir / "*"), main_class, *args]

