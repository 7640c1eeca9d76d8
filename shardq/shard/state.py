"""The shard state machine: pure logic, no I/O, no clock, no randomness.

Every public method takes ``now`` (wall-clock seconds) from the caller, validates its
input (raising a typed error and changing nothing), then mutates the state only by
applying log operations (:mod:`.ops`) through :meth:`ShardState.apply`, the same function
replay uses. The operations produced are collected for the caller to persist
(:meth:`ShardState.take_ops`); a caller must make them durable before it replies, with one
exception: a lease of a ``lease_sync = "batched"`` queue whose job's enqueue is already
durable may be answered once its record is written, before its fsync (:mod:`.committer`).

:class:`ShardState` is one object made of one module per concern, each a mixin built on
:class:`~.core.StateCore` (the shared attributes, the plumbing of operations, job state
changes, key lines, time) and on nothing else:

============================  ==========================================================
:mod:`.queues` (QueueOps)     keys and queues: enqueue, producer dedup, retry sessions,
                              ready priorities, stats, queue settings
:mod:`.leases` (LeaseOps)     dequeue, ack, nack, bury, extend, dead letters, epochs
:mod:`.control` (ControlOps)  pause, resume, cancel, job look-up, dead-letter pages,
                              metrics figures
:mod:`.results` (ResultOps)   results, progress, workflow barriers (arrive, fire, cancel)
:mod:`.workflows`             workflow records: put, end, read, list the running ones
(WorkflowOps)
:mod:`.checkpoint`            the checkpoint codec: snapshot, and applying checkpoint-only
(CheckpointCodec)             operations
============================  ==========================================================

The one place two concerns meet is a barrier's callback: the arrival that completes a
barrier (:mod:`.results`) enqueues its callback through the enqueue path (:mod:`.queues`),
so :class:`ShardState`, which holds both, provides ``_enqueue_callback``.

Job states and their transitions are in :mod:`.jobstate`; the data layout is described in
:mod:`.core`.
"""
from __future__ import annotations

from typing import Any

from .checkpoint import CheckpointCodec
from .control import ControlOps
from .core import KEY_LIST_MAX, Job, QueueState, StateCore
from .jobstate import TRANSITIONS, JobState
from .leases import LeaseOps
from .queues import QueueOps
from .results import ResultOps
from .workflows import WorkflowOps

__all__ = ["ShardState", "JobState", "TRANSITIONS", "KEY_LIST_MAX", "Job", "QueueState", "StateCore"]


class ShardState(QueueOps, LeaseOps, ControlOps, ResultOps, WorkflowOps, CheckpointCodec):
    """The state of one shard. See the module docstring for the guarantees and for which
    module holds which of its methods; every method is on this one object, as before the
    split, so callers and replay see no difference."""

    def _enqueue_callback(self, item: tuple[Any, ...], now: float) -> int:
        """A barrier's callback enqueued as any job is (its checks, limits, dedup): the
        job's id; the enqueue's typed error, with nothing logged, if it refuses."""
        return self.enqueue_many([item], now)[0]
