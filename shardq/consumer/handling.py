"""Running one job: the handler's context, the exactly-once-effect transaction, backoff.

:func:`execute` is the idempotent consumer. With a store it skips a job id already
processed; otherwise it runs the handler inside the store's transaction, claims the job id
(UNIQUE) in that same transaction, checks the lease is still ours, and only then commits,
so the handler's writes through ``ctx.db`` and the "processed" mark land together or not
at all. The ack comes after the commit (in :mod:`shardq.consumer.worker`).
"""
from __future__ import annotations

import importlib
import logging
import random
import signal
from typing import Any, Callable

from .. import limits
from .idempotency import IdempotencyStore
from ..types import Lease

log = logging.getLogger("shardq.worker")

# Outcomes of one run of a job.
DONE, DUPLICATE, FAILED, LOST, EXPIRED, SKIPPED = (
    "done", "duplicate", "failed", "lost", "expired", "skipped")


class Context:
    """What a handler gets. ``db`` is the idempotency transaction's DB-API cursor (None
    without a store). ``lease`` is the lease as it was when the handler started; the
    worker tracks later heartbeats itself."""

    __slots__ = ("job_id", "key", "body", "attempt", "queue", "lease", "db")

    def __init__(self, lease: Lease, db: Any = None):
        self.job_id, self.key, self.body = lease.job_id, lease.key, lease.body
        self.attempt, self.queue, self.lease, self.db = lease.attempt, lease.queue, lease, db

    def __repr__(self) -> str:
        return f"Context(job_id={self.job_id}, queue={self.queue!r}, attempt={self.attempt})"


Handler = Callable[[Context], Any]


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in ``[0, min(cap_s, base_s * 2**(attempt-1))]``."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(max(attempt, 1) - 1, 64)))


def error_text(exc: BaseException) -> str:
    """``"Type: message"``, cut to ``limits.ERROR_TEXT_BYTES_MAX`` UTF-8 bytes."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # a __str__ that raises
        text = type(exc).__name__
    raw = text.encode("utf-8", "replace")
    if len(raw) > limits.ERROR_TEXT_BYTES_MAX:
        text = raw[: limits.ERROR_TEXT_BYTES_MAX].decode("utf-8", "ignore")
    return text


def execute(handler: Handler, lease: Lease, store: IdempotencyStore | None,
            may_commit: Callable[[], bool] | None = None) -> tuple[str, str | None]:
    """Run one job (in a runner thread, or in a pool process with ``may_commit=None``).

    With a store: skip if seen; else handler, claim, lease check, commit, in that order.
    The claim comes last so the write lock is held as briefly as the handler allows, and
    the lease check comes after the claim, right before the commit. Returns (outcome, error).
    """
    try:
        if store is None:
            handler(Context(lease))
            return DONE, None
        if store.seen(lease.job_id):
            return DUPLICATE, None
        with store.transaction() as txn:
            handler(Context(lease, txn.db))
            if not txn.claim(lease.job_id):
                txn.abort()  # another delivery committed it while we ran
                return DUPLICATE, None
            if may_commit is not None and not may_commit():
                txn.abort()  # lease lost: roll back, the redelivery wins
                return LOST, None
        return DONE, None
    except BaseException as exc:  # noqa: BLE001 - a handler must never kill its runner
        log.warning("job %s attempt %d failed", lease.job_id, lease.attempt, exc_info=True)
        return FAILED, error_text(exc)


# ---------------------------------------------------------------------------- pool processes
# Process-local state of a pool process, set once by its initializer (never used in the parent).
_CHILD: dict[str, Any] = {}


def _child_init(handler: Handler, spec: tuple | None) -> None:
    # The parent handles SIGINT/SIGTERM (a terminal or a service manager signals the whole
    # group); children finish their job and are SIGKILLed if the grace period ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    store = None
    if spec is not None:
        factory, args, kwargs = spec
        store = factory(*args, **kwargs)
    _CHILD.update(handler=handler, store=store)


def _child_run(lease: Lease) -> tuple[str, str | None]:
    # No lease check before the commit here (the lease lives in the parent); the UNIQUE
    # claim still keeps the effect to one commit. See docs/guarantees.md.
    return execute(_CHILD["handler"], lease, _CHILD["store"], None)


def load_handler(spec: str) -> Handler:
    """Import ``"package.module:function"`` (the attribute may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected module:function, got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return obj
