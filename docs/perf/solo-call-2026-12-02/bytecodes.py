"""Bytecodes shardq runs in the caller for one lone enqueue, dequeue and ack
(sys.settrace with opcode events), by function: ``python bytecodes.py TREE``.
"""
import os, sys, tempfile, shutil, collections
sys.path.insert(0, sys.argv[1])
import shardq
from shardq.service.supervisor import Supervisor
d = tempfile.mkdtemp(dir="/dev/shm")
sup = Supervisor(d + "/data", {"http": {"listen": ""}}, 1)
sup.start(background=True)
counts = collections.Counter()
def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    frame.f_trace_lines = False
    if event == "opcode":
        counts[frame.f_code.co_name] += 1
    return tracer
with shardq.Router(sup.dd.path, supervisor=sup) as q:
    for _ in range(50): q.enqueue(b"x" * 100, key="k")
    ops = {"enqueue": lambda: q.enqueue(b"x" * 100, key="k1")}
    l = q.dequeue(); q.ack(l)
    for name, fn in ops.items():
        counts.clear(); sys.settrace(tracer); fn(); sys.settrace(None)
        print(name, sum(counts.values()), counts.most_common(12))
    q.enqueue(b"y", key="k2")
    counts.clear(); sys.settrace(tracer); l = q.dequeue(); sys.settrace(None); print("dequeue", sum(counts.values()), counts.most_common(8))
    counts.clear(); sys.settrace(tracer); q.ack(l); sys.settrace(None); print("ack", sum(counts.values()), counts.most_common(8))
sup.stop(); shutil.rmtree(d)
