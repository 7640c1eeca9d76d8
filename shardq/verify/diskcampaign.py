"""The disk-fault campaign (``shardq verify --disk-faults``): one fault of synced data per
phase, against a real service, and a verdict for each.

A phase, on the campaign's data dir:

1. ``shardq serve`` starts (the WAL's sync hook on: :mod:`.diskfaults`); the workload runs
   through the router, each acknowledged id and body recorded: the leases held since the
   last phase acked or nacked, new jobs enqueued (single calls and batches, keyed and
   keyless, some with dedup ids), jobs leased, most acked, some nacked, the rest held
   across the kill. Rounds repeat until a file of the fault's target can take it;
2. once the service is idle (every call answered, a round trip to every shard after it,
   then no file of a shard and no line of the sync log changing for ``QUIET_S``), the
   supervisor and its shards are SIGKILLed by PID;
3. the data dir is copied and the fault is applied to the copy, in synced bytes only;
   the service restarts on the copy, and the fault gets its verdict (:func:`judge`):
   **kept** (the shard started and every acknowledged, not yet acked job is there, byte
   for byte, and no acked one came back), **refused** (the shard stays down, its reason
   in ``stats`` is a corrupt log naming the damaged file and an offset no later than the
   damage, and the other shards serve all their jobs) or **LOSS** (anything else);
4. after a refusal, ``shardq wal repair <shard dir> --force`` runs on the copy and the
   service starts again: how many of the shard's jobs came back is reported, not judged;
5. the copy is deleted. The next phase goes on from the undamaged data dir, so faults
   never pile up and the record of what was acknowledged stays exact.

What the seed fixes: the plan (:func:`~.plan.disk_plan`), the workload's calls and bodies,
and each fault's draws. The files' sizes can differ between two runs (what a shard
writes depends in places on timing, e.g. when it goes idle), and with them the offsets a
draw lands on.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from types import FrameType
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass
from typing import Any

from ..protocol import status_file
from ..datadir import DataDir
from ..errors import NotFound, ShardqError
from ..types import Lease
from ..service.supervision import START_TIMEOUT_S
from ..service.supervisor import child_env
from ..wal.fileio import FAULT_SYNC_LOG_ENV
from .diskfaults import Damage, apply, choose
from .history import CLOCK
from .plan import DISK_KINDS, DISK_TARGETS, DiskFault, disk_plan, fingerprint
from .run import RunDir, _alive, _short_tmpdir, _signal, _toml

KiB = 1024
QUIET_S = 0.3            # an idle shard has written its last byte this long ago
# The longest a service may take to have every shard ready or failed: longer than the
# supervisor's own start timeout, so a shard it takes for hung is restarted and judged.
SETTLE_S = START_TIMEOUT_S + 30
VISIBILITY_S = 3600.0    # leases held across phases never expire during a run
LIVE_JOBS_TARGET = 120   # the workload leases and acks to keep about this many jobs live
KEYS = 24
ROUNDS_MAX = 40          # workload rounds a phase runs at most to grow a file of its target

KEPT, REFUSED, LOSS = "kept", "refused", "LOSS"
VERDICTS = (KEPT, REFUSED, LOSS)
_CORRUPT = re.compile(r"corrupt log (\S+) at (?:byte )?offset (\d+)")


@dataclass
class Outcome:
    index: int
    kind: str
    target: str
    shard: int | None = None
    damage: str = ""
    verdict: str = ""
    why: str = ""              # the refusal's reason, or what went missing
    torn_cut: bool = False     # the restarted service logged a torn tail cut
    repair: dict[str, Any] | None = None  # after a refusal: exit code, jobs of the shard back of expected


@dataclass
class Found:
    """What a started shard holds of what it should: acknowledged jobs it lacks, jobs whose
    body differs, and how many more jobs it has than it should (acked ones come back)."""

    missing: list[int]
    changed: list[int]
    extra: int

    @property
    def ok(self) -> bool:
        return not (self.missing or self.changed or self.extra)

    def describe(self) -> str:
        parts = [f"{len(self.missing)} acknowledged jobs missing{_eg(self.missing)}" if self.missing else "",
                 f"{len(self.changed)} with another body{_eg(self.changed)}" if self.changed else "",
                 f"{self.extra} more jobs than live (acked jobs back)" if self.extra else ""]
        return ", ".join(p for p in parts if p)


def _eg(ids: list[int]) -> str:
    return f" (e.g. {', '.join(map(str, ids[:3]))})" if ids else ""


def judge(shard: int, damage: Damage, shards: list[dict[str, Any]], found: dict[int, Found]) -> tuple[str, str]:
    """The verdict on one fault, and why: from ``stats()["shards"]`` of the restarted
    service and what each shard that answered holds (``found``)."""
    for i, sh in enumerate(shards):
        if i == shard:
            continue
        if not sh.get("available"):
            return LOSS, f"undamaged shard {i} is down: {sh.get('reason') or sh.get('error')}"
        if not found[i].ok:
            return LOSS, f"undamaged shard {i}: {found[i].describe()}"
    sh = shards[shard]
    if sh.get("available"):
        return (KEPT, "") if found[shard].ok else (LOSS, f"started: {found[shard].describe()}")
    reason = sh.get("reason") or sh.get("error") or ""
    m = _CORRUPT.search(reason)
    if sh.get("reason_kind") != "corrupt_log" or m is None:
        return LOSS, f"down, not as a corrupt log: status {sh.get('status')}: {reason}"
    if os.path.realpath(m.group(1)) != os.path.realpath(damage.path):
        return LOSS, f"refused naming another file: {reason}"
    if int(m.group(2)) > damage.end:
        return LOSS, f"refused at an offset after the damage (which ends at {damage.end}): {reason}"
    return REFUSED, reason


class Campaign:
    """One campaign: owns every process it starts and ends them by PID."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.plan = disk_plan(a.seed, a.faults_per_kind)
        self.data_dir = a.data_dir or os.path.join(_short_tmpdir(), "data")
        self.fault_dir = self.data_dir.rstrip("/") + "-fault"
        self.work = self.data_dir.rstrip("/") + "-verify"
        os.makedirs(self.work, exist_ok=True)
        self.sync_log = os.path.join(self.work, "synced-sizes.log")
        self.rng = random.Random(f"{a.seed}/disk-workload")
        self.live: dict[int, bytes] = {}      # acknowledged, not acked: job id -> body
        self.acked = 0
        self.held: list[Lease] = []                # leases kept across the kill, settled next phase
        self.ops: Counter[str] = Counter()
        self.spawned: list[subprocess.Popen[bytes]] = []
        self.outcomes: list[Outcome] = []
        self.started = CLOCK.monotonic()

    # ------------------------------------------------------------------ processes
    def _config(self) -> str:
        path = os.path.join(self.work, "shardq.toml")
        with open(path, "w") as f:
            f.write(_toml({
                "service": {"restart_backoff_max": 0.5},
                # small segments and checkpoints: every shard has sealed segments and a
                # checkpoint within a few phases
                "limits": {"segment_bytes": 16 * KiB, "compact_min_bytes": 32 * KiB},
                "queue_defaults": {"visibility_timeout": VISIBILITY_S, "max_deliveries": 1_000_000},
                "http": {"listen": "127.0.0.1:0"},
            }))
        return path

    def start(self, path: str, log_name: str, hook: bool) -> subprocess.Popen[bytes]:
        """``shardq serve`` on ``path``, waited for until every shard is ready or failed.
        ``hook``: its shards note each sync in the side file (only the campaign's own data
        dir: the files of a damaged copy say nothing about what was synced)."""
        env = child_env()
        if hook:
            env[FAULT_SYNC_LOG_ENV] = self.sync_log
        with open(os.path.join(self.work, log_name), "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "shardq.cli", "serve", "--config", self._config(),
                                     "--data-dir", path, "--shards", str(self.a.shards)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.spawned.append(proc)
        run_dir = DataDir(path).run_dir
        deadline = CLOCK.monotonic() + SETTLE_S
        while True:
            if proc.poll() is not None:
                return proc
            status = status_file.read(run_dir)
            rows = status.get("shards", []) if status else []
            # A shard in a crash loop has settled too: its verdict says why it is down.
            if len(rows) == self.a.shards and all(r.get("status") in ("ready", "failed") or r.get("restarts", 0) >= 2
                                                  for r in rows):
                return proc
            if CLOCK.monotonic() > deadline:
                raise RuntimeError(f"the service on {path} did not settle in {SETTLE_S:.0f} s; "
                                   f"see {os.path.join(self.work, log_name)}")
            time.sleep(0.02)  # poll with a deadline

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the supervisor and every shard of it, by PID; wait until they are gone."""
        import psutil
        try:
            pids = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pids = [proc.pid]
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        proc.wait()
        deadline = CLOCK.monotonic() + 20
        while any(_alive(p) for p in pids) and CLOCK.monotonic() < deadline:
            time.sleep(0.01)  # poll with a deadline

    def cleanup(self) -> None:
        for proc in self.spawned:
            if proc.poll() is None:
                self.kill(proc)
        self.spawned = []  # every one has been waited for

    def on_sigterm(self, signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through run_campaign's finally

    # ------------------------------------------------------------------ workload
    def _body(self) -> bytes:
        big = self.rng.random() < 0.15  # some records span several sectors and pages
        return self.rng.randbytes(self.rng.randint(600, 3000) if big else self.rng.randint(16, 300))

    def _item(self) -> dict[str, Any]:
        item: dict[str, Any] = {"body": self._body()}
        if self.rng.random() < 0.6:
            item["key"] = f"k{self.rng.randrange(KEYS):02d}"
        if self.rng.random() < 0.2:
            item["dedup_id"] = f"d{self.rng.randrange(2**48):x}"
        return item

    def workload_round(self, q: Any) -> None:
        """Settle the held leases, enqueue, lease; ack, nack or hold each lease. Any error
        is the harness's (nothing is damaged here): it stops the campaign."""
        held, self.held = self.held, []
        for lease in held:
            self._settle(q, lease, hold=False)
        for _ in range(self.rng.randint(6, 12)):
            if self.rng.random() < 0.5:
                item = self._item()
                self.live[q.enqueue(**item)] = item["body"]
                self.ops["enqueue"] += 1
            else:
                items = [self._item() for _ in range(self.rng.randint(2, 8))]
                for job_id, item in zip(q.enqueue_many(items), items):
                    self.live[job_id] = item["body"]
                self.ops["enqueue_batch"] += 1
        want = max(5, min(100, len(self.live) - LIVE_JOBS_TARGET + self.rng.randint(5, 15)))
        for lease in q.dequeue_many("default", max_jobs=want, visibility=VISIBILITY_S):
            self.ops["lease"] += 1
            self._settle(q, lease, hold=True)

    def _settle(self, q: Any, lease: Lease, hold: bool) -> None:
        u = self.rng.random()
        if hold and u < 0.15:
            self.held.append(lease)
        elif u < 0.8:
            q.ack(lease)
            self.live.pop(int(lease.job_id))  # the local shards' ids are ints
            self.acked += 1
            self.ops["ack"] += 1
        else:
            q.nack(lease)
            self.ops["nack"] += 1

    def wait_idle(self, q: Any) -> None:
        """Every call was answered; a round trip to every shard proves each finished the
        iterations before it (their commits and compactions); then wait until no shard
        file and no sync note has changed for ``QUIET_S`` (an idle shard may still write,
        e.g. a batched lease's fsync, or a mark after its last one)."""
        q.stats()
        deadline = CLOCK.monotonic() + 30
        last, since = None, CLOCK.monotonic()
        while True:
            now = CLOCK.monotonic()
            snap = self._disk_state()
            if snap != last:
                last, since = snap, now
            elif now - since >= QUIET_S:
                return
            if now > deadline:
                raise RuntimeError("the service did not go idle within 30 s")
            time.sleep(0.02)  # poll with a deadline

    def _disk_state(self) -> tuple[Any, ...]:
        dd = DataDir(self.data_dir)
        files = []
        for i in range(self.a.shards):
            d = dd.shard_dir(i)
            for name in sorted(os.listdir(d)):
                st = os.stat(os.path.join(d, name))
                files.append((i, name, st.st_size, st.st_mtime_ns))
        try:
            side = os.stat(self.sync_log).st_size
        except FileNotFoundError:
            side = 0
        return side, tuple(files)

    # ------------------------------------------------------------------ one phase
    def shard_dirs(self, path: str) -> list[str]:
        dd = DataDir(path)
        return [dd.shard_dir(i) for i in range(self.a.shards)]

    def phase(self, index: int, fault: DiskFault) -> Outcome:
        import shardq
        out = Outcome(index, fault.kind, fault.target)
        rng = random.Random(fault.seed)
        service = self.start(self.data_dir, "service.log", hook=True)
        if service.poll() is not None:
            raise RuntimeError(f"shardq serve exited with {service.returncode}; see the service.log")
        chosen = None
        with closing(shardq.connect(self.data_dir, retry_s=5, request_timeout_s=10)) as q:
            for _ in range(ROUNDS_MAX):
                self.workload_round(q)
                self.wait_idle(q)
                # drawn while idle: nothing changes between here and the kill
                chosen = choose(fault.kind, fault.target, self.shard_dirs(self.data_dir), self.sync_log, rng)
                if chosen is not None:
                    break
        self.kill(service)
        if chosen is None:
            raise RuntimeError(f"no {fault.target} took a {fault.kind} after {ROUNDS_MAX} workload rounds")
        shard, damage, writes = chosen
        out.shard = shard
        shutil.rmtree(self.fault_dir, ignore_errors=True)
        shutil.copytree(self.data_dir, self.fault_dir, ignore=shutil.ignore_patterns("run", "supervisor.lock"))
        damage.path = os.path.join(self.shard_dirs(self.fault_dir)[shard], os.path.basename(damage.path))
        self.apply_fault(damage, writes)
        out.damage = damage.describe()
        log_name = f"fault-{index:04d}.log"
        proc = self.start(self.fault_dir, log_name, hook=False)
        try:
            out.verdict, out.why = self.observe(proc, shard, damage)
            out.torn_cut = _logged(os.path.join(self.work, log_name), "torn tail cut")
            if out.verdict == REFUSED:
                self.kill(proc)
                out.repair = self.repair(index, shard)
        finally:
            self.cleanup()
            shutil.rmtree(self.fault_dir, ignore_errors=True)
        return out

    def apply_fault(self, damage: Damage, writes: list[tuple[int, bytes]]) -> None:
        apply(damage.path, writes)

    def observe(self, proc: subprocess.Popen[bytes], shard: int, damage: Damage) -> tuple[str, str]:
        import shardq
        if proc.poll() is not None:
            return LOSS, f"the service exited with {proc.returncode}"
        with closing(shardq.connect(self.fault_dir, retry_s=1, request_timeout_s=10)) as q:
            shards = q.stats()["shards"]
            found = {i: self.found(q, i, sh) for i, sh in enumerate(shards) if sh.get("available")}
        return judge(shard, damage, shards, found)

    def expected(self, shard: int) -> dict[int, bytes]:
        from ..client.routing import shard_of_job
        return {j: b for j, b in self.live.items() if shard_of_job(j) == shard}

    def found(self, q: Any, shard: int, stats: dict[str, Any]) -> Found:
        missing, changed = [], []
        expected = self.expected(shard)
        for job_id, body in sorted(expected.items()):
            try:
                if q.job(job_id)["body"] != body:
                    changed.append(job_id)
            except NotFound:
                missing.append(job_id)
            except ShardqError:  # it went down while asked: what it held cannot be shown
                missing.append(job_id)
        return Found(missing, changed, max(stats.get("jobs", 0) - len(expected), 0))

    def repair(self, index: int, shard: int) -> dict[str, Any]:
        """``shardq wal repair --force`` on the refused shard, then what came back."""
        import shardq
        shard_dir = self.shard_dirs(self.fault_dir)[shard]
        done = subprocess.run([sys.executable, "-m", "shardq.cli", "wal", "repair", shard_dir, "--force"],
                              capture_output=True, text=True, env=child_env(), timeout=300, check=False)
        said = (done.stdout + done.stderr).strip().splitlines()
        result: dict[str, Any] = {"rc": done.returncode, "said": said[-1] if said else "",
                                  "expected": len(self.expected(shard)), "back": 0, "started": False}
        if done.returncode != 0:
            return result
        proc = self.start(self.fault_dir, f"fault-{index:04d}-repaired.log", hook=False)
        if proc.poll() is not None:
            return result
        with closing(shardq.connect(self.fault_dir, retry_s=1, request_timeout_s=10)) as q:
            sh = q.stats()["shards"][shard]
            if sh.get("available"):
                got = self.found(q, shard, sh)
                result.update(started=True, back=result["expected"] - len(got.missing) - len(got.changed),
                              extra=got.extra)
            else:
                result["down"] = sh.get("reason") or sh.get("error")
        return result


def _logged(path: str, text: str) -> bool:
    try:
        with open(path, errors="replace") as f:
            return any(text in line for line in f)
    except OSError:
        return False


def replay_command(a: argparse.Namespace) -> str:
    return (f"shardq verify --disk-faults --seed {a.seed} --shards {a.shards} "
            f"--faults-per-kind {a.faults_per_kind}")


def run_campaign(a: argparse.Namespace) -> int:
    if a.data_dir and os.path.exists(a.data_dir) and os.listdir(a.data_dir):
        print(f"error: --data-dir {a.data_dir} is not empty; verify needs a fresh directory", file=sys.stderr)
        return 2
    c = Campaign(a)
    tmp = RunDir(a, c.data_dir)
    try:
        return _campaign(a, c, tmp)
    finally:
        tmp.close()  # on every way out (SIGINT and SIGTERM too) but a LOSS verdict or --keep


def _campaign(a: argparse.Namespace, c: Campaign, tmp: RunDir) -> int:
    print(f"shardq verify --disk-faults seed={a.seed} shards={a.shards} faults={len(c.plan)} "
          f"data_dir={c.data_dir}", flush=True)
    print(f"replay: {replay_command(a)}", flush=True)
    print(f"fault plan (fixed by the seed): {len(c.plan)} faults, fingerprint {fingerprint(c.plan)}", flush=True)
    before = signal.signal(signal.SIGTERM, c.on_sigterm)
    try:
        for i, fault in enumerate(c.plan, 1):
            out = c.phase(i, fault)
            c.outcomes.append(out)
            print(_line(out, len(c.plan), CLOCK.monotonic() - c.started), flush=True)
    except (RuntimeError, ShardqError, OSError) as e:
        print(f"error: the campaign could not be carried out: {e}; {tmp.fate(c.work)}", file=sys.stderr)
        return 2
    except SystemExit:
        print(f"stopped by SIGTERM; {tmp.fate(c.work)}", file=sys.stderr, flush=True)
        raise
    except KeyboardInterrupt:
        print(f"stopped by SIGINT; {tmp.fate(c.work)}", file=sys.stderr, flush=True)
        raise
    finally:
        c.cleanup()
        signal.signal(signal.SIGTERM, before)
    counts = tally(c.outcomes)
    passed = not any(o.verdict == LOSS for o in c.outcomes)
    _print_summary(a, c, counts, passed)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"passed": passed, "seed": a.seed, "shards": a.shards, "faults_per_kind": a.faults_per_kind,
                       "fingerprint": fingerprint(c.plan), "elapsed_s": round(CLOCK.monotonic() - c.started, 1),
                       "workload": {"ops": dict(c.ops), "live_at_end": len(c.live), "acked": c.acked},
                       "counts": counts, "faults": [asdict(o) for o in c.outcomes]}, f, indent=2)
    if not passed:
        tmp.keep()  # the damaged files are the evidence of the loss
    if tmp.kept:
        print(f"data dir and logs kept in {c.data_dir} and {c.work}")
    return 0 if passed else 1


def tally(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Per ``kind/target``: faults, each verdict, and after refusals what repair gave back:
    ``repaired_all`` (every job of the shard), ``repaired_some`` (it started without some),
    ``repair_failed`` (it refused, or the shard did not start)."""
    counts: dict[str, dict[str, int]] = {}
    for kind in DISK_KINDS:
        for target in DISK_TARGETS:
            counts[f"{kind}/{target}"] = dict.fromkeys(("faults", *VERDICTS, "repaired_all", "repaired_some",
                                                         "repair_failed", "torn_cut"), 0)
    for o in outcomes:
        row = counts[f"{o.kind}/{o.target}"]
        row["faults"] += 1
        row[o.verdict] += 1
        row["torn_cut"] += o.torn_cut
        if o.repair is not None:
            r = o.repair
            row["repair_failed" if not r["started"] else
                "repaired_all" if r["back"] == r["expected"] else "repaired_some"] += 1
    return {k: v for k, v in counts.items() if v["faults"]}


def _line(o: Outcome, n: int, elapsed: float) -> str:
    text = f"[{elapsed:7.1f}s] fault {o.index}/{n} shard {o.shard}: {o.damage}: {o.verdict}"
    if o.why:
        text += f" ({o.why})"
    if o.torn_cut:
        text += "; the restarted shard logged a torn tail cut"
    if o.repair is not None:
        r = o.repair
        text += (f"; wal repair exit {r['rc']}, " + (f"{r['back']}/{r['expected']} jobs back" if r["started"]
                                                     else f"shard not started ({r.get('down') or r['said']})"))
    return text


def _print_summary(a: argparse.Namespace, c: Campaign, counts: dict[str, Any], passed: bool) -> None:
    print()
    print(f"shardq verify --disk-faults summary (seed {a.seed}, {CLOCK.monotonic() - c.started:.0f} s, "
          f"{len(c.outcomes)} faults, fingerprint {fingerprint(c.plan)})")
    print(f"workload: {dict(c.ops)}; {len(c.live)} jobs live at the end, {c.acked} acked")
    print(f"{'kind/target':<30}{'faults':>7}{'kept':>6}{'refused':>9}{'LOSS':>6}  after wal repair: "
          "all back / some lost / not started")
    for name, row in counts.items():
        print(f"{name:<30}{row['faults']:>7}{row[KEPT]:>6}{row[REFUSED]:>9}{row[LOSS]:>6}  "
              f"{row['repaired_all']} / {row['repaired_some']} / {row['repair_failed']}")
    total = {k: sum(r[k] for r in counts.values()) for k in ("faults", *VERDICTS)}
    print(f"{'total':<30}{total['faults']:>7}{total[KEPT]:>6}{total[REFUSED]:>9}{total[LOSS]:>6}")
    print(f"VERDICT: {'PASS' if passed else 'FAIL'}")
