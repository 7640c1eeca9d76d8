"""AWS Signature Version 4, verified: the Authorization header, or the query string
(presigned). The algorithm is AWS's documented one (canonical request, string to sign,
HMAC-SHA256 key chain); signatures are compared in constant time.

Errors as AWS gives them: no signature MissingAuthenticationToken, a malformed one
IncompleteSignature, an unknown key id InvalidClientTokenId, a wrong signature (or secret,
or scope, or a clock more than 15 minutes off) SignatureDoesNotMatch, a presigned request
past its X-Amz-Expires AccessDenied."""
from __future__ import annotations

import calendar
import hashlib
import hmac
import re
import time
from typing import Protocol
from urllib.parse import parse_qsl, quote

from .. import limits
from .faults import fault

class Headers(Protocol):
    """What the check reads of a request's headers (names without case)."""

    def get(self, name: str, default: None = None) -> str | None: ...

    def get_all(self, name: str) -> list[str] | None: ...


ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED = "UNSIGNED-PAYLOAD"
_AUTH = re.compile(r"AWS4-HMAC-SHA256\s+Credential=([^,\s]+),\s*SignedHeaders=([^,\s]+),"
                   r"\s*Signature=([0-9a-f]{64})\s*\Z")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    k = _hmac(("AWS4" + secret).encode(), date)
    return _hmac(_hmac(_hmac(k, region), service), "aws4_request")


def canonical_uri(raw_path: str) -> str:
    """The path as sent, dot segments and empty segments removed, encoded once more."""
    out: list[str] = []
    for seg in raw_path.split("/"):
        if seg == "..":
            if out:
                out.pop()
        elif seg and seg != ".":
            out.append(seg)
    path = "/" + "/".join(out)
    if raw_path.endswith("/") and out:
        path += "/"
    return quote(path, safe="/~")


def canonical_query(query: str, drop: str | None = None) -> str:
    pairs = [(quote(k, safe="-_.~"), quote(v, safe="-_.~"))
             for k, v in parse_qsl(query, keep_blank_values=True) if k != drop]
    return "&".join(f"{k}={v}" for k, v in sorted(pairs))


def _amz_time(stamp: str) -> float | None:
    try:
        return calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        return None


class Verifier:
    """Checks requests against one key pair, for ``region`` and service ``sqs``."""

    def __init__(self, access_key_id: str, secret_access_key: str, region: str):
        self.key_id, self.secret, self.region = access_key_id, secret_access_key, region

    def verify(self, method: str, raw_path: str, query: str, headers: Headers, body: bytes, now: float) -> None:
        """Raise the SqsApiError AWS answers unless the request is signed with our key."""
        q = dict(parse_qsl(query, keep_blank_values=True))
        auth = headers.get("Authorization")
        if auth is not None:
            m = _AUTH.match(auth.strip())
            if m is None:
                raise fault("IncompleteSignature", "Authorization header requires 'Credential', 'SignedHeaders' and "
                                                   "'Signature' parameters of algorithm AWS4-HMAC-SHA256.")
            credential, signed, signature = m.groups()
            stamp = headers.get("X-Amz-Date") or ""
            drop = None
            expires = None
        elif "X-Amz-Signature" in q:
            if q.get("X-Amz-Algorithm") != ALGORITHM:
                raise fault("IncompleteSignature", "X-Amz-Algorithm must be AWS4-HMAC-SHA256.")
            credential, signed = q.get("X-Amz-Credential", ""), q.get("X-Amz-SignedHeaders", "")
            signature, stamp, drop = q["X-Amz-Signature"], q.get("X-Amz-Date", ""), "X-Amz-Signature"
            try:
                expires = int(q.get("X-Amz-Expires", "900"))
            except ValueError:
                raise fault("IncompleteSignature", "X-Amz-Expires must be a number of seconds.") from None
        else:
            raise fault("MissingAuthenticationToken", "Request is missing Authentication Token")
        parts = credential.split("/")
        if len(parts) != 5 or parts[4] != "aws4_request" or not signed:
            raise fault("IncompleteSignature", f"Credential must be <key id>/<date>/<region>/sqs/aws4_request, got "
                                               f"{credential[:200]!r}.")
        key_id, date, region, service, _ = parts
        if not hmac.compare_digest(key_id.encode(), self.key_id.encode()):
            raise fault("InvalidClientTokenId", "The security token included in the request is invalid.")
        if region != self.region or service != "sqs":
            raise fault("SignatureDoesNotMatch", f"Credential should be scoped to a valid region and service "
                                                 f"('{self.region}', 'sqs'), not ('{region}', '{service}').")
        when = _amz_time(stamp)
        if when is None or not stamp.startswith(date):
            raise fault("IncompleteSignature", "X-Amz-Date is missing, malformed, or not of the credential's date.")
        if expires is not None:
            if now > when + expires:
                raise fault("AccessDenied", "Request has expired.")
        elif abs(now - when) > limits.SQS_API_CLOCK_SKEW_S:
            raise fault("SignatureDoesNotMatch", f"Signature expired: {stamp} is more than "
                                                 f"{limits.SQS_API_CLOCK_SKEW_S // 60} minutes from the server's "
                                                 f"time.")
        names = signed.split(";")
        if "host" not in names:
            raise fault("SignatureDoesNotMatch", "The host header must be signed.")
        lines = []
        for n in names:
            values = headers.get_all(n) or []
            lines.append(f"{n}:{','.join(' '.join(v.split()) for v in values)}\n")
        declared = headers.get("X-Amz-Content-Sha256")
        payloads = [declared] if declared else ([UNSIGNED, _sha256(body)] if drop else [_sha256(body)])
        if declared and declared != UNSIGNED and declared != _sha256(body):
            raise fault("SignatureDoesNotMatch", "The provided X-Amz-Content-Sha256 does not match the body.")
        key = signing_key(self.secret, date, region, service)
        scope = f"{date}/{region}/{service}/aws4_request"
        for payload in payloads:
            canonical = "\n".join([method.upper(), canonical_uri(raw_path), canonical_query(query, drop),
                                   "".join(lines), signed, payload])
            to_sign = "\n".join([ALGORITHM, stamp, scope, _sha256(canonical.encode())])
            expected = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            if hmac.compare_digest(expected, signature):
                return
        raise fault("SignatureDoesNotMatch", "The request signature we calculated does not match the signature you "
                                             "provided. Check your AWS Secret Access Key and signing method.")
