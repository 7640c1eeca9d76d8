"""``shardq serve`` with its SQS listener on, and boto3 clients of it (JSON and query
protocol) for tests/sqs_api/."""
from __future__ import annotations

import copy
import json
import os

from .service import Service, wait_until

REGION = "us-east-1"
KEY_ID = "AKIDSHARDQTEST0001"
SECRET = "shardq-test-secret-key-0123456789abcdef"
# 1 MiB messages travel as bodies a little over 1 MiB (an envelope with their attributes)
QUEUE_DEFAULTS = {"max_body_bytes": 2 * 1024 * 1024, "max_deliveries": 1_000_000}


def sqs_service(keys: bool = False, shards: int = 2, data_dir: str | None = None) -> Service:
    cfg: dict = {"listen": "127.0.0.1:0"}
    if keys:
        cfg.update(access_key_id=KEY_ID, secret_access_key=SECRET)
    return Service(data_dir=data_dir, shards=shards, config={"sqs_api": cfg, "queue_defaults": dict(QUEUE_DEFAULTS),
                                                              "http": {"listen": ""}})


def module_fixtures(protocol: str = "json"):  # noqa: ANN201 - two pytest fixtures
    """``svc, sqs = module_fixtures()`` in a test module: its own ``shardq serve`` with the
    SQS listener (``svc.url`` its address) and a boto3 client of it speaking ``protocol``,
    both for the module."""
    import pytest

    @pytest.fixture(scope="module")
    def svc():
        with sqs_service() as s:
            s.url = sqs_url(s)
            yield s

    @pytest.fixture(scope="module")
    def sqs(svc):
        return client(svc.url, protocol)
    return svc, sqs


def sqs_url(svc: Service) -> str:
    """Where the SQS listener of ``svc`` is (``run/sqs-api.json``, written once it listens)."""
    path = os.path.join(svc.data_dir, "run", "sqs-api.json")

    def current():
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        return info["url"] if info["pid"] == svc.proc.pid else None
    return wait_until(current, 20, 0.02, "the SQS listener's address file")


def waiting_dequeues(svc: Service) -> list[int]:
    """Each shard's waiting dequeues parked now: a long poll the listener has read and sent
    on waits at every shard (its dequeue parked there), so a test polls this, not a sleep."""
    with svc.connect() as q:
        return [sh.get("waiting_dequeues", 0) for sh in q.stats()["shards"]]


def parked(svc: Service, before: list[int], more: int, what: str) -> None:
    """Wait until ``more`` long polls wait at every shard beyond ``before``."""
    want = [n + more for n in before]
    wait_until(lambda: waiting_dequeues(svc) == want, 20, 0.02, what)


def client(url: str, protocol: str = "json", key_id: str = KEY_ID, secret: str = SECRET, **config):
    """A boto3 SQS client of ``url``; ``protocol="query"`` makes botocore send the query
    protocol (the API model's protocol switched, with the query names of the members)."""
    import boto3
    import botocore.config
    import botocore.session
    session = botocore.session.get_session()
    if protocol == "query":
        loader = session.get_component("data_loader")
        model = copy.deepcopy(loader.load_service_model("sqs", "service-2"))
        _to_query(model)
        session.get_component("data_loader").load_service_model = (
            lambda name, type_name, api_version=None, _m=model, _l=loader.load_service_model:
            _m if (name, type_name) == ("sqs", "service-2") else _l(name, type_name, api_version))
    cfg = botocore.config.Config(retries={"max_attempts": 1}, **config)
    return boto3.Session(botocore_session=session).client(
        "sqs", region_name=REGION, endpoint_url=url.rstrip("/"), aws_access_key_id=key_id,
        aws_secret_access_key=secret, config=cfg)


# The member names of the query protocol (the API's query model); the JSON model has none.
_QUERY_NAMES = {"AttributeNameList": "AttributeName", "MessageAttributeNameList": "MessageAttributeName",
                "MessageSystemAttributeList": "MessageSystemAttributeName", "TagKeyList": "TagKey",
                "AWSAccountIdList": "AWSAccountId", "ActionNameList": "ActionName", "QueueUrlList": "QueueUrl",
                "MessageList": "Message", "BatchResultErrorEntryList": "BatchResultErrorEntry",
                "ListMessageMoveTasksResultEntryList": "ListMessageMoveTasksResultEntry"}
_QUERY_MAPS = {"QueueAttributeMap": ("Attribute", "Name", "Value"), "TagMap": ("Tag", "Key", "Value"),
               "MessageBodyAttributeMap": ("MessageAttribute", "Name", "Value"),
               "MessageBodySystemAttributeMap": ("MessageSystemAttribute", "Name", "Value"),
               "MessageSystemAttributeMap": ("Attribute", "Name", "Value")}


def _to_query(model: dict) -> None:
    model["metadata"]["protocol"] = "query"
    model["metadata"]["protocols"] = ["query"]
    model["metadata"]["xmlNamespace"] = "http://queue.amazonaws.com/doc/2012-11-05/"
    shapes = model["shapes"]
    for name, shape in shapes.items():
        if name in _QUERY_NAMES:
            shape["member"]["locationName"] = _QUERY_NAMES[name]
        elif name.endswith("EntryList") and shape.get("type") == "list":
            shape["member"]["locationName"] = shape["member"]["shape"]
        if name in _QUERY_MAPS:
            elem, k, v = _QUERY_MAPS[name]
            shape["locationName"] = elem
            shape["key"]["locationName"] = k
            shape["value"]["locationName"] = v
    for op_name, op in model["operations"].items():
        if "output" in op:
            op["output"]["resultWrapper"] = f"{op_name}Result"
    for shape in shapes.values():
        for member in shape.get("members", {}).values():
            target = shapes[member["shape"]]
            if target.get("type") in ("map", "list") and "locationName" in target and target.get("flattened"):
                member["locationName"] = target["locationName"] if target.get("type") == "map" else \
                    target["member"].get("locationName", member.get("locationName"))
