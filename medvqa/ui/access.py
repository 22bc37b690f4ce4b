"""Who may reach which route of the served app: one login wall in front of all of them, no upload
served back, and a refused upload's leftovers deleted at once.

Gradio checks the login route by route, and not on all of them (/gradio_api/cancel, /stream,
/heartbeat, /startup-events answer without one), and a route a later Gradio release adds is open
until someone notices. `AccessGuard` is ASGI middleware around the whole app, so with a login set
nothing but the login page and its static assets answers a request without the login cookie: the
rest gets 401. Gradio still does its own checks behind it.

It also refuses Gradio's file routes for anything in the upload folder (an upload is never served
back: the scan is shown as an inline image), and tells the `UploadFolder` when an upload request
starts and ends, so that a refused one's temporary file is deleted right away.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from starlette.requests import HTTPConnection

from .uploads import UploadFolder

UPLOAD_ROUTE = "/gradio_api/upload"
_FILE_ROUTES = ("/gradio_api/file=", "/gradio_api/file/", "/file=", "/file/")
# What the login page itself needs: the page (Gradio renders its login form there), the login and
# logout routes, static assets, and the route the page asks whether it is logged in. And the route
# Gradio's own launch() calls, without a cookie, to run the app's startup events (once: later calls
# do nothing).
_PUBLIC_PATHS = {"/", "/login", "/logout", "/favicon.ico", "/theme.css", "/gradio_api/theme.css", "/robots.txt",
                 "/manifest.json", "/gradio_api/login_check", "/gradio_api/startup-events"}
_PUBLIC_PREFIXES = ("/assets/", "/static/", "/svelte/", "/pwa_icon")


class AccessGuard:
    """ASGI middleware: the login wall (when `login_required`), no file route into the upload folder,
    and upload requests reported to `uploads`. Passed to Gradio through launch(app_kwargs=...)."""

    def __init__(self, app: Any, uploads: UploadFolder, login_required: bool):
        self.app = app
        self.uploads = uploads
        self.login_required = login_required

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
        if scope["type"] == "http" and scope.get("method") == "POST" and path.rstrip("/") == UPLOAD_ROUTE:
            await self._upload(scope, receive, send)
            return
        await self.app(scope, receive, send)

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


def _file_route_target(path: str) -> str | None:
    """The file a file route asks for (`/gradio_api/file=<path>`), or None for any other route."""
    for prefix in _FILE_ROUTES:
        if path.startswith(prefix):
            return unquote(path[len(prefix):])
    return None


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


async def _refuse(scope: dict, send: Any, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
