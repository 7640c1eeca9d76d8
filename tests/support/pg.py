"""A real PostgreSQL server for tests: ``initdb`` + ``pg_ctl`` in a short temp dir.

The server listens on a unix socket in that dir and on a free 127.0.0.1 port, runs as the
``postgres`` OS user when the tests run as root (PostgreSQL refuses to run as root), and is
stopped by PID at the end. The ``pg`` fixture is session-scoped, so the suite starts one
server; ``pg_dsn`` gives each test a fresh database on it.

If no PostgreSQL binaries are found (``.ci/setup-system`` installs them) or the server does
not start, the tests that use it skip with the reason; nothing else makes them skip.
"""
from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile

import pytest

from support.service import wait_until


def find_bindir() -> str | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``: ``pg_config
    --bindir``, else the newest ``/usr/lib/postgresql/*/bin``."""
    candidates = []
    if shutil.which("pg_config"):
        try:
            out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=10)
            candidates.append(out.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                         key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0,
                         reverse=True)
    for d in candidates:
        if d and all(os.access(os.path.join(d, exe), os.X_OK) for exe in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """One PostgreSQL cluster in a temp dir. ``start()``, ``restart()``, ``stop()``."""

    def __init__(self, bindir: str):
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="pg", dir="/tmp")  # short: the socket path must fit
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "server.log")
        self.port = free_port()
        self.pid: int | None = None
        self.proc: subprocess.Popen | None = None
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no 'postgres' user to run the "
                                   "server as (PostgreSQL refuses root)") from None
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self._dbs = itertools.count(1)

    def _run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self._as_user + list(argv), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def init(self, fsync: bool = False) -> None:
        # Tests: fsync=off. They kill processes, never the machine, and a killed postmaster's
        # writes are in the page cache; crash recovery (WAL replay) still runs. The
        # benchmark passes fsync=True: commits are then as durable as SQLite's FULL.
        r = self._run(os.path.join(self.bindir, "initdb"), "-D", self.data, "-U", "postgres",
                      "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {r.stderr.strip() or r.stdout.strip()}")
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write(f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.dir}'\nfsync = {'on' if fsync else 'off'}\n"
                    "max_connections = 200\nshared_buffers = 32MB\n")

    def start(self, timeout: float = 60.0) -> PgServer:
        """Run the postmaster as a child (through ``runuser`` when root): a killed postmaster
        is then reaped at once, so the next start does not take its zombie for a live server."""
        log = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                self._as_user + [os.path.join(self.bindir, "postgres"), "-D", self.data],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        try:
            self.pid = wait_until(self._ready, timeout, 0.05, "PostgreSQL to accept connections")
        except BaseException:
            self.pid = self._postmaster_pid()
            self.kill()
            raise
        return self

    def _postmaster_pid(self) -> int | None:
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return int(f.readline())
        except (OSError, ValueError):
            return None

    def _ready(self) -> int | None:
        import psycopg
        if self.proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.tail()}")
        pid = self._postmaster_pid()
        if pid is None:
            return None
        try:
            psycopg.connect(self.dsn(), connect_timeout=2).close()
        except psycopg.OperationalError:
            return None
        return pid

    def kill(self) -> None:
        """A crash of the server: SIGKILL the postmaster and every process of the cluster."""
        pids = [self.pid] + _children(self.pid) if self.pid else []
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in pids:
            _wait_gone(pid)
        self.pid = None

    def restart(self) -> None:
        """Crash the server and start it again (WAL recovery runs), on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.pid is None:
            return
        # "Immediate" shutdown: the cluster is thrown away, so no checkpoint is worth waiting for.
        _signal(self.pid, signal.SIGQUIT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def dsn(self, dbname: str = "postgres", tcp: bool = False) -> str:
        host = "127.0.0.1" if tcp else self.dir
        return f"host={host} port={self.port} user=postgres dbname={dbname}"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_db(self) -> str:
        import psycopg
        name = f"t{os.getpid()}_{next(self._dbs)}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int) -> None:
    wait_until(lambda: not _alive(pid), 20, 0.02, f"process {pid} to exit")


def _children(pid: int) -> list[int]:
    try:
        import psutil
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - best effort: no psutil or a gone process means no children
        return []


@pytest.fixture(scope="session")
def pg():
    """The session's PostgreSQL server (skips the test with the reason if there is none)."""
    try:
        import psycopg  # noqa: F401 - imported only to see whether psycopg is installed
    except ImportError:
        pytest.skip("psycopg is not installed (pip install -e '.[test]')")
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (bash .ci/setup-system installs it)")
    try:
        server = PgServer(bindir)
    except RuntimeError as exc:
        pytest.skip(f"cannot run PostgreSQL here: {exc}")
    try:
        server.init()
        server.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        server.cleanup()
        pytest.skip(f"PostgreSQL did not start: {exc}")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def pg_dsn(pg) -> str:
    """A DSN (unix socket) of a fresh database on the session's server."""
    return pg.dsn(pg.create_db())
