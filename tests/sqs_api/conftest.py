"""The fixtures most SQS API modules share: a ``shardq serve`` of their own with the SQS
listener on (one per module), and a boto3 client of it over AWS JSON 1.0. A module that
needs another service or protocol defines its own ``svc`` or ``sqs``."""
from __future__ import annotations

import pytest

from tests.support.sqs_listener import client, sqs_service, sqs_url


@pytest.fixture(scope="module")
def svc():
    with sqs_service() as s:
        s.url = sqs_url(s)
        yield s


@pytest.fixture(scope="module")
def sqs(svc):
    return client(svc.url)
