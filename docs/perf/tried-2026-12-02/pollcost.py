"""A ping-pong over a socketpair, 20,000 calls: the caller waits with poll() then readv(),
or with a blocking readv() bounded by SO_RCVTIMEO; wall, user and system us per call.
Usage: python pollcost.py"""
import os, socket, select, time, resource, sys, struct
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
N = 20000
pid = os.fork()
if pid == 0:
    a.close(); fd = b.fileno(); buf = bytearray(65536)
    while True:
        n = os.readv(fd, (buf,))
        if not n: os._exit(0)
        os.write(fd, bytes(buf[:n]))
b.close(); fd = a.fileno(); buf = bytearray(65536); msg = b"x" * 120
p = select.poll(); p.register(fd, select.POLLIN)
a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 30, 0))
def run(mode):
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    for _ in range(N):
        os.write(fd, msg)
        if mode == "poll":
            p.poll(30000)
        os.readv(fd, (buf,))
    dt = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
    return f"{mode}: wall {dt/N*1e6:.1f} user {(r1.ru_utime-r0.ru_utime)/N*1e6:.1f} sys {(r1.ru_stime-r0.ru_stime)/N*1e6:.1f}"
for i in range(3):
    print(run("poll"), "|", run("read"))
a.close(); os.wait()
