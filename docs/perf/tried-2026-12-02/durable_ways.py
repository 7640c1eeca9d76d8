"""One small append made durable, four ways; wall per append and the whole machine's CPU
(all processes, kernel threads and interrupts: /proc/stat) per append.
Usage: python durable_ways.py DIR [ROUNDS] [N]"""
import os, sys, time, mmap, statistics
DIR = sys.argv[1]; ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2; N = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
SIZE = 32 << 20
def cpu():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v) - v[3] - v[4]  # minus idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")
def prepare(path, zero):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    if zero:
        z = b"\0" * (1 << 20)
        for _ in range(SIZE >> 20): os.write(fd, z)
    else:
        os.posix_fallocate(fd, 0, SIZE)
    os.fsync(fd); os.close(fd)
def run(mode, path):
    zero = mode != "fallocate+fdatasync"
    prepare(path, zero)
    flags = os.O_RDWR
    if mode == "odirect+odsync": flags |= os.O_DIRECT | os.O_DSYNC
    if mode == "odsync": flags |= os.O_DSYNC
    fd = os.open(path, flags)
    rec = b"r" * 120
    blk = mmap.mmap(-1, 8192)  # page-aligned
    off = 0
    c0 = cpu(); t0 = time.perf_counter()
    for i in range(N):
        if mode == "odirect+odsync":
            base = off & ~4095
            blk[off - base:off - base + 120] = rec
            end = off + 120
            nb = ((end - base + 4095) // 4096) * 4096
            os.pwritev(fd, [memoryview(blk)[:nb]], base)
            if end - base >= 4096:  # keep the tail block's bytes at the front
                tail = end & ~4095
                blk[:end - tail] = blk[tail - base:end - base]
        elif mode == "odsync":
            os.pwrite(fd, rec, off)
        else:
            os.pwrite(fd, rec, off); os.fdatasync(fd)
        off += 120
    dt = time.perf_counter() - t0; c = cpu() - c0
    os.close(fd); os.unlink(path)
    return dt / N * 1e6, c / N * 1e6
modes = ["fallocate+fdatasync", "zeroed+fdatasync", "odsync", "odirect+odsync"]
for r in range(ROUNDS):
    for m in (modes if r % 2 == 0 else modes[::-1]):
        w, c = run(m, os.path.join(DIR, "durable-probe.log"))
        print(f"{m:22s} wall {w:6.0f} us  machine CPU {c:6.0f} us per append", flush=True)
