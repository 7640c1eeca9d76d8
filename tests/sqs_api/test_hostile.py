"""The SQS listener against hostile clients: the console listener's checks
(tests/service/test_http_limits.py) on this listener, which runs on the asyncio listener
(shardq/service/aio_listener.py) with its own body limit. Heads and bodies bounded, each at
its maximum; with keys, a body is not awaited before its Authorization header names the
key; hundreds of half-sent and slow-drip connections cost no threads while requests are
still answered. (The overall request deadline is the listener's own code, timed in
tests/service/test_aio_listener.py.)"""
from __future__ import annotations

import json
import socket
import threading
import time

import psutil
import pytest

from shardq import limits
from tests.support.sqs_listener import parked, sqs_service, sqs_url, waiting_dequeues


def _port(svc) -> int:
    return int(sqs_url(svc).rstrip("/").rpartition(":")[2])


@pytest.fixture(scope="module")
def svc():
    with sqs_service(shards=1) as s:
        s.port = _port(s)
        yield s


def exchange(port: int, data: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(data)
        out = bytearray()
        while chunk := s.recv(65536):
            out += chunk
    return int(out.split(b" ", 2)[1]), bytes(out)


def request(body: bytes, target: str = "AmazonSQS.ListQueues", extra: str = "", pad: int = 0) -> bytes:
    head = (f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Amz-Target: {target}\r\n"
            f"Content-Type: application/x-amz-json-1.0\r\nContent-Length: {len(body)}\r\n{extra}X-Pad: \r\n\r\n"
            ).encode()
    return head.replace(b"X-Pad: ", b"X-Pad: " + b"p" * max(0, pad - len(head))) + body


def test_head_at_its_maximum_passes_and_one_byte_more_is_431(svc):
    assert exchange(svc.port, request(b"{}", pad=limits.HTTP_HEAD_BYTES_MAX))[0] == 200
    assert exchange(svc.port, request(b"{}", pad=limits.HTTP_HEAD_BYTES_MAX + 1))[0] == 431


def test_body_at_its_maximum_passes_and_one_byte_more_is_refused(svc):
    exchange(svc.port, request(json.dumps({"QueueName": "hostile"}).encode(), "AmazonSQS.CreateQueue"))
    url = f"http://127.0.0.1:{svc.port}/000000000000/hostile"
    # 1 MiB of quotes, each escaped as \" by JSON: the largest body SQS takes, at its largest encoding
    body = json.dumps({"QueueUrl": url, "MessageBody": '"' * (1024 * 1024)}).encode()
    body += b" " * (limits.SQS_API_BODY_BYTES_MAX - len(body))  # JSON allows trailing blanks
    status, data = exchange(svc.port, request(body, "AmazonSQS.SendMessage"))
    assert status == 200 and b"MessageId" in data
    status, data = exchange(svc.port, request(body + b" ", "AmazonSQS.SendMessage"))
    assert status == 400 and b"InvalidParameterValue" in data


def test_with_keys_a_body_is_not_awaited_before_the_signature_names_the_key():
    with sqs_service(keys=True, shards=1) as s, socket.create_connection(("127.0.0.1", _port(s)), timeout=5) as c:
        c.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Amz-Target: AmazonSQS.ListQueues\r\n"
                  + f"Content-Length: {limits.SQS_API_BODY_BYTES_MAX}\r\n\r\n".encode())
        data = b""
        while chunk := c.recv(65536):  # to the close (a timeout fails the test)
            data += chunk
        assert data.startswith(b"HTTP/1.1 403 ") and data.count(b"HTTP/1.1 ") == 1, data[:200]
        assert b"MissingAuthenticationToken" in data


def test_hundreds_of_half_open_and_slow_drip_connections_cost_no_threads(svc):
    serve = psutil.Process(svc.proc.pid)

    def timed() -> float:
        start = time.monotonic()
        assert exchange(svc.port, request(b"{}"))[0] == 200
        return time.monotonic() - start
    timed()
    baseline = serve.num_threads()
    conns, stop = [], threading.Event()

    def drip():
        while not stop.wait(0.1):
            for s in conns[1::2]:
                try:
                    s.send(b"x")
                except OSError:
                    pass
    try:
        for _ in range(150):
            for first in (b"POST / HTTP/1.1\r\nHost: 127.0", b"POST / HTTP/1.1\r\nX-Slow: "):
                s = socket.create_connection(("127.0.0.1", svc.port), timeout=15)
                s.sendall(first)
                conns.append(s)
        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        peak = baseline
        for _ in range(5):
            assert timed() < 1.0
            peak = max(peak, serve.num_threads())
        assert peak <= baseline, (baseline, peak)  # one event loop's thread, started with it
    finally:
        stop.set()
        for s in conns:
            s.close()


def test_a_chunked_body_is_read_not_taken_for_an_empty_one(svc):
    """The console's listener decodes chunked bodies (held to this listener's body limit):
    the request is the one its chunks spell, never an empty body."""
    body = json.dumps({"QueueName": "chunk"}).encode()
    head = (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Amz-Target: AmazonSQS.CreateQueue\r\n"
            b"Content-Type: application/x-amz-json-1.0\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n"
    status, data = exchange(svc.port, head + chunks)
    assert status == 200 and b"/000000000000/chunk" in data, data
    status, data = exchange(svc.port, head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 1, body))
    assert status == 400 and data.count(b"HTTP/1.1 ") == 1  # a chunk longer than it says: malformed


def test_a_crowd_of_long_polls_does_not_hold_up_a_send(svc):
    """Requests run as tasks on one loop over one client: 100 consumers waiting in long
    polls (a Celery fleet) leave a producer's send answered at once."""
    exchange(svc.port, request(json.dumps({"QueueName": "crowd"}).encode(), "AmazonSQS.CreateQueue"))
    url = f"http://127.0.0.1:{svc.port}/000000000000/crowd"
    polls = []
    before = waiting_dequeues(svc)
    try:
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", svc.port), timeout=15)
            s.sendall(request(json.dumps({"QueueUrl": url, "WaitTimeSeconds": 20}).encode(),
                              "AmazonSQS.ReceiveMessage", extra="", pad=0).replace(b"Connection: close", b"X: y"))
            polls.append(s)
        parked(svc, before, 100, "the 100 long polls waiting at the shard")
        start = time.monotonic()
        status, _ = exchange(svc.port, request(json.dumps({"QueueUrl": url, "MessageBody": "go"}).encode(),
                                               "AmazonSQS.SendMessage"))
        assert status == 200 and time.monotonic() - start < 2.0
        parked(svc, before, 99, "one poll answered, 99 still waiting")  # the count was these polls'
    finally:
        for s in polls:
            s.close()


def test_serve_refuses_to_start_on_a_taken_address_naming_the_key(svc, tmp_path):
    from tests.support.service import Service
    other = Service(data_dir=str(tmp_path / "d"), shards=1, config={
        "http": {"listen": ""}, "sqs_api": {"listen": f"127.0.0.1:{svc.port}"}})
    try:
        other.start(timeout=20)  # the shards may answer before the listener is refused
    except AssertionError:
        pass
    try:
        assert other.proc.wait(20) != 0
        assert "sqs_api.listen" in other.tail() and "cannot listen" in other.tail()
    finally:
        other.stop()
        other.log.close()
