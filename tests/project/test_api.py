"""The public API is explicit and stable: changing it must be a deliberate edit here."""
import shardq
import shardq.errors

EXPECTED = {
    "open", "connect", "Queue", "Router", "Lease", "DeadLetter", "JobId", "Config", "QueueConfig",
    "Worker", "ShardqError", "InvalidJob", "UnknownQueue", "InvalidConfig", "ProtocolError",
    "AuthError", "NotFound", "LeaseLost", "JobGone", "QueueFull", "ShardUnavailable", "OutcomeUnknown",
    "TooManyConnections", "Closed",
    "ShardCountMismatch", "NotADataDir", "DataDirLocked", "UsageError", "Unsupported",
    "CorruptLog", "LogFailed", "App", "Task", "Exponential", "Retry", "Fail", "aio", "Cancelled",
    "PostgresStore", "StoreUnavailable", "OutboxBehind", "JobFailed", "chain", "group", "chord", "Workflow",
    "WorkflowCancelled",
}


def test_exports_are_exactly_the_documented_api():
    assert set(shardq.__all__) == EXPECTED
    for name in shardq.__all__:
        assert getattr(shardq, name) is not None


def test_every_error_derives_from_the_one_base():
    for name, obj in vars(shardq.errors).items():
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, shardq.ShardqError), name


def test_lease_fields_are_the_documented_ones():
    assert shardq.Lease._fields == ("job_id", "key", "body", "queue", "attempt", "token", "deadline")


def test_the_router_implements_the_queue_protocol():
    from shardq.client.engine import Calls
    # attributes set by the constructor: the router's own, and those both clients set alike
    set_by_init = shardq.Router.__init__.__code__.co_names + Calls._init_calls.__code__.co_names
    assert "_init_calls" in shardq.Router.__init__.__code__.co_names
    missing = [name for name in dir(shardq.Queue) if not name.startswith("_")
               and not hasattr(shardq.Router, name) and name not in set_by_init]
    assert not missing, missing
    assert "service_id" in set_by_init


def test_a_shard_process_and_a_bare_import_load_only_what_they_use():
    # A shard (restarted by the supervisor, started by every test) needs neither the router
    # nor asyncio; `import shardq` alone loads none of the parts named in shardq._LAZY.
    import json
    import subprocess
    import sys
    probe = ("import json, sys; import {m}; "
             "print(json.dumps(sorted(n for n in sys.modules if n.startswith(('shardq', 'asyncio')))))")
    loaded = {m: set(json.loads(subprocess.run([sys.executable, "-c", probe.format(m=m)], check=True,
                                               capture_output=True, text=True).stdout))
              for m in ("shardq", "shardq.shard.process")}
    assert not loaded["shardq"] & {"shardq.config", "shardq.client.router", "shardq.tasks.app",
                                   "shardq.consumer.worker", "shardq.client.aio", "asyncio"}, loaded["shardq"]
    shard = loaded["shardq.shard.process"]
    assert "shardq.shard.state" in shard and "shardq.wal.log" in shard  # the probe sees imports
    assert not shard & {"shardq.client.router", "shardq.client.connection", "shardq.tasks.app",
                        "asyncio"}, shard
    assert set(shardq.__all__) <= set(dir(shardq))  # completion and help() list the lazy names too


def test_the_asyncio_client_imports_as_a_user_writes_it():
    """``import shardq.aio`` and ``from shardq.aio import connect`` (what a FastAPI app writes
    first) failed with ModuleNotFoundError: ``shardq.aio`` was only a lazy attribute. Each
    form, in a fresh process, reaches the one module ``shardq.client.aio``."""
    import subprocess
    import sys
    for form in ("import shardq.aio as a", "from shardq import aio as a",
                 "from shardq.aio import connect; import shardq.aio as a; assert connect is a.connect",
                 "import shardq; a = shardq.aio"):
        probe = f"{form}; import shardq, shardq.client.aio as c; assert a is c is shardq.aio, (a, c)"
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert r.returncode == 0, (form, r.stderr[-500:])


def test_the_cli_parser_imports_no_commands_dependencies():
    """Every ``shardq`` command builds the whole parser first: it must not import what only
    some command needs (the worker's consumer, croniter, importlib.metadata for --version),
    which every command would then pay at start-up. ``--version`` still reads the version."""
    import json
    import subprocess
    import sys
    probe = ("import json, sys; from shardq.cli.main import build_parser; build_parser(); "
             "print(json.dumps(sorted(sys.modules)))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                                           text=True).stdout))
    assert "shardq.cli.worker" in loaded and "shardq.config" in loaded  # the probe sees imports
    assert not loaded & {"shardq.consumer.policy", "shardq.consumer.handling", "croniter", "importlib.metadata",
                         "shardq.client.router", "asyncio"}, sorted(loaded)
    out = subprocess.run([sys.executable, "-m", "shardq.cli", "--version"], check=True, capture_output=True,
                         text=True).stdout
    assert out.startswith("shardq ") and len(out.split()) == 2, out
