"""bench/probes/sqs_listener_path.py runs end to end on a few requests: every receive got its
10 messages and every delete took, each action's calls and loop turns a request are counted,
a send's two stretches are timed, and the functions it names are the listener's (the SQS
actions, the HTTP listener). No timing is asserted."""
import json
import subprocess
import sys

from support.service import REPO


def test_sqs_listener_path_probe_runs(tmp_path):
    out = tmp_path / "path.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.sqs_listener_path", "--requests", "20", "--top", "400",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True and res["requests"] == 20
    assert set(res["actions"]) == {"SendMessage", "ReceiveMessage", "DeleteMessageBatch"}
    for action, got in res["actions"].items():
        assert got["cpu_us"] > 0 and got["calls"] > 100 and 1 <= got["loop_turns"] < 20, action
        names = [where for where, _ in got["top"]]
        assert any(n.startswith("shardq/service/aio_listener.py:") for n in names), action
        assert not any(n.startswith("bench/sqs_api.py") for n in names), action  # the client is not counted
    send = res["actions"]["SendMessage"]  # both stretches of a lone send were seen, in order
    assert 0 < send["to_shard_p50_us"] <= send["to_shard_p99_us"] and 0 < send["to_client_p50_us"], send
    receive = [w for w, _ in res["actions"]["ReceiveMessage"]["top"]]
    assert any(w.startswith("shardq/sqs_api/messages.py:") and w.endswith(":_present_all") for w in receive)
    # ten messages a receive: per message work shows ten times a request
    encode = [n for w, n in res["actions"]["ReceiveMessage"]["top"] if w.startswith("shardq/sqs_api/handles.py:")]
    assert encode and max(encode) >= 10
