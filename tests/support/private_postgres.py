"""A private PostgreSQL server for tests that stop and restart the database.

The session's shared server (``support.databases``) is used by everybody's tests on this machine
and must never be stopped. A test that needs a database *outage* starts its own server instead:
``initdb`` into a fresh directory, ``pg_ctl start`` on a free loopback port with trust auth, and
then ``stop()`` / ``start()`` it at will. Everything is removed again by ``close()``.

PostgreSQL refuses to run as root, so when the tests run as root the server commands run as the
``postgres`` user (``runuser -u postgres --``) in a directory that user owns. The binaries come
from ``$KMQ_PG_BIN`` (a directory with ``initdb`` and ``pg_ctl``), else the newest
``/usr/lib/postgresql/*/bin``, else ``$PATH``.

Example::

    with PrivatePostgres() as pg:
        url = pg.create_database()      # postgresql+asyncpg://postgres@127.0.0.1:<port>/<db>
        pg.stop()                       # the outage
        pg.start()                      # and back, same port, same data
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

PG_BIN_ENV = "KMQ_PG_BIN"
_RUN_AS = "postgres"

StopMode = Literal["smart", "fast", "immediate"]


class PrivatePostgresError(RuntimeError):
    """The private server could not be set up, started or stopped (with its log tail)."""


def find_pg_bin() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``."""
    override = os.environ.get(PG_BIN_ENV, "").strip()
    if override:
        return Path(override)
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)] or [0],
    )
    for candidate in reversed(versions):
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    raise PrivatePostgresError(
        "no PostgreSQL server binaries (initdb, pg_ctl) found: install PostgreSQL or set "
        f"{PG_BIN_ENV}=/path/to/postgresql/bin"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrivatePostgres:
    """One throwaway PostgreSQL server (data directory, port, log) owned by the caller."""

    def __init__(self, *, port: int | None = None, base_dir: Path | None = None) -> None:
        self.bin = find_pg_bin()
        self.port = port or _free_port()
        self._base_dir = base_dir
        self.root: Path | None = None
        self.data_dir: Path | None = None
        self.log_path: Path | None = None
        self._as_other_user = os.geteuid() == 0
        self._initialized = False

    # -- lifecycle ----------------------------------------------------------------------------

    def init(self) -> None:
        """``initdb`` a fresh cluster (trust auth, no fsync: a test server)."""
        if self._initialized:
            return
        root = Path(tempfile.mkdtemp(prefix="kmq-private-pg-", dir=self._base_dir))
        self.root = root
        self.data_dir = root / "data"
        self.log_path = root / "server.log"
        if self._as_other_user:
            user = pwd.getpwnam(_RUN_AS)
            os.chown(root, user.pw_uid, user.pw_gid)
        root.chmod(0o700)
        self._run(
            [
                str(self.bin / "initdb"),
                "--pgdata",
                str(self.data_dir),
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ],
            what="initdb",
            timeout=120,
        )
        self._initialized = True

    def start(self, within: float = 60.0) -> None:
        """Start the server (initializing it first if needed) and wait until it accepts."""
        self.init()
        assert self.data_dir is not None
        assert self.root is not None
        options = " ".join(
            [
                "-c listen_addresses=127.0.0.1",
                f"-c port={self.port}",
                f"-c unix_socket_directories={self.root}",
                "-c fsync=off",
                "-c full_page_writes=off",
                "-c max_connections=50",
                "-c shared_buffers=32MB",
            ]
        )
        self._run(
            [
                str(self.bin / "pg_ctl"),
                "start",
                "--pgdata",
                str(self.data_dir),
                "--log",
                str(self.log_path),
                "--options",
                options,
                "--wait",
                "--timeout",
                str(int(within)),
            ],
            what="pg_ctl start",
            timeout=within + 10,
        )
        self._wait_accepting(within)

    def stop(self, mode: StopMode = "fast", within: float = 60.0) -> None:
        """Stop the server: ``fast`` (disconnect everyone, clean shutdown) or ``immediate``
        (like a crash: no shutdown checkpoint, recovery at the next start)."""
        if not self.running:
            return
        assert self.data_dir is not None
        self._run(
            [
                str(self.bin / "pg_ctl"),
                "stop",
                "--pgdata",
                str(self.data_dir),
                "--mode",
                mode,
                "--wait",
                "--timeout",
                str(int(within)),
            ],
            what=f"pg_ctl stop -m {mode}",
            timeout=within + 10,
        )

    def close(self) -> None:
        """Stop the server (immediately) and remove its directory. Idempotent."""
        try:
            if self._initialized:
                with contextlib.suppress(PrivatePostgresError):
                    self.stop("immediate")
        finally:
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)
                self.root = None
            self._initialized = False

    @property
    def running(self) -> bool:
        """Whether the postmaster is up (its pid file names a live process)."""
        if self.data_dir is None:
            return False
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- databases ----------------------------------------------------------------------------

    def url(self, database: str = "postgres") -> str:
        """``postgresql+asyncpg://postgres@127.0.0.1:<port>/<database>``."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """Create a database (``kmq_<hex>`` by default); returns its asyncpg URL."""
        name = name or f"kmq_{secrets.token_hex(4)}"
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"database name {name!r}: use lower-case letters, digits and _")
        self.psql(f"CREATE DATABASE {name}")
        return self.url(name)

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run one SQL command with ``psql`` (as the server's superuser); returns its output."""
        return self._run(
            [
                str(self.bin / "psql"),
                "--no-psqlrc",
                "--quiet",
                "--tuples-only",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--username",
                "postgres",
                "--dbname",
                database,
                "--command",
                sql,
            ],
            what="psql",
            timeout=60,
            as_server_user=False,
        )

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "<no server log>"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    # -- internals ----------------------------------------------------------------------------

    def _run(
        self, command: list[str], *, what: str, timeout: float, as_server_user: bool = True
    ) -> str:
        if as_server_user and self._as_other_user:
            command = ["runuser", "-u", _RUN_AS, "--", *command]
        env = {**os.environ, "LC_ALL": "C", "PGTZ": "UTC"}
        env.pop("PGDATA", None)
        try:
            result = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env=env,
                cwd=str(self.root) if self.root is not None else None,
            )
        except subprocess.TimeoutExpired as exc:
            raise PrivatePostgresError(
                f"{what} did not finish within {timeout:.0f}s\n{self.log_tail()}"
            ) from exc
        if result.returncode != 0:
            raise PrivatePostgresError(
                f"{what} failed with code {result.returncode}: {result.stderr.strip()}\n"
                f"--- {self.log_path} ---\n{self.log_tail()}"
            )
        return result.stdout

    def _wait_accepting(self, within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise PrivatePostgresError(
                        f"the private server on port {self.port} does not accept connections: "
                        f"{exc}\n{self.log_tail()}"
                    ) from exc
            time.sleep(0.05)
