"""SigV4 verification: requests signed by botocore's own signer (header and query-string
signing) pass; a wrong secret, an unknown key id, a missing or stale signature get AWS's
errors. In process against the verifier, then end to end against ``shardq serve`` with keys."""
from __future__ import annotations

import email.message
import http.client
import re
import time
from urllib.parse import urlsplit

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import botocore.exceptions
import pytest

from shardq.errors import SqsApiError
from shardq.sqs_api.sigv4 import Verifier
from tests.support.sqs_listener import KEY_ID, SECRET, client, sqs_service, sqs_url

BODY = b'{"QueueNamePrefix": "a b/c"}'


def _signed(secret: str = SECRET, key_id: str = KEY_ID, query: bool = False, region: str = "us-east-1",
            url: str = "http://127.0.0.1:9324/000000000000/my%20queue?x=1&a=b%20c%2F"):
    creds = botocore.credentials.Credentials(key_id, secret)
    req = botocore.awsrequest.AWSRequest("POST", url, data=BODY,
                                         headers={"Content-Type": "application/x-amz-json-1.0",
                                                  "X-Amz-Target": "AmazonSQS.ListQueues"})
    signer = botocore.auth.SigV4QueryAuth(creds, "sqs", region, 300) if query else \
        botocore.auth.SigV4Auth(creds, "sqs", region)
    signer.add_auth(req)
    prepared = req.prepare()
    split = urlsplit(prepared.url)
    headers = email.message.Message()
    for k, v in prepared.headers.items():
        headers[k] = v
    headers["Host"] = split.netloc
    body = prepared.body or b""  # query-string signing moves a form body into the query
    return split.path, split.query, headers, body.encode() if isinstance(body, str) else body


def _verify(path, query, headers, body=BODY, now=None):
    Verifier(KEY_ID, SECRET, "us-east-1").verify("POST", path, query, headers, body, now or time.time())


def _code(fn) -> str:
    with pytest.raises(SqsApiError) as e:
        fn()
    return e.value.code


@pytest.mark.parametrize("query", [False, True], ids=["header", "query-string"])
def test_botocore_signatures_verify_and_a_changed_byte_does_not(query):
    path, q, headers, body = _signed(query=query)
    _verify(path, q, headers, body)
    if not query:  # the header signature covers the body
        assert _code(lambda: _verify(path, q, headers, body + b" ")) == "SignatureDoesNotMatch"
    assert _code(lambda: _verify(path + "x", q, headers, body)) == "SignatureDoesNotMatch"
    assert _code(lambda: _verify(path, q.replace("x=1", "x=2"), headers, body)) == "SignatureDoesNotMatch"


@pytest.mark.parametrize("query", [False, True], ids=["header", "query-string"])
def test_wrong_secret_unknown_key_region_and_time_get_aws_errors(query):
    assert _code(lambda: _verify(*_signed(secret="x" * 40, query=query))) == "SignatureDoesNotMatch"
    assert _code(lambda: _verify(*_signed(key_id="AKIDSOMEONEELSE001", query=query))) == "InvalidClientTokenId"
    assert _code(lambda: _verify(*_signed(region="eu-west-1", query=query))) == "SignatureDoesNotMatch"
    late = time.time() + 16 * 60
    assert _code(lambda: _verify(*_signed(query=query), now=late)) in ("SignatureDoesNotMatch", "AccessDenied")


def test_no_signature_and_a_malformed_one():
    headers = email.message.Message()
    headers["Host"] = "127.0.0.1"
    assert _code(lambda: _verify("/", "", headers)) == "MissingAuthenticationToken"
    headers["Authorization"] = "AWS4-HMAC-SHA256 Credential=x"
    assert _code(lambda: _verify("/", "", headers)) == "IncompleteSignature"


@pytest.fixture(scope="module")
def svc():
    with sqs_service(keys=True) as s:
        s.url = sqs_url(s)
        yield s


@pytest.mark.parametrize("protocol", ["json", "query"])
def test_a_service_with_keys_answers_signed_requests_only(svc, protocol):
    good = client(svc.url, protocol)
    url = good.create_queue(QueueName=f"signed-{protocol}")["QueueUrl"]
    good.send_message(QueueUrl=url, MessageBody="x" * 1024 * 1024)  # the signed body at its maximum
    assert len(good.receive_message(QueueUrl=url)["Messages"][0]["Body"]) == 1024 * 1024
    with pytest.raises(botocore.exceptions.ClientError) as e:
        client(svc.url, protocol, secret="w" * 40).list_queues()
    assert e.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(botocore.exceptions.ClientError) as e:
        client(svc.url, protocol, key_id="AKIDSOMEONEELSE001").list_queues()
    assert e.value.response["Error"]["Code"] == "InvalidClientTokenId"


def _send(svc, method: str, target: str, body: bytes | None = None, headers: dict | None = None):
    host = urlsplit(svc.url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
    conn.request(method, target, body, headers or {})
    r = conn.getresponse()
    data = r.read()
    error = re.search(rb"<Code>([^<]*)</Code>", data)
    return r.status, error and error.group(1).decode(), data


def test_a_presigned_query_request_is_taken_from_its_url_and_covered_by_its_signature(svc):
    sqs = client(svc.url, "query")
    url = sqs.create_queue(QueueName="presigned")["QueueUrl"]
    # botocore's presigner puts a query-protocol request's parameters in the URL, for a POST
    presigned = urlsplit(sqs.generate_presigned_url("send_message", Params={"QueueUrl": url, "MessageBody": "hi"},
                                                    ExpiresIn=300))
    target = f"{presigned.path}?{presigned.query}"
    assert "Action=SendMessage" in target and "X-Amz-Signature=" in target
    status, _, data = _send(svc, "POST", target)
    assert status == 200 and b"<MessageId>" in data
    assert sqs.receive_message(QueueUrl=url)["Messages"][0]["Body"] == "hi"
    status, error, _ = _send(svc, "POST", target.replace("MessageBody=hi", "MessageBody=ho"))
    assert (status, error) == (403, "SignatureDoesNotMatch")
    status, error, _ = _send(svc, "POST", target, b"MessageBody=ho",  # a body the signature does not cover
                             {"Content-Type": "application/x-www-form-urlencoded"})
    assert (status, error) == (403, "MissingAuthenticationToken")


def test_a_header_signed_post_with_parameters_in_its_url_is_covered_by_its_signature(svc):
    creds = botocore.credentials.Credentials(KEY_ID, SECRET)
    client(svc.url, "query").create_queue(QueueName="in-url")
    params = "Action=ListQueues&Version=2012-11-05&QueueNamePrefix=in-u"

    def signed(form: bytes) -> tuple[str, dict, bytes]:
        req = botocore.awsrequest.AWSRequest("POST", f"{svc.url.rstrip('/')}/?{params}", data=form,
                                             headers={"Content-Type": "application/x-www-form-urlencoded"})
        botocore.auth.SigV4Auth(creds, "sqs", "us-east-1").add_auth(req)
        prepared = req.prepare()
        split = urlsplit(prepared.url)
        return f"{split.path}?{split.query}", dict(prepared.headers.items()), form
    for form in (b"", b"MaxResults=5"):  # everything in the URL; the URL and the body
        target, headers, body = signed(form)
        status, _, data = _send(svc, "POST", target, body, headers)
        assert status == 200 and b"/000000000000/in-url</QueueUrl>" in data, form
    status, error, _ = _send(svc, "POST", target.replace("in-u", "in-"), body, headers)
    assert (status, error) == (403, "SignatureDoesNotMatch")
    status, error, _ = _send(svc, "POST", target, b"MaxResults=6", headers)
    assert (status, error) == (403, "SignatureDoesNotMatch")


def test_an_unsigned_body_is_not_read(svc):
    host = urlsplit(svc.url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
    conn.request("POST", "/", b"{}", {"X-Amz-Target": "AmazonSQS.ListQueues",
                                      "Content-Type": "application/x-amz-json-1.0"})
    r = conn.getresponse()
    assert r.status == 403 and r.getheader("x-amzn-query-error") == "MissingAuthenticationToken;Sender"
