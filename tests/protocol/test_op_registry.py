"""The op registries are the one place an operation is declared: the log operations
(``ops.REGISTRY``: code, name, record, apply method) and the wire requests
(``wire.REQUESTS``: name, args, retry policy, handler). Every older table is derived from
them; these tests check that the derived tables agree with them, that every operation has
a function that applies or serves it, and that what the state machine writes reads back
through the records (so a field's name and position are declared once)."""
from __future__ import annotations

import os

import msgpack
import pytest

from shardq.errors import InvariantViolation
from shardq.shard import ops
from shardq.shard.state import ShardState

T0 = 1_000_000.0


# ---------------------------------------------------------------------------- log operations
def test_names_and_codes_are_derived_from_the_registry():
    assert ops.NAMES == {code: spec.name for code, spec in ops.REGISTRY.items()}
    assert all(code == spec.code for code, spec in ops.REGISTRY.items())
    assert len({spec.name for spec in ops.REGISTRY.values()}) == len(ops.REGISTRY)
    assert len({spec.record for spec in ops.REGISTRY.values()}) == len(ops.REGISTRY)
    # Every code constant of the module is registered under its own name, and nothing else is.
    constants = {name: value for name, value in vars(ops).items()
                 if name.isupper() and type(value) is int and name not in ("TOKEN_EPOCH_BITS", "JOB_ID")}
    assert {value: name.lower() for name, value in constants.items()} == ops.NAMES


def test_every_operation_has_an_apply_method_and_the_dispatch_tables_are_the_registry(make_config):
    state = ShardState(0, make_config())
    assert set(state._apply) == set(ops.REGISTRY)
    assert set(state._apply_record) == {spec.record for spec in ops.REGISTRY.values()}
    assert ops.CODES == {spec.record: code for code, spec in ops.REGISTRY.items()}
    for code, spec in ops.REGISTRY.items():
        method = getattr(ShardState, spec.apply)
        assert callable(method), spec
        assert state._apply[code].__name__ == f"replay_{spec.record.__name__.lower()}", spec  # replay: fn(op)
        assert state._apply_record[spec.record].__func__ is method, spec   # live: fn(*record)


def test_each_apply_method_takes_its_records_fields_by_name_and_default():
    """The record is the one declaration of an operation's fields: the method that applies
    it takes them in the same order, under the same names, with the same defaults (an
    older log's record lacks the fields with defaults)."""
    import inspect
    for spec in ops.REGISTRY.values():
        params = list(inspect.signature(getattr(ShardState, spec.apply)).parameters.values())[1:]
        assert tuple(p.name for p in params) == spec.record._fields, spec.name
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params), spec.name
        defaults = {p.name: p.default for p in params if p.default is not p.empty}
        assert defaults == spec.record._field_defaults, spec.name


def test_encode_leaves_off_trailing_defaults_and_a_checkpoint_writes_every_field():
    assert ops.encode(ops.Release(7, 0, None)) == [ops.RELEASE, 7, 0, None]
    assert ops.encode(ops.Release(7, 0, None, True)) == [ops.RELEASE, 7, 0, None, True]
    assert ops.encode(ops.Enqueue(5, "q", None, b"b", 0, 0, None, 1.0)) == [ops.ENQUEUE, 5, "q", None, b"b", 0, 0,
                                                                             None, 1.0]
    assert ops.encode(ops.Arrive("b", 0, 2, b"v", None)) == [ops.ARRIVE, "b", 0, 2, b"v", None]  # no default: kept
    assert ops.encode(ops.Workflow("w", b"s", 1.0)) == [ops.WORKFLOW, "w", b"s", 1.0]
    assert ops.encode_whole(ops.Workflow("w", b"s", 1.0)) == [ops.WORKFLOW, "w", b"s", 1.0, None, None, None, None]
    assert ops.encode(ops.Ack(3)) == [ops.ACK, 3]


def test_replay_gives_an_old_record_its_defaults_and_ignores_later_fields(make_config):
    state = ShardState(0, make_config())
    state.replay([[[ops.ENQUEUE, 1 << 10, "default", None, b"x", 0, 0, None, T0],     # no dedup_expires
                   [ops.LEASE, 1 << 10, 5, T0 + 30, "a later field"],
                   [ops.RELEASE, 1 << 10, 0, None]]])                            # no undelivered
    assert state.jobs[1 << 10].attempts == 1 and state.queues["default"].counts[2] == 1
    with pytest.raises(InvariantViolation):
        state.replay([[[ops.EXTEND, 1 << 10]]])                                  # a field without a default


def test_operations_on_one_job_hold_its_id_first():
    assert ops.JOB_OPS == {ops.ENQUEUE, ops.LEASE, ops.ACK, ops.RELEASE, ops.EXTEND, ops.DEAD, ops.REDRIVE,
                           ops.PURGE, ops.JOB, ops.CANCEL, ops.RESULT, ops.PROGRESS}
    for code in ops.JOB_OPS:
        assert ops.field(ops.REGISTRY[code].record, "job_id") == ops.JOB_ID


def test_read_gives_defaults_to_old_records_and_ignores_later_fields():
    old = [ops.RELEASE, 7, 0, None]                  # written before `undelivered` existed
    assert ops.read(ops.Release, old) == ops.Release(7, 0, None, False)
    assert ops.read(ops.Release, old + [True]).undelivered is True
    assert ops.read(ops.Pause, [ops.PAUSE, "q", 5.0, "a later field"]) == ops.Pause("q", 5.0)
    assert ops.read(ops.Meta, [ops.META, 3, 9]).epoch is None
    with pytest.raises(TypeError):
        ops.read(ops.Extend, [ops.EXTEND, 7])        # a field without a default is missing
    assert ops.field(ops.Enqueue, "dedup_expires") == 9


def _workload(state: ShardState, payloads: list[bytes] | None = None, since_pin: bool = True) -> list[list]:
    """Drive ``state`` through every live operation; returns what it logged, msgpack
    round-tripped as replay reads it (and appends each call's record payload, as the log
    writes it, to ``payloads``). ``since_pin`` False leaves out the operations added after
    the bytes were pinned (:data:`WORKLOAD_LOG_SHA256`): the pin is of those before."""
    logged: list[list] = []

    def run(fn, *args, **kw):
        try:
            return fn(*args, **kw)
        finally:
            payload = msgpack.packb(state.take_ops())
            if payloads is not None:
                payloads.append(payload)
            logged.extend(msgpack.unpackb(payload, raw=False))

    now = T0
    run(state.begin_epoch)
    run(state.note_priorities, "default")
    a, b, c, d = run(state.enqueue_many, [(b"a", "k", "default", 0, 0, "dedup-a"), (b"b", "k", "default", 0, 0, None),
                                          (b"c", None, "default", 0, 3, None), (b"d", None, "default", 5, 0, None)],
                     now, (11, 1, 1))
    leases = {l.job_id: l for l in run(state.dequeue, "default", now, None, 2)}
    assert set(leases) == {a, c}                                         # b waits behind a (key k)
    run(state.extend, a, leases[a].token, now, 30)                       # EXTEND
    run(state.nack, c, leases[c].token, now, 0, None, False)             # RELEASE, undelivered
    (lc,) = run(state.dequeue, "default", now, None, 1)
    assert lc.job_id == c
    run(state.set_progress, c, lc.token, 0.1, None, now)                 # c stays: its progress is checkpointed
    run(state.nack, c, lc.token, now, 1, "boom")                         # RELEASE with a delay
    run(state.put_result, a, leases[a].token, b"result", 60.0, now)      # RESULT
    run(state.set_progress, a, leases[a].token, 0.5, "half", now)       # PROGRESS
    run(state.ack, a, leases[a].token, now)                              # ACK: b moves up
    (lb,) = run(state.dequeue, "default", now, None, 1)
    assert lb.job_id == b
    run(state.bury, b, lb.token, now, "bad")                             # DEAD
    run(state.redrive, "default", now, [b])                              # REDRIVE
    (lb,) = run(state.dequeue, "default", now, None, 1)
    run(state.bury, b, lb.token, now, "bad again")
    run(state.purge_dead, "default", now)                                # PURGE
    run(state.pause, "default", now)
    run(state.resume, "default", now)
    run(state.cancel, d, now)                                            # CANCEL
    run(state.pause, "default", now)                                     # paused: in the checkpoint
    run(state.set_limits, "limited", {"concurrency": 2}, now)            # LIMITS: in the checkpoint too
    callback = [b"callback", None, "default", 0, 0]
    run(state.arrive, "chord", 0, 2, b"v0", 60.0, callback, now)          # ARRIVE
    run(state.arrive, "chord", 1, 2, b"v1", 60.0, callback, now)          # ARRIVE, ENQUEUE, FIRED
    run(state.cancel_barrier, "other", 60.0, now)                        # BARRIER_CANCEL
    run(state.put_workflow, "wf-1", b"spec", now)                        # WORKFLOW
    run(state.put_workflow, "wf-2", b"spec", now)
    run(state.end_workflow, "wf-2", "failed", "boom", 60.0, now)         # WORKFLOW_END: in the checkpoint too
    if since_pin:
        run(state.enqueue_many, [(b"e", "k", "purged", 0, 0, None), (b"f", "k", "purged", 0, 0, None)], now, None)
        run(state.dequeue, "purged", now, None, 1)
        run(state.purge_queue, "purged", now)                            # PURGE_QUEUE
    return logged


LIMITED = {"queues": {"default": {}, "limited": {"concurrency": 1}}}  # a placed queue (docs/limits.md)


def test_every_operation_written_reads_through_its_record(make_config):
    state = ShardState(0, make_config(**LIMITED))
    logged = _workload(state)
    checkpoint = [op for chunk in state.snapshot() for op in msgpack.unpackb(chunk, raw=False)]
    seen = set()
    for op in logged + checkpoint:
        spec = ops.REGISTRY[op[0]]
        record = spec.record
        required = len(record._fields) - len(record._field_defaults)
        assert required <= len(op) - 1 <= len(record._fields), (spec.name, op)
        fields = ops.read(record, op)
        if op[0] in ops.JOB_OPS:
            assert fields.job_id == op[ops.JOB_ID]
        seen.add(op[0])
    assert seen == set(ops.REGISTRY), {ops.NAMES[c] for c in set(ops.REGISTRY) - seen}
    # and what was written replays into the same state, live log and checkpoint alike
    for source in (logged, checkpoint):
        again = ShardState(0, make_config(**LIMITED))
        again.replay([source])
        again.advance(T0)
        state.advance(T0)
        assert sorted(again.jobs) == sorted(state.jobs)


#: sha256 of the record payloads that :func:`_workload` writes, then of its checkpoint's
#: chunks: taken from the code that wrote ops as lists by hand, before the state emitted
#: typed records. The bytes on disk are the format: a change here is a format change.
WORKLOAD_LOG_SHA256 = "ec157fe5006899367ea925a444a1ba9a40e1b86830f1f8d4b08eaa3fd4ecff26"
WORKLOAD_CHECKPOINT_SHA256 = "5ed1fe5aa67cea1e832e8c08694fd671d70d8fdea3734a8ac6aa5afdda97c1c7"


def test_the_bytes_written_are_those_of_the_format(make_config):
    import hashlib
    state = ShardState(0, make_config(**LIMITED))
    payloads: list[bytes] = []
    _workload(state, payloads, since_pin=False)
    assert hashlib.sha256(b"".join(payloads)).hexdigest() == WORKLOAD_LOG_SHA256
    assert hashlib.sha256(b"".join(state.snapshot())).hexdigest() == WORKLOAD_CHECKPOINT_SHA256


# ---------------------------------------------------------------------------- wire requests
def test_wire_tables_are_derived_from_the_requests():
    from shardq.protocol import wire
    assert wire.OPS == frozenset(wire.REQUESTS)
    assert wire.ARITY == {name: len(r.args._fields) for name, r in wire.REQUESTS.items()}
    assert wire.RETRY == {name: r.retry for name, r in wire.REQUESTS.items()}
    assert wire.CONTROL_ARITY == {name: len(r.args._fields) for name, r in wire.REQUESTS.items() if r.control}
    assert all(name == r.name and r.retry in (wire.RESEND, wire.UNKNOWN) for name, r in wire.REQUESTS.items())
    # the control ops are the nine the module's table lists last, and every op is in that table
    assert set(wire.CONTROL_ARITY) == {"pause", "resume", "cancel", "job", "dead_page", "purge_ids", "metrics",
                                       "metrics_page", "backup_cut"}
    table = wire.__doc__[wire.__doc__.index("op    "):]
    assert all(f"\n{name} " in table for name in wire.REQUESTS), [n for n in wire.REQUESTS if f"\n{n} " not in table]


def test_every_wire_op_calls_a_state_method_with_its_record_or_has_a_handler(tmp_path, make_config):
    """A request names the state method it calls (served by the one generic handler, which
    passes its argument record's fields by name) or, when it does more, a handler of its own."""
    import inspect

    from shardq.protocol import wire
    from shardq.shard.control_handlers import ControlHandlers
    from shardq.shard.durable import DurableShard
    from shardq.shard.process import ShardServer
    for r in wire.REQUESTS.values():
        assert (r.calls is None) != (r.handler is None), r
        if r.calls is not None:
            params = inspect.signature(getattr(ShardState, r.calls)).parameters
            required = {n for n, p in params.items() if p.default is p.empty and n not in ("self", "now")}
            assert set(r.args._fields) <= set(params) and required <= set(r.args._fields), r
        else:
            assert callable(getattr(ShardServer, r.handler, None)), r
            if r.control:
                assert r.handler in vars(ControlHandlers), r  # control ops: control_handlers.py
    shard = DurableShard(str(tmp_path / "s"), 0, make_config())
    shard.open()
    try:
        server = ShardServer(shard, str(tmp_path / "sock"), b"k" * 32)
        assert set(server._handlers) == wire.OPS
        for name, r in wire.REQUESTS.items():
            h = server._handlers[name]
            if r.handler:
                assert h.__name__ == f"server_call[{r.handler}]", name   # the method gets the record
            else:
                assert h.__name__ == f"state_call[{r.calls}]", name
        # the generic handler: the wire's args become the record, passed by name, with now
        server._handlers["pause"](["default"], T0, None, 1)
        assert shard.state.queues["default"].paused == T0
        assert server._handlers["queue_config"](["default"], T0, None, 2)["visibility_timeout"] > 0
        with pytest.raises(TypeError):
            server._handlers["extend"]([1, 2], T0, None, 3)  # arity: _execute answers it as ProtocolError first
        # a handler of its own gets the record too
        assert server._handlers["cancel_wait"]([7], T0, None, 4) is False          # no such wait
        assert server._handlers["dead_page"](["default", None, 10], T0, None, 5) == []
        server._poller.close()
        os.close(server._wake_r)
        os.close(server._wake_w)
    finally:
        shard.close()


def test_reply_rows_are_arrays_in_their_record_order():
    from shardq.protocol import wire
    row = wire.LeaseRow(5, "k", b"body", 1, 9, 2.5, 3, True)
    assert msgpack.unpackb(wire.pack(row)) == [5, "k", b"body", 1, 9, 2.5, 3, True]
    assert wire.LeaseRow._fields[:6] == ("job_id", "key", "body", "attempt", "token", "deadline")
    dead = wire.DeadRow(5, None, b"body", 2, "boom")
    assert msgpack.unpackb(wire.pack(dead)) == [5, None, b"body", 2, "boom"]
