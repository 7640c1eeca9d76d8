"""The history checker: pure, no I/O. See the package docstring for what it counts."""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


from ..shard.ops import TOKEN_EPOCH_BITS
from ..types import JobId
from .history import EXAMPLES_MAX, FAILING, Effect, Enqueue, LeaseRec, body_digest, body_for, parse_body


@dataclass
class Report:
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.counts.get(k, 0) == 0 for k in FAILING)

    def bad(self, what: str, example: Any) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        ex = self.examples.setdefault(what, [])
        if len(ex) < EXAMPLES_MAX:
            ex.append(example)


def check(enqueues: list[Enqueue], leases: list[LeaseRec], effects: list[Effect],
          dead_letters: int = 0, body_bytes: int = 0, lease_sync: str = "batched") -> Report:
    """Judge a run's histories. Pure: no I/O. See the module docstring for the rules.
    ``body_bytes``: the run's ``--body-bytes``; every effect's body digest is checked
    against the body its header says was enqueued. ``lease_sync``: the queue's; under
    ``"strict"`` no lease is lost to a crash, so a job leased again while a lease from
    before a restart lives, or two deliveries of one job with the same attempt number, fail
    the run (under ``"batched"`` a power cut may cause both: counted as information)."""
    rep = Report(counts=dict.fromkeys(FAILING, 0))
    invoked: dict[tuple[Any, ...], tuple[Enqueue, JobId | None]] = {}   # (key, seq) -> (op, id if ok)
    for op in enqueues:
        ids = op.ids if op.outcome == "ok" else None  # an ok call's ids, in item order
        for i, item in enumerate(op.items):
            invoked[tuple(item)] = (op, None if ids is None else ids[i])

    # Effects by (key, seq), in commit order.
    applied: dict[tuple[Any, ...], list[Effect]] = defaultdict(list)
    for e in sorted(effects, key=lambda e: e.order):
        parsed = parse_body(e.body)
        if parsed is None or (e.lease_key is not None and parsed[1] != e.lease_key):
            rep.bad("unexpected", {"job_id": e.job_id, "body": e.body.decode("utf-8", "replace")[:80],
                                   "why": "body not a verify job or not its lease's key"})
            continue
        applied[(parsed[1], parsed[2])].append(e)
        if e.body_digest is not None and e.body_digest != body_digest(body_for(*parsed, body_bytes)):
            rep.bad("body_mismatch", {"job_id": e.job_id, "key": parsed[1], "seq": parsed[2],
                                      "why": "the body delivered is not the body enqueued"})

    for kseq, effs in applied.items():
        if len(effs) > 1:
            rep.bad("duplicated_effects", {"key": kseq[0], "seq": kseq[1], "job_ids": [e.job_id for e in effs]})
        hit = invoked.get(kseq)
        if hit is None or hit[0].outcome == "fail":
            rep.bad("unexpected", {"key": kseq[0], "seq": kseq[1], "job_id": effs[0].job_id,
                                   "why": "never enqueued" if hit is None else "enqueue failed definitely"})
        elif hit[1] is not None and effs[0].job_id != hit[1]:
            rep.bad("id_mismatch", {"key": kseq[0], "seq": kseq[1], "enqueue_id": hit[1],
                                    "effect_job_id": effs[0].job_id})

    ok_jobs = ambiguous = recovered = 0
    for kseq, (op, jid) in invoked.items():
        if op.outcome == "ok":
            ok_jobs += 1
            if kseq not in applied:
                rep.bad("lost", {"key": kseq[0], "seq": kseq[1], "job_id": jid, "producer": op.producer})
        elif op.outcome == "info":
            ambiguous += 1
            recovered += kseq in applied

    def order_check(included: Callable[[tuple[Any, ...]], bool], count_as: str | None) -> int:
        last: dict[str, tuple[int, Effect]] = {}
        bad = 0
        for (key, seq), e in sorted(((kseq, effs[0]) for kseq, effs in applied.items()),
                                    key=lambda ke: ke[1].order):
            if not included((key, seq)):
                continue
            prev = last.get(key)
            if prev is not None and seq < prev[0]:
                bad += 1
                if count_as:
                    rep.bad(count_as, {"key": key, "seq": seq, "committed_after_seq": prev[0],
                                       "job_id": e.job_id, "after_job_id": prev[1].job_id})
            else:
                last[key] = (seq, e)
        return bad

    order_check(lambda ks: ks in invoked and invoked[ks][0].outcome == "ok", "order_violations")
    rep.info["order_violations_incl_recovered"] = order_check(
        lambda ks: ks in invoked and invoked[ks][0].outcome != "fail", None)

    _check_leases(rep, leases, strict=lease_sync == "strict")
    deliveries = Counter(l.job_id for l in leases)
    rep.info.update(
        enqueue_ops=len(enqueues),
        enqueue_ops_ok=sum(op.outcome == "ok" for op in enqueues),
        jobs_ok=ok_jobs, jobs_ambiguous=ambiguous, ambiguous_delivered=recovered,
        ambiguous_not_delivered=ambiguous - recovered,
        jobs_failed=sum(len(op.items) for op in enqueues if op.outcome == "fail"),
        jobs_delayed=sum(op.delayed for op in enqueues),
        enqueue_resends=sum(op.tries - 1 for op in enqueues),
        enqueue_ops_ok_after_resend=sum(op.tries > 1 and op.outcome == "ok" for op in enqueues),
        enqueue_ops_taken_up=sum(op.taken_up for op in enqueues),
        effects=len(effects), deliveries=len(leases),
        duplicate_deliveries=sum(n - 1 for n in deliveries.values()),
        redelivered_jobs=sum(n > 1 for n in deliveries.values()),
        max_attempt=max((l.attempt for l in leases), default=0),
        worker_stalls=dict(Counter(l.stalled for l in leases if l.stalled)),
        leases_expired_before_start=sum(l.result == "expired" for l in leases),
        acks_lease_lost=sum(l.result in ("LeaseLost", "JobGone") and l.nack_delay is None for l in leases),
        nacks=sum(l.nack_delay is not None for l in leases),
        nacks_ok=sum(l.nack_delay is not None and l.result == "ok" for l in leases),
        extends=sum(l.extended is not None for l in leases),
        extends_ok=sum(l.extended == "ok" for l in leases),
        late_commits=sum(l.commit_t is not None and l.commit_t > l.deadline for l in leases),
        late_commits_new_effect=sum(bool(l.inserted) and l.commit_t is not None and l.commit_t > l.deadline
                                    for l in leases),
        dead_letters=dead_letters)
    return rep


def _epoch(token: object) -> int | None:
    """The shard start a local lease token belongs to (tokens of other backends: None)."""
    return token >> TOKEN_EPOCH_BITS if isinstance(token, int) else None


def _check_leases(rep: Report, leases: list[LeaseRec], strict: bool = False) -> None:
    """Two leases of one key live at once, judged conservatively from the worker's clock
    readings: a lease was granted at some time in [t0, t1] and ended no earlier than
    min(ack sent, deadline); a pair overlaps for certain when each was granted before the
    other's earliest end. And one delivery count handed out twice for a job."""
    seen: dict[tuple[int, int], str] = {}
    for l in leases:
        other = seen.setdefault((l.job_id, l.token), l.worker)
        if other != l.worker:
            rep.bad("token_reused", {"job_id": l.job_id, "token": l.token, "workers": [other, l.worker]})
    attempts: dict[tuple[int, int], LeaseRec] = {}
    for l in sorted(leases, key=lambda l: l.t1):
        first = attempts.setdefault((l.job_id, l.attempt), l)
        if first is not l and first.token != l.token:
            # A crash lost the first lease's record, so the job went out again with the same
            # count: "batched" leases allow it after a machine crash, "strict" ones never.
            if strict:
                rep.bad("attempt_reused", {"job_id": l.job_id, "attempt": l.attempt,
                                           "tokens": [first.token, l.token], "workers": [first.worker, l.worker]})
            else:
                rep.info["attempts_reused"] = rep.info.get("attempts_reused", 0) + 1
    by_key: dict[str, list[LeaseRec]] = defaultdict(list)
    for l in leases:
        if l.key is not None:
            by_key[l.key].append(l)

    def end_lo(l: LeaseRec) -> float:
        return min(l.deadline, l.end_t0 if l.end_t0 is not None else float("inf"))

    for key, ls in by_key.items():
        ls.sort(key=lambda l: l.t1)
        active: list[LeaseRec] = []
        for l in ls:
            active = [a for a in active if end_lo(a) > l.t1]
            for a in active:
                if a.t1 < end_lo(l) and (a.job_id, a.token) != (l.job_id, l.token):
                    if _epoch(a.token) != _epoch(l.token) and not strict:
                        # A lease from before a shard restart beside one after it: with
                        # lease_sync = "batched" a power cut may lose the first one's record,
                        # so its job is leased again; the old holder is fenced (its token is
                        # below the new epoch: LeaseLost), the effect stays once.
                        rep.info["fenced_overlaps"] = rep.info.get("fenced_overlaps", 0) + 1
                        continue
                    rep.bad("double_in_flight", {
                        "key": key, "first": [a.job_id, a.token, a.worker], "second": [l.job_id, l.token, l.worker],
                        "first_deadline": a.deadline, "second_granted_by": l.t1})
            active.append(l)


# ====================================================================== child roles
