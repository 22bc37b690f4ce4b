"""Limits that keep one user's huge image or an attacker's guesses from costing everyone else: the
memory budget for decoded scans (medvqa/ui/budget.py), the login throttle (medvqa/ui/access.py), and
bidirectional overrides stripped from what is shown (medvqa/safe_text.py)."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
from PIL import Image

from .ui_helpers import MAX_UPLOAD_MB, last_reply
from .ui_helpers import ui_pipeline, ui_settings, upload_folder  # noqa: F401 - fixtures


def png_upload(folder, name: str, side: int, seed: int | None) -> dict:
    """An RGB PNG of side × side pixels, noisy (or, with no seed, one colour: a few KB however large),
    placed as Gradio places an upload."""
    (folder / name).mkdir()
    path = folder / name / "scan.png"
    pixels = (np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8) if seed is not None
              else np.full((side, side, 3), 90, np.uint8))
    Image.fromarray(pixels).save(path)
    return {"path": str(path)}


def test_decoded_scans_stay_within_the_budget_and_come_back_identical(ui_pipeline, upload_folder):  # noqa: F811
    from medvqa.config import ServingConfig
    from medvqa.ui.handlers import _Handlers

    settings = dataclasses.replace(ui_pipeline.settings, serving=ServingConfig(decoded_scans_mb=2))
    handlers = _Handlers(ui_pipeline, settings, max_upload_mb=MAX_UPLOAD_MB)
    # 500 × 500 RGB: 0.75 MB rendered + 0.75 MB kept (the decoded frame, its own level indexes): two
    # such sessions exceed 2 MB.
    *_, first = handlers.upload(png_upload(upload_folder, "a", 500, 0), None)
    shown = first.scan.pixels.copy()
    digest = first.conversation.digest
    *_, second = handlers.upload(png_upload(upload_folder, "b", 500, 1), None)
    assert first.scan.pixels is None and first.conversation.image is None  # the least recently used went
    assert second.scan.pixels is not None and handlers.budget.held() <= 2 * 2**20
    handlers.warm(first)  # using a dropped session decodes it again, exactly as it was shown
    assert np.array_equal(first.scan.pixels, shown) and np.array_equal(first.conversation.image, shown)
    assert first.conversation.digest == digest  # the model's caches for it stay valid
    assert second.scan.pixels is None and handlers.budget.held() <= 2 * 2**20
    # One scan that alone needs more than the budget is refused, and the tab keeps what it had.
    *_, chat, kept = handlers.upload(png_upload(upload_folder, "c", 1200, None), first)
    assert kept is first and "more than the 2 MB the server keeps for decoded scans" in last_reply(chat)
    assert "serving.decoded_scans_mb" in last_reply(chat)
    for session in (first, second):
        session.close()
    assert handlers.budget.held() == 0


def test_login_throttle_grows_per_address_and_per_user_name():
    from medvqa.ui.access import LoginThrottle

    now = [0.0]
    throttle = LoginThrottle(free_failures=3, first_delay_s=1, max_delay_s=8, clock=lambda: now[0])
    assert [throttle.attempt("10.0.0.1", "alice") for _ in range(3)] == [0, 0, 0]
    assert throttle.attempt("10.0.0.1", "alice") == 1  # refused, and not counted
    assert throttle.attempt("10.0.0.2", "Alice") == 1  # the user name, from anywhere
    assert throttle.attempt("10.0.0.1", "bob") == 1  # the address, for any user name
    now[0] += 1
    assert throttle.attempt("10.0.0.1", "alice") == 0
    assert throttle.attempt("10.0.0.1", "alice") == 2  # the delay doubles with each failure
    now[0] += 100
    for _ in range(10):
        throttle.attempt("10.0.0.1", "alice")
        now[0] += 100
    assert throttle.attempt("10.0.0.1", "alice") == 0 and throttle.attempt("10.0.0.1", "alice") == 8  # capped
    throttle.succeeded("10.0.0.1", "alice")
    assert throttle.attempt("10.0.0.1", "alice") == 0 and throttle.attempt("10.0.0.3", "carol") == 0


def test_the_login_pages_multipart_form_is_throttled_by_its_user_name():
    """Gradio's login page posts multipart/form-data: its user name is read too, so one user's failures
    never hold up another's login from another address (they were all counted under the name "")."""
    from medvqa.ui.access import _form_user_name

    boundary = "----formBoundaryX7"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"username\"\r\n\r\n Dr. Müller \r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"password\"\r\n\r\nsecret\r\n"
            f"--{boundary}--\r\n").encode()
    content_type = f"multipart/form-data; boundary={boundary}".encode()
    assert _form_user_name(body, content_type) == "Dr. Müller"
    assert _form_user_name(b"username=alice&password=x", b"application/x-www-form-urlencoded") == "alice"
    assert _form_user_name(b"garbage", content_type) == ""
    assert _form_user_name(body.replace(b"username", b"user"), content_type) == ""


def test_the_login_route_is_throttled_with_a_message(tmp_path):
    """AccessGuard in front of a stand-in for Gradio's /login: a burst of wrong passwords is cut
    short with 429 and a message; then even the right one must wait."""
    httpx = pytest.importorskip("httpx")
    import anyio
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from medvqa.ui.access import AccessGuard, LoginThrottle
    from medvqa.ui.uploads import UploadFolder

    checked = []

    async def login(request: Request):
        form = await request.form()
        checked.append(form["password"])
        ok = form["password"] == "right"
        return JSONResponse({"success": True} if ok else {"detail": "Incorrect credentials."}, 200 if ok else 400)

    app = AccessGuard(Starlette(routes=[Route("/login", login, methods=["POST"])]), uploads=UploadFolder(tmp_path),
                      login_required=False, throttle=LoginThrottle(free_failures=5))

    async def run():
        transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            statuses = [(await client.post("/login", data={"username": "u", "password": "wrong"})).status_code
                        for _ in range(200)]
            right = await client.post("/login", data={"username": "u", "password": "right"})
        return statuses, right

    statuses, right = anyio.run(run)
    assert statuses[:5] == [400] * 5 and set(statuses[5:]) == {429} and len(checked) == 5
    assert right.status_code == 429 and "please wait 1 s before trying again" in right.json()["detail"]
    assert right.headers["retry-after"] == "1"


def test_bidirectional_overrides_are_stripped_from_what_is_shown():
    from medvqa.imaging import Scan
    from medvqa.safe_text import inert, visible
    from medvqa.ui.render import _escape_model_text
    from medvqa.ui.session import _Answer

    tricky = "Is there \u202eeffusion\u202c? \u2066left\u2069\u200b"
    assert visible(tricky) == "Is there effusion? left"
    assert "\u202e" not in _escape_model_text(tricky) and "\u2066" not in inert(tricky)
    scan = Scan(np.zeros((2, 2, 3), np.uint8), None, 0, 1, {}, "png")
    record = _Answer(question=tricky, scan=scan, text="No \u202eeffusion.").record()
    assert record["question"] == "Is there effusion? left" and record["answer"] == "No effusion."


def test_the_login_page_gets_the_script_that_shows_a_refused_try(tmp_path):
    """Gradio's login form shows nothing for a 429: the page the guard serves to a browser not logged in
    carries login.js, which does, with a Content-Length that still matches; other routes pass as they are."""
    httpx = pytest.importorskip("httpx")
    import anyio
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    from medvqa.ui.access import LOGIN_SCRIPT_TAG, AccessGuard
    from medvqa.ui.uploads import UploadFolder

    page = "<html><head><title>t</title></head><body>form</body></html>"

    async def index(request):
        return HTMLResponse(page)

    async def config(request):
        return JSONResponse({"auth_required": True})

    def guard(login_required: bool) -> AccessGuard:
        return AccessGuard(Starlette(routes=[Route("/", index), Route("/config", config)]),
                           uploads=UploadFolder(tmp_path / str(login_required)), login_required=login_required)

    async def run(app, path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return await client.get(path)

    served = anyio.run(run, guard(True), "/")
    assert served.status_code == 200 and served.content.count(LOGIN_SCRIPT_TAG) == 1
    assert served.content.index(LOGIN_SCRIPT_TAG) < served.content.index(b"</head>")
    assert int(served.headers["content-length"]) == len(served.content)
    assert b"medvqa-login-note" in LOGIN_SCRIPT_TAG and b"</script>" not in LOGIN_SCRIPT_TAG[:-len(b"</script>")]
    async def head(app, path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return await client.head(path)

    assert int(anyio.run(head, guard(True), "/").headers["content-length"]) == len(served.content)
    assert anyio.run(run, guard(True), "/config").status_code == 401  # behind the wall, as before
    assert anyio.run(run, guard(False), "/").text == page  # no login set: no login page to add to
