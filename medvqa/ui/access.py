"""Who may reach which route of the served app: one login wall in front of all of them, no upload
served back, and a refused upload's leftovers deleted at once.

Gradio checks the login route by route, and not on all of them (/gradio_api/cancel, /stream,
/heartbeat, /startup-events answer without one), and a route a later Gradio release adds is open
until someone notices. `AccessGuard` is ASGI middleware around the whole app, so with a login set
nothing but the login page and its static assets answers a request without the login cookie: the
rest gets 401. Gradio still does its own checks behind it.

Logging in is throttled (`LoginThrottle`): per client address and per user name, after a few
failures each further try must wait a delay that doubles with every failure, and a try made sooner
is answered 429 with a message saying how long to wait (the password is not even checked). Gradio's
login form shows nothing for a 429, so the login page is served with a script of the app's (login.js)
that shows that message and counts the wait down.

It also refuses Gradio's file routes for anything in the upload folder (an upload is never served
back: the scan is shown as an inline image), and Gradio's deep links: `/gradio_api/deep_link` would
write the session's components, the scan as an inline PNG and the chat among them, to a file in
the upload folder, and a page opened with `?deep_link=` would show them to whoever has the link.
And it tells the `UploadFolder` when an upload request
starts and ends, so that a refused one's temporary file is deleted right away.
"""

from __future__ import annotations

import json
import math
import threading
from email.parser import BytesParser
from email.policy import HTTP
import time
from collections import OrderedDict
from typing import Any, Callable
from urllib.parse import parse_qs, parse_qsl, unquote

from starlette.requests import HTTPConnection

from .page import page_script
from .uploads import UploadFolder

UPLOAD_ROUTE = "/gradio_api/upload"
LOGIN_ROUTES = ("/login", "/gradio_api/login")
_MAX_LOGIN_BODY = 64 * 1024
_FILE_ROUTES = ("/gradio_api/file=", "/gradio_api/file/", "/file=", "/file/")
# What the login page itself needs: the page (Gradio renders its login form there), the login and
# logout routes, static assets, and the route the page asks whether it is logged in. And the route
# Gradio's own launch() calls, without a cookie, to run the app's startup events (once: later calls
# do nothing).
_PUBLIC_PATHS = {"/", "/login", "/logout", "/favicon.ico", "/theme.css", "/gradio_api/theme.css", "/robots.txt",
                 "/manifest.json", "/gradio_api/login_check", "/gradio_api/startup-events"}
_PUBLIC_PREFIXES = ("/assets/", "/static/", "/svelte/", "/pwa_icon")
DEEP_LINK_ROUTE = "/gradio_api/deep_link"
# What the login page gets besides Gradio's form (see login.js and _with_login_script).
LOGIN_SCRIPT_TAG = f"<script>({page_script('login.js')})();</script>".encode()


class AccessGuard:
    """ASGI middleware: the login wall (when `login_required`), no file route into the upload folder,
    and upload requests reported to `uploads`. Passed to Gradio through launch(app_kwargs=...)."""

    def __init__(self, app: Any, uploads: UploadFolder, login_required: bool,
                 throttle: LoginThrottle | None = None):
        self.app = app
        self.uploads = uploads
        self.login_required = login_required
        self.throttle = throttle or LoginThrottle()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if _file_route_target(path) is not None and self.uploads.holds(_file_route_target(path)):
            await _refuse(scope, send, 404, "Not found.")
            return
        if self.login_required and not _is_public(path) and not _logged_in(scope):
            await _refuse(scope, send, 401, "Not authenticated: log in first.")
            return
        if path.rstrip("/") == DEEP_LINK_ROUTE or _asks_deep_link(scope):
            await _refuse(scope, send, 404, "Deep links are off in this app: a session's scan is never written out.")
            return
        if scope["type"] == "http" and scope.get("method") == "POST" and path.rstrip("/") == UPLOAD_ROUTE:
            await self._upload(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("method") == "POST" and path.rstrip("/") in LOGIN_ROUTES:
            await self._login(scope, receive, send)
            return
        if (self.login_required and scope["type"] == "http" and scope.get("method") in ("GET", "HEAD")
                and path.rstrip("/") == "" and not _logged_in(scope)):
            await self.app(scope, receive, _with_login_script(send, head=scope.get("method") == "HEAD"))
            return
        await self.app(scope, receive, send)

    async def _login(self, scope: dict, receive: Any, send: Any) -> None:
        """Gradio's login route behind the throttle: a try is let through only when neither its client
        address nor its user name must wait; it counts as failed unless Gradio accepts it."""
        body = await read_body(scope, receive, send, _MAX_LOGIN_BODY, "The login form is too large.")
        if body is None:
            return
        user = _form_user_name(body, dict(scope.get("headers", [])).get(b"content-type", b""))
        address = (scope.get("client") or ("", 0))[0] or ""
        wait_s = self.throttle.attempt(address, user)
        if wait_s > 0:
            wait = max(1, math.ceil(wait_s))  # whole seconds, never "0 s"
            await _refuse(scope, send, 429, f"Too many failed logins from this address or for this user name: "
                                            f"please wait {wait} s before trying again.",
                          headers=[(b"retry-after", str(wait).encode())])
            return
        status = 0

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if status == 200:
                    self.throttle.succeeded(address, user)
            await send(message)

        await self.app(scope, replay(body, receive), watch)

    async def _upload(self, scope: dict, receive: Any, send: Any) -> None:
        """Run Gradio's upload route; a refusal (an error status, or a request that broke off) has its
        leftovers deleted as soon as it ends."""
        status = 0

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if not 200 <= status < 300:
                    self.uploads.upload_refused()
            await send(message)

        self.uploads.upload_started()
        try:
            await self.app(scope, receive, watch)
        finally:
            self.uploads.upload_ended(refused=not 200 <= status < 300)


def _with_login_script(send: Any, head: bool = False) -> Any:
    """`send` for the login page: its HTML gets login.js (what the login form leaves unsaid: a try the
    throttle refused, and how long to wait) at the end of its head. Any other answer passes as it is. A HEAD
    request's answer has no body: its Content-Length is the page's with the script, as GET sends it."""
    start: dict | None = None
    chunks: list[bytes] = []

    async def wrapped(message: dict) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            if message.get("status") == 200 and headers.get(b"content-type", b"").startswith(b"text/html"):
                if head:
                    length = int(headers.get(b"content-length", b"0") or 0)
                    await send({**message, "headers": [*[(k, v) for k, v in message.get("headers", [])
                                                          if k != b"content-length"],
                                                        (b"content-length", str(length + len(LOGIN_SCRIPT_TAG)).encode())]})
                    return
                start = message  # held until the whole page is read
                return
            await send(message)
            return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        page = b"".join(chunks)
        at = page.find(b"</head>")
        if at >= 0:
            page = page[:at] + LOGIN_SCRIPT_TAG + page[at:]
        headers = [(name, value) for name, value in start.get("headers", []) if name != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
        await send({"type": "http.response.body", "body": page})

    return wrapped


async def read_body(scope: dict, receive: Any, send: Any, limit: int, too_large: str) -> bytes | None:
    """A request's whole body, read for a middleware to look at; None once it is answered 413 with
    `too_large` (past `limit` bytes) or the client went away."""
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > limit:
            await _refuse(scope, send, 413, too_large)
            return None
    return body


def replay(body: bytes, receive: Any) -> Any:
    """A `receive` for the app behind a middleware that read the body (read_body): the body, then the
    client's own messages (its going away, as Starlette waits for it)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _form_user_name(body: bytes, content_type: bytes) -> str:
    """The user name a login form posts, URL-encoded or (as Gradio's login page sends it) multipart; ""
    when there is none. Read only to throttle: Gradio checks the form itself."""
    if content_type.split(b";")[0].strip().lower() == b"multipart/form-data":
        message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type + b"\r\n\r\n" + body)
        if not message.is_multipart():
            return ""
        for part in message.iter_parts():
            if part.get_param("name", header="content-disposition") == "username":
                return (part.get_payload(decode=True) or b"").decode("utf-8", "replace").strip()
        return ""
    return (parse_qs(body.decode("utf-8", "replace")).get("username") or [""])[0].strip()


def _file_route_target(path: str) -> str | None:
    """The file a file route asks for (`/gradio_api/file=<path>`), or None for any other route."""
    for prefix in _FILE_ROUTES:
        if path.startswith(prefix):
            return unquote(path[len(prefix):])
    return None


def _asks_deep_link(scope: dict) -> bool:
    """Whether the query string names a deep link (`/?deep_link=`, `/config?deep_link=`)."""
    query = scope.get("query_string", b"")
    return b"deep_link" in query and any(name == "deep_link"
                                         for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True))


def _is_public(path: str) -> bool:
    normalised = path.rstrip("/") or "/"
    return normalised in _PUBLIC_PATHS or path.startswith(_PUBLIC_PREFIXES)


def _logged_in(scope: dict) -> bool:
    """Whether the request carries a login cookie Gradio issued. Read from Gradio's own token store
    (`App.tokens`, cookie `access-token[-unsecure]-<cookie_id>`, as its `get_current_user` reads them);
    if that store cannot be found the answer is no, so a changed Gradio fails closed."""
    app = scope.get("app")
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not isinstance(tokens, dict) or not cookie_id:
        return False
    cookies = HTTPConnection(scope).cookies
    token = cookies.get(f"access-token-{cookie_id}") or cookies.get(f"access-token-unsecure-{cookie_id}")
    return token is not None and token in tokens


class LoginThrottle:
    """Failed logins per client address and per user name. The first `free_failures` cost nothing;
    after that each try must wait `first_delay_s` × 2^(failures − free_failures) seconds (at most
    `max_delay_s`) after the last one. A try counts as failed from the moment it is let through (so
    that a burst of tries sent at once is throttled too) until it succeeds, which clears both its
    address and its user name. Entries are forgotten after `forget_s` without a try, and at most
    `max_entries` are kept (the oldest go first)."""

    def __init__(self, free_failures: int = 5, first_delay_s: float = 1.0, max_delay_s: float = 300.0,
                 forget_s: float = 3600.0, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.free_failures, self.first_delay_s, self.max_delay_s = free_failures, first_delay_s, max_delay_s
        self.forget_s, self.max_entries, self.clock = forget_s, max_entries, clock
        self._failures: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()  # key → (count, last try)
        self._lock = threading.Lock()

    def attempt(self, address: str, user: str) -> float:
        """Seconds this try must still wait (then it is refused and not counted), or 0: it is let
        through and counted as failed until `succeeded`."""
        now = self.clock()
        keys = (("address", address), ("user", user.casefold()))
        with self._lock:
            self._forget_old(now)
            wait_s = max(self._wait(key, now) for key in keys)
            if wait_s > 0:
                return wait_s
            for key in keys:
                count, _ = self._failures.pop(key, (0, now))
                self._failures[key] = (count + 1, now)
            while len(self._failures) > self.max_entries:
                self._failures.popitem(last=False)
        return 0.0

    def succeeded(self, address: str, user: str) -> None:
        with self._lock:
            self._failures.pop(("address", address), None)
            self._failures.pop(("user", user.casefold()), None)

    def _wait(self, key: tuple[str, str], now: float) -> float:
        count, last = self._failures.get(key, (0, now))
        if count < self.free_failures:
            return 0.0
        delay = min(self.first_delay_s * 2 ** (count - self.free_failures), self.max_delay_s)
        return max(0.0, last + delay - now)

    def _forget_old(self, now: float) -> None:
        while self._failures:
            key, (_, last) = next(iter(self._failures.items()))
            if now - last < self.forget_s:
                break
            del self._failures[key]


async def _refuse(scope: dict, send: Any, status: int, message: str, headers: list | None = None) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
