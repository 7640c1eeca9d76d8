"""What a record's write and fdatasync cost after a short and after a long idle gap.

    python -m bench.probes.fsync_idle [--samples 300] [--gaps-ms 2,50] [--file-mib 64] [--dir DIR] [--json PATH]
    python -m bench.probes.fsync_idle --quick            # 10 samples: checks that it runs

Figures L and W start each call from idle (2 ms and 50 ms after the last), and W's fdatasync
is the longer (docs/performance.md, "Figures L and W"). This probe writes one record of
``RECORD_BYTES`` and fdatasyncs it, after each gap in turn, into three files side by side:

* ``reserved``: ``posix_fallocate``d to ``--file-mib`` first (64: a segment's default size), as
  the log reserves each segment (``wal.fileio.Files.allocate``): appends never change its size;
* ``zeroed``: zeros written and fsynced first (no unwritten extent is left to convert);
* ``growing``: each record extends the file (its size changes with every fdatasync);
* ``dsync``: reserved as ``reserved``, each record written and made durable by one call,
  ``os.pwritev(fd, [record], offset, os.RWF_DSYNC)`` (reported as the write; its fdatasync 0).

Reported per file and gap: the write's, the fdatasync's and both together's p50 / p90 / p99 in
microseconds,
and whether the reserved files kept their size. The files take turns, so the machine's load falls
on each alike. No timing is checked.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from shardq.wal.fileio import Files

RECORD_BYTES = 160      # a lone enqueue's record (100-byte body, a key, the session op)
FILE_MIB = 64           # the log's default segment size (config.storage.segment_bytes)
KINDS = ("reserved", "zeroed", "growing", "dsync")


def _open(path: str, kind: str, mib: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    if kind in ("reserved", "dsync"):
        failed = Files().allocate(fd, mib << 20)
        if failed is not None:
            raise failed
    elif kind == "zeroed":
        zeros = bytes(1 << 20)
        for _ in range(mib):
            os.write(fd, zeros)
    os.fsync(fd)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def pct(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {f"p{p}": round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1e6, 1) for p in (50, 90, 99)}


def run(samples: int, gaps_s: list[float], directory: str, mib: int = FILE_MIB) -> dict[str, object]:
    fds = {kind: _open(os.path.join(directory, kind), kind, mib) for kind in KINDS}
    took: dict[tuple[str, float], tuple[list[float], list[float], list[float]]] = {
        (k, g): ([], [], []) for k in KINDS for g in gaps_s}
    record, clock = b"r" * RECORD_BYTES, time.perf_counter
    offsets = dict.fromkeys(KINDS, 0)
    try:
        for _ in range(samples):
            for gap in gaps_s:
                for kind, fd in fds.items():
                    time.sleep(gap)
                    if kind == "dsync":
                        t0 = clock()
                        os.pwritev(fd, [record], offsets[kind], os.RWF_DSYNC)
                        t1 = t2 = clock()
                        offsets[kind] += RECORD_BYTES
                    else:
                        t0 = clock()
                        os.write(fd, record)
                        t1 = clock()
                        os.fdatasync(fd)
                        t2 = clock()
                    writes, syncs, both = took[(kind, gap)]
                    writes.append(t1 - t0)
                    syncs.append(t2 - t1)
                    both.append(t2 - t0)
        kept = all(os.fstat(fds[k]).st_size == mib << 20 for k in ("reserved", "dsync"))
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"samples": samples, "record_bytes": RECORD_BYTES, "reserved_kept_its_size": kept,
            "results": [{"file": k, "gap_ms": g * 1e3, "write_us": pct(w), "fdatasync_us": pct(s),
                         "durable_us": pct(b)} for (k, g), (w, s, b) in took.items()]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.fsync_idle", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300, help="records per file and gap (default 300)")
    p.add_argument("--gaps-ms", default="2,50", help="idle gaps before each record (default 2,50: L's and W's)")
    p.add_argument("--file-mib", type=int, default=FILE_MIB,
                   help="the reserved and zero-filled files' size (default 64)")
    p.add_argument("--dir", default=None, help="where the files go (default: the system's temporary directory)")
    p.add_argument("--quick", action="store_true", help="10 samples")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    samples = 10 if a.quick else a.samples
    tmp = tempfile.mkdtemp(prefix="sq-fsync-", dir=a.dir)
    try:
        res = run(samples, [float(g) / 1e3 for g in a.gaps_ms.split(",")], tmp, a.file_mib)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'file':9s} {'gap ms':>6s}  write p50 / p90 / p99   fdatasync p50 / p90 / p99"
          "   both p50 / p90 / p99 (us)")
    for r in res["results"]:  # type: ignore[attr-defined]
        w, s, b = r["write_us"], r["fdatasync_us"], r["durable_us"]
        print(f"{r['file']:9s} {r['gap_ms']:6.0f}  {w['p50']:7.1f} {w['p90']:7.1f} {w['p99']:7.1f}"
              f"   {s['p50']:7.1f} {s['p90']:7.1f} {s['p99']:8.1f}   {b['p50']:7.1f} {b['p90']:7.1f} {b['p99']:8.1f}")
    print(f"the reserved files kept their size: {res['reserved_kept_its_size']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
