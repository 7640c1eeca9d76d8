"""The chaos run itself: a real service, producers, workers, a seeded fault schedule, the drain."""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from types import FrameType
from collections import Counter
from dataclasses import asdict
from typing import Any

from ..errors import ShardqError
from ..service.supervisor import child_env
from ..wal.fileio import FAULT_SYNC_LOG_ENV

from .check import Report, check
from .history import (CLOCK, FAILING, PROGRESS_EVERY_S, SCHEMA, Enqueue, parse_body, read_effects,
                      read_producer_history, read_worker_history)
from .options import build_parser
from .plan import KILL_PRODUCER, POWER_CUT, SERVICE_KINDS, Fault, fingerprint, kinds_for, plan
from .powercut import lose_unsynced_pages, reboot

KiB = 1024


_NOT_REPLAYED = {"help", "data_dir", "json", "keep", "run"}  # where a run's files go, not what it does
_ALWAYS_SHOWN = {"seed", "duration", "shards", "producers", "workers", "keys", "fault_interval"}


def replay_command(a: argparse.Namespace) -> str:
    """The command that runs ``a`` again: every option that shapes the run, the seed (which
    fixes the fault schedule, not the interleaving) and each setting not at its default."""
    words = ["shardq", "verify"]
    for act in build_parser()._actions:
        if act.dest in _NOT_REPLAYED or not act.option_strings:
            continue
        value = getattr(a, act.dest, act.default)
        if act.dest not in _ALWAYS_SHOWN and value == act.default:
            continue
        if act.nargs == 0:  # a flag
            if value:
                words.append(act.option_strings[0])
        else:
            words += [act.option_strings[0], shlex.quote(str(value))]
    return " ".join(words)


def _short_tmpdir() -> str:
    return tempfile.mkdtemp(prefix="sqv", dir="/tmp")  # unix socket paths must stay short


def _alive(pid: int) -> bool:
    import psutil
    try:
        alive: bool = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        return alive
    except psutil.NoSuchProcess:
        return False


def _target(f: Fault) -> int:
    """The shard, worker or producer a fault acts on (every kind but a service kill names one)."""
    if f.target is None:
        raise ValueError(f"fault {f.kind} at {f.at_s:.1f} s names no target")
    return f.target


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _toml(cfg: dict[str, Any]) -> str:
    out = []
    for section, body in cfg.items():
        out.append(f"[{section}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in body.items()]
    return "\n".join(out) + "\n"


class Run:
    """One chaos run: owns every process it starts and ends them by PID."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.target = getattr(a, "target", None)   # another backend: no service of ours
        self.runners = getattr(a, "worker_kind", "loop").startswith("runner")  # workers: the standard runner
        self.kinds = kinds_for(target=bool(self.target), power_cuts=getattr(a, "power_cuts", False),
                               kill_producers=getattr(a, "kill_producers", False))
        self.plan, self.plan_end_s = plan(a.seed, self.kinds, duration_s=a.duration, interval_s=a.fault_interval,
                                          shards=a.shards, workers=a.workers, visibility_s=a.visibility,
                                          health_timeout_s=a.health_timeout, producers=a.producers)
        self.data_dir = a.data_dir or os.path.join(_short_tmpdir(), "data")
        self.work = self.data_dir.rstrip("/") + "-verify"
        self.connect_to = self.target or self.data_dir  # what producers and workers connect to
        os.makedirs(self.work, exist_ok=True)
        self.db = os.path.join(self.work, "effects.db")
        self.stop_producers = os.path.join(self.work, "stop-producers")
        self.stop_workers = os.path.join(self.work, "stop-workers")
        self.log_path = os.path.join(self.work, "service.log")
        self.service: subprocess.Popen[bytes] | None = None
        self.spawned: list[subprocess.Popen[bytes]] = []  # every child, whatever role it was given
        self.spawning = False
        self.stop_signal = 0   # a SIGTERM that came while a child was being started
        self.producers: list[subprocess.Popen[bytes]] = []
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.worker_files: list[tuple[str, str]] = []
        self.incarnation: Counter[int] = Counter()
        self.faults: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()      # planned faults whose target was not running
        self.power_cut_pages: Counter[str] = Counter()
        self.unexpected_exits: Counter[str] = Counter()
        self.started = CLOCK.monotonic()
        self.next_progress = self.started + PROGRESS_EVERY_S
        self._effects_seen = 0
        self._delivered: set[Any] = set()
        self.env = child_env()
        self.sync_log = os.path.join(self.work, "synced-sizes.log")
        if POWER_CUT in self.kinds:  # the WAL's test hook: which bytes of a segment were synced
            self.env[FAULT_SYNC_LOG_ENV] = self.sync_log

    # ------------------------------------------------------------------ processes
    def _spawn(self, args: list[str], log_name: str, env: dict[str, Any] | None = None) -> subprocess.Popen[bytes]:
        """Start a child and record it before anything can interrupt: a SIGTERM that comes
        meanwhile is acted on once the child is in ``spawned``, where cleanup finds it."""
        out = open(os.path.join(self.work, log_name), "ab")  # noqa: SIM115 - closed below, once inherited
        self.spawning = True
        try:
            proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env or self.env)
            self.spawned.append(proc)
        finally:
            self.spawning = False
            out.close()
        if self.stop_signal:
            raise SystemExit(128 + self.stop_signal)
        return proc

    def on_sigterm(self, signum: int, _frame: FrameType | None) -> None:
        if self.spawning:
            self.stop_signal = signum
            return
        raise SystemExit(128 + signum)  # unwinds through run()'s finally, which ends every child

    def service_config(self) -> dict[str, Any]:
        """Small segments and a low compaction threshold, so rotations and compactions
        happen all through the run, also with large bodies (about 8 bodies a segment, 16
        between compactions at least)."""
        body = getattr(self.a, "body_bytes", 0)
        return {
            "service": {"health_timeout": self.a.health_timeout, "restart_backoff_max": 0.5},
            "limits": {"segment_bytes": max(32 * KiB, 8 * body), "compact_min_bytes": max(64 * KiB, 16 * body)},
            "queue_defaults": {"visibility_timeout": self.a.visibility, "max_deliveries": self.a.max_deliveries,
                               "max_body_bytes": max(256 * KiB, body),
                               "lease_sync": getattr(self.a, "lease_sync", "batched")},
            "http": {"listen": "127.0.0.1:0"},  # never the default port: runs may overlap
        }

    def start_service(self) -> None:
        cfg = os.path.join(self.work, "shardq.toml")
        with open(cfg, "w") as f:
            f.write(_toml(self.service_config()))
        self.service = self._spawn(["-m", "shardq.cli", "serve", "--config", cfg, "--data-dir", self.data_dir,
                                    "--shards", str(self.a.shards)], "service.log")
        self._wait_ready()

    @property
    def _svc(self) -> subprocess.Popen[bytes]:
        """The service process (started by :meth:`start_service`)."""
        if self.service is None:
            raise RuntimeError("the service is not started")
        return self.service

    def _wait_ready(self, timeout: float = 60.0) -> None:
        from ..client.router import Router
        deadline = CLOCK.monotonic() + timeout
        while True:
            if self._svc.poll() is not None:
                raise RuntimeError(f"shardq serve exited with {self._svc.returncode}; see {self.log_path}")
            try:
                with Router(self.data_dir, retry_s=0.5, request_timeout_s=2) as q:  # the local shards
                    q.ping()
                return
            except (ShardqError, OSError):
                if CLOCK.monotonic() > deadline:
                    raise RuntimeError(f"service not ready after {timeout:.0f} s; see {self.log_path}") from None
                time.sleep(0.05)  # poll with a deadline

    def service_pids(self) -> list[int]:
        import psutil
        try:
            return [self._svc.pid] + [c.pid for c in psutil.Process(self._svc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return [self._svc.pid]

    def shard_pids(self) -> dict[int, int]:
        import psutil
        out = {}
        try:
            for c in psutil.Process(self._svc.pid).children():
                cmd = c.cmdline()
                if "shardq.shard.process" in cmd and "--index" in cmd:
                    out[int(cmd[cmd.index("--index") + 1])] = c.pid
        except psutil.Error:
            pass
        return out

    def kill_service(self) -> None:
        pids = self.service_pids()
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self._svc.wait()
        self._wait_gone(pids)

    @staticmethod
    def _wait_gone(pids: list[int], timeout: float = 20.0) -> None:
        deadline = CLOCK.monotonic() + timeout
        while any(_alive(p) for p in pids) and CLOCK.monotonic() < deadline:
            time.sleep(0.01)  # poll with a deadline

    def start_producers(self) -> None:
        for p in range(self.a.producers):
            self.producers.append(self.start_producer(p))

    def start_producer(self, p: int, resume: bool = False) -> subprocess.Popen[bytes]:
        """Producer ``p``; ``resume``: a new process after a kill, which takes its keys'
        sequence numbers (and, with --dedup, the call left without an answer) from the
        history the killed one wrote."""
        keys = [f"k{i:03d}" for i in range(self.a.keys)]
        mine = keys[p::self.a.producers]
        return self._spawn(
            ["-m", "shardq.verify", "_producer", "--data-dir", self.connect_to, "--index", str(p),
             "--keys", ",".join(mine), "--history", os.path.join(self.work, f"producer-{p}.jsonl"),
             "--stop", self.stop_producers, "--seed", str(self.a.seed), "--rate", str(self.a.rate),
             "--body-bytes", str(getattr(self.a, "body_bytes", 0)),
             # Even producers retry long enough to ride out every fault; odd ones give
             # up after 1 s, so pauses and restarts leave enqueues of unknown outcome.
             "--batch", "5", "--retry-s", "8" if p % 2 == 0 else "1",
             "--client", getattr(self.a, "client", "threads"),
             "--delay-prob", str(getattr(self.a, "delay_prob", 0.0)),
             *(["--dedup"] if getattr(self.a, "dedup", False) else []),
             *(["--resume"] if resume else [])], f"producer-{p}.log")

    def start_worker(self, w: int) -> None:
        self.incarnation[w] += 1
        name = f"w{w}.{self.incarnation[w]}"
        hist = os.path.join(self.work, f"worker-{name}.jsonl")
        self.worker_files.append((name, hist))
        if self.runners:
            self.workers[w] = self._spawn_runner(name, hist, w)
            return
        self.workers[w] = self._spawn(
            ["-m", "shardq.verify", "_worker", "--data-dir", self.connect_to, "--name", name, "--db", self.db,
             "--history", hist, "--stop", self.stop_workers, "--batch", str(getattr(self.a, "worker_batch", 4)),
             "--retry-s", "5", "--client", getattr(self.a, "client", "threads"),
             "--seed", str(self.a.seed), "--stall-prob", str(self.a.stall_prob),
             "--stall-s", str(self.a.visibility / 2), "--nack-prob", str(getattr(self.a, "nack_prob", 0.0)),
             "--extend-prob", str(getattr(self.a, "extend_prob", 0.0)), "--extend-s", str(2 * self.a.visibility)],
            f"worker-{w}.log")

    def _spawn_runner(self, name: str, hist: str, w: int) -> subprocess.Popen[bytes]:
        """The standard worker runner (``shardq worker``, threads, the SQLite idempotency
        store in the effect database) with the verify handler (:mod:`.runner`)."""
        from .runner import ENV
        env = dict(self.env)
        env[ENV] = json.dumps({"history": hist, "name": name, "seed": self.a.seed,
                               "nack_prob": getattr(self.a, "nack_prob", 0.0),
                               "extend_prob": getattr(self.a, "extend_prob", 0.0),
                               "extend_s": 2 * self.a.visibility})
        # --worker-batch is its concurrency; at 1 (the default with --target) it holds one
        # lease at a time, no prefetch: moto mis-orders a timed-out batch of one group.
        batch = max(1, getattr(self.a, "worker_batch", 4))
        return self._spawn(["-m", "shardq.cli", "worker", "shardq.verify.runner:handle", "--data-dir",
                            self.connect_to, "--concurrency", str(batch), *(["--prefetch", "0"] if batch == 1 else []),
                            *(["--mode", "process"] if self.a.worker_kind == "runner-process" else []),
                            "--idempotency", self.db, "--log-level", "WARNING"], f"worker-{w}.log", env=env)

    def init_db(self) -> None:
        from . import runner
        db = sqlite3.connect(self.db, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(runner.SCHEMA if self.runners else SCHEMA)
        db.close()

    # ------------------------------------------------------------------ faults
    def tick(self) -> None:
        """Keep the cast alive (restart what died on its own) and print progress."""
        if self.service is not None and self.service.poll() is not None:
            self.unexpected_exits["service"] += 1
            self._log(f"service exited on its own with {self.service.returncode}; restarting")
            self.start_service()
        for i, proc in enumerate(self.producers):  # no fault stops a producer: a crash of the harness
            if proc.poll() is not None and not os.path.exists(self.stop_producers):
                raise RuntimeError(f"producer {i} exited on its own with {proc.returncode} (see "
                                   f"{os.path.join(self.work, f'producer-{i}.log')})")
        for w, proc in list(self.workers.items()):
            if proc.poll() is not None and not os.path.exists(self.stop_workers):
                self.unexpected_exits["worker"] += 1
                self._log(f"worker {w} exited on its own with {proc.returncode}; restarting")
                self.start_worker(w)
        if CLOCK.monotonic() >= self.next_progress:
            self.next_progress += PROGRESS_EVERY_S
            self.progress()

    def sleep(self, seconds: float) -> None:
        """Sleep inside the fault schedule (spacing faults, holding a pause), ticking."""
        end = CLOCK.monotonic() + seconds
        while (left := end - CLOCK.monotonic()) > 0:
            time.sleep(min(left, 0.1))
            self.tick()

    def inject(self, f: Fault) -> str:
        """Inject one planned fault; its detail for the log ("skipped: ..." if its shard was
        not running, e.g. still restarting after an earlier fault)."""
        kind = f.kind
        if kind in ("kill_shard", "pause_shard"):
            pid = self.shard_pids().get(_target(f))
            if pid is None:
                self.skipped[kind] += 1
                return f"skipped: shard {f.target} not running"
            if kind == "kill_shard":
                _signal(pid, signal.SIGKILL)
                detail = f"shard {f.target} pid {pid}"
            else:
                _signal(pid, signal.SIGSTOP)
                self.sleep(f.seconds)
                _signal(pid, signal.SIGCONT)
                if f.hung:
                    self.faults["pause_shard_past_health_timeout"] += 1
                detail = f"shard {f.target} for {f.seconds:.1f} s"
        elif kind in ("kill_service", POWER_CUT):
            t0 = CLOCK.monotonic()
            self.kill_service()
            detail = ""
            if kind == POWER_CUT:
                lost = lose_unsynced_pages(self.data_dir, self.sync_log, random.Random(f.seed))
                reboot(self.data_dir)
                self.power_cut_pages.update(lost)
                detail = (f"{lost['pages_lost']} unsynced pages lost, {lost['pages_kept']} kept "
                          f"({lost['bytes_lost']} bytes); ")
            self.start_service()
            detail += f"restarted in {CLOCK.monotonic() - t0:.1f} s"
        elif kind == "kill_worker":
            t = _target(f)
            _signal(self.workers[t].pid, signal.SIGKILL)
            self.workers[t].wait()
            self.start_worker(t)
            detail = f"worker {f.target}"
        elif kind == KILL_PRODUCER:
            t = _target(f)
            proc = self.producers[t]
            _signal(proc.pid, signal.SIGKILL)
            proc.wait()
            self.producers[t] = self.start_producer(t, resume=True)
            detail = f"producer {f.target}"
        elif kind == "pause_worker":
            pid = self.workers[_target(f)].pid
            _signal(pid, signal.SIGSTOP)
            self.sleep(f.seconds)
            _signal(pid, signal.SIGCONT)
            detail = f"worker {f.target} for {f.seconds:.1f} s"
        else:
            raise ValueError(kind)
        self.faults[kind] += 1
        return detail

    def schedule(self) -> None:
        """Inject the planned faults, each at its planned time (or as soon as the one before
        is done), then wait for the schedule's end."""
        t0 = CLOCK.monotonic()
        for f in self.plan:
            self.sleep(t0 + f.at_s - CLOCK.monotonic())
            self._log(f"fault {f.kind}: {self.inject(f)}")
        self.sleep(t0 + self.plan_end_s - CLOCK.monotonic())

    # ------------------------------------------------------------------ progress
    def _log(self, msg: str) -> None:
        print(f"[{CLOCK.monotonic() - self.started:7.1f}s] {msg}", flush=True)

    def _enqueues(self) -> list[Enqueue]:
        return [op for p in range(self.a.producers)
                for op in read_producer_history(os.path.join(self.work, f"producer-{p}.jsonl"), p)]

    def _applied(self) -> set[Any]:
        for e in read_effects(self.db, self._effects_seen):
            self._effects_seen = max(self._effects_seen, e.order)
            parsed = parse_body(e.body)
            if parsed:
                self._delivered.add(parsed[1:])
        return self._delivered

    def progress(self) -> None:
        ops = self._enqueues()
        ok = sum(len(o.items) for o in ops if o.outcome == "ok")
        amb = sum(len(o.items) for o in ops if o.outcome != "ok" and o.t1 is not None)
        faults = sum(self.faults[k] for k in self.kinds)
        self._log(f"enqueued ok={ok} ambiguous={amb} | delivered={len(self._applied())} | faults={faults} "
                  + " ".join(f"{k}={self.faults[k]}" for k in self.kinds if self.faults[k]))

    # ------------------------------------------------------------------ drain and check
    def drain(self) -> dict[str, Any]:
        import shardq
        open(self.stop_producers, "w").close()
        deadline = CLOCK.monotonic() + 60
        for p in self.producers:
            while p.poll() is None and CLOCK.monotonic() < deadline:
                self.sleep(0.1)
            if p.poll() is None:
                p.kill()
                p.wait()
        ok_items = {tuple(it) for op in self._enqueues() if op.outcome == "ok" for it in op.items}
        self._log(f"producers stopped; draining {len(ok_items) - len(ok_items & self._applied())} "
                  "acknowledged jobs not yet applied")
        deadline = CLOCK.monotonic() + self.a.drain_timeout
        backlog, empty_polls = None, 0
        q = shardq.connect(self.connect_to, retry_s=5, request_timeout_s=5)
        try:
            while CLOCK.monotonic() < deadline:
                self.tick()
                try:
                    st = q.stats()["queues"].get("default", {})
                    backlog = sum(st.get(k, 0) for k in ("ready", "delayed", "waiting", "in_flight"))
                except ShardqError:
                    backlog = None
                empty_polls = empty_polls + 1 if backlog == 0 else 0
                # Done when every acknowledged job is applied, or when nothing is left to
                # deliver (only dead letters, if any) for a second.
                if backlog == 0 and (ok_items <= self._applied() or empty_polls >= 5):
                    break
                time.sleep(0.2)  # poll with a deadline
            try:
                dead = len(q.dead_letters("default", limit=10_000))
            except ShardqError:
                dead = -1
        finally:
            q.close()
        open(self.stop_workers, "w").close()
        for proc in self.workers.values():
            if self.runners and proc.poll() is None:  # a runner stops on SIGTERM, finishing its jobs
                _signal(proc.pid, signal.SIGCONT)
                _signal(proc.pid, signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {"drained": backlog == 0, "backlog_left": backlog,
                "dead_letters": dead}

    def stop_service(self) -> None:
        if self.target:
            return
        if self.service is None or self.service.poll() is not None:
            return
        pids = self.service_pids()
        self.service.send_signal(signal.SIGTERM)
        try:
            self.service.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self._wait_gone(pids)

    def cleanup(self) -> None:
        """End every process this run started, by PID: each child still running, and the
        shards of a service among them."""
        import psutil
        for proc in self.spawned:
            if proc.poll() is not None:
                continue
            try:
                pids = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pids = [proc.pid]
            for pid in pids:
                _signal(pid, signal.SIGCONT)
                _signal(pid, signal.SIGKILL)
            proc.wait()
            self._wait_gone(pids)

    def wal_check(self) -> dict[str, Any]:
        if self.target:
            return {}
        from ..datadir import DataDir
        from ..wal import repair
        dd = DataDir(self.data_dir)
        statuses = Counter(r.status for i in range(dd.shards()) for r in repair.check(dd.shard_dir(i)))
        return dict(statuses)

    def service_events(self) -> dict[str, Any]:
        events: Counter[str] = Counter()
        try:
            with open(self.log_path, errors="replace") as f:
                for line in f:
                    if "event=shard-exit" in line:
                        events["shard_exits_sigkill" if "signal=SIGKILL" in line else "shard_exits_other"] += 1
                    for ev in ("shard-hung", "shard-failed", "shard-restart"):
                        if f"event={ev} " in line:
                            events[ev.replace("-", "_")] += 1
                    if "torn tail cut" in line:
                        events["torn_tails_cut"] += 1
                    if "are preallocated zeros" in line:
                        events["preallocated_tails"] += 1
                    if " compacted: " in line:
                        events["compactions"] += 1
        except OSError:
            pass
        return dict(events)


class RunDir:
    """The temp dir a run made (none with ``--data-dir``): removed by :meth:`close` unless
    kept (``--keep``, or :meth:`keep` for a FAIL verdict, whose files are its evidence)."""

    def __init__(self, a: argparse.Namespace, data_dir: str) -> None:
        self.path = None if a.data_dir else os.path.dirname(data_dir)
        self.kept = bool(getattr(a, "keep", False)) or self.path is None

    def keep(self) -> None:
        self.kept = True

    def fate(self, work: str) -> str:
        """What happens to the run's files, in words, for a message about its end."""
        return f"files kept in {work}" if self.kept else f"its temp dir {self.path} is removed (--keep keeps it)"

    def close(self) -> None:
        if not self.kept and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def run(a: argparse.Namespace) -> int:
    """A chaos run (see the package's docstring). Its temp dir is removed on every way out
    (a pass, an error, SIGINT, SIGTERM) except a FAIL verdict or ``--keep``."""
    if getattr(a, "target", None):
        from .target import prepare
        problem = prepare(a)
        if problem:
            print(f"error: --target {a.target}: {problem}", file=sys.stderr)
            return 2
    if a.data_dir and os.path.exists(a.data_dir) and os.listdir(a.data_dir):
        print(f"error: --data-dir {a.data_dir} is not empty; verify needs a fresh directory", file=sys.stderr)
        return 2
    r = Run(a)
    tmp = RunDir(a, r.data_dir)
    try:
        return _run(a, r, tmp)
    finally:
        tmp.close()


def _run(a: argparse.Namespace, r: Run, tmp: RunDir) -> int:
    print(f"shardq verify seed={a.seed} duration={a.duration}s shards={a.shards} producers={a.producers} "
          f"workers={a.workers} keys={a.keys} visibility={a.visibility}s client={getattr(a, 'client', 'threads')} "
          f"data_dir={r.data_dir}", flush=True)
    if r.target:
        print(f"target: {r.target} (worker faults only: {', '.join(r.kinds)}; worker batch {a.worker_batch})",
              flush=True)
    print(f"replay: {replay_command(a)}", flush=True)
    print(f"fault schedule (fixed by the seed; the interleaving is not): {len(r.plan)} faults, "
          f"fingerprint {fingerprint(r.plan)}", flush=True)
    before = signal.signal(signal.SIGTERM, r.on_sigterm)
    try:
        r.init_db()
        if not r.target:
            r.start_service()
        r.start_producers()
        for w in range(a.workers):
            r.start_worker(w)
        r.schedule()
        r._log("fault schedule over; stopping producers")
        drain = r.drain()
        r.stop_service()
        wal = r.wal_check()
    except RuntimeError as e:
        print(f"error: the run could not be carried out: {e}; {tmp.fate(r.work)}", file=sys.stderr)
        return 2
    except SystemExit:
        print(f"stopped by SIGTERM; {tmp.fate(r.work)}", file=sys.stderr, flush=True)
        raise
    except KeyboardInterrupt:
        print(f"stopped by SIGINT; {tmp.fate(r.work)}", file=sys.stderr, flush=True)
        raise
    finally:
        r.cleanup()
        signal.signal(signal.SIGTERM, before)
    enqueues = r._enqueues()
    if not any(op.outcome == "ok" for op in enqueues):
        print(f"error: the run could not be carried out: no enqueue was acknowledged, so it checked "
              f"nothing; {tmp.fate(r.work)}", file=sys.stderr)
        return 2
    leases = [l for name, path in r.worker_files for l in read_worker_history(path, name)]
    effects = read_effects(r.db)
    rep = check(enqueues, leases, effects, dead_letters=max(drain["dead_letters"], 0),
                lease_sync=getattr(a, "lease_sync", "batched"),
                body_bytes=getattr(a, "body_bytes", 0))
    rep.info.update(drain)
    rep.info["wal_check"] = wal
    rep.info["service"] = r.service_events()
    rep.info["unexpected_exits"] = dict(r.unexpected_exits)
    if wal.get("corrupt"):
        rep.counts["wal_corrupt"] = wal["corrupt"]
    faults = {k: r.faults[k] for k in r.kinds}
    if not r.target:
        faults["pause_shard_past_health_timeout"] = r.faults["pause_shard_past_health_timeout"]
        faults["skipped"] = sum(r.skipped.values())   # planned against a shard that was restarting
    rep.info["schedule"] = {"faults": len(r.plan), "fingerprint": fingerprint(r.plan)}
    if POWER_CUT in r.kinds:
        rep.info["power_cut_pages"] = dict(r.power_cut_pages)
    passed = rep.ok and not rep.counts.get("wal_corrupt")
    _print_summary(a, rep, faults, passed, CLOCK.monotonic() - r.started, r.kinds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"passed": passed, "seed": a.seed, "args": {k: v for k, v in vars(a).items() if k != "fn"},
                       "faults": faults, "elapsed_s": round(CLOCK.monotonic() - r.started, 1),
                       **asdict(rep)}, f, indent=2, default=str)
    if not passed:
        tmp.keep()  # the histories are the evidence of what failed
    if tmp.kept:
        print(f"data dir and histories kept in {r.data_dir} and {r.work}")
    return 0 if passed else 1


def _print_summary(a: argparse.Namespace, rep: Report, faults: dict[str, Any],
                   passed: bool, elapsed: float, kinds: tuple[str, ...] = SERVICE_KINDS) -> None:
    i = rep.info
    print()
    print(f"shardq verify summary  (seed {a.seed}, {elapsed:.0f} s, bodies of "
          f"{getattr(a, 'body_bytes', 0) or 'a few'} bytes)")
    print("faults injected: " + ", ".join(f"{k}={v}" for k, v in faults.items())
          + f"  (total {sum(faults[k] for k in kinds)}; schedule {i['schedule']['faults']} faults, "
          f"fingerprint {i['schedule']['fingerprint']})")
    if "power_cut_pages" in i:
        pages = i["power_cut_pages"]
        print(f"power cuts: {pages.get('pages_lost', 0)} unsynced pages lost, {pages.get('pages_kept', 0)} kept "
              f"({pages.get('bytes_lost', 0)} bytes), in {pages.get('segments', 0)} newest segments "
              f"({pages.get('unknown', 0)} without a recorded sync)")
    print(f"enqueue calls {i['enqueue_ops']} ({i['enqueue_ops_ok']} ok); jobs ok {i['jobs_ok']}, "
          f"ambiguous {i['jobs_ambiguous']} (delivered {i['ambiguous_delivered']}, "
          f"not {i['ambiguous_not_delivered']}), failed {i['jobs_failed']}, delayed {i['jobs_delayed']}")
    if getattr(a, "dedup", False):
        print(f"dedup ids: {i['enqueue_resends']} calls of unknown outcome sent again, "
              f"{i['enqueue_ops_ok_after_resend']} calls answered after a resend, "
              f"{i['enqueue_ops_taken_up']} of them left by a killed producer")
    if getattr(a, "worker_kind", "loop").startswith("runner"):
        print(f"handler runs {i['deliveries']} (of a job run before {i['duplicate_deliveries']}, max attempt "
              f"{i['max_attempt']}, failed with Retry {i['nacks']}, extended {i['extends']} "
              f"({i['extends_ok']} ok)); effects {i['effects']}; dead letters {i['dead_letters']} (the "
              "runner's skips of expired leases, its commits and acks are in its log)")
    else:
        print(f"deliveries {i['deliveries']} (duplicate {i['duplicate_deliveries']}, max attempt "
              f"{i['max_attempt']}, expired before start {i['leases_expired_before_start']}, ack LeaseLost "
              f"{i['acks_lease_lost']}, failed and nacked {i['nacks']} ({i['nacks_ok']} answered ok), "
              f"extended {i['extends']} ({i['extends_ok']} ok)); worker stalls {i['worker_stalls']}; "
              f"effects {i['effects']}; late commits {i['late_commits']} "
              f"(new effect {i['late_commits_new_effect']}); dead letters {i['dead_letters']}")
    print(f"service: {i.get('service')}; wal check after stop: {i.get('wal_check')}; "
          f"drained: {i.get('drained')}")
    if i.get("drained") is False and i.get("backlog_left"):
        print(f"the drain timeout passed with {i['backlog_left']} jobs still in the queue (ready, delayed, "
              "waiting or in flight): not applied, so they count as lost below (a longer --drain-timeout "
              "tells them apart)")
    print(f"{'check':<28}{'count':>8}  result")
    for k in (*FAILING, *(["wal_corrupt"] if "wal_corrupt" in rep.counts else [])):
        n = rep.counts.get(k, 0)
        print(f"{k:<28}{n:>8}  {'ok' if n == 0 else 'FAIL'}")
        for ex in rep.examples.get(k, []):
            print(f"    e.g. {json.dumps(ex, default=str)}")
    print(f"VERDICT: {'PASS' if passed else 'FAIL'}")
