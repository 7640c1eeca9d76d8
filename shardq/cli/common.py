"""What every client command shares: where the service is, the config file, output helpers,
the parser class with shardq's error form and the guard that turns an error into its line
and exit code (main.py and worker.py's own entry point both use them)."""
from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from .. import config as config_mod
from ..errors import ShardqError
from . import exits

if TYPE_CHECKING:
    from ..client.contracts import Control
    #: what ``register(sub, parent)`` of each command module adds its parsers to
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_CONFIG = "config/shardq.toml"


def stoppable_while_starting(name: str, body: Callable[[], int]) -> int:
    """Run a long-running command's ``body`` so that a SIGTERM/SIGINT before its loop takes
    the signals over (while it imports, connects, opens its store) is a clean stop, exit 0,
    as one while it runs is (:func:`shardq.stopping.stop_while_starting`)."""
    from ..stopping import StopBeforeStart, restore_signals, stop_while_starting
    old = stop_while_starting()
    try:
        return body()
    except StopBeforeStart as e:
        print(f"{name}: {e} while starting: stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        restore_signals(old)


def common_parser() -> argparse.ArgumentParser:
    """``--config`` and ``--data-dir`` (alias ``--connect``), for every command that needs
    the service: one flag name and one default everywhere."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", help=f"TOML config (default {DEFAULT_CONFIG} if present)")
    p.add_argument("--data-dir", "--connect", dest="data_dir", metavar="DATA_DIR",
                   help="the service's data dir (default: the config's service.data_dir)")
    return p


def load_config(path: str | None) -> config_mod.Config:
    """The config named by ``--config``; else config/shardq.toml if present; else defaults."""
    if path is None:
        return config_mod.load(DEFAULT_CONFIG) if os.path.exists(DEFAULT_CONFIG) else config_mod.Config()
    return config_mod.load(path)


def config_source(path: str | None) -> str:
    """Which config :func:`load_config` reads, in words (for the startup log)."""
    if path is not None:
        return os.path.abspath(path)
    return os.path.abspath(DEFAULT_CONFIG) if os.path.exists(DEFAULT_CONFIG) else "built-in defaults (no file)"


def target(args: argparse.Namespace) -> str:
    """Where the service is: ``--data-dir``, else the config's ``service.data_dir``."""
    return args.data_dir or load_config(args.config).service.data_dir


def service_dir(args: argparse.Namespace) -> str:
    """:func:`target`, for a command that uses a service's data dir (not ``serve``, which
    makes one, nor ``restore``, which writes one): NotADataDir (exit 5) naming the path when
    it is a file, or below one, rather than an OSError from deep inside the command. A missing
    directory is left to the command (``NotADataDir: ... no shardq.json``, as before); a
    backend's URL (``sqs://``) passes."""
    from ..backends import for_target
    from ..errors import NotADataDir
    path = target(args)
    if for_target(path) is not None or os.path.isdir(path):
        return path
    where = "--data-dir" if args.data_dir else "the config's service.data_dir"
    if os.path.lexists(path):
        raise NotADataDir(f"{os.path.abspath(path)} is not a shardq data dir: it is a file, not a directory "
                          f"({where} names the directory shardq serve runs on)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADataDir(f"{os.path.abspath(path)} is not a shardq data dir: {parent} is a file, not a "
                          f"directory ({where} names the directory shardq serve runs on)")
    return path


def local_only(path: str, command: str) -> str:
    """``path``, for a command that works only on the local shards' data dir (``serve``,
    ``console``, ``backup``, ``restore``, ``wal check``, ``schedules``): a backend's URL
    (``sqs://``) is :func:`unsupported` naming ``command``, before anything is read or made,
    rather than taken as a directory's name."""
    from ..backends import for_target
    backend = for_target(path)
    if backend is not None:
        raise unsupported(command, backend.__name__)
    return path


def local_service_dir(args: argparse.Namespace, command: str) -> str:
    """:func:`service_dir`, for a command that works only on the local shards
    (:func:`local_only`)."""
    return local_only(service_dir(args), command)


def check_dir_arg(path: str, flag: str, *, create: bool) -> None:
    """A directory the command line names, checked at its edge: UsageError (exit 2) naming
    ``flag`` and ``path`` when it is something else than a directory, or (``create``) when it
    cannot be created, rather than an OSError from deep inside the command."""
    from ..errors import UsageError
    if os.path.isdir(path):
        return
    if os.path.lexists(path):
        raise UsageError(f"{flag} {path}: not a directory")
    if not create:
        raise UsageError(f"{flag} {path}: no such directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create this directory: {e.strerror}") from None


def no_such_job(job_id: object) -> Exception:
    """The one error of every command that names a job that does not exist (``job show``,
    ``job cancel``, ``ack``, ``nack``): NotFound, exit 2, this text. The service cannot tell a
    job that never was from one that has ended, so neither does the message."""
    from ..errors import NotFound
    return NotFound(f"no such job: {job_id} (never enqueued, or finished, cancelled or purged since)")


@contextlib.contextmanager
def naming_a_job(job_id: object) -> Iterator[None]:
    """Around a command's calls on one job: the service's ways of saying that the job does
    not exist (NotFound; JobGone, an ack's or nack's) become :func:`no_such_job`. A lease
    that is not current (LeaseLost, Cancelled) is not that, and passes."""
    from ..errors import JobGone, NotFound
    try:
        yield
    except (NotFound, JobGone):
        raise no_such_job(job_id) from None


def connect(args: argparse.Namespace, **router_options: Any) -> Any:
    """A client of the service the command line names (a Queue; typed Any, since commands
    use it as a context manager and reach the router's own calls through :func:`control_call`)."""
    import shardq
    return shardq.connect(service_dir(args), **router_options)


def number(text: str) -> float:
    """argparse type for seconds: refuses what is not a number (argparse then exits 2)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def job_id(text: str) -> int | str:
    """argparse type of every job id argument (``job``, ``ack``, ``nack``, ``dead-letters
    --id``): ASCII digits are a local shards' job id, checked as the router does (``not a
    job id: '...'``, or the range past 2**63 - 1: the same error from each command); other
    text is kept for a backend whose ids are text (an SQS message id), and
    :func:`check_local_ids` refuses it on the local shards the same way. Named ``job id``
    (argparse shows a type's ``__name__`` when it fails)."""
    from ..client.routing import job_id_from_text
    from ..errors import InvalidJob
    if not (text.isascii() and text.isdigit()):
        return text
    try:
        return job_id_from_text(text)
    except InvalidJob as e:
        raise argparse.ArgumentTypeError(str(e)) from None


job_id.__name__ = "job id"


def lease_token(text: str) -> int | str:
    """argparse type of a lease's token (``ack``, ``nack``): as :func:`job_id`, a number on
    the local shards (below 2**63), text on a backend whose tokens are text."""
    if not (text.isascii() and text.isdigit()):
        return text
    if len(text) > 19:
        raise argparse.ArgumentTypeError(not_a("lease token", text))
    if int(text) >= 2**63:
        raise argparse.ArgumentTypeError(f"token must be an integer in [0, 2**63 - 1], got {text}")
    return int(text)


lease_token.__name__ = "lease token"


def not_a(what: str, text: str) -> str:
    """The one text of a job id or token that is not one: ``not a job id: '...'``."""
    return f"not a {what}: {text!r:.40}"


def check_local_ids(args: argparse.Namespace, command: str, **named: object) -> None:
    """On the local shards (not another backend's URL) every job id and token is a number:
    UsageError with the text and form of a bad command line's (``argument job_id: not a job
    id: 'abc' (see shardq ack --help)``), before anything is sent. ``named``: argument name
    -> value (a list for a repeated flag); a job id unless the name says token."""
    from ..backends import for_target
    from ..errors import UsageError
    if for_target(target(args)) is not None:
        return
    for name, value in named.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                what = "lease token" if name == "token" else "job id"
                raise UsageError(f"argument {name}: {not_a(what, v)} (see shardq {command} --help)")


def body_fields(body: bytes, raw: bool = False, limit_bytes: int | None = None) -> dict[str, Any]:
    """A job body as the JSON field that fits it, one of three:

    * ``{"task": {"name", "args", "kwargs"}}``: a task body (shardq's msgpack format), decoded;
    * ``{"body": text}``: a body that is UTF-8 text;
    * ``{"body_base64": ...}``: any other body, or every body with ``raw``: its exact bytes.

    ``limit_bytes`` shows only the first that many bytes of a text or base64 body (never
    cutting a character); a task body is shown whole, since a part cannot be decoded."""
    if not raw:
        from ..tasks import body as taskbody
        task = taskbody.describe(body)
        if task is not None:
            return {"task": task}
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            if limit_bytes is not None and len(body) > limit_bytes:
                # the body is valid UTF-8, so only a character cut at the end can fail: drop it
                text = body[:limit_bytes].decode("utf-8", "ignore")
            return {"body": text}
    shown = body if limit_bytes is None else body[:limit_bytes]
    return {"body_base64": base64.b64encode(shown).decode("ascii")}


def add_raw_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw", action="store_true",
                   help="print each body's exact bytes as body_base64, undecoded (default: a task "
                        "body decoded as task, UTF-8 text as body, anything else as body_base64)")


def shown(text: object, *, backslash: bool = True) -> str:
    """``text`` as a terminal may print it: a name, key or body of the service's (a queue
    name may hold any character) with each character that is not printable (control
    characters: ESC, BEL, a newline that would fake a row; other non-printables) escaped as
    ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u2028``), and (``backslash``) a backslash
    doubled, so that an escape reads as one; printable text, non-ASCII letters included, as
    it is. For every table and line the commands print (JSON output escapes them itself);
    an error's message, whose values are mostly ``repr``'s already, keeps its backslashes."""
    text = str(text)
    if text.isprintable() and not (backslash and "\\" in text):
        return text
    return "".join(c if c.isprintable() and not (backslash and c == "\\") else repr(c)[1:-1] for c in text)


def print_json(obj: object) -> None:
    print(json.dumps(obj, default=str), file=sys.stdout)


def control_call(q: object, call: str) -> Control:
    """``q`` as a client with the control calls (pause, resume, purge, cancel, job,
    dead_letters_page, set_limits: :class:`~shardq.client.contracts.Control`, the local
    shards' router's, not the Queue protocol's); else Unsupported, naming the ``call`` asked."""
    from ..client.contracts import Control
    if not isinstance(q, Control):
        raise unsupported(call, type(q).__name__)
    return q


def unsupported(call: str, backend: str) -> Exception:
    """The one error of a call or command that a backend cannot do (``pause`` on SQS,
    ``backup --connect sqs://...``): Unsupported, exit 2, ``<call>: not supported by the
    <backend> backend``."""
    from ..errors import Unsupported
    return Unsupported(f"{call}: not supported by the {backend} backend")


#: the levels ``--log-level`` names (any case); logging's aliases (WARN, FATAL) are taken too
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """argparse type of every ``--log-level`` (:func:`add_log_level`): a level's name, any
    case, returned in upper case as ``logging`` takes it; another is a bad command line
    (exit 2) naming the levels, not a ValueError from ``setLevel`` once the command runs."""
    import logging
    level = text.upper()
    if level not in logging.getLevelNamesMapping():
        raise argparse.ArgumentTypeError(f"not a log level: {text!r:.40} (one of {', '.join(LOG_LEVELS)}; "
                                         "any case)")
    return level


log_level.__name__ = "log level"


def add_log_level(p: argparse.ArgumentParser) -> None:
    """``--log-level``, the same flag wherever a command takes one (``worker``, ``outbox relay``)."""
    p.add_argument("--log-level", type=log_level, default="INFO", metavar="LEVEL",
                   help=f"the lowest level logged: {', '.join(LOG_LEVELS)} (any case; default INFO)")


class Parser(argparse.ArgumentParser):
    """argparse with shardq's error form: a bad command line prints one line
    ``error: UsageError: <message> (see <prog> --help)`` and exits 2, like every other
    error of the command (docs/operations.md, "Exit codes"), not argparse's usage block.
    Sub-commands are parsed by this class too (argparse makes subparsers of the parent's
    class)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: UsageError: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(exits.USAGE)


def run_guarded(fn: Callable[[], int]) -> int:
    """Run a command body; turn an error into one ``error:`` line and its exit code."""
    try:
        return fn()
    except ShardqError as e:  # a message may name the service's queues: escaped, one line
        print(f"error: {type(e).__name__}: {shown(e, backslash=False)}", file=sys.stderr)
        return exits.for_error(e)
    except BrokenPipeError:
        # The reader went away (`shardq stats | head`): what it wanted was delivered.
        # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.OK
    except OSError as e:
        print(f"error: {type(e).__name__}: {shown(e, backslash=False)}", file=sys.stderr)
        return exits.FAILURE
    except KeyboardInterrupt:
        return 130
