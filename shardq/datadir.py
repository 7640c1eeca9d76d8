"""The service's data directory: its layout, its metadata, its key file.

::

    <data>/shardq.json        {"format": 1, "shards": N, "id": ...}: N is fixed at creation
    <data>/authkey            HMAC key for client authentication (mode 0600)
    <data>/http-token         the HTTP listener's token when none is configured (mode 0600)
    <data>/run/shard-<i>.sock unix sockets (directory mode 0700)
    <data>/shard-<i>/         each shard's WAL segments and checkpoints, and its boot record
                              (boot.json: shard/boot_fence.py)
    <data>/supervisor.lock    held (flock) by the running supervisor; holds its PID

The data dir and run dir are created 0700 and the key file 0600. Refused with
:class:`~shardq.errors.AuthError`, each with the command that fixes it: a key file that is
a symlink, not a regular file, owned by another user, or open to the group or others; a run
dir that the group or others can read, enter or write (mode 0755 lets anyone list and reach
the sockets). Nothing is chmod-ed behind the operator's back.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
import time
from typing import Any

from . import limits
from .clock import Clock, SystemClock
from .config import HTTP_TOKEN_CHARS_MIN
from .errors import (AuthError, DataDirLocked, DataDirNotWritable, InvalidConfig, NotADataDir,
                     ServiceNotRunning, ShardCountMismatch)

META = "shardq.json"
FORMAT = 1
SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux, including the terminator
SUPERVISOR_LOCK = "supervisor.lock"
HTTP_TOKEN_FILE = "http-token"
# A supervisor takes its lock a few milliseconds after it creates the data dir; a client
# that finds the lock free looks again for this long before it says no service runs.
SERVICE_START_GRACE_S = 0.5
# A client's probe holds the lock shared for microseconds; a supervisor that meets one
# tries again for this long before it calls the data dir held.
LOCK_PROBE_WAIT_S = 0.2
_POLL_S = 0.01
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class DataDir:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.path.abspath(os.fspath(path))

    # layout
    @property
    def run_dir(self) -> str:
        return os.path.join(self.path, "run")

    def socket_path(self, index: int) -> str:
        return os.path.join(self.run_dir, f"shard-{index}.sock")

    def shard_dir(self, index: int) -> str:
        return os.path.join(self.path, f"shard-{index}")

    @property
    def key_path(self) -> str:
        return os.path.join(self.path, "authkey")

    @property
    def http_token_path(self) -> str:
        return os.path.join(self.path, HTTP_TOKEN_FILE)

    def http_token(self, create: bool = False) -> str:
        """The console token kept in ``<data>/http-token``; made (random, mode 0600) when
        ``create`` and it does not exist. Checked as the key file is: a symlink, another
        owner's file or one the group or others may read or change is refused (AuthError),
        since that token opens the console to whoever can read it."""
        path = self.http_token_path
        if create:
            try:  # O_EXCL: two starts never write two tokens; the mode is set at creation
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                pass
            except OSError as e:
                raise self._not_writable(e) from None
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(32) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                _sync_dir(self.path)
        token = _read_private(path, "token file", missing="start `shardq serve` on this data dir first",
                              symlink="delete it (serve makes a new one)",
                              mode_note=" (and so use the console)").decode("ascii", "replace")
        if len(token) < HTTP_TOKEN_CHARS_MIN:
            raise AuthError(f"token file {path} holds fewer than {HTTP_TOKEN_CHARS_MIN} "
                            "characters; delete it (serve makes a new one)")
        return token

    # creation and checks
    def init(self, shards: int) -> int:
        """Create the directory for ``shards`` shards, or check an existing one has that many.

        Returns the number of shards. Raises ShardCountMismatch if the directory was made
        for another number: per-key order depends on the key -> shard map.
        """
        if not 1 <= shards <= limits.SHARDS_MAX:
            raise InvalidConfig(f"shards: must be in [1, {limits.SHARDS_MAX}], got {shards}")
        try:
            return self._init(shards)
        except OSError as e:
            raise self._not_writable(e) from None

    def _init(self, shards: int) -> int:
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        if not os.path.isdir(self.run_dir):
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            os.chmod(self.run_dir, 0o700)  # whatever the umask; an existing one is checked instead
        if len(self.socket_path(shards - 1).encode()) > SOCKET_PATH_MAX:
            raise InvalidConfig(f"data_dir: {self.path!r} is too long for unix socket paths "
                                f"(at most {SOCKET_PATH_MAX} bytes in all); use a shorter path")
        meta = os.path.join(self.path, META)
        if os.path.exists(meta):
            existing = self.shards()
            if existing != shards:
                raise ShardCountMismatch(
                    f"{self.path} was created with {existing} shards; starting with {shards} would "
                    f"move keys between shards and break per-key order. Start with --shards {existing}.")
        else:
            tmp = meta + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"format": FORMAT, "shards": shards, "id": secrets.token_hex(8)}, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, meta)
            _sync_dir(self.path)
        self._ensure_key()
        return shards

    def exists(self) -> bool:
        return os.path.exists(os.path.join(self.path, META))

    def _meta(self) -> dict[str, Any]:
        """The data dir's ``shardq.json``, checked: InvalidConfig naming the file if it is
        damaged (not JSON, not an object, a shard count or id of the wrong kind)."""
        path = os.path.join(self.path, META)
        try:
            with open(path, "rb") as f:
                meta = json.loads(f.read())
        except FileNotFoundError:
            raise NotADataDir(f"{self.path} is not a shardq data dir (no {META}); "
                                "start `shardq serve` on it first") from None
        except NotADirectoryError:  # (a file, or a path below one: not a raw OSError)
            raise NotADataDir(f"{self.path} is not a shardq data dir: it is not a directory") from None
        except ValueError as e:  # (JSONDecodeError, and UnicodeDecodeError: bytes that are no JSON text)
            raise _damaged(path, f"not JSON: {e}") from None
        if not isinstance(meta, dict):
            raise _damaged(path, f"a JSON {type(meta).__name__}, not an object")
        if meta.get("format") != FORMAT:
            raise InvalidConfig(f"{self.path}: unsupported format {meta.get('format')!r}")
        shards = meta.get("shards")
        if type(shards) is not int or not 1 <= shards <= limits.SHARDS_MAX:
            raise _damaged(path, f"'shards' is {shards!r}, not an int in [1, {limits.SHARDS_MAX}]")
        if not isinstance(meta.get("id", ""), str):
            raise _damaged(path, f"'id' is {meta['id']!r}, not a string")
        return meta

    def shards(self) -> int:
        return int(self._meta()["shards"])

    def service_id(self) -> str | None:
        """A random id made when the data dir was created. Job ids start again in a new
        data dir; this tells the two apart (see IdempotencyStore.bind)."""
        return self._meta().get("id")

    def _ensure_key(self) -> None:
        if os.path.exists(self.key_path):
            return
        fd = os.open(self.key_path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        os.rename(self.key_path + ".tmp", self.key_path)
        _sync_dir(self.path)

    def authkey(self) -> bytes:
        """The key, after checking nobody but the owner can read or change it or the sockets.

        The key file is opened without following a symlink (``O_NOFOLLOW``) and checked on
        the open descriptor (``fstat``), so it cannot be swapped between check and read."""
        self._check_run_dir()
        key = _read_private(self.key_path, "key file", missing="is the service initialised?",
                            symlink="replace it with the file itself (mode 0600)")
        if len(key) < 16:
            raise AuthError(f"key file {self.key_path} is too short")
        return key

    def _check_run_dir(self) -> None:
        try:
            st = os.stat(self.run_dir)
        except FileNotFoundError:
            raise AuthError(f"no socket dir at {self.run_dir}; is the service initialised?") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthError(f"refusing socket dir {self.run_dir}: mode {stat.S_IMODE(st.st_mode):04o} lets "
                            "others list, reach or replace the sockets; run chmod 700 on it")

    def _not_writable(self, e: OSError) -> OSError | DataDirNotWritable:
        """``e`` as DataDirNotWritable when the file system or permissions refused a write."""
        if e.errno not in _NOT_WRITABLE:
            return e
        return DataDirNotWritable(f"the data dir {self.path} must be writable by this user "
                                  f"(uid {os.geteuid()}): {e.strerror}: {e.filename or self.path}")

    def lock(self, name: str, clock: Clock | None = None) -> int:
        """Take an exclusive lock file and write this process's PID into it, or raise
        DataDirLocked naming the PID of the process that holds it (after a short wait, timed
        by ``clock``'s monotonic reading, the system clock by default)."""
        clock = clock or SystemClock()
        path = os.path.join(self.path, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise self._not_writable(e) from None
        deadline = clock.monotonic() + LOCK_PROBE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if clock.monotonic() >= deadline:
                    holder = _pid_in(fd)
                    os.close(fd)
                    who = f" (pid {holder})" if holder else ""
                    raise DataDirLocked(f"{path} is held by another running process{who}") from None
            time.sleep(_POLL_S)  # polling a lock a client's probe holds for microseconds
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise self._not_writable(e) from None
        return fd

    def service_running(self) -> bool | None:
        """Whether a supervisor holds this data dir's lock; None if no supervisor ever ran
        on it (no lock file). A shared, non-blocking flock probe: it changes nothing, and a
        supervisor starting meanwhile waits it out (:meth:`lock`)."""
        try:
            fd = os.open(os.path.join(self.path, SUPERVISOR_LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # releases the shared lock, if it was taken
        return False

    def require_service(self, grace_s: float = SERVICE_START_GRACE_S, clock: Clock | None = None) -> None:
        """Return at once if a service runs on this data dir; raise ServiceNotRunning,
        within ``grace_s``, if its supervisor lock stays free. The router and the asyncio
        client call it when they are created, so a command against a stopped service fails
        in under a second instead of retrying for ``retry_s``. A data dir no supervisor has
        served yet (no lock file: one being created now, or shards a test runs alone) is
        left to the client's own retrying. ``grace_s`` is timed by ``clock`` (the system clock
        by default)."""
        clock = clock or SystemClock()
        deadline = clock.monotonic() + grace_s
        while self.service_running() is False:
            if clock.monotonic() >= deadline:
                raise ServiceNotRunning(f"no shardq service is running on {self.path}: start it with "
                                        f"shardq serve --data-dir {self.path}")
            time.sleep(_POLL_S)  # a polled deadline: a supervisor may be taking its lock now


def _read_private(path: str, what: str, *, missing: str, symlink: str, mode_note: str = "") -> bytes:
    """The stripped content of a secret file (the key file, the console's token), read only
    if it is a regular file of this user that nobody else may read or change. The checks are
    made on the open descriptor (``fstat``), so the file cannot be swapped between check and
    read; AuthError names the file and the fix."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise AuthError(f"no {what} at {path}; {missing}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AuthError(f"refusing {what} {path}: it is a symlink; {symlink}") from None
        raise AuthError(f"cannot open {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"refusing {what} {path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise AuthError(f"refusing {what} {path}: owned by uid {st.st_uid}, not by this "
                            f"user (uid {os.geteuid()}); run shardq as its owner or chown it")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthError(f"refusing {what} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets "
                            f"others read or change it{mode_note}; run chmod 600 on it")
        return os.read(fd, 4096).strip()
    finally:
        os.close(fd)


def _pid_in(fd: int) -> int | None:
    """The PID a lock file holds, as :meth:`DataDir.lock` wrote it (None if not readable)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _damaged(path: str, why: str) -> InvalidConfig:
    return InvalidConfig(f"{path} is damaged ({why}); it holds the shard count and the service id "
                         "(docs/operations.md, \"The data dir\"): restore it from a backup")


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
