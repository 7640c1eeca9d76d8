"""Workflows: chains, groups and chords of task calls, and their results.

::

    wf = chain(fetch.s(url), parse.s(), store.s()).send()    # -> Workflow
    wf.result(timeout=30)          # the last step's return value (JobFailed, WorkflowCancelled, TimeoutError)
    c = chord(group(score.s(d) for d in docs), summarize.s()).send()

How it holds (docs/design.md, "Workflows and results"): every step reports its result to a
*barrier* on the shard that will enqueue what comes next; the barrier counts each member
once, by its index, and its shard enqueues the next step in the same commit as the last
arrival. So a step runs after everything before it succeeded, and is enqueued once,
whatever is killed in between. A group that follows a step is started by one
``shardq.fanout`` job, which arrives at one barrier of one member per member (each on that
member's shard), so each member is enqueued once too.

This module builds the jobs (``Builder``, pure but for asking the router where a queue's
jobs live); :mod:`.reading` reads a workflow's state from its jobs and barriers (pure).
Every workflow ends (docs/workflows.md, "How a workflow ends"): ``reading.verdict`` says
when, and the record decides what the jobs cannot tell (a gone job: cancelled, or
purged). :class:`Workflow` reads them with generators of client calls, run by ``_drive``
with the threaded client and ``_adrive`` with the asyncio one: one reading, two drivers.

Each sent workflow also leaves a *record* on its home shard (docs/design.md, "Workflow
records"): its steps (``spec_of``), so that any process can load it (``Workflow.load``),
and, once the service's watcher saw it end (``Workflow.outcome``), how it ended. The record
is for looking, never for running: a workflow runs the same without it.
"""
from __future__ import annotations

import asyncio
import logging
import math
import numbers
import time
import uuid
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar
from collections.abc import Callable, Generator, Iterable

import msgpack

from .. import limits
from ..clock import Clock, SystemClock
from ..client.contracts import AsyncResults, Results
from ..client.routing import job_item
from ..errors import InvalidJob, JobFailed, NotFound, ShardqError, Unsupported, WorkflowCancelled
from ..protocol import validate
from . import body as taskbody
from .reading import (ENDED, FAILED, FANOUT, RUNNING, SUCCEEDED, Barriers, Verdict, status_rows, step_jobs, verdict,
                      watched)

if TYPE_CHECKING:
    from .app import App, Task

#: The format of a workflow record's spec (``spec_of``).
SPEC_FORMAT = 1
#: How long an ended workflow's record is kept.
RECORD_KEPT_S = limits.WORKFLOW_RESULT_S_DEFAULT

log = logging.getLogger("shardq.workflow")

#: The client calls a reading generator yields, by name: methods of
#: :class:`~shardq.client.contracts.Results` and of its asyncio twin, which ``_drive`` and
#: ``_adrive`` call by that name (tests/tasks/test_task_contracts.py checks they are).
ReadCall: TypeAlias = Literal["barriers", "results", "end_workflow", "workflow"]
_T = TypeVar("_T")
#: A reading: yields ``(call, args)``, is sent the reply, returns ``_T``.
Reading: TypeAlias = Generator[tuple[ReadCall, tuple[Any, ...]], Any, _T]

#: Result polling: the first wait, and the longest one between two looks.
POLL_FIRST_S = 0.005
POLL_MAX_S = 0.25
RETRY_FLOOR_S = 0.2  # a look of result(timeout) past its deadline still tries a shard this long


def pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True, datetime=False)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---------------------------------------------------------------------------- signatures
@dataclass(frozen=True)
class Signature:
    """A task call not sent yet (``task.s(*args, **kwargs)``). In a chain the step gets
    the previous step's return value as its first argument after ``ctx``."""
    task: Task[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    delay: float = 0
    priority: int = 0

    def set(self, *, delay: float | None = None, priority: int | None = None) -> Signature:
        """This call with a delay (seconds, counted from when its job is enqueued: for a
        step, when the step before it finished) or a priority, as ``task.send_with`` takes.
        Checked here as ``send_with`` checks them (InvalidJob): a later step's job is
        enqueued by a shard when the step before it reports, too late to refuse it."""
        if delay is not None:
            validate.seconds("delay", delay, hi=limits.DELAY_S_MAX)
        if priority is not None:
            validate.priority(priority)
        return replace(self, delay=self.delay if delay is None else delay,
                       priority=self.priority if priority is None else priority)

    def send(self) -> Workflow:
        return chain(self).send()


class Group:
    """Members run in parallel (sent in one batch call); their results come in member order."""

    members: list[Signature | Chain]

    def __init__(self, *members: Any):
        if len(members) == 1 and not isinstance(members[0], (Signature, Group, Chain)):
            members = tuple(members[0])  # group(generator)
        flat: list[Signature | Chain] = []
        for m in members:
            if isinstance(m, Group):
                flat.extend(m.members)
            elif isinstance(m, (Signature, Chain)):
                flat.append(m)
            else:
                raise InvalidJob(f"a group holds task.s(...) signatures and chains, got {m!r:.80}")
        self.members = flat

    def send(self) -> Workflow:
        return chain(self).send()


class Chain:
    """Steps one after the other; each gets the previous one's result."""

    steps: list[Signature | Group]

    def __init__(self, *steps: Any):
        flat: list[Signature | Group] = []
        for s in steps:
            if isinstance(s, Chain):
                flat.extend(s.steps)
            elif isinstance(s, (Signature, Group)):
                flat.append(s)
            else:
                raise InvalidJob(f"a chain holds task.s(...) signatures, groups and chains, got {s!r:.80}")
        if not flat:
            raise InvalidJob("a chain needs at least one step")
        self.steps = flat

    def send(self) -> Workflow:
        """Enqueue the jobs that start the workflow (one batch call per 10,000); returns
        once they are durable."""
        _check_groups(self)  # (an empty group first has no task to name the app)
        return Workflow.start(_app_of(self), self)


def chain(*steps: Any) -> Chain:
    return Chain(*steps)


def group(*members: Any) -> Group:
    return Group(*members)


def chord(header: Any, body: Signature) -> Chain:
    """``body`` runs once, after every member of ``header`` succeeded, with their results
    in member order."""
    return Chain(header if isinstance(header, Group) else Group(header), body)


def _app_of(node: Any) -> App:
    while not isinstance(node, Signature):
        node = node.steps[0] if isinstance(node, Chain) else node.members[0]
    return node.task.app


# ---------------------------------------------------------------------------- building
@dataclass
class Step:
    """One job of a workflow, for status and results: started now (``index`` in the first
    batch), or by a barrier (``barrier``: ``(shard, id)``; its job is the barrier's callback)."""
    task: str
    path: str
    barrier: tuple[int, str] | None = None
    index: int | None = None
    item: list[Any] | None = field(default=None, repr=False)
    reports: tuple[int, str, int] | None = None   # (shard, barrier id, member index) it arrives at


@dataclass
class Target:
    """Where a step reports its result: barrier ``bid`` on ``shard``, ``total`` members,
    enqueueing ``callback`` once all arrived."""
    bid: str
    shard: int
    total: int
    callback: list[Any]


class Builder:
    """Turns a chain into enqueue items. ``route(queue, key, barrier)`` says which shard a
    job goes to (the router's :meth:`~shardq.client.router.Router.route`).

    Paths name the steps: the top chain's step ``k`` is ``0.k``, member ``j`` of a group
    there ``0.k.j``, and step ``m`` of a chain that is that member ``0.k.j.m``."""

    def __init__(self, route: Callable[[str, str | None, str], int], wf_id: str, ttl_s: float):
        self.route = route
        self.wf_id = wf_id
        self.ttl_s = ttl_s
        self.finals: set[str] = set()
        self.count = 0
        self.steps: list[Step] = []
        self.barriers: list[tuple[int, str]] = []
        #: queue -> (the largest body of a job a barrier enqueues there, its step's name)
        self.later: dict[str, tuple[int, str]] = {}
        #: the queues a barrier enqueues a job of a priority other than 0 to
        self.later_priorities: set[str] = set()

    def build(self, top: Chain) -> list[list[Any]]:
        """The items to enqueue now (``[body, key, queue, delay, priority]``); the steps
        and barriers are left in :attr:`steps` and :attr:`barriers`."""
        _check_groups(top)
        self.finals = set(final_paths(top))
        start = self.chain_items(top.steps, None, 0, None, "0", None)
        self.steps.sort(key=lambda step: [int(part) for part in step.path.split(".")])  # built from the end
        where = {id(item): i for i, item in enumerate(start)}
        for step in self.steps:
            step.index = where.get(id(step.item)) if step.barrier is None else None
        return start

    def new_barrier(self) -> str:
        self.count += 1
        return f"{self.wf_id}.{self.count}"

    def chain_items(self, steps: list[Any], target: Target | None, index: int, inputs: list[Any] | None, path: str,
                    started_by: tuple[int, str] | None) -> list[list[Any]]:
        """The jobs that start a chain whose last step reports to ``target`` at ``index``.
        Built from the end: each step is the callback of the barrier its predecessor
        reports to, and that barrier lives where the step's first job is enqueued."""
        tgt, idx = target, index
        for k in range(len(steps) - 1, 0, -1):
            step, prev = steps[k], steps[k - 1]
            total = len(prev.members) if isinstance(prev, Group) else 1
            bid = self.new_barrier()
            queue, key = first_route(step)
            shard = self.route(queue, key, bid)
            self.barriers.append((shard, bid))
            mode = "all" if isinstance(prev, Group) else "one"
            (callback,) = self.node_items(step, tgt, idx, [bid, shard, mode], f"{path}.{k}", (shard, bid), True)
            tgt, idx = Target(bid, shard, total, callback), 0
        return self.node_items(steps[0], tgt, idx, inputs, f"{path}.0", started_by, False)

    def node_items(self, node: Any, target: Target | None, index: int, inputs: list[Any] | None, path: str,
                   started_by: tuple[int, str] | None, by_barrier: bool) -> list[list[Any]]:
        if isinstance(node, Signature):
            return [self.signature_item(node, target, index, inputs, path, started_by)]
        if not by_barrier:
            items: list[list[Any]] = []
            for j, m in enumerate(node.members):
                items += self.member_items(m, target, index + j, inputs, f"{path}.{j}", started_by)
            return items
        # A group that a barrier starts: one fanout job, which arrives at one barrier per
        # member (on that member's shard); each member is its barrier's callback.
        spawns = []
        for j, m in enumerate(node.members):
            bid = self.new_barrier()
            queue, key = first_route(m)
            shard = self.route(queue, key, bid)
            self.barriers.append((shard, bid))
            (item,) = self.member_items(m, target, index + j, [bid, shard, "one"], f"{path}.{j}", (shard, bid))
            spawns.append([shard, bid, item])
        queue, _ = first_route(node)
        body = taskbody.encode(FANOUT, [spawns, self.ttl_s], {}, None, taskbody.Steps(None, None, inputs))
        item = self.checked([body, None, queue, 0, 0], path, FANOUT, started_by)
        self.steps.append(Step(FANOUT, path, started_by, item=item))
        return [item]

    def member_items(self, member: Any, target: Target | None, index: int, inputs: list[Any] | None, path: str,
                     started_by: tuple[int, str] | None) -> list[list[Any]]:
        if isinstance(member, Signature):
            return [self.signature_item(member, target, index, inputs, path, started_by)]
        if not isinstance(member.steps[-1], Signature):
            raise InvalidJob("a chain inside a group must end with a task (its result is the member's)")
        if started_by is not None and not isinstance(member.steps[0], Signature):
            raise InvalidJob("a chain inside a group that follows a step must start with a task, not a group")
        return self.chain_items(member.steps, target, index, inputs, path, started_by)

    def signature_item(self, sig: Signature, target: Target | None, index: int, inputs: list[Any] | None,
                       path: str, started_by: tuple[int, str] | None) -> list[Any]:
        report = None if target is None else [target.bid, target.shard, index, target.total, self.ttl_s,
                                              target.callback]
        name, args, kwargs, key, queue, delay, priority = call(sig, inputs is not None)
        # A step's value goes to the barrier it reports to: only the workflow's own values
        # (its final steps', for the workflow's TTL, never less: a final result gone before
        # the service saw it would end the workflow) and a task's asked-for ones are kept.
        keep = self.ttl_s if path in self.finals else sig.task.keep_result
        body = taskbody.encode(name, args, kwargs, None,
                               taskbody.Steps(None if keep is None else float(keep), report, inputs))
        item = self.checked([body, key, queue, delay, priority], path, sig.task.name, started_by)
        reports = None if target is None else (target.shard, target.bid, index)
        self.steps.append(Step(sig.task.name, path, started_by, item=item, reports=reports))
        return item

    def checked(self, item: list[Any], path: str, task: str, started_by: tuple[int, str] | None) -> list[Any]:
        """``item``, checked as an enqueue checks a job (key, delay, priority, queue name,
        body: ``routing.job_item``) if a barrier enqueues it: its shard would refuse it only
        when the step before it reports, after that step's effect committed, and that step
        would then run again and again until dead-lettered. (The first jobs are checked by
        their enqueue; the body against each queue's own limit in :meth:`Workflow.start`.)"""
        if started_by is not None:
            body, key, queue, delay, priority = item
            try:
                job_item(body, key, queue, delay, priority, None)
            except InvalidJob as exc:
                raise InvalidJob(f"step {path} ({task}): {exc}") from None
            if len(body) > self.later.get(queue, (0, ""))[0]:
                self.later[queue] = (len(body), f"step {path} ({task})")
            if priority:
                self.later_priorities.add(queue)
        return item


def call(sig: Signature, with_input: bool) -> tuple[str, list[Any], dict[str, Any], str | None, str, float, int]:
    """A signature's call checked as ``task.send`` checks it (signature, key, msgpack).
    ``with_input``: the step gets an input first, not known yet: None stands in for it
    (its key function, if any, sees None there), and it is not sent."""
    placeholder = (None,) if with_input else ()
    job = sig.task.job(placeholder + tuple(sig.args), sig.kwargs, sig.delay, sig.priority)
    name, args, kwargs = taskbody.decode(job["body"])
    return name, args[len(placeholder):], kwargs, job["key"], job["queue"], job["delay"], job["priority"]


def _check_groups(node: Any) -> None:
    """InvalidJob for a group with no member, or more than a barrier counts, anywhere."""
    if isinstance(node, Chain):
        for step in node.steps:
            _check_groups(step)
    elif isinstance(node, Group):
        if not node.members:
            raise InvalidJob("a group in a workflow needs at least one member")
        if len(node.members) > limits.BARRIER_MEMBERS_MAX:
            raise InvalidJob(f"a group of {len(node.members)} members: at most {limits.BARRIER_MEMBERS_MAX}")
        for m in node.members:
            _check_groups(m)


def first_route(node: Any) -> tuple[str, str | None]:
    """The queue and key of the job that starts ``node`` as a callback (a group: its fanout
    job, on its first member's queue, with no key)."""
    if isinstance(node, Signature):
        _, _, _, key, queue, _, _ = call(node, True)
        return queue, key
    if isinstance(node, Chain):
        return first_route(node.steps[0])
    queue, _ = first_route(node.members[0])
    return queue, None


def final_paths(top: Chain) -> list[str]:
    """The paths of the steps whose results are the workflow's: the last step, or each
    member's last step if it is a group (in member order)."""
    k = len(top.steps) - 1
    last = top.steps[k]
    if isinstance(last, Signature):
        return [f"0.{k}"]
    return [f"0.{k}.{j}" if isinstance(m, Signature) else f"0.{k}.{j}.{len(m.steps) - 1}"
            for j, m in enumerate(last.members)]


def signatures(node: Any) -> Iterable[Signature]:
    if isinstance(node, Signature):
        yield node
    elif isinstance(node, Chain):
        for s in node.steps:
            yield from signatures(s)
    else:
        for m in node.members:
            yield from signatures(m)


def spec_of(steps: list[Step], barriers: list[tuple[int, str]], finals: list[str], first_ids: list[Any],
            single: bool) -> bytes:
    """A workflow's record: what :meth:`Workflow.load` needs, zlib-compressed msgpack
    (a chord's members repeat their task name and barrier: it compresses tenfold)."""
    rows = [[s.task, s.path, list(s.barrier) if s.barrier else None, s.index, list(s.reports) if s.reports else None]
            for s in steps]
    return zlib.compress(msgpack.packb([SPEC_FORMAT, rows, [list(b) for b in barriers], finals, first_ids, single]))


def from_spec(spec: bytes) -> tuple[list[Step], list[tuple[int, str]], list[str], list[Any], bool]:
    """The steps, barriers, finals, first job ids and ``single`` of a record; InvalidJob
    for one this version does not read."""
    try:
        fmt, rows, barriers, finals, first_ids, single = msgpack.unpackb(zlib.decompress(spec), raw=False)
    except Exception as exc:  # noqa: BLE001 - zlib and msgpack raise several types: all mean unreadable
        raise InvalidJob(f"a workflow record this version cannot read ({type(exc).__name__})") from None
    if fmt != SPEC_FORMAT:
        raise InvalidJob(f"a workflow record of format {fmt!r}; this version reads {SPEC_FORMAT}")
    try:
        steps = [Step(_text(task), _text(path), _ref(barrier, 2), _index(index), None, _ref(reports, 3))
                 for task, path, barrier, index, reports in rows]
        refs = [_ref(b, 2) for b in barriers]
        if not all(type(f) is str for f in finals) or not all(_index(i) is not None for i in first_ids) \
                or type(single) is not bool:
            raise TypeError("finals, first job ids or single")
    except (TypeError, ValueError) as exc:
        raise InvalidJob(f"a workflow record this version cannot read (malformed: {exc})") from None
    return steps, [r for r in refs if r is not None], finals, first_ids, single


def workflow_id(value: Any) -> str:
    """A workflow id as given to :meth:`Workflow.load` (or ``shardq workflow show``),
    checked: InvalidJob names it a workflow id (the client's check of the record's key
    calls it a barrier id: a workflow's record is kept where a barrier of that id would be)."""
    if type(value) is not str or not value \
            or len(value.encode("utf-8", "surrogatepass")) > limits.BARRIER_ID_BYTES_MAX:
        got = f"a str of {len(value.encode('utf-8', 'surrogatepass'))} bytes" \
            if type(value) is str and len(value) > 40 else f"{value!r:.40}"
        raise InvalidJob(f"a workflow id must be a string of 1..{limits.BARRIER_ID_BYTES_MAX} bytes (UTF-8), "
                         f"got {got}")
    return value


def _text(value: Any) -> str:
    if type(value) is not str:
        raise TypeError(f"a text field holds {type(value).__name__}")
    return value


def _index(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise TypeError(f"an index holds {value!r:.40}")
    return value


def _ref(value: Any, size: int) -> Any:
    """``[shard, barrier id]`` (size 2) or ``[shard, barrier id, index]`` (3) as a tuple, or None."""
    if value is None:
        return None
    if type(value) is not list or len(value) != size or type(value[0]) is not int or type(value[1]) is not str \
            or (size == 3 and _index(value[2]) is None):
        raise TypeError(f"a barrier reference holds {value!r:.60}")
    return tuple(value)


class Workflow:
    """A sent chain, group or chord. ``result()`` waits for its last step (or, for one that
    ends with a group, every member's) and returns its value; ``status()`` tells every
    step's state; ``cancel()`` stops what has not run. The process that sent the workflow
    holds its handle; any other loads one by id (:meth:`load`) from the workflow's record.
    Each step's job, once enqueued, can be looked at from anywhere (``app.status(job_id)``,
    ``shardq job show``)."""

    def __init__(self, app: App | None, wf_id: str, steps: list[Step], barriers: list[tuple[int, str]],
                 finals: list[str], first_ids: list[Any], single: bool, queue: Any = None):
        self.app, self.id, self.steps, self.barriers = app, wf_id, steps, barriers
        self.finals, self.first_ids, self.single = finals, first_ids, single
        self._queue = queue

    def _clock(self) -> Clock:
        """The clock its waits are timed by: the app's (a workflow loaded without one: the system's)."""
        return self.app.clock if self.app is not None else SystemClock()

    @property
    def queue(self) -> Any:
        """The client it looks with: the app's, or the one it was loaded with."""
        return self._queue if self._queue is not None else self.app.queue  # type: ignore[union-attr]  # one is set: load() passes a queue exactly when it has no app

    @classmethod
    def start(cls, app: App, top: Chain) -> Workflow:
        q = app.queue
        if not isinstance(q, Results):
            raise Unsupported(f"workflows need the local shards' service; {type(q).__name__} keeps no results "
                              "or barriers (docs/workflows.md)")
        wf_id = uuid.uuid4().hex[:20]
        ttl = max([limits.WORKFLOW_RESULT_S_DEFAULT] + [s.task.keep_result or 0 for s in signatures(top)])
        builder = Builder(q.route, wf_id, float(ttl))
        items = builder.build(top)
        for queue, (size, step) in builder.later.items():  # each queue's limit (the client keeps it)
            most = q.queue_config(queue).get("max_body_bytes")
            if type(most) is int and size > most:
                raise InvalidJob(f"{step}: its job's body is {size} bytes, over the max_body_bytes of queue "
                                 f"{queue!r} ({most}): the barrier that enqueues it would be refused")
        finals, single = final_paths(top), isinstance(top.steps[-1], Signature)
        # The record's size, checked before anything is enqueued (each id adds at most 9 bytes).
        room = len(spec_of(builder.steps, builder.barriers, finals, [], single)) + 9 * len(items)
        if room > limits.WORKFLOW_SPEC_BYTES_MAX:
            raise InvalidJob(f"workflow of {len(builder.steps)} steps: its record would take up to {room} bytes, "
                             f"over limits.WORKFLOW_SPEC_BYTES_MAX ({limits.WORKFLOW_SPEC_BYTES_MAX}); split it")
        if builder.later_priorities:  # as the client's own prioritized enqueue would, before any job is in
            q.note_priorities(sorted(builder.later_priorities))
        jobs = [{"body": b, "key": k, "queue": qn, "delay": d, "priority": p} for b, k, qn, d, p in items]
        # One call, however many jobs, never cut here: the client checks the whole batch (keys,
        # bodies against their queues' max_body_bytes) before it sends any request; parts
        # would be checked alone, and a refusal past the 10,000th job leave the first ones in.
        ids: list[Any] = q.enqueue_many(jobs)
        wf = cls(app, wf_id, builder.steps, builder.barriers, finals, ids, single)
        try:
            q.put_workflow(wf_id, spec_of(wf.steps, wf.barriers, finals, ids, single))
        except ShardqError as exc:  # it runs all the same: only the record is missing
            log.warning("workflow %s: sent, but its record was not kept (%s: %s): it runs, and is not listed "
                        "(metrics, console, shardq workflow show)", wf_id, type(exc).__name__, exc)
        return wf

    @classmethod
    def load(cls, source: App | Results, wf_id: str) -> Workflow:
        """The workflow ``wf_id`` as its record says, from any process: ``source`` is an
        :class:`~shardq.tasks.app.App` or a client with the results and workflow calls
        (:class:`~shardq.client.contracts.Results`: a router of the local shards). NotFound
        if no record of it is kept (never sent from a version that keeps them, or ended and
        expired); Unsupported for an app whose queue keeps none."""
        app = None if isinstance(source, Results) else source
        q = source if app is None else app.queue
        if not isinstance(q, Results):
            raise Unsupported(f"workflows need the local shards' service; {type(q).__name__} keeps no "
                              "workflow records (docs/workflows.md)")
        steps, barriers, finals, first_ids, single = from_spec(q.workflow(workflow_id(wf_id))["spec"])
        return cls(app, wf_id, steps, barriers, finals, first_ids, single, queue=None if app else q)

    def outcome(self) -> tuple[str, str | None] | None:
        """How the workflow ended, from its jobs and barriers (what the service's watcher
        records): ``("failed", why)`` once a step was dead-lettered, ``("succeeded", None)``
        once every final step succeeded, ``("cancelled", why)`` once it was cancelled
        (``wf.cancel()``, a barrier cancelled) or a step's job is gone before it reported
        (cancelled, or purged); None while it runs. ``why`` names the step."""
        q = self.queue
        *_, v = _drive(q, self._judge(q.shards, every=False))
        if v.state == RUNNING:
            return None
        if v.state == SUCCEEDED:
            return "succeeded", None
        return ("failed" if v.state == FAILED else "cancelled"), v.why

    # ------------------------------------------------------------------ looking
    # The reading is written once, as generators that yield the client calls they need
    # (``(method, args)``) and are sent their replies: ``_drive`` runs them with the
    # threaded client, ``_adrive`` with the asyncio one.
    def _marker(self, shards: int) -> tuple[int, str]:
        """The barrier ``wf.cancel()`` cancels first, whatever else has fired: the durable
        sign, read with the workflow's barriers, that it was cancelled (no step uses it)."""
        bid = f"{self.id}.cancel"
        return zlib.crc32(bid.encode()) % shards, bid

    def _judge(self, shards: int, every: bool) -> Reading[tuple[Any, ...]]:
        """One look: each step's job, the results read (``every``: every step's, as sizes;
        else those ``result()`` watches, with values), the barriers, and the
        :class:`Verdict`. A step that reads as gone before it reported is confirmed by a
        second read of the barriers (it may have reported, and been acked, in between)."""
        states = yield "barriers", (self.barriers + [self._marker(shards)],)
        barriers = dict(zip(self.barriers, states))
        cancelled = bool(states[-1] and states[-1].get("cancelled"))
        jobs = step_jobs(self.steps, self.first_ids, barriers)
        known = [j for j in jobs if j is not None] if every else watched(self.steps, jobs, barriers, self.finals)
        results = {r.job_id: r for r in (yield "results", (known, every))} if known else {}
        v = verdict(self.steps, jobs, results, barriers, self.finals, cancelled)
        if v.state == ENDED and v.recheck:
            again = dict(zip(self.barriers, (yield "barriers", (self.barriers,))))
            v = verdict(self.steps, jobs, results, again, self.finals, cancelled)
        return jobs, results, barriers, v

    def _answer(self, v: Verdict) -> Reading[Any]:
        """What ``result()`` says of an ended workflow: its value, or the error it raises.
        A failure is recorded as the watcher would record it (``failed``: its first end is
        kept), then raised as JobFailed. An end the jobs cannot tell apart (a cancel from a
        dead step purged, a cancel from a result gone) is told by the workflow's record,
        ended here as cancelled unless it ended already (its first end is kept): ``failed``
        raises JobFailed with the failure it recorded, ``succeeded`` the value (or
        JobFailed: the result is gone since)."""
        if v.state == SUCCEEDED:
            return self._value(v.values)
        step, task = (v.step.path, v.step.task) if v.step is not None else (None, None)
        if v.state == FAILED:
            # Recorded as the watcher would (its first end is kept: a redrive later lets it
            # run on, and it stays failed). The jobs say it failed whatever the record says,
            # so a record that cannot be written changes nothing here.
            try:
                yield "end_workflow", (self.id, "failed", v.why, RECORD_KEPT_S)
            except ShardqError:
                pass  # no record kept (NotFound), or its shard unavailable: the watcher records it
            raise JobFailed(v.why or "", job_id=v.job_id, error=v.error, task=task, step=step)
        try:
            state = yield "end_workflow", (self.id, "cancelled", v.why, RECORD_KEPT_S)
        except NotFound:
            state = None  # no record kept (its put failed, or it expired): the jobs alone say
        if state == "succeeded" and v.values is not None:
            return self._value(v.values)
        if state == "failed":
            try:
                error = (yield "workflow", (self.id,))["error"]
            except NotFound:  # expired in between: its failure is all it said
                error = None
            raise JobFailed(f"workflow {self.id} failed: {error or 'a step was dead-lettered'} (since then: {v.why})",
                            job_id=v.job_id, error=error, task=task, step=step)
        if state == "succeeded" or (state is None and v.lost):
            raise JobFailed(f"workflow {self.id} ended, but its result cannot be read: {v.why}", job_id=v.job_id,
                            error=v.why, task=task, step=step)
        raise WorkflowCancelled(f"workflow {self.id} cancelled: {v.why}", workflow_id=self.id, step=step,
                                task=task, job_id=v.job_id)

    def _poll(self, shards: int) -> Reading[tuple[bool, Any]]:
        """One look for ``result()``: ``(True, value)`` once it ended (or the error raised),
        ``(False, None)`` while it runs."""
        *_, v = yield from self._judge(shards, every=False)
        if v.state == RUNNING:
            return False, None
        return True, (yield from self._answer(v))

    def _value(self, values: list[Any] | None) -> Any:
        out = [unpack(v) for v in values or []]
        return out[0] if self.single else out

    def _look(self, q: Any, every: bool = True) -> tuple[list[int | None], dict[int, Any], Barriers]:
        """Each step's job, the outcomes of every step's job (``every``: their values'
        sizes only) or of the ones ``result()`` watches (with their values), and the
        barriers' states."""
        jobs, results, barriers, _ = _drive(q, self._judge(q.shards, every))
        return jobs, results, barriers

    def status(self) -> list[dict[str, Any]]:
        """Every step: ``step`` (its path), ``task``, ``job_id`` (None until enqueued),
        ``state`` (``pending`` before it is enqueued, then the job's: ``ready``, ``leased``,
        ``succeeded``, ``dead``...), ``attempts``, ``progress``, ``note``, ``error``,
        ``result_bytes``; a pending step also ``arrived`` of ``total``."""
        jobs, results, barriers = self._look(self.queue)
        return status_rows(self.steps, jobs, results, barriers)

    def result(self, timeout: float | None = None) -> Any:
        """The workflow's value once it is done: the last step's return value (a list of
        the members' for one that ends with a group). Once it has ended otherwise, at
        once: JobFailed if a step was dead-lettered (or purged since, or its result is
        gone), WorkflowCancelled if it was cancelled (``cancel()``, or a step's job
        cancelled); both name the step. TimeoutError if it runs past ``timeout`` seconds
        (None or ``math.inf``: no limit; NaN is refused with InvalidJob)."""
        q, clock = self.queue, self._clock()
        deadline = _deadline(timeout, clock)
        wait = POLL_FIRST_S
        while True:
            done, value = _drive(q, self._poll(q.shards), _retry_left(deadline, clock))
            if done:
                return value
            wait = _next_wait(wait, deadline, f"workflow {self.id}", clock)
            time.sleep(wait)

    async def result_async(self, timeout: float | None = None) -> Any:
        """As :meth:`result`, with the app's asyncio client (``await wf.result_async()``)."""
        if self.app is None:
            raise TypeError("result_async needs a workflow sent or loaded with an App (Workflow.load(app, id))")
        q, clock = await self.app.aio(), self.app.clock
        deadline = _deadline(timeout, clock)
        wait = POLL_FIRST_S
        while True:
            done, value = await _adrive(q, self._poll(q.shards), _retry_left(deadline, clock))
            if done:
                return value
            wait = _next_wait(wait, deadline, f"workflow {self.id}", clock)
            await asyncio.sleep(wait)

    def cancel(self) -> dict[str, Any]:
        """Stop what has not run: its marker is cancelled (from then on ``result()``
        raises WorkflowCancelled at once), then each barrier not fired yet (nothing after
        it is enqueued), then every job enqueued and not finished
        (:meth:`~shardq.client.router.Router.cancel`); the record ends ``cancelled``.
        A workflow that had ended already keeps its end: one that succeeded is left as it
        is, one that failed is recorded failed (and what is left of it cancelled). Returns
        the counts and the record's ``state``."""
        q: Any = self.queue
        *_, before = _drive(q, self._judge(q.shards, every=False))
        if before.state == SUCCEEDED:
            return {"barriers_cancelled": 0, "jobs": {}, "state": self._end(q, "succeeded", None)}
        if before.state == FAILED:
            self._end(q, "failed", before.why)
        q.cancel_barrier(*self._marker(q.shards), RECORD_KEPT_S)
        fired = 0
        for shard, bid in self.barriers:
            fired += q.cancel_barrier(shard, bid, limits.WORKFLOW_RESULT_S_DEFAULT) == "fired"
        jobs, results, _ = self._look(q)
        outcomes: dict[str, int] = {}
        for job_id in jobs:
            r = results.get(job_id) if job_id is not None else None
            if r is None or r.state in ("succeeded", "gone"):
                continue
            what = q.cancel(job_id)
            outcomes[what] = outcomes.get(what, 0) + 1
        state = self._end(q, "cancelled", "cancelled by wf.cancel()")
        return {"barriers_cancelled": len(self.barriers) - fired, "jobs": outcomes, "state": state}

    def _end(self, q: Any, state: str, why: str | None) -> str:
        """Record the end (its first end is kept): the state the record holds now."""
        try:
            recorded: str = q.end_workflow(self.id, state, why, RECORD_KEPT_S)
            return recorded
        except NotFound:
            return state  # sent without a record (its put failed, or an older version sent it)


def _drive(q: Results, gen: Reading[Any], retry_s: float | None = None) -> Any:
    """Run a reading generator with the threaded client ``q``: each call it yields is
    made, and its reply (or its ShardqError) sent back; returns what it returns.
    ``retry_s``: how long each call tries a shard that is down (None: the client's)."""
    reply: Any = None
    error: ShardqError | None = None
    kw = {} if retry_s is None else {"retry_s": retry_s}
    while True:
        try:
            method, args = gen.throw(error) if error is not None else gen.send(reply)
        except StopIteration as stop:
            return stop.value
        try:
            reply, error = getattr(q, method)(*args, **kw), None
        except ShardqError as exc:
            reply, error = None, exc


async def _adrive(q: AsyncResults, gen: Reading[Any], retry_s: float | None = None) -> Any:
    """As :func:`_drive`, with the asyncio client."""
    reply: Any = None
    error: ShardqError | None = None
    kw = {} if retry_s is None else {"retry_s": retry_s}
    while True:
        try:
            method, args = gen.throw(error) if error is not None else gen.send(reply)
        except StopIteration as stop:
            return stop.value
        try:
            reply, error = await getattr(q, method)(*args, **kw), None
        except ShardqError as exc:
            reply, error = None, exc


def _retry_left(deadline: float | None, clock: Clock) -> float | None:
    """How long a look of ``result(timeout)`` may try a shard that is down: until the
    deadline (at least a moment, to reconnect to one that is up), None without one."""
    if deadline is None:
        return None
    return max(RETRY_FLOOR_S, deadline - clock.monotonic())


#: Steps a description lists (``describe``); the counts by state cover every step.
DESCRIBE_STEPS_MAX = 200


def describe(q: Any, wf_id: str, steps_max: int = DESCRIBE_STEPS_MAX) -> dict[str, Any]:
    """A workflow as ``shardq workflow show`` and the console show it, from its record and
    its steps' jobs, with the client ``q``: ``id``, ``state`` (``running``, or how it
    ended as the service's watcher recorded it), ``error``, ``started_at``, ``ended_at``,
    ``expires_at``, ``steps_total``, ``steps_by_state`` (every step's state counted),
    ``steps`` (the first ``steps_max`` rows of :meth:`Workflow.status`, in step order) and
    ``steps_shown``. NotFound if no record of it is kept."""
    record = q.workflow(workflow_id(wf_id))
    wf = Workflow.load(q, wf_id)
    rows = wf.status()
    by_state: dict[str, int] = {}
    for row in rows:
        by_state[row["state"]] = by_state.get(row["state"], 0) + 1
    return {"id": wf_id, "state": record["state"], "error": record["error"], "started_at": record["started_at"],
            "ended_at": record["ended_at"], "expires_at": record["expires_at"], "steps_total": len(rows),
            "steps_by_state": by_state, "steps": rows[:steps_max], "steps_shown": min(len(rows), steps_max)}


def _deadline(timeout: float | None, clock: Clock) -> float | None:
    """The deadline (``clock``'s monotonic time) of a ``result(timeout)``: None, no deadline,
    for ``timeout=None`` or ``math.inf``; InvalidJob for NaN (a deadline no time passes: it
    waited for ever) or a value that is not a number. A timeout of 0 or less looks once."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or math.isnan(timeout):
        raise InvalidJob(f"timeout must be None or a number of seconds, got {timeout!r:.40}")
    if timeout == math.inf:
        return None
    return clock.monotonic() + float(timeout)


def _next_wait(wait: float, deadline: float | None, what: str, clock: Clock) -> float:
    """The next pause between looks (doubling up to POLL_MAX_S, never past the deadline,
    a reading of ``clock``'s monotonic time); TimeoutError (``"<what> not done in time"``)
    once the deadline has passed."""
    if deadline is not None:
        left = deadline - clock.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} not done in time")
        return min(wait * 2, POLL_MAX_S, left)
    return min(wait * 2, POLL_MAX_S)
