"""Scratch measurement kept with its results (dsync.txt): one 120-byte append made durable
with write + fdatasync, or with one pwritev(RWF_DSYNC). Usage: python dsync.py [ROUNDS]"""
import os, time, statistics, sys
N = 3000
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
def run(mode, path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, 64 << 20)
    os.fsync(fd)
    rec = b"r" * 120
    off = 0
    t = []
    for i in range(N):
        t0 = time.perf_counter()
        if mode == "write+fdatasync":
            os.pwrite(fd, rec, off); os.fdatasync(fd)
        else:
            os.pwritev(fd, [rec], off, os.RWF_DSYNC)
        t.append(time.perf_counter() - t0)
        off += len(rec)
    os.close(fd); os.unlink(path)
    return statistics.mean(t) * 1e6, statistics.median(t) * 1e6
for r in range(ROUNDS):
    for mode in (["write+fdatasync", "RWF_DSYNC"] if r % 2 == 0 else ["RWF_DSYNC", "write+fdatasync"]):
        m, p50 = run(mode, "/tmp/dsync-probe.log")
        print(f"{mode:16s} mean {m:6.0f} us  median {p50:6.0f} us")
