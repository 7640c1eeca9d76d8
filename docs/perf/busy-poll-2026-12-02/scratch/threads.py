"""Per-thread voluntary switches and CPU of the shard and the client during lone enqueues."""
import os, sys, time, tempfile
sys.path.insert(0, "/work/main")
from bench.peers.shardq_peer import ShardqAdapter

def per_thread(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = st[st.index("(")+1:st.rindex(")")]
            f = st[st.rindex(")")+2:].split()
            ut, stt = int(f[11]), int(f[12])
            vol = nvol = 0
            for line in open(f"/proc/{pid}/task/{tid}/status"):
                if line.startswith("voluntary_ctxt_switches"): vol = int(line.split()[1])
                if line.startswith("nonvoluntary_ctxt_switches"): nvol = int(line.split()[1])
            out[tid] = (name, ut, stt, vol, nvol)
        except FileNotFoundError:
            pass
    return out

N = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
d = tempfile.mkdtemp(dir=sys.argv[2] if len(sys.argv) > 2 else "/tmp")
a = ShardqAdapter(shards=1)
a.setup(d)
try:
    pids = a.server_pids() + [os.getpid()]
    OP = os.environ.get("OP", "enqueue")
    if OP == "lease-ack":
        from bench.call_floor import _fill
        _fill(a, [(b"x"*100, f"k{i%1000}") for i in range(N + 50)])
        def call(i):
            h = a.client.dequeue(1.0); a.client.ack(h)
    else:
        def call(i): a.client.enqueue(b"x"*100, f"k{i%1000}")
    for i in range(50): call(i)
    before = {p: per_thread(p) for p in pids}
    t = time.perf_counter()
    for i in range(N): call(i)
    took = time.perf_counter() - t
    after = {p: per_thread(p) for p in pids}
    print(f"{took/N*1e6:.0f} us/call")
    for p in pids:
        for tid, (name, ut, stt, vol, nvol) in after[p].items():
            b = before[p].get(tid, (name, 0, 0, 0, 0))
            dv, dn = vol - b[3], nvol - b[4]
            du, ds = (ut - b[1]) * 10000 / N, (stt - b[2]) * 10000 / N
            if dv or dn or du or ds:
                print(f"pid {p} tid {tid} {name:16s} vol/call {dv/N:.2f} invol/call {dn/N:.2f} user {du:.1f}us sys {ds:.1f}us")
finally:
    a.teardown()
