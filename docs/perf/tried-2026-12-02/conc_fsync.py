"""Does a second fdatasync overlap one in flight on the same file? T threads each append a
120-byte record (under a lock, in order) and fdatasync, N commits in all."""
import os, sys, threading, time, statistics
path = sys.argv[1] + "/conc.log"; T = int(sys.argv[2]); N = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
os.posix_fallocate(fd, 0, 64 << 20); os.fsync(fd)
lock = threading.Lock(); off = [0]; n = [0]; lat = []
def worker():
    rec = b"r" * 120
    while True:
        with lock:
            if n[0] >= N: return
            n[0] += 1
            o = off[0]; off[0] += 120
            os.pwrite(fd, rec, o)
        t0 = time.perf_counter(); os.fdatasync(fd); lat.append(time.perf_counter() - t0)
t0 = time.perf_counter()
ts = [threading.Thread(target=worker) for _ in range(T)]
for t in ts: t.start()
for t in ts: t.join()
dt = time.perf_counter() - t0
print(f"threads {T}: {N/dt:.0f} commits/s, fdatasync p50 {statistics.median(lat)*1e6:.0f} us")
os.close(fd); os.unlink(path)
