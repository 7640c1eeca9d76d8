"""The AWS SDK for Go v2 (service/sqs as Debian packages it, a release that speaks SQS's query
protocol and signs with its own SigV4 signer; it rejects a message whose body MD5 differs)
against a real ``shardq serve`` with keys set: a standard and a FIFO queue, every call a
producer and a consumer make (go/check_sqs.go, built once per test session), results asserted
here as test_js_sdk.py asserts the JavaScript SDK's."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess

import pytest

from support.sqs_clients import CREDENTIALS, go_sdk_binary
from support.sqs_listener import KEY_ID, SECRET, sqs_service, sqs_url

FIRST_BODY = "first ✓ message: ünïcödé and <xml> & \"quotes\""  # as check_sqs.go sends it


@pytest.fixture(scope="session")
def go_binary(tmp_path_factory):
    return go_sdk_binary(str(tmp_path_factory.mktemp("go-sdk")))


@pytest.fixture(scope="module")
def go_run(go_binary):
    with sqs_service(keys=True) as svc:
        url = sqs_url(svc).rstrip("/")
        env = dict(os.environ, SQS_ENDPOINT=url, QUEUE_PREFIX="go", **CREDENTIALS)
        env.update(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET)
        r = subprocess.run([go_binary], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{r.stderr[-3000:]}\n--- service log ---\n{svc.tail()}"
        yield json.loads(r.stdout), url


def test_standard_queue_send_receive_visibility_and_delete(go_run):
    res, url = go_run
    std = res["standard"]
    assert std["queue_url"] == std["get_queue_url"] == url + "/000000000000/go-std"
    assert std["send"] == {**std["send"], "md5_body_ok": True, "md5_attrs_ok": True}
    assert std["send_batch"] == {"successful": [f"e{i}" for i in range(10)], "failed": 0, "md5_attrs_ok": True}
    got = {m["body"]: m for m in std["received"]}
    assert sorted(got) == sorted([FIRST_BODY] + [f"batch {i}" for i in range(10)])
    assert all(m["md5_attrs_ok"] for m in std["received"])
    first = got[FIRST_BODY]
    assert first["message_id"] == std["send"]["message_id"]
    b64 = lambda raw: base64.b64encode(bytes(raw)).decode()  # noqa: E731 - Go's JSON writes []byte so
    assert first["attributes"] == {
        "Greeting": {"DataType": "String", "StringValue": "héllo wörld ✓"},
        "Count": {"DataType": "Number", "StringValue": "-12.5e3"},
        "Blob": {"DataType": "Binary", "BinaryValue": b64([0, 1, 2, 253, 254, 255])},
        "Kind": {"DataType": "String.order", "StringValue": "express"},
        "Weight": {"DataType": "Number.int", "StringValue": "42"},
        "Thumb": {"DataType": "Binary.png", "BinaryValue": b64([137, 80, 78, 71])},
    }
    for m in std["received"]:
        assert m["system"]["ApproximateReceiveCount"] == "1" and m["system"]["SenderId"] == KEY_ID
        assert int(m["system"]["SentTimestamp"]) <= int(m["system"]["ApproximateFirstReceiveTimestamp"])
    assert std["after_visibility_0"] == [{"body": FIRST_BODY, "receive_count": "2", "new_handle": True}]
    assert std["delete_batch"] == {"successful": 10, "failed": 0} and std["left_after_delete"] == 0
    assert std["queue_attributes"]["QueueArn"] == "arn:aws:sqs:us-east-1:000000000000:go-std"


def test_fifo_queue_keeps_group_order_one_in_flight_and_dedups(go_run):
    fifo = go_run[0]["fifo"]
    sent = fifo["sent"]
    for g in "abc":
        seqs = [int(s["sequence"]) for s in sent if s["group"] == g]
        assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert fifo["duplicate_message_id"] == sent[0]["message_id"]
    delivered: dict[str, list[str]] = {g: [] for g in "abc"}
    for rnd in fifo["rounds"]:
        groups = [m["group"] for m in rnd["received"]]
        assert len(groups) == len(set(groups)), f"two messages of one group in flight at once: {rnd}"
        assert not set(groups) & {m["group"] for m in rnd["while_in_flight"]}, rnd
        for m in rnd["received"] + rnd["while_in_flight"]:
            delivered[m["group"]].append(m["body"])
    assert delivered == {g: [f"{g}{i}" for i in range(5)] for g in "abc"}


def test_a_message_of_1_mib_goes_both_ways_with_its_md5(go_run):
    big = go_run[0]["largest"]
    expected = hashlib.md5(("é" * (512 * 1024)).encode()).hexdigest()
    assert big == {"body_bytes": 1024 * 1024, "md5_sent": expected, "md5_received": expected, "same_body": True}
