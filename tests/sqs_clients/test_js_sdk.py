"""The AWS SDK for JavaScript v3 (``@aws-sdk/client-sqs``, from npm; it rejects a message whose
body MD5 differs) against a real ``shardq serve`` with the SQS listener on: a standard and a
FIFO queue, every call a producer and a consumer make (js/check_sqs.mjs), results asserted here.
Each runs twice: on a loopback listener with no keys, and on one with keys, where every request
carries the JS SDK's own SigV4 signature (a signer no one here wrote) and the listener checks it."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess

import pytest

from support.sqs_clients import CREDENTIALS, JS_DIR, js_sdk_installed
from support.sqs_listener import KEY_ID, SECRET, sqs_service, sqs_url

FIRST_BODY = "first ✓ message: ünïcödé and <xml> & \"quotes\""  # as check_sqs.mjs sends it


def _env(url: str, keys: bool, **kw) -> dict:
    env = dict(os.environ, SQS_ENDPOINT=url, QUEUE_PREFIX="js", **CREDENTIALS, **kw)
    if keys:
        env.update(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET)
    return env


@pytest.fixture(scope="module", params=["no keys", "keys"])
def js_run(request):
    node = js_sdk_installed()
    keys = request.param == "keys"
    with sqs_service(keys=keys) as svc:
        url = sqs_url(svc).rstrip("/")
        env = _env(url, keys)
        r = subprocess.run([node, "check_sqs.mjs"], cwd=JS_DIR, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{r.stderr[-3000:]}\n--- service log ---\n{svc.tail()}"
        yield json.loads(r.stdout), url


def test_standard_queue_send_receive_visibility_and_delete(js_run):
    res, url = js_run
    std = res["standard"]
    assert std["queue_url"].startswith(url + "/") and std["queue_url"].endswith("/js-std")
    assert std["get_queue_url"] == std["queue_url"]
    # The SDK checked MD5OfMessageBody itself (it throws otherwise); the attributes' MD5 was computed by the script.
    assert std["send"] == {**std["send"], "md5_body_ok": True, "md5_attrs_ok": True}
    assert std["send_batch"] == {"successful": [f"e{i}" for i in range(10)], "failed": [], "md5_attrs_ok": True}

    got = {m["body"]: m for m in std["received"]}
    assert sorted(got) == sorted([FIRST_BODY] + [f"batch {i}" for i in range(10)])
    assert all(m["md5_attrs_ok"] for m in std["received"])
    first = got[FIRST_BODY]
    assert first["message_id"] == std["send"]["message_id"]
    assert first["attributes"] == {
        "Greeting": {"DataType": "String", "StringValue": "héllo wörld ✓"},
        "Count": {"DataType": "Number", "StringValue": "-12.5e3"},
        "Blob": {"DataType": "Binary", "BinaryValue": base64.b64encode(bytes([0, 1, 2, 253, 254, 255])).decode()},
        "Kind": {"DataType": "String.order", "StringValue": "express"},
        "Weight": {"DataType": "Number.int", "StringValue": "42"},
        "Thumb": {"DataType": "Binary.png", "BinaryValue": base64.b64encode(bytes([137, 80, 78, 71])).decode()},
    }
    assert got["batch 7"]["attributes"] == {"Index": {"DataType": "Number", "StringValue": "7"}}
    for m in std["received"]:
        assert m["system"]["ApproximateReceiveCount"] == "1"
        assert int(m["system"]["SentTimestamp"]) <= int(m["system"]["ApproximateFirstReceiveTimestamp"])

    # Visibility 0: the message is back at once, with a new receipt handle and a second receive counted.
    assert std["after_visibility_0"] == [{"body": first["body"], "receive_count": "2", "new_handle": True}]
    assert std["delete_batch"] == {"successful": 10, "failed": []}
    assert std["left_after_delete"] == 0
    attrs = std["queue_attributes"]
    assert attrs["QueueArn"] == "arn:aws:sqs:us-east-1:000000000000:js-std"
    assert attrs["ApproximateNumberOfMessages"] == "0" and attrs["ApproximateNumberOfMessagesNotVisible"] == "0"


def test_fifo_queue_keeps_group_order_one_in_flight_and_dedups(js_run):
    fifo = js_run[0]["fifo"]
    sent = fifo["sent"]
    assert fifo["queue_url"].endswith("/js-order.fifo")
    # SequenceNumber grows within a group; a content-based duplicate answers the first MessageId.
    for g in "abc":
        seqs = [int(s["sequence"]) for s in sent if s["group"] == g]
        assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert fifo["duplicate_message_id"] == sent[0]["message_id"]

    delivered = {g: [] for g in "abc"}
    for rnd in fifo["rounds"]:
        groups = [m["group"] for m in rnd["received"]]
        assert len(groups) == len(set(groups)), f"two messages of one group in flight at once: {rnd}"
        # Asked again before any delete: nothing of a group whose message is in flight.
        assert not set(groups) & {m["group"] for m in rnd["while_in_flight"]}, rnd
        for m in rnd["received"] + rnd["while_in_flight"]:
            delivered[m["group"]].append(m["body"])
    assert delivered == {g: [f"{g}{i}" for i in range(5)] for g in "abc"}


def test_a_message_of_1_mib_goes_both_ways_with_its_md5(js_run):
    big = js_run[0]["largest"]
    expected = hashlib.md5(("é" * (512 * 1024)).encode()).hexdigest()
    assert big == {"body_bytes": 1024 * 1024, "md5_sent": expected, "md5_received": expected, "same_body": True}


# A request signed with a wrong secret or by an unknown key id: AWS's error, as the SDK names it.
WRONG_SIGNATURES = """
import { SQSClient, ListQueuesCommand } from "@aws-sdk/client-sqs";
const out = {};
for (const [name, accessKeyId, secretAccessKey] of [
    ["right", process.env.KEY_ID, process.env.SECRET],
    ["wrong secret", process.env.KEY_ID, "not-the-secret-0123456789"],
    ["unknown key", "AKIDUNKNOWNKEY000001", process.env.SECRET]]) {
  const c = new SQSClient({ endpoint: process.env.SQS_ENDPOINT, region: "us-east-1", maxAttempts: 1,
                            credentials: { accessKeyId, secretAccessKey } });
  try { await c.send(new ListQueuesCommand({})); out[name] = "ok"; }
  catch (e) { out[name] = [e.name, e.$metadata?.httpStatusCode]; }
}
console.log(JSON.stringify(out));
"""


def test_a_wrong_signature_gets_aws_error_in_the_js_sdk():
    node = js_sdk_installed()
    with sqs_service(keys=True) as svc:
        env = _env(sqs_url(svc).rstrip("/"), True, KEY_ID=KEY_ID, SECRET=SECRET)
        r = subprocess.run([node, "--input-type=module", "-e", WRONG_SIGNATURES], cwd=JS_DIR, env=env,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == {"right": "ok", "wrong secret": ["SignatureDoesNotMatch", 403],
                                    "unknown key": ["InvalidClientTokenId", 403]}
