"""Plain HTTP calls to the listener of ``shardq serve`` (stdlib only), for the HTTP tests."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit




# ---------------------------------------------------------------------------- helpers
def request(url: str, path: str, method: str = "GET", body=None, headers: dict | None = None,
            timeout: float = 15.0):
    """(status, headers, body bytes); never follows redirects."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        hdrs = dict(headers or {})
        if isinstance(body, (dict, list)):
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def api(url, path, body=None, headers=None, method=None):
    status, _, data = request(url, path, method or ("GET" if body is None else "POST"), body, headers)
    return status, json.loads(data) if data else None
