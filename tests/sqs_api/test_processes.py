"""``[sqs_api] processes``: the SQS listener as several processes of ``serve`` on one port.
The key is checked (typed error naming it, its maximum taken); with 2, both processes serve
what either made; SIGKILL of one under load loses no answered send, it is started again, and
the other answers meanwhile."""
from __future__ import annotations

import http.client
import json
import os
import signal
import threading

import pytest

from shardq import limits
from shardq.config import parse
from shardq.errors import InvalidConfig
from tests.support.service import Service, alive, wait_until
from tests.support.sqs_listener import QUEUE_DEFAULTS, sqs_url


@pytest.mark.parametrize("bad", [0, limits.SQS_API_PROCESSES_MAX + 1, "2", True, 1.5])
def test_processes_is_checked_and_named(bad):
    with pytest.raises(InvalidConfig, match="sqs_api.processes"):
        parse({"sqs_api": {"listen": "127.0.0.1:0", "processes": bad}})


def test_processes_takes_its_maximum():
    cfg = parse({"sqs_api": {"listen": "127.0.0.1:0", "processes": limits.SQS_API_PROCESSES_MAX}})
    assert cfg.sqs_api.processes == limits.SQS_API_PROCESSES_MAX and parse({}).sqs_api.processes == 1


def _address(svc: Service) -> dict:
    sqs_url(svc)  # written by this serve
    with open(os.path.join(svc.data_dir, "run", "sqs-api.json")) as f:
        return json.load(f)


def _call(port: int, action: str, params: dict, conn: http.client.HTTPConnection | None = None) -> tuple[dict, str]:
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("POST", "/", body=json.dumps(params), headers={
            "Content-Type": "application/x-amz-json-1.0", "X-Amz-Target": f"AmazonSQS.{action}"})
        r = c.getresponse()
        data = r.read()
        assert r.status == 200, data
        return (json.loads(data) if data else {}), r.getheader("x-amzn-RequestId") or ""
    finally:
        if conn is None:
            c.close()


@pytest.fixture(scope="module")
def svc():
    with Service(shards=1, config={"http": {"listen": ""}, "queue_defaults": dict(QUEUE_DEFAULTS),
                                   "sqs_api": {"listen": "127.0.0.1:0", "processes": 2}}) as s:
        s.port = int(sqs_url(s).rstrip("/").rpartition(":")[2])
        yield s


def test_two_processes_serve_one_port_and_share_the_queues(svc):
    pids = _address(svc)["pids"]
    assert len(set(pids)) == 2 and all(alive(p) for p in pids)
    assert set(pids) <= set(svc.all_pids())  # serve's children: ended with it
    url = _call(svc.port, "CreateQueue", {"QueueName": "shared"})[0]["QueueUrl"]
    for i in range(40):  # new connections: the kernel hands each to one process or the other
        _call(svc.port, "SendMessage", {"QueueUrl": url, "MessageBody": f"m{i}"})
    got = []
    while len(got) < 40:
        msgs = _call(svc.port, "ReceiveMessage", {"QueueUrl": url, "MaxNumberOfMessages": 10,
                                                  "WaitTimeSeconds": 1})[0].get("Messages", [])
        assert msgs, got
        got += [m["Body"] for m in msgs]
        _call(svc.port, "DeleteMessageBatch", {"QueueUrl": url, "Entries": [
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(msgs)]})
    assert sorted(got) == sorted(f"m{i}" for i in range(40))


def test_kill_9_of_one_process_under_load_loses_no_answered_send_and_it_comes_back(svc):
    url = _call(svc.port, "CreateQueue", {"QueueName": "killed"})[0]["QueueUrl"]
    before = _address(svc)["pids"]
    answered: list[str] = []
    stop = threading.Event()

    def produce(n: int) -> None:
        conn, i = None, 0
        while not stop.is_set():
            body = f"p{n}-{i}"
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
                _call(svc.port, "SendMessage", {"QueueUrl": url, "MessageBody": body}, conn)
            except (OSError, http.client.HTTPException):  # its process was killed: reconnect, send again
                conn.close()
                conn = None
                continue
            answered.append(body)
            i += 1
        if conn is not None:
            conn.close()
    threads = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(answered) >= 100, 30, what="sends over both processes")
        os.kill(before[0], signal.SIGKILL)
        restarted = wait_until(lambda: (lambda p: p if p[0] != before[0] and alive(p[0]) else None)(
            _address(svc)["pids"]), 20, what="the killed SQS process to be started again")
        count = len(answered)
        wait_until(lambda: len(answered) >= count + 100, 30, what="sends after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert restarted[1] == before[1] and alive(before[1])  # the other one served on
    drained: set[str] = set()
    while True:
        msgs = _call(svc.port, "ReceiveMessage", {"QueueUrl": url, "MaxNumberOfMessages": 10})[0].get("Messages", [])
        if not msgs:
            break
        drained |= {m["Body"] for m in msgs}
        _call(svc.port, "DeleteMessageBatch", {"QueueUrl": url, "Entries": [
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(msgs)]})
    lost = set(answered) - drained
    assert not lost, f"{len(lost)} answered sends lost, e.g. {sorted(lost)[:5]}"


def test_serve_stopped_ends_its_sqs_processes():
    with Service(shards=1, config={"http": {"listen": ""}, "sqs_api": {"listen": "127.0.0.1:0", "processes": 2}}) as s:
        pids = _address(s)["pids"]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        s.proc.send_signal(signal.SIGTERM)  # as a service manager stops it (Service.stop SIGKILLs what is left)
        assert s.proc.wait(30) == 0
        assert not any(alive(p) for p in pids)  # ended by serve before it exited
        assert not os.path.exists(os.path.join(s.data_dir, "run", "sqs-api.json"))
