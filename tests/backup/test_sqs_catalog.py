"""A backup keeps the SQS API's state (issue 46; docs/backup.md, "What a backup holds").

Queues made and changed through the SQS API, a message sent and one received, then
``backup`` and ``restore``: ``serve`` of the restored copy answers GetQueueUrl, the same
attributes and tags, and the receipt handle given out before the backup still deletes its
message (the handle key came along), and a move task that was running in a process of the
original is listed FAILED. Only the catalog is copied, not its lock file or the owner files
of live processes; it is read without its lock, whole. A damaged catalog in a backup is
refused naming it, and a backup of a data dir that never ran the SQS API (as every backup
taken before this change) restores without one.
"""
from __future__ import annotations

import base64
import dataclasses
import hmac
import json
import os
import shutil
import threading

import botocore.exceptions
import pytest

from shardq.backup import sqs_catalog
from shardq.backup.logfiles import sha256
from shardq.backup.manifest import MANIFEST, Manifest
from shardq.backup.restore import restore
from shardq.backup.take import backup
from shardq.errors import CorruptLog
from shardq.sqs_api import catalog as sqs_api_catalog
from shardq.sqs_api.catalog import Catalog

from support.service import Service, short_tmpdir
from support.sqs_inproc import InProcessApi
from support.sqs_listener import QUEUE_DEFAULTS, client, sqs_service, sqs_url

HOST = "127.0.0.1:9324"
COUNTS = ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible")


@pytest.fixture(scope="module")
def taken():
    """One service, two backups: ``before`` taken before the SQS API ever ran on it, ``after``
    once queues were made, a message sent and one received (its handle kept)."""
    base = short_tmpdir("sqbks")
    got = {"base": base, "before": os.path.join(base, "before"), "after": os.path.join(base, "after")}
    config = {"http": {"listen": ""}, "queue_defaults": dict(QUEUE_DEFAULTS)}
    with Service(data_dir=os.path.join(base, "data"), shards=2, config=config) as svc:
        with svc.connect() as q:
            q.enqueue(b"a plain shardq job", queue="plain")
        backup(svc.data_dir, got["before"])
        api = InProcessApi(svc.data_dir, Catalog(svc.data_dir))
        try:
            dlq = api.call("CreateQueue", {"QueueName": "orders-dlq"}, HOST)["QueueUrl"]
            dlq_arn = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["QueueArn"]},
                               HOST)["Attributes"]["QueueArn"]
            url = api.call("CreateQueue", {"QueueName": "orders", "Attributes": {"VisibilityTimeout": "600"},
                                           "tags": {"team": "billing"}}, HOST)["QueueUrl"]
            api.call("SetQueueAttributes", {"QueueUrl": url, "Attributes": {
                "MessageRetentionPeriod": "86400", "ReceiveMessageWaitTimeSeconds": "3",
                "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": 4})}}, HOST)
            for body in ("first", "second"):
                api.call("SendMessage", {"QueueUrl": url, "MessageBody": body}, HOST)
            (msg,) = api.call("ReceiveMessage", {"QueueUrl": url, "MaxNumberOfMessages": 1}, HOST)["Messages"]
            got["attributes"] = api.call("GetQueueAttributes", {"QueueUrl": url, "AttributeNames": ["All"]},
                                         HOST)["Attributes"]
            assert {k: got["attributes"][k] for k in COUNTS} == dict.fromkeys(COUNTS, "1")
            got["handle"], got["key"] = msg["ReceiptHandle"], api.catalog.key
            # a message move task running in this process while the backup is taken (1 message
            # a second, 10 to move: it runs for 9 s at least)
            moves = api.call("CreateQueue", {"QueueName": "moves"}, HOST)["QueueUrl"]
            back = api.call("CreateQueue", {"QueueName": "moves-dlq"}, HOST)["QueueUrl"]
            got["back_arn"] = back_arn = api.arn("moves-dlq")
            api.call("SetQueueAttributes", {"QueueUrl": moves, "Attributes": {"RedrivePolicy": json.dumps(
                {"deadLetterTargetArn": back_arn, "maxReceiveCount": 4})}}, HOST)
            for i in range(10):
                api.call("SendMessage", {"QueueUrl": back, "MessageBody": f"dead {i}"}, HOST)
            api.call("StartMessageMoveTask", {"SourceArn": back_arn, "DestinationArn": api.arn("moves"),
                                              "MaxNumberOfMessagesPerSecond": 1}, HOST)
            owners = os.listdir(os.path.join(svc.data_dir, "sqs-api", "owners"))
            assert owners  # this process's, live while the backup runs
            backup(svc.data_dir, got["after"])
            assert [t["Status"] for t in api.catalog.tasks().values()] == ["RUNNING"]  # still, after the backup
        finally:
            api.close()
    yield got
    shutil.rmtree(base, ignore_errors=True)


def test_a_restored_copy_serves_the_sqs_queues_and_the_receipt_handles_given_before_the_backup(taken):
    assert sorted(os.listdir(os.path.join(taken["after"], "sqs-api"))) == ["catalog.json"]  # no lock, no owners
    listed = {f.path for f in Manifest.read(taken["after"]).files}
    assert sqs_catalog.PATH in listed
    new = os.path.join(taken["base"], "restored")
    restore(taken["after"], new)
    assert sorted(os.listdir(os.path.join(new, "sqs-api"))) == ["catalog.json"]
    assert os.stat(os.path.join(new, "sqs-api")).st_mode & 0o777 == 0o700
    with sqs_service(shards=2, data_dir=new) as svc:
        sqs = client(sqs_url(svc))
        url = sqs.get_queue_url(QueueName="orders")["QueueUrl"]
        assert url.endswith("/orders")
        assert sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"] == taken["attributes"]
        assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"team": "billing"}
        dlq = sqs.get_queue_url(QueueName="orders-dlq")["QueueUrl"]
        assert sqs.list_dead_letter_source_queues(QueueUrl=dlq)["queueUrls"] == [url]
        # the handle of the receive before the backup deletes the message it leased: same key,
        # and the lease (600 s) is in the copy
        sqs.delete_message(QueueUrl=url, ReceiptHandle=taken["handle"])
        counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=list(COUNTS))["Attributes"]
        assert counts == {"ApproximateNumberOfMessages": "1", "ApproximateNumberOfMessagesNotVisible": "0"}
        # a handle signed with another key is refused, so the deletion above was the key's doing
        forged = Catalog(os.path.join(taken["base"], "elsewhere"))
        assert forged.key != taken["key"]
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=_resigned(taken["handle"], forged.key),
                                          VisibilityTimeout=5)
        assert e.value.response["Error"]["Code"] == "ReceiptHandleIsInvalid"
        # the move task that ran in a process of the original is no task of the copy's processes
        (task,) = sqs.list_message_move_tasks(SourceArn=taken["back_arn"])["Results"]
        assert task["Status"] == "FAILED"
        (left,) = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0)["Messages"]
        assert left["Body"] in ("first", "second")


def _resigned(handle: str, key: bytes) -> str:
    """The same lease as ``handle``, signed with ``key``."""
    raw = base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))
    payload = raw[:-16]
    return base64.urlsafe_b64encode(payload + hmac.digest(key, payload, "sha256")[:16]).decode().rstrip("=")


def test_a_backup_of_a_data_dir_that_never_ran_the_sqs_api_restores_without_a_catalog(taken):
    assert sorted(f.path for f in Manifest.read(taken["before"]).files) == ["authkey", "shardq.json"]
    assert "sqs-api" not in os.listdir(taken["before"])
    new = os.path.join(taken["base"], "restored-before")
    restored = restore(taken["before"], new)
    assert sum(s.jobs for s in restored.shards) == 1
    assert "sqs-api" not in os.listdir(new)
    # the SQS API makes its catalog there at first start, as on any data dir: no queues, a new key
    fresh = Catalog(new)
    assert fresh.names() == [] and fresh.key != taken["key"]


def copy_of(taken, tmp: str) -> str:
    path = os.path.join(tmp, "copy")
    shutil.copytree(taken["after"], path)
    return path


@pytest.fixture
def tmp():
    path = short_tmpdir("sqbkc")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_damaged_catalog_in_a_backup_is_refused_naming_it_and_nothing_is_restored(taken, tmp):
    copy = copy_of(taken, tmp)
    path = os.path.join(copy, sqs_catalog.PATH)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(data)
    new = os.path.join(tmp, "new")
    with pytest.raises(CorruptLog, match=r"its sha256 is \w+, the manifest's \w+: the file changed") as e:
        restore(copy, new)
    assert e.value.path == path
    assert not os.path.exists(new) and not [n for n in os.listdir(tmp) if ".restoring-" in n]
    os.unlink(path)
    with pytest.raises(CorruptLog, match="missing: the backup's manifest lists it") as e:
        restore(copy, new)
    assert e.value.path == path and not os.path.exists(new)


def test_a_catalog_without_its_handle_key_is_refused_even_with_a_manifest_made_to_match(taken, tmp):
    copy = copy_of(taken, tmp)
    path = os.path.join(copy, sqs_catalog.PATH)
    doc = json.load(open(path))
    del doc["key"]
    raw = json.dumps(doc).encode()
    open(path, "wb").write(raw)
    m = Manifest.read(copy)
    files = tuple(dataclasses.replace(f, bytes=len(raw), sha256=sha256(raw)) if f.path == sqs_catalog.PATH else f
                  for f in m.files)
    with open(os.path.join(copy, MANIFEST), "wb") as f:
        f.write(dataclasses.replace(m, files=files).encode())
    new = os.path.join(tmp, "new")
    with pytest.raises(CorruptLog, match="an SQS API catalog without its receipt handle key") as e:
        restore(copy, new)
    assert e.value.path == path and not os.path.exists(new)


def test_the_backup_reads_the_file_the_sqs_api_writes_and_refuses_a_damaged_one(tmp):
    assert sqs_catalog.PATH == f"{sqs_api_catalog.DIR}/{sqs_api_catalog.FILE}"
    assert sqs_catalog.snapshot(tmp) is None  # never ran the SQS API
    Catalog(tmp)
    assert json.loads(sqs_catalog.snapshot(tmp))["key"] == Catalog(tmp).key.hex()
    path = os.path.join(tmp, sqs_catalog.PATH)
    for damage, reason in ((b'{"version": 1, "key": "', "not JSON"),
                           (b"[]", "not an SQS API catalog of version 1"),
                           (b'{"version": 1, "key": "ab", "queues": {}, "deleted": {}, "tasks": {}}',
                            "without its receipt handle key"),
                           (json.dumps({"version": 1, "key": "ab" * 32, "queues": {}, "deleted": {}}).encode(),
                            "without its table of tasks")):
        with open(path, "wb") as f:
            f.write(damage)
        with pytest.raises(CorruptLog, match=reason) as e:
            sqs_catalog.snapshot(tmp)
        assert e.value.path == path


def test_a_snapshot_taken_while_the_catalog_changes_is_one_whole_version(tmp):
    """No lock is taken: the SQS API replaces the file by rename, so each read sees one whole
    version (a file rewritten in place would be read half old, half new)."""
    catalog = Catalog(tmp)
    catalog.create("q", {"VisibilityTimeout": "0"}, {}, {})
    done = threading.Event()

    def change() -> None:
        try:
            for i in range(1, 60):
                catalog.set_attributes("q", {"VisibilityTimeout": str(i), "Policy": "x" * (i * 97 % 4000)})
        finally:
            done.set()
    t = threading.Thread(target=change)
    t.start()
    seen = set()
    try:
        while not done.is_set():
            doc = json.loads(sqs_catalog.snapshot(tmp))  # checked whole: CorruptLog otherwise
            attrs = doc["queues"]["q"]["attributes"]
            seen.add(int(attrs["VisibilityTimeout"]))
            assert len(attrs.get("Policy", "")) == int(attrs["VisibilityTimeout"]) * 97 % 4000
    finally:
        t.join(30)
    assert len(seen) > 1  # it did read while the file changed
