"""A real PostgreSQL server run from the machine's binaries (initdb / pg_ctl), no Docker.

PostgreSQL refuses to run as root, so when we are root every server command goes through
`runuser -u postgres` and the data directory belongs to that user. When the binaries are
missing and we are root on a Debian-like system, `apt-get install -y postgresql` fetches them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from layer.localstack.process import LocalStackError, port_open, tail, wait_until

_SERVER_USER = "postgres"


@dataclass(frozen=True)
class PostgresConfig:
    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 15432
    database: str = "qlayer"
    user: str = "postgres"
    # Tests and the demo trade durability of the *dev* server for speed; never used outside it.
    fast: bool = False

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{self.database}"

    def url_for(self, database: str) -> str:
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{database}"


def find_bindir(install: bool = True) -> Path:
    """The directory holding initdb and pg_ctl; installs PostgreSQL with apt-get when allowed."""
    override = os.environ.get("QLAYER_PG_BINDIR")
    if override:
        if (Path(override) / "initdb").exists():
            return Path(override)
        raise LocalStackError(f"QLAYER_PG_BINDIR={override} holds no initdb")
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
        reverse=True,
    )
    if candidates:
        return candidates[0].parent
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        for cmd in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "postgresql"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            if proc.returncode != 0:
                raise LocalStackError(
                    f"'{' '.join(cmd)}' failed; install PostgreSQL 14+ server binaries by hand: "
                    f"{proc.stderr.strip()[-200:]}"
                )
        return find_bindir(install=False)
    raise LocalStackError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found: install them "
        "(apt-get install -y postgresql) or set QLAYER_PG_BINDIR"
    )


class PostgresNode:
    """Start, stop and inspect one local PostgreSQL server. Every method is idempotent."""

    def __init__(self, config: PostgresConfig) -> None:
        self.config = config
        self.dir = config.state_dir / "postgres"
        self.data_dir = self.dir / "data"
        self.log_file = self.dir / "postgres.log"
        self._as_root = os.geteuid() == 0

    def _run(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["runuser", "-u", _SERVER_USER, "--", *args] if self._as_root else args
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if check and proc.returncode != 0:
            raise LocalStackError(
                f"{Path(args[0]).name} failed: {(proc.stderr or proc.stdout).strip()[-400:]}"
            )
        return proc

    def _prepare_dirs(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self._as_root:
            return
        try:
            entry = pwd.getpwnam(_SERVER_USER)
        except KeyError as exc:
            raise LocalStackError(
                "running as root needs a 'postgres' system user to own the server; create one "
                "(useradd --system postgres) or run qlayer as an ordinary user"
            ) from exc
        os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        # Every parent must be traversable by that user (a state dir under /root is not).
        probe = subprocess.run(["runuser", "-u", _SERVER_USER, "--", "test", "-w", str(self.dir)],
                               capture_output=True, check=False)
        if probe.returncode != 0:
            raise LocalStackError(
                f"the postgres user cannot reach {self.dir} (a parent directory is private); "
                "choose a state directory it can enter (QLAYER_DEV_STATE_DIR or --state-dir), "
                "e.g. /var/lib/qlayer/dev"
            )

    def pid(self) -> int | None:
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid

    def running(self) -> bool:
        return self.pid() is not None and port_open(self.config.host, self.config.port)

    def _initdb(self, bindir: Path) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        self._run([str(bindir / "initdb"), "-D", str(self.data_dir), "-U", self.config.user,
                   "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"])
        c = self.config
        settings = [
            f"listen_addresses = '{c.host}'",
            f"port = {c.port}",
            # The socket goes beside the data: /var/run/postgresql may be absent or not ours.
            f"unix_socket_directories = '{self.data_dir}'",
            "max_connections = 200",
            "shared_buffers = 256MB",
            "log_min_messages = warning",
        ]
        if c.fast:
            settings += ["fsync = off", "synchronous_commit = off", "full_page_writes = off"]
        conf = self.data_dir / "postgresql.conf"
        self._run(["sh", "-c", f"cat >> '{conf}' <<'EOF'\n" + "\n".join(settings) + "\nEOF\n"])

    def up(self, timeout: float = 60.0) -> str:
        """Start the server unless it runs already; create the database. Returns its URL."""
        c = self.config
        if not self.running():
            if self.pid() is None and port_open(c.host, c.port):
                raise LocalStackError(
                    f"port {c.host}:{c.port} is busy but not by this stack's PostgreSQL; stop "
                    "whatever uses it or choose another port (QLAYER_DEV_POSTGRES_PORT, "
                    "--postgres-port)"
                )
            bindir = find_bindir()
            self._prepare_dirs()
            self._initdb(bindir)
            if self.pid() is None:
                try:
                    self._run([str(bindir / "pg_ctl"), "-D", str(self.data_dir), "-l",
                               str(self.log_file), "-w", "-t", str(int(timeout)), "start"])
                except LocalStackError as exc:
                    # pg_ctl only says "examine the log output": show it.
                    raise LocalStackError(
                        f"{exc}\nLast lines of {self.log_file}:\n{tail(self.log_file)}"
                    ) from exc
            wait_until(
                lambda: port_open(c.host, c.port), timeout, f"PostgreSQL on {c.host}:{c.port}",
                alive=lambda: self.pid() is not None,
                on_death=lambda: f"Last lines of {self.log_file}:\n{tail(self.log_file)}",
            )
        self.create_database(c.database)
        return c.url

    def create_database(self, name: str, template: str | None = None) -> None:
        """CREATE DATABASE unless it exists."""
        import psycopg

        c = self.config
        with psycopg.connect(host=c.host, port=c.port, user=c.user, dbname="postgres",
                             autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                  (name,)).fetchone()
            if exists is None:
                ident = psycopg.sql.Identifier(name)
                if template is None:
                    conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(ident))
                else:
                    conn.execute(psycopg.sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                        ident, psycopg.sql.Identifier(template)))

    def wipe(self) -> bool:
        """Delete the stopped server's data, every database in it; the next `up` runs initdb.

        The log moves to postgres.log.1. True when there was data. Refuses while it runs.
        """
        pid = self.pid()
        if pid is not None:
            raise LocalStackError(
                f"PostgreSQL (pid {pid}) still runs: stop it before wiping its data")
        had = self.data_dir.exists()
        if had:
            shutil.rmtree(self.data_dir)
        if self.log_file.exists():
            self.log_file.replace(self.log_file.with_name(self.log_file.name + ".1"))
        return had

    def crash(self) -> bool:
        """Stop the server as a crash would (`pg_ctl stop -m immediate`: no checkpoint, every
        connection cut; the next `up` runs crash recovery). For fault-injection (the soak).
        True when one was running."""
        if self.pid() is None:
            return False
        bindir = find_bindir(install=False)
        self._run([str(bindir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w",
                   "-t", "60", "stop"], check=False)
        return True

    def down(self) -> bool:
        """Stop the server (fast shutdown). True when one was running."""
        if self.pid() is None:
            return False
        bindir = find_bindir(install=False)
        self._run([str(bindir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w",
                   "-t", "60", "stop"], check=False)
        return True
