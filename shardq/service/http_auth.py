"""Who may use the HTTP listener, and which requests may change something.

* **Token (the default, on loopback too).** ``http.token`` or ``SHARDQ_HTTP_TOKEN``, else
  a random one the service keeps in ``<data dir>/http-token`` (mode 0600): on a shared
  machine any local user can connect to 127.0.0.1, and the console must not give them what
  the 0700 socket dir keeps from them. Every request except the login page and static
  assets must carry it: ``Authorization: Bearer <token>`` (scripts, Prometheus) or the
  session cookie that ``POST /login`` or ``GET /login?token=`` sets (people). The cookie
  holds an HMAC of the token, never the token, and changes when the token does.
* **Metrics on loopback.** ``/metrics`` is open without the token when the listener is on
  loopback (a local Prometheus, by convention) unless ``metrics_public = false``; still
  only with a loopback ``Host`` (see below). Nothing else is.
* **No token (``auth = "none"``, loopback only).** Anyone who can connect to the loopback
  address may use the console, so the ``Host`` header must name a loopback host: a web page
  whose domain was rebound to 127.0.0.1 (DNS rebinding) is refused.
* **CSRF.** Every request that changes state is a ``POST`` with a JSON body, and unless it
  carries the bearer token (which a browser never adds by itself) it must send
  ``X-CSRF-Token`` with the value ``GET /api/session`` returns, and an ``Origin``, if any,
  of this listener: ``http://`` (or ``https://``, the TLS proxy the docs put in front of
  it off a trusted network) and exactly the request's ``Host`` (``ws://`` or another host or
  port is another origin). Another site's page can neither read that value nor send the header.

Comparisons of secrets use :func:`hmac.compare_digest`.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from email.message import Message
from http.cookies import CookieError, SimpleCookie

from ..config import is_loopback
from .http_head import Head

COOKIE = "shardq_session"
#: The schemes of this listener's origin: it serves plain HTTP, and ``https`` is a TLS proxy in
#: front of it (only this listener's own proxy serves its host and port). A same-origin
#: ``Origin`` is one of these, ``://`` and exactly the request's ``Host`` (browsers send both lowercased).
SCHEMES = ("http", "https")


def _host_of(host_header: str) -> str:
    """The host part of a ``Host`` or ``Origin`` authority (``[::1]:80`` -> ``::1``)."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


class Auth:
    """The checks of one listener. ``token`` None: open on loopback only."""

    def __init__(self, token: str | None, metrics_public: bool = False):
        self.token = token or None
        self.metrics_public = metrics_public
        # With a token, the cookie and CSRF values derive from it (stable across restarts);
        # without one, from a secret of this process.
        secret = self.token.encode() if self.token else os.urandom(32)
        self._session = hmac.new(secret, b"shardq console session", hashlib.sha256).hexdigest()
        self._csrf = hmac.new(secret, b"shardq console csrf", hashlib.sha256).hexdigest()

    @property
    def csrf(self) -> str:
        return self._csrf

    def session_cookie(self) -> str:
        return f"{COOKIE}={self._session}; Path=/; HttpOnly; SameSite=Strict"

    @staticmethod
    def logout_cookie() -> str:
        return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"

    def host_ok(self, headers: Message | Head) -> bool:
        """Without a token, only a loopback ``Host`` (DNS-rebinding defence)."""
        if self.token:
            return True
        host = headers.get("Host") or ""
        return bool(host) and is_loopback(_host_of(host))

    def metrics_open(self, headers: Message | Head) -> bool:
        """``/metrics`` without the token: allowed, and asked with a loopback ``Host`` (a
        rebound domain must not read it from a browser)."""
        host = headers.get("Host") or ""
        return self.metrics_public and bool(host) and is_loopback(_host_of(host))

    def login_ok(self, token: str) -> bool:
        return self.token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    def identify(self, headers: Message | Head) -> str | None:
        """``"bearer"``, ``"cookie"``, ``"open"`` (no token configured) or None (refused)."""
        if self.token is None:
            return "open"
        auth = headers.get("Authorization") or ""
        if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), self.token.encode()):
            return "bearer"
        try:
            jar = SimpleCookie(headers.get("Cookie") or "")
        except CookieError:
            return None
        morsel = jar.get(COOKIE)
        if morsel is not None and hmac.compare_digest(morsel.value.encode(), self._session.encode()):
            return "cookie"
        return None

    def csrf_ok(self, headers: Message | Head, how: str) -> bool:
        """A state-changing request: bearer-authenticated, or the CSRF header and a
        same-origin ``Origin`` (when the browser sends one)."""
        if how == "bearer":
            return True
        sent = headers.get("X-CSRF-Token") or ""
        if not hmac.compare_digest(sent.encode(), self._csrf.encode()):
            return False
        origin = headers.get("Origin")
        if origin is not None:  # sent by browsers on POST; "null" (sandboxed, file:) is refused
            host = (headers.get("Host") or "").lower()
            scheme, sep, authority = origin.lower().partition("://")
            return bool(host) and bool(sep) and scheme in SCHEMES and authority == host
        return True
