"""A tab's session belongs to the browser that opened it, not to whoever learns its session hash.

Gradio keys every tab's state (here: its scan, conversation and transcript) by a `session_hash` the
page makes up and sends in the clear: in the query string of `/gradio_api/queue/data`, in the path
of `/gradio_api/heartbeat/<hash>`, in the JSON of every call. A reverse proxy's access log records
those URLs, and anyone holding a hash could call `/export` or `/set_preset` with it and read that
tab's conversation and scan.

`TabBinding` is ASGI middleware that gives each browser a random cookie (`COOKIE`: HttpOnly,
SameSite=Lax) and replaces every session hash a request carries, wherever Gradio reads it, with a
keyed digest of the hash and that cookie (`TabKeys.key`). Gradio only ever sees the digests, so a
hash without its browser's cookie opens an empty session of its own. The rewriting fails closed: a
place Gradio reads a hash that this module missed would see the raw hash, which keys no session
of any browser (the tests would find the tab broken, not another tab's scan).

A request with no cookie (a script with a plain HTTP client) is keyed by its hash alone, so it
still works across calls; `gradio_client` picks the cookie up from `/config` like a browser. The
cookie is only set on a response to a request that carries no hash, so a client that keeps cookies
never sees its key change between two calls of one session.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.requests import HTTPConnection

from .access import read_body, replay

COOKIE = "medvqa-browser"
_COOKIE_VALUE = re.compile(r"^[A-Za-z0-9_-]{32,64}$")
# Routes that carry the hash in their path: /gradio_api/heartbeat/<hash>, /gradio_api/stream/<hash>/...
_PATH_HASH = re.compile(r"^(.*?/(?:heartbeat|stream)/)([^/]+)(.*)$")
_MAX_JSON_BODY = 16 * 2**20  # a call's JSON (questions, file references); uploads are multipart


class TabKeys:
    """The app's secret (made at start, never stored) and the digest it keys sessions by."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def key(self, browser: str | None, session_hash: str) -> str:
        """The session key Gradio sees for `session_hash` sent with the browser cookie `browser` (None: none)."""
        message = f"{browser or ''}\0{session_hash}".encode("utf-8", "surrogateescape")
        return "t" + hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:40]


class TabBinding:
    """ASGI middleware: each browser's cookie, and every session hash a request carries keyed by it."""

    def __init__(self, app: Any, keys: TabKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        browser = HTTPConnection(scope).cookies.get(COOKIE)
        browser = browser if browser and _COOKIE_VALUE.match(browser) else None
        scope, carried = self._rewrite_scope(scope, browser)
        if scope["type"] == "http" and _is_json_post(scope):
            body = await read_body(scope, receive, send, _MAX_JSON_BODY, "The request is too large.")
            if body is None:
                return  # refused as too large, or the client went away
            body, in_body = self._rewrite_body(body, browser)
            carried = carried or in_body
            scope = _with_header(scope, b"content-length", str(len(body)).encode())
            receive = replay(body, receive)
        if scope["type"] == "http" and browser is None and not carried:
            send = _setting_cookie(send, scope)
        await self.app(scope, receive, send)

    def _rewrite_scope(self, scope: dict, browser: str | None) -> tuple[dict, bool]:
        scope, carried = dict(scope), False
        match = _PATH_HASH.match(scope.get("path", ""))
        if match and "/gradio_api/" in match.group(1) + "/":
            path = match.group(1) + self.keys.key(browser, match.group(2)) + match.group(3)
            scope["path"], scope["raw_path"], carried = path, path.encode("utf-8", "surrogateescape"), True
        query = scope.get("query_string", b"")
        if b"session_hash" in query:
            pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
            if any(name == "session_hash" for name, _ in pairs):
                pairs = [(name, self.keys.key(browser, value) if name == "session_hash" else value)
                         for name, value in pairs]
                scope["query_string"], carried = urlencode(pairs).encode("latin-1"), True
        headers = scope.get("headers", [])
        if any(name == b"session_hash" for name, _ in headers):
            scope["headers"] = [(name, self.keys.key(browser, value.decode("latin-1")).encode() if name == b"session_hash"
                                 else value) for name, value in headers]
            carried = True
        return scope, carried

    def _rewrite_body(self, body: bytes, browser: str | None) -> tuple[bytes, bool]:
        if b"session_hash" not in body:
            return body, False
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return body, False  # not JSON after all: Gradio refuses it
        if not isinstance(data, dict) or not isinstance(data.get("session_hash"), str):
            return body, False
        data["session_hash"] = self.keys.key(browser, data["session_hash"])
        return json.dumps(data).encode(), True


def _is_json_post(scope: dict) -> bool:
    if scope.get("method") != "POST":
        return False
    content_type = dict(scope.get("headers", [])).get(b"content-type", b"")
    return content_type.split(b";")[0].strip().lower() == b"application/json"


def _with_header(scope: dict, name: bytes, value: bytes) -> dict:
    headers = [(key, old) for key, old in scope.get("headers", []) if key != name]
    return {**scope, "headers": [*headers, (name, value)]}


def _setting_cookie(send: Any, scope: dict) -> Any:
    secure = scope.get("scheme") == "https" or dict(scope.get("headers", [])).get(b"x-forwarded-proto") == b"https"
    cookie = (f"{COOKIE}={secrets.token_urlsafe(32)}; Path=/; HttpOnly; SameSite=Lax"
              + ("; Secure" if secure else "")).encode()

    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
        await send(message)

    return sending
