"""The boot record of a shard: what lets a placed queue's lease leave before its fsync.

A placed queue's caps (``concurrency``, ``group_concurrency``) count the leases the shard
knows. A lease whose reply left before its record was fsynced is known to a restarted
shard only if the record survived: a crash of the shard process keeps it (the kernel holds
what was written), a crash of the **machine** may lose it, and the job it leased could
still be running, uncounted, while the restarted shard fills its slot. So the shard hands
such leases out early only while it can tell, at its next start, whether the machine went
down under them, and then **fences** its placed queues: none of them leases anything until
every lease a power cut could have lost has run out.

The record, ``<shard dir>/boot.json``, written whole (temporary file, fsync, rename, fsync
of the directory) before the shard serves and again when it stops cleanly:

* ``boot_id``: the kernel's boot id when the run started (``/proc/sys/kernel/random/boot_id``;
  None where there is none: that run fsynced every placed lease first);
* ``clean``: the run stopped cleanly, its log synced to the end;
* ``early_visibility_s``: the longest visibility of any placed lease that run handed out
  before its fsync (a longer one waited for its fsync); 0: none went early;
* ``fence_until``: placed queues lease nothing before this time (wall clock, the clock of
  lease deadlines), carried from run to run until it has passed.

:func:`decide` is the rule (pure: the caller reads the files and the clock). A run that
did not stop cleanly under another boot id may have lost early leases: the fence is
``now + early_visibility_s`` of that run (its early leases ran out by then: they were
handed out before ``now``, none longer than that). Under the same boot id the kernel kept
every write, so there is nothing to fence. No record: the shard is new, or was last run by
a version that fsynced every placed lease first. A record that cannot be read: the worst
this configuration allows is assumed (see :func:`decide`).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

from ..config import Config

log = logging.getLogger("shardq.shard")

BOOT_RECORD = "boot.json"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
FORMAT = 1
#: A lease handed out at ``now`` with visibility ``v`` ends at ``now + v``: compared with
#: the run's ``early_visibility_s`` with this much room for the float sum.
VISIBILITY_EPS_S = 1e-6


@dataclass(frozen=True)
class BootRecord:
    boot_id: str | None
    clean: bool
    early_visibility_s: float
    fence_until: float


def current_boot_id(path: str = BOOT_ID_PATH) -> str | None:
    """This boot's id, or None where the kernel has none to give (not Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            got = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return got or None


def early_visibility_s(config: Config, boot_id: str | None) -> float:
    """The longest visibility a placed lease may have and still leave before its fsync in
    this run: the longest ``visibility_timeout`` of the placed queues of ``config`` (their
    own and ``[queue_defaults]``, which every undeclared queue takes). 0 without a boot id:
    then no restart could tell a power cut from a crash, and every placed lease waits."""
    if boot_id is None:
        return 0.0
    cfgs = [config.queue_defaults, *config.queues.values()]
    return max((c.visibility_timeout for c in cfgs if c.placed()), default=0.0)


def decide(prev: BootRecord | None, unreadable: bool, boot_id: str | None, now: float,
           early_s: float) -> tuple[BootRecord, str | None]:
    """The record of the run starting now, and why it is fenced (None: no new fence).

    ``prev``: the last run's record (None: none, or ``unreadable``); ``early_s``: this
    run's :func:`early_visibility_s`. A fence already in the record is kept until it has
    passed: the leases it waits for are no shorter for a restart in between. An unreadable
    record says nothing of how the last run ended: the fence is ``now + early_s`` (this
    configuration's longest), the best bound there is without it."""
    carried = prev.fence_until if prev is not None and prev.fence_until > now else 0.0
    fence, why = carried, None
    if unreadable:
        fence = max(fence, now + early_s)
        why = "its boot record could not be read"
    elif (prev is not None and not prev.clean and prev.early_visibility_s > 0
            and (boot_id is None or prev.boot_id != boot_id)):
        fence = max(fence, now + prev.early_visibility_s)
        why = "the machine restarted since its last run, which did not stop cleanly"
    if fence <= now:
        fence = 0.0
    return BootRecord(boot_id, False, early_s, fence), why if fence > carried else None


def read(shard_dir: str) -> tuple[BootRecord | None, str | None]:
    """The record in ``shard_dir``: (record, None), (None, None) if there is none, or
    (None, what is wrong with it)."""
    path = os.path.join(shard_dir, BOOT_RECORD)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path}: {e.strerror}"
    try:
        d = json.loads(raw)
        rec = BootRecord(d["boot_id"], d["clean"], float(d["early_visibility_s"]), float(d["fence_until"]))
        if not (rec.boot_id is None or type(rec.boot_id) is str) or type(rec.clean) is not bool:
            raise ValueError("boot_id or clean has the wrong type")
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        return None, f"{path}: not a boot record ({type(e).__name__}: {e})"
    return rec, None


def write(shard_dir: str, rec: BootRecord) -> None:
    """Replace the record durably: a crash leaves the old one or the new one, whole."""
    path = os.path.join(shard_dir, BOOT_RECORD)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        json.dump({"format": FORMAT, **asdict(rec)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fd = os.open(shard_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start(shard_dir: str, index: int, config: Config, now: float,
          boot_id_path: str = BOOT_ID_PATH) -> BootRecord:
    """Read the last run's record, decide, write this run's (before the shard serves) and
    say in the log why placed queues are fenced, if they are. If the record cannot be
    written (a full disk), the run still starts, with the fence decided and no early
    placed lease (``early_visibility_s`` 0): the old record, kept, fences no less."""
    prev, problem = read(shard_dir)
    boot_id = current_boot_id(boot_id_path)
    rec, why = decide(prev, problem is not None, boot_id, now, early_visibility_s(config, boot_id))
    if problem is not None:
        log.error("shard %d: %s", index, problem)
    if why is not None:
        log.warning("shard %d: %s: a lease of a placed queue handed out before its fsync may have been "
                    "lost with it, and its job may still run; so placed queues lease nothing for %.1f s, "
                    "until every such lease has run out (docs/limits.md, \"Across restarts\")",
                    index, why, rec.fence_until - now)
    elif rec.fence_until > now:
        log.warning("shard %d: placed queues stay fenced for %.1f s more, as its last run left them "
                    "(docs/limits.md, \"Across restarts\")", index, rec.fence_until - now)
    try:
        write(shard_dir, rec)
    except OSError as e:
        log.error("shard %d: cannot write its boot record (%s): every lease of a placed queue waits for "
                  "its fsync in this run", index, e)
        return BootRecord(rec.boot_id, False, 0.0, rec.fence_until)
    return rec


def stopped_cleanly(shard_dir: str, rec: BootRecord) -> None:
    """After the log is closed (synced to its end): nothing this run handed out is lost."""
    write(shard_dir, BootRecord(rec.boot_id, True, rec.early_visibility_s, rec.fence_until))
