"""Run a document's examples as a new user would: in a copy of the repo layout, against a real
``shardq serve`` on the default config.

The sandbox (one per document) is a short temporary directory holding ``config/`` (copied
from the repo), ``.venv`` (a link to the venv running the tests, so ``.venv/bin/shardq`` and
``.venv/bin/python`` work) and, once the service runs, ``var/shardq``. Its service is
``.venv/bin/shardq serve`` started there with no flags, exactly as the README says.
Examples run with that directory as cwd and ``PYTHONPATH`` pointing at the code under test.
One thing differs from the reader's machine: the sandbox's HTTP listener is on a free port of
its own (``SHARDQ_HTTP_LISTEN``), and every ``127.0.0.1:7781`` (the default ``http.listen``) in
an example and its output is read as that port. A service the reader already runs (the
README's first command) holds 7781, and so may another sandbox.

How each block is run (markers: see :mod:`doc_blocks`):

* ``sh``/``bash``: one ``bash -e -o pipefail`` script; its exit status must be the
  ``<!-- exit N -->`` marker's N (default 0) and its output (stdout and stderr, as a
  terminal shows them) must match a following ``<!-- output -->`` block, if any.
* ``console``: one bash session; each ``$ `` line is a command, the lines up to the next
  ``$ `` are its output (``...`` matches anything); every command must exit 0 (to show a
  failure, end the command with ``; echo "exit $?"``).
* ``python``: one program, run with ``.venv/bin/python -c`` (cwd on ``sys.path``); exit
  status and output as for ``sh``. Each block stands alone: names do not carry over from
  an earlier block, but the service's jobs do.
* ``toml``: not run; it must be a (partial) shardq config: ``shardq.config.parse`` accepts it.
* a block the text names as a file (``Save this as `PATH`:`` right above it, see
  :mod:`doc_blocks`): written to PATH in the sandbox at its place.
* anything else (``text``, ``json``, no language...): not run.

Long-running commands: a line of a ``sh`` block that runs ``shardq serve`` or
``shardq worker`` in the foreground (no ``&``, no ``--help``, for a worker no ``--burst``:
that one ends by itself and runs as any command) would never end, so such a block
must hold only such lines. Each is started on its own, waited for until its process catches
SIGTERM (``serve``: after every shard is ready; ``worker``: once it runs), and, for a worker,
until the queue it names has nothing ready or in flight (it did the work the document gave
it); then it gets SIGTERM and must exit 0 leaving no process behind. Before a ``serve`` line
the sandbox's own service is stopped (it holds ``var/shardq``) and it is started again after
the block, on the same data dir.

Environment steps: ``python3 -m venv .venv``, ``.venv/bin/pip install -q -e .`` (or
``'.[test]'``) and ``bash .ci/setup-system`` at the start of a line or of a ``&&`` chain are
what the test session already did to run at all; they are dropped.

Every process a block starts runs in a session of its own; when the block ends, whatever
is left in that session is ended by PID (SIGTERM, then SIGKILL).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib

import psutil

from support.doc_blocks import Block, matches
from support.service import poll_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 60.0
DEFAULT_LISTEN = "127.0.0.1:7781"  # http.listen's default (docs/operations.md); a test keeps them equal

_GIVEN = re.compile(r"^(?:python3 -m venv \.venv|\.venv/bin/pip install -q -e (?:\.|'\.\[test\]')"
                    r"|bash \.ci/setup-system)\s*(?:&&\s*|$)")


class ExampleFailed(AssertionError):
    pass


def given_steps_dropped(line: str) -> str:
    """``line`` without the leading environment steps the test session already took."""
    while m := _GIVEN.match(line):
        line = line[m.end():]
    return line


def logical_lines(text: str) -> list[str]:
    """Lines with ``\\`` continuations joined; blank and comment-only lines left out."""
    out, cur = [], ""
    for raw in text.splitlines():
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def long_running(line: str) -> str | None:
    """``"serve"`` or ``"worker"`` if ``line`` runs one in the foreground, else None."""
    try:
        words = list(shlex.shlex(line, posix=True, punctuation_chars=True))
    except ValueError:
        return None
    if "--help" in words or (words and words[-1] == "&"):
        return None
    if "--burst" in words and "worker" in words:
        return None  # it exits 0 once its queues are drained: an ordinary command
    for i, w in enumerate(words[:-1]):
        program = os.path.basename(w) == "shardq" or (
            w in ("shardq", "shardq.cli") and i > 0 and words[i - 1] == "-m")
        if program and words[i + 1] in ("serve", "worker"):
            return words[i + 1]
    return None


def check_config_block(block: Block) -> None:
    """A ``toml`` block must be a shardq config (every key is optional)."""
    from shardq import config
    try:
        config.parse(tomllib.loads(block.text))
    except Exception as e:  # noqa: BLE001 - any parse error fails the example with its text
        raise ExampleFailed(f"{block.where}: not a valid shardq config: {type(e).__name__}: {e}\n"
                            f"{block.text}") from None


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler (``SigCgt`` in /proc): it is safe to stop."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        pass
    return False


def session_pids(sid: int) -> list[int]:
    pids = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return pids


def end_session(sid: int, grace_s: float = 5.0) -> list[int]:
    """End every process left in session ``sid``, by PID; returns the PIDs that were left."""
    left = session_pids(sid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if poll_until(lambda: not session_pids(sid), time.monotonic() + grace_s, 0.02):
            break
    return left


class Sandbox:
    """A copy of the repo layout with its own ``shardq serve``. Use as a context manager."""

    def __init__(self, service: bool = True):
        self.base = tempfile.mkdtemp(prefix="sqdoc", dir="/tmp")  # short: socket paths
        self.root = os.path.join(self.base, "repo")
        os.makedirs(self.root)
        shutil.copytree(os.path.join(REPO, "config"), os.path.join(self.root, "config"))
        _link_venv(os.path.join(self.root, ".venv"))
        self.env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        PYTHONUNBUFFERED="1")
        self.env.pop("PYTHONSAFEPATH", None)
        self.listen = f"127.0.0.1:{_free_port()}"  # the sandbox's HTTP listener (see the module doc)
        self.env["SHARDQ_HTTP_LISTEN"] = self.listen
        self.want_service = service
        self.service: subprocess.Popen | None = None
        self.service_log = os.path.join(self.base, "serve.log")
        self.stop_codes: list[int | None] = []  # every exit status of the sandbox's service
        self._client = None

    # ---------------------------------------------------------------- the service
    def start_service(self) -> None:
        with open(self.service_log, "ab") as log:
            self.service = subprocess.Popen([self.path(".venv/bin/shardq"), "serve"], cwd=self.root,
                                            env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        service = self.service
        if not poll_until(lambda: service.poll() is not None or catches_sigterm(service.pid),
                          time.monotonic() + READY_TIMEOUT_S, 0.02) or service.poll() is not None:
            self.stop_service()
            raise ExampleFailed(f"`.venv/bin/shardq serve` did not start:\n{self.service_tail()}")

    def stop_service(self) -> None:
        """SIGTERM the supervisor, record its exit status, end whatever it left by PID."""
        if self.service is None:
            return
        if self._client is not None:
            self._client.close()
            self._client = None
        proc, self.service = self.service, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        left = end_session(proc.pid)
        self.stop_codes.append(None if left else proc.poll())

    def service_tail(self, n: int = 20) -> str:
        try:
            with open(self.service_log, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def client(self):
        """A router to the sandbox's service, kept for the sandbox's life."""
        if self._client is None:
            import shardq
            self._client = shardq.connect(self.path("var/shardq"), retry_s=10)
        return self._client

    # ---------------------------------------------------------------- blocks
    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def run(self, block: Block) -> None:
        """Do what ``block`` asks (see the module docstring); ExampleFailed if it fails."""
        if block.illustration or block.is_output:
            return
        block = self._here(block)
        if block.file is not None:
            dest = self.path(block.file)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "w") as f:
                f.write(block.text)
            return
        if block.lang == "toml":
            check_config_block(block)
            return
        if not block.runnable:
            return
        if block.lang in ("sh", "bash"):
            lines = [l for l in map(given_steps_dropped, logical_lines(block.text)) if l]
            kinds = [long_running(l) for l in lines]
            if any(kinds):
                if not all(kinds) or block.exit_code:
                    raise ExampleFailed(f"{block.where}: a block that runs `shardq serve` or "
                                        f"`shardq worker` in the foreground must hold only such "
                                        f"lines, and they must exit 0 on SIGTERM")
                self._run_long_block(block, lines)
                return
        self._ensure_service()
        if block.lang in ("sh", "bash"):
            script = "set -eo pipefail\n" + "\n".join(given_steps_dropped(l) for l in block.text.splitlines())
            rc, out = self._call(["bash", "-c", script], block)
        elif block.lang == "python":
            rc, out = self._call([self.path(".venv/bin/python"), "-c", block.text], block)
        else:
            self._run_console(block)
            return
        if rc != block.exit_code:
            raise ExampleFailed(f"{block.where}: exit status {rc}, the document says {block.exit_code}"
                                + _show(block.text, out))
        if block.output is not None and not matches(block.output.text, out):
            raise ExampleFailed(f"{block.where}: output does not match {block.output.where}"
                                + _show(block.text, out, block.output.text))

    def _here(self, block: Block) -> Block:
        """``block`` (and its output) with the default listener's address read as the sandbox's."""
        if DEFAULT_LISTEN not in block.text + (block.output.text if block.output else ""):
            return block
        output = block.output and dataclasses.replace(block.output,
                                                      text=block.output.text.replace(DEFAULT_LISTEN, self.listen))
        return dataclasses.replace(block, text=block.text.replace(DEFAULT_LISTEN, self.listen), output=output)

    def _call(self, argv: list[str], block: Block) -> tuple[int, str]:
        proc = subprocess.Popen(argv, cwd=self.root, env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            end_session(proc.pid)
            out, _ = proc.communicate()
            raise ExampleFailed(f"{block.where}: still running after {BLOCK_TIMEOUT_S:.0f} s"
                                + _show(block.text, out.decode(errors="replace"))) from None
        end_session(proc.pid)  # what it started in the background
        return proc.returncode, out.decode(errors="replace")

    def _run_console(self, block: Block) -> None:
        commands: list[tuple[str, list[str]]] = []
        for line in block.text.splitlines():
            if line.startswith("$ "):
                commands.append((line[2:], []))
            elif commands:
                commands[-1][1].append(line)
            elif line.strip():
                raise ExampleFailed(f"{block.where}: a console block starts with a `$ ` line")
        script = "exec 2>&1\n" + "".join(f"{cmd}\nprintf '\\036%d\\036' $?\n" for cmd, _ in commands)
        rc, out = self._call(["bash", "-c", script], block)
        parts = out.split("\036")
        for i, (cmd, expected) in enumerate(commands):
            if 2 * i + 1 >= len(parts):
                raise ExampleFailed(f"{block.where}: `{cmd}` did not finish" + _show(block.text, out))
            got, status = parts[2 * i], parts[2 * i + 1]
            if status != "0":
                raise ExampleFailed(f"{block.where}: `{cmd}` exited {status}" + _show(block.text, got))
            if not matches("\n".join(expected), got):
                raise ExampleFailed(f"{block.where}: output of `{cmd}` does not match"
                                    + _show(cmd, got, "\n".join(expected)))

    def _run_long_block(self, block: Block, lines: list[str]) -> None:
        serves = any(long_running(l) == "serve" for l in lines)
        if serves:
            self.stop_service()  # it holds var/shardq, which a `serve` line may want
        else:
            self._ensure_service()
        for line in lines:
            self._run_long(block, line)
        self._ensure_service()  # the sandbox's own, on the same data dir: later blocks see the jobs

    def _ensure_service(self) -> None:
        if self.service is not None and self.service.poll() is not None:
            code = self.service.returncode
            self.stop_service()
            raise ExampleFailed(f"the document's `shardq serve` exited ({code}) before this block:\n"
                                f"{self.service_tail()}")
        if self.want_service and self.service is None:
            self.start_service()

    def _run_long(self, block: Block, line: str) -> None:
        log_path = os.path.join(self.base, "long.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(["bash", "-c", line], cwd=self.root, env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

        def output() -> str:
            with open(log_path, "rb") as f:
                return f.read().decode(errors="replace")

        try:
            deadline = time.monotonic() + READY_TIMEOUT_S

            def ready():
                if proc.poll() is not None:
                    raise ExampleFailed(f"{block.where}: `{line}` exited {proc.returncode} before it "
                                        f"was ready" + _show(line, output()))
                main = _command_process(proc.pid)
                return main if main is not None and catches_sigterm(main.pid) else None
            main = poll_until(ready, deadline, 0.02)
            if main is None:
                raise ExampleFailed(f"{block.where}: `{line}` not ready after {READY_TIMEOUT_S:.0f} s"
                                    + _show(line, output()))
            if long_running(line) == "worker":
                self._wait_queue_settled(block, line, deadline)
            main.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                raise ExampleFailed(f"{block.where}: `{line}` did not exit within 30 s of SIGTERM"
                                    + _show(line, output())) from None
        finally:
            left = end_session(proc.pid)
        if rc != 0 or left:
            raise ExampleFailed(f"{block.where}: `{line}` exited {rc} on SIGTERM (0 expected)"
                                + (f", leaving processes {left}" if left else "") + _show(line, output()))

    def _wait_queue_settled(self, block: Block, line: str, deadline: float) -> None:
        """A worker did the document's work: its queue has nothing ready or in flight."""
        argv = shlex.split(line)
        queue = _flag(argv, "--queue") or "default"
        data_dir = _flag(argv, "--data-dir") or _flag(argv, "--connect")
        if data_dir is not None and os.path.abspath(self.path(data_dir)) != self.path("var/shardq"):
            return  # another service: nothing to look at
        counts: dict = {}

        def settled() -> bool:
            counts.clear()
            counts.update(self.client().stats()["queues"].get(queue, {}))
            return not counts.get("ready") and not counts.get("in_flight")
        if not poll_until(settled, deadline, 0.05):
            raise ExampleFailed(f"{block.where}: `{line}` left {counts} in queue {queue!r}")

    # ---------------------------------------------------------------- end
    def close(self) -> None:
        self.stop_service()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _command_process(pid: int) -> psutil.Process | None:
    """The process a ``bash -c LINE`` ended up running: bash itself once it has exec'd, else
    its only non-shell descendant at the top."""
    try:
        p = psutil.Process(pid)
        while p.name() in ("bash", "sh"):
            children = p.children()
            if len(children) != 1:
                return None
            p = children[0]
        return p
    except psutil.Error:
        return None


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _link_venv(dest: str) -> None:
    """``.venv`` in the sandbox: the venv running the tests, or one made of links to it."""
    if sys.prefix != sys.base_prefix and os.path.exists(os.path.join(sys.prefix, "bin", "shardq")):
        os.symlink(sys.prefix, dest)
        return
    bin_dir = os.path.join(dest, "bin")
    os.makedirs(bin_dir)
    for name in ("python", "python3"):
        os.symlink(sys.executable, os.path.join(bin_dir, name))
    script = os.path.join(bin_dir, "shardq")
    with open(script, "w") as f:
        f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m shardq "$@"\n')
    os.chmod(script, 0o755)


def _show(text: str, out: str, expected: str | None = None) -> str:
    s = f"\n--- example ---\n{text.rstrip()}\n--- output ---\n{out.rstrip()}"
    if expected is not None:
        s += f"\n--- expected ---\n{expected.rstrip()}"
    return s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
