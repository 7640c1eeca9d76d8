"""Claims in README.md and docs/*.md that are not examples: tables, synopses, defaults, links,
log lines, the data dir layout. Each test reads the claim from the document itself where it
can, so a document and the code cannot drift apart without a failure here.

Runnable examples are tested by test_docs.py; behaviour with tests of its own elsewhere
(exit codes: test_cli.py; guarantees under faults: test_chaos_faults.py, ...) is not
repeated here.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import glob
import os
import re
import shutil
import signal
import stat
import zlib

import pytest

from support import doc_blocks
from support.doc_runner import REPO
from support.service import Service, alive, restarted, short_tmpdir, wait_until


def doc(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def block_containing(path: str, needle: str) -> doc_blocks.Block:
    found = [b for b in doc_blocks.read(path, REPO) if needle in b.text]
    assert len(found) == 1, f"{path}: {len(found)} blocks hold {needle!r}"
    return found[0]


def subparsers(parser) -> dict:
    import argparse
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


# --------------------------------------------------------------------------- README
def test_the_readme_lists_every_command_and_each_has_help(capsys):
    from shardq.cli.main import build_parser
    listed = re.search(r"Other commands: `shardq ([^`]+)`", doc("README.md"))[1].split("|")
    commands = subparsers(build_parser())
    shown = {"serve", "worker"}  # the README's own examples
    assert {c.split()[0] for c in listed} | shown == set(commands)
    for line in listed:
        words = line.split()
        for path in [words] if words[0] != "wal" else [["wal", "check"], ["wal", "repair"]]:
            with pytest.raises(SystemExit) as e:
                (build_parser() if path[0] != "verify" else __import__("shardq.verify").verify.build_parser()
                 ).parse_args((path if path[0] != "verify" else []) + ["--help"])
            assert e.value.code == 0, path
    assert "usage:" in capsys.readouterr().out


def test_the_readme_test_command_is_what_ci_runs():
    block = block_containing("README.md", "pytest")
    assert block.illustration  # it runs the whole suite: CI runs it, not the docs test
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = [l.strip() for l in f if l.strip() and not l.startswith("#")]
    assert block.text.strip() in ci


@pytest.mark.parametrize("path", ["README.md"] + sorted(
    os.path.join("docs", n) for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md")))
def test_relative_links_and_named_files_exist(path):
    text = doc(path)
    base = os.path.dirname(os.path.join(REPO, path))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert os.path.exists(os.path.join(base, target)), f"{path}: link to {target}"
    for named in set(re.findall(r"`((?:tests|bench|shardq|docs|config|\.ci)/[\w./-]+?)(?:::\w+)?`", text)):
        assert os.path.exists(os.path.join(REPO, named)), f"{path}: names {named}"


@pytest.mark.parametrize("path", ["README.md"] + sorted(
    os.path.join("docs", n) for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md")))
def test_tests_named_in_the_text_exist(path):
    """reliability.md and others cite tests as evidence (`test_x.py::test_y`, `test_y`)."""
    sources = {os.path.basename(f): doc(os.path.relpath(f, REPO))
               for f in glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True)}
    text = doc(path)
    for file, name in re.findall(r"`(?:tests/(?:\w+/)?)?(test_\w+\.py)::(test_\w+)`", text):
        assert f"def {name}(" in sources.get(file, ""), f"{path}: {file}::{name}"
    for name in re.findall(r"`(test_\w+)`", text):
        assert any(f"def {name}(" in src for src in sources.values()), f"{path}: {name}"


def test_the_benchmark_commands_name_modules_and_flags_that_exist():
    blocks = [b for b in doc_blocks.read("docs/performance.md", REPO) if "-m bench." in b.text]
    assert blocks
    for block in blocks:
        for line in block.text.splitlines():
            m = re.search(r"-m (bench(?:\.\w+)+)(.*?)(?:#|$)", line)  # bench.run, bench.probes.call_floor
            if not m:
                continue
            src = doc(m[1].replace(".", "/") + ".py")
            for flag in re.findall(r"--[\w-]+", m[2]):
                negated = flag.startswith("--no-") and f'"--{flag[5:]}"' in src and "BooleanOptionalAction" in src
                assert f'"{flag}"' in src or negated, f"{m[1]} has no {flag}"
    assert "bench" in doc("pyproject.toml")


# --------------------------------------------------------------------------- operations.md
def test_a_key_goes_to_crc32_of_the_key_mod_n():
    from shardq.client.router import shard_for_key
    assert "`crc32(key) % N`" in doc("docs/operations.md")
    for key in ["user-42", "", "ключ", "k" * 512]:
        for n in (1, 2, 7, 1024):
            assert shard_for_key(key, n) == zlib.crc32(key.encode()) % n


def config_table() -> dict[str, str]:
    text = doc("docs/operations.md")
    section = text[text.index("## Configuration"):text.index("## Embedding the router")]
    rows = {}
    for keys, default in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", section, re.M):
        names = re.findall(r"`([\w.<>…]+)`", keys)
        if "<name>" in names[0]:
            continue  # keys of named tables (schedules.<name>.…): no fixed defaults
        defaults = [d.strip() for d in default.split(",")] if "," in keys else [default.strip()]
        for name, value in zip(names, defaults * len(names) if len(defaults) == 1 else defaults):
            if "<name>" not in name:
                rows[name] = value
    return rows


def test_the_config_table_names_every_key_with_its_default():
    from shardq.config import Config
    defaults = Config().to_dict()
    rows = config_table()
    schema = {f"{s}.{k}" for s in ("service", "limits", "queue_defaults", "http") for k in defaults[s]}
    schema.add("http.token")  # never in to_dict(): it must not reach shard command lines
    defaults["http"]["token"] = Config().http.token
    assert set(rows) == schema
    for name, shown in rows.items():
        section, key = name.split(".")
        value = defaults[section][key]
        if shown.endswith("MiB"):
            assert value == int(shown.split()[0]) * 2**20, name
        elif shown in ("true", "false"):
            assert value is (shown == "true"), name
        elif shown.startswith("`"):  # a literal: a string, or a list such as `[]`
            assert json.dumps(value) == shown.strip("`") or value == shown.strip("`"), name
        else:
            assert value == float(shown.replace(",", "")), name


def test_the_data_dir_layout_is_as_documented():
    text = doc("docs/operations.md")
    for line in ("var/shardq/shardq.json", "var/shardq/authkey", "var/shardq/run/shard-<i>.sock",
                 "var/shardq/shard-<i>/"):
        assert line in text
    with Service(shards=2) as svc:
        with open(os.path.join(svc.data_dir, "shardq.json")) as f:
            meta = json.load(f)
        assert (meta["format"], meta["shards"]) == (1, 2) and meta["id"]
        mode = lambda p: stat.S_IMODE(os.stat(os.path.join(svc.data_dir, p)).st_mode)  # noqa: E731 - a one-line local helper
        assert mode("authkey") == 0o600 and mode("run") == 0o700
        for i in range(2):
            assert stat.S_ISSOCK(os.stat(os.path.join(svc.data_dir, "run", f"shard-{i}.sock")).st_mode)
            assert any(n.endswith(".wal") for n in os.listdir(os.path.join(svc.data_dir, f"shard-{i}")))
    with Service(shards=1) as other:
        with open(os.path.join(other.data_dir, "shardq.json")) as f:
            assert json.load(f)["id"] != meta["id"]  # random per data dir


def test_the_log_lines_shown_are_what_serve_logs():
    """The start and restart lines of operations.md's log example, with every number, path
    and the leading ``...`` as wildcards, appear in a real service's log after a shard SIGKILL."""
    shown = block_containing("docs/operations.md", "event=spawn").text.splitlines()
    patterns = []
    for line in shown:
        if "event=shard-failed" in line or "disk full" in line:
            continue  # a corrupt log, a full disk: test_resilience_startup.py, test_resilience_disk_full.py
        p = re.escape(line.removeprefix("... "))
        p = re.sub(r"\d+(?:\\\.\d+)?", r"\\d+(?:\\.\\d+)?", p)
        p = re.sub(r"(?:\\?/[\w.\\-]+)+", r"\\S+", p)  # a path: the test's own
        patterns.append(re.compile(p))
    assert len(patterns) >= 5
    with Service(shards=2) as svc:
        pid = svc.shard_pids()[1]
        os.kill(pid, 9)
        restarted(svc, 1, pid)
        log = svc.tail(200)
    for p in patterns:
        assert p.search(log), f"no line like {p.pattern!r} in:\n{log}"


def test_serve_exits_0_on_sigint_and_at_once_on_a_second_signal():
    """operations.md: "SIGTERM or SIGINT: ... the supervisor exits 0. A second signal kills
    everything at once." (SIGTERM: every document's service in test_docs.py and
    test_supervisor.py; SIGKILL of the supervisor: test_supervisor.py.)"""
    with Service(shards=2) as svc:
        shards = svc.shard_pids()
        svc.proc.send_signal(signal.SIGINT)
        assert svc.proc.wait(30) == 0
        for pid in shards:
            wait_until(lambda: not alive(pid), 10, what=f"shard {pid} gone")
    with Service(shards=2) as svc:
        shards = svc.shard_pids()
        os.kill(shards[0], signal.SIGSTOP)  # the first signal's clean stop now waits for it
        svc.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "event=stopping" in svc.tail(), 10, what="the first signal taken")
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(5) == 1  # not the 10 s grace of a clean stop
        for pid in shards:
            wait_until(lambda: not alive(pid), 10, what=f"shard {pid} gone")


def test_open_takes_the_config_as_a_toml_path(tmp_path):
    """operations.md: "`shardq.open(..., config=...)` takes the same schema as a dict or a
    TOML path" (the dict: the doctest in shardq/__init__.py)."""
    import shardq
    assert "takes the same schema as a dict or a TOML path" in doc("docs/operations.md")
    cfg = tmp_path / "shardq.toml"
    cfg.write_text("[queue_defaults]\nmax_deliveries = 3\n[queues.emails]\nvisibility_timeout = 120\n")
    parent = short_tmpdir()  # short: socket paths
    try:
        with shardq.open(os.path.join(parent, "data"), shards=1, config=str(cfg)) as q:
            assert q.queue_config("default")["max_deliveries"] == 3
            emails = q.queue_config("emails")
            assert (emails["visibility_timeout"], emails["max_deliveries"]) == (120, 3)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_the_cli_synopsis_flags_exist():
    from shardq.cli.main import build_parser
    block = block_containing("docs/operations.md", "shardq enqueue BODY")
    commands = subparsers(build_parser())
    for line in block.text.splitlines():
        for part in line.split("#")[0].split(" ; "):
            words = part.split()
            if not words or words[0] != "shardq" or words[1] == "verify":
                continue
            if words[1].startswith("-"):  # a flag of shardq itself (--version)
                assert words[1] in build_parser()._option_string_actions, part
                continue
            parser = commands[words[1]]
            if words[1] == "wal":
                parser = subparsers(parser)[words[2]]
            options = set(parser._option_string_actions)
            for flag in re.findall(r"--[\w-]+", part):
                assert flag in options, f"{part.strip()}: {flag}"


def test_every_command_the_docs_show_names_flags_and_choices_that_exist():
    """Each `shardq COMMAND ...` span of the docs and the README: its flags exist for that
    command (verify's own parser for `shardq verify`), and a flag with choices is given one
    of them (the worker reference once told of a `--mode asyncio` the CLI refuses)."""
    import argparse

    from shardq.cli.main import build_parser
    from shardq.verify import build_parser as verify_parser
    commands = subparsers(build_parser())
    checked, wrong = 0, []
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)) + [
            os.path.join(REPO, "README.md")]:
        for span in re.findall(r"`([^`\n]+)`", doc(os.path.relpath(path, REPO))):
            words = span.split()
            if len(words) < 2 or words[0] not in ("shardq", ".venv/bin/shardq") or words[1] not in commands:
                continue
            parser = verify_parser() if words[1] == "verify" else commands[words[1]]
            nested = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
            if len(words) > 2 and words[2] in nested:
                parser = nested[words[2]]
            options = parser._option_string_actions
            for i, word in enumerate(words):
                flag, _, given = word.partition("=")
                if not re.fullmatch(r"--[a-z][\w-]*", flag):
                    continue
                checked += 1
                if flag not in options:
                    wrong.append(f"{path}: `{span}`: no {flag}")
                    continue
                value = given or (words[i + 1] if i + 1 < len(words) else "")
                choices = options[flag].choices
                if choices and re.fullmatch(r"[a-z][\w-]*", value) and value not in choices:
                    wrong.append(f"{path}: `{span}`: {flag} {value} is none of {sorted(choices)}")
    assert checked > 30 and not wrong, wrong


def test_the_verify_synopsis_flags_exist():
    from shardq.verify import build_parser
    block = block_containing("docs/reliability.md", "shardq verify --duration S | --run")
    options = set(build_parser()._option_string_actions)
    flags = re.findall(r"--[\w-]+", block.text)
    assert set(flags) == options - {"-h", "--help"}, set(flags) ^ (options - {"-h", "--help"})


# --------------------------------------------------------------------------- design.md
def test_the_module_table_names_files_that_exist():
    text = doc("docs/design.md")
    layout = text[text.index("## Modules"):text.index("## Log format")]
    rows = [r for r in re.findall(r"^\| (.+?) \| (.+?) \|$", layout, re.M) if r[0] != "module"]
    assert len(rows) >= 20
    for row in rows:
        paths = re.findall(r"`(shardq/[\w/.]+)`", row[0])
        assert paths, row
        for p in paths:
            assert os.path.exists(os.path.join(REPO, p)), p
            if p.endswith("/"):  # `wal/`: `format`, `fileio`, ... are its modules
                for mod in re.findall(r"`(\w+)`", row[1].split(":", 1)[-1]):
                    if mod.islower() and "(" not in mod:
                        assert os.path.exists(os.path.join(REPO, p, mod + ".py")), (p, mod)


def test_the_log_format_is_as_documented():
    from shardq import limits
    from shardq.shard import ops
    from shardq.wal import format as fmt
    text = doc("docs/design.md")
    assert 'b"SHQWAL\\x00\\x03"' in text and fmt.SEGMENT_MAGIC == b"SHQWAL\x00\x03"
    assert 'b"SHQCKP\\x00\\x03"' in text and fmt.CHECKPOINT_MAGIC == b"SHQCKP\x00\x03"
    assert 'struct "<4sIIQQII" (36 bytes)' in text and fmt.HEADER.format == "<4sIIQQII" and fmt.HEADER.size == 36
    assert 'b"SQr\\x03"' in text and fmt.RECORD_MARK == b"SQr\x03" and fmt.MAGIC_BYTES == 8
    assert fmt.HEADERS[2].format == "<III" and 'header\n`"<III"`' in text
    assert fmt.HEADERS[1].format == "<II" and "8-byte header without the header CRC" in text
    mib = 1024 * 1024
    assert f"`SEGMENT_RECORD_BYTES_MAX` = {limits.SEGMENT_RECORD_BYTES_MAX // mib} MiB" in text
    assert f"`CHECKPOINT_RECORD_BYTES_MAX` = {limits.CHECKPOINT_RECORD_BYTES_MAX // mib} MiB" in text
    assert f"`FRAME_BYTES_MAX` = {limits.FRAME_BYTES_MAX // mib} MiB" in text
    assert f"`CHECKPOINT_CHUNK_BYTES` ({limits.CHECKPOINT_CHUNK_BYTES // 1024} KiB" in text
    assert f"`REQUEST_BYTES_MAX` ({limits.REQUEST_BYTES_MAX // mib} MiB" in text
    assert limits.SEGMENT_RECORD_BYTES_MAX > limits.FRAME_BYTES_MAX > limits.REQUEST_BYTES_MAX
    assert "`NNNNNNNNNNNNNNNN.wal` (16-digit" in text and fmt.segment_name(3) == "0000000000000003.wal"
    ops_table = text[text.index("## Operations"):text.index("## The state machine")]
    rows = dict(re.findall(r"^\| (\d+) \| (\w+) \|", ops_table, re.M))
    assert {int(c): n for c, n in rows.items()} == {c: n for c, n in ops.NAMES.items() if not 20 <= c <= 23}
    assert "| 20–23 | meta, job, dedup, client |" in ops_table
    assert [ops.NAMES[c] for c in range(20, 24)] == ["meta", "job", "dedup", "client"]


# --------------------------------------------------------------------------- numbers in the text
def _router_default(name):
    from shardq.client.router import Router
    return inspect.signature(Router).parameters[name].default


def _worker_default(name):
    from shardq.consumer.options import WorkerOptions  # the settings of every worker runner
    return {f.name: f.default for f in dataclasses.fields(WorkerOptions)}[name]


def _const(module, name):
    return lambda: getattr(__import__(module, fromlist=[name]), name)


NUMBERS = [
    # (document, the words it says, the value in the code, what the words mean)
    ("docs/operations.md", "`ShardUnavailable` (a shard did not come back within `retry_s`, default 15 s;",
     lambda: _router_default("retry_s"), 15),
    ("docs/operations.md", "A shard holds at most\n`limits.max_connections` (4,096) clients at once",
     _const("shardq.limits", "CONNECTIONS_MAX_DEFAULT"), 4096),
    ("docs/operations.md", "hold up to 16 slots of their\nown",
     _const("shardq.shard.acceptor", "SERVICE_CONNECTIONS_MAX"), 16),
    ("docs/operations.md", "to\n`limits.max_connections` + 64 when",
     _const("shardq.limits", "SHARD_FDS_BESIDES_CLIENTS"), 64),
    ("docs/guarantees.md", "`request_timeout_s`, 30 s by default", lambda: _router_default("request_timeout_s"), 30),
    ("docs/operations.md", "`busy_poll_us` (default 300,", lambda: _router_default("busy_poll_us"), 300),
    ("docs/operations.md", "| `service.busy_poll_us` | 300 |", lambda: __import__("shardq.config", fromlist=["x"])
     .parse({}).service.busy_poll_us, 300),
    ("docs/operations.md", "at most 10,000; 0 turns it off", _const("shardq.busypoll", "BUSY_POLL_US_MAX"),
     10_000),
    ("docs/guarantees.md", "After `max_deliveries` deliveries (default 5)",
     _const("shardq.limits", "MAX_DELIVERIES_DEFAULT"), 5),
    ("docs/guarantees.md", "`retention_s` (default 7 days)",
     _const("shardq.consumer.idempotency", "RETENTION_S_DEFAULT"), 7 * 86400),
    ("docs/guarantees.md", "`min(1 s, 10% of the\n  lease)`", _const("shardq.consumer.policy", "COMMIT_MARGIN_S"), 1),
    ("docs/guarantees.md", "`busy_timeout_s` (30 s)",
     _const("shardq.consumer.idempotency", "BUSY_TIMEOUT_S_DEFAULT"), 30),
    ("docs/guarantees.md", "`base` 1 s", lambda: _worker_default("backoff_base_s"), 1),
    ("docs/guarantees.md", "`cap` 300 s", lambda: _worker_default("backoff_cap_s"), 300),
    ("docs/guarantees.md", "(at most 2048 UTF-8 bytes)", _const("shardq.limits", "ERROR_TEXT_BYTES_MAX"), 2048),
    ("docs/guarantees.md", "(0.1 s\n  doubling to 5 s)", _const("shardq.consumer.policy", "UNAVAILABLE_BACKOFF_S_MIN"),
     0.1),
    ("docs/guarantees.md", "doubling to 5 s", _const("shardq.consumer.policy", "UNAVAILABLE_BACKOFF_S_MAX"), 5),
    ("docs/guarantees.md", "`grace_s` (30 s)", lambda: _worker_default("grace_s"), 30),
    ("docs/guarantees.md", "then every hour", _const("shardq.consumer.options", "PRUNE_EVERY_S"), 3600),
    ("docs/guarantees.md", "batches of 10,000 rows", _const("shardq.consumer.idempotency", "PRUNE_BATCH_ROWS"),
     10_000),
    ("docs/design.md", "`dedup_window` (default 300 s)", _const("shardq.limits", "DEDUP_WINDOW_S_DEFAULT"), 300),
    ("docs/design.md", "idle clients are\ndropped after 10 minutes", _const("shardq.limits", "CLIENT_SESSION_TTL_S"),
     600),
    ("docs/design.md", "5 s socket timeout", _const("shardq.protocol.sockio", "HANDSHAKE_TIMEOUT_S"), 5),
    ("docs/design.md", "At most 32 run at once", _const("shardq.shard.acceptor", "HANDSHAKES_MAX"), 32),
    ("docs/design.md", "takes none of its replies for 1 s", _const("shardq.shard.conn", "SEND_TIMEOUT_S"), 1),
    ("docs/design.md", "one read of at most 1 MiB per connection", _const("shardq.protocol.wire", "READ_BYTES"), 2**20),
]


@pytest.mark.parametrize("path, words, value, expected", NUMBERS, ids=[n[1][:40] for n in NUMBERS])
def test_numbers_in_the_text_are_the_code_defaults(path, words, value, expected):
    assert words in doc(path), f"{path} no longer says {words!r}: update the text or this table"
    assert value() == expected


def test_worker_error_text_is_cut_to_the_documented_bytes():
    from shardq.consumer.handling import error_text
    text = error_text(ValueError("é" * 5000))
    assert text.startswith("ValueError: é") and len(text.encode()) <= 2048
    assert len(text.encode()) >= 2046  # cut at the limit, not far below (a 2-byte char may not fit)
