"""A tab's session is reached only from the browser that opened it (medvqa/ui/tab_binding.py), Gradio's
deep links are off (access.py), and upload folders left by an app that was killed are removed at the
next start (uploads.sweep_abandoned_folders).

The middleware is tested on a small ASGI app that echoes what Gradio would read, then on the served
app: a second client that knows only a tab's session hash (as a proxy's access log shows it) gets
an empty session, not that tab's transcript or scan.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
gradio_client = pytest.importorskip("gradio_client")
from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from medvqa.ui.tab_binding import COOKIE, TabBinding, TabKeys  # noqa: E402
from medvqa.ui.uploads import PRIVATE_FOLDER_PREFIX, sweep_abandoned_folders  # noqa: E402

from .conftest import REPO, load_script  # noqa: E402
from .ui_helpers import (QUESTION, app_url, ask_streaming, client, dicom_file, image_src, ui_app,  # noqa: E402, F401
                         ui_pipeline, ui_settings, upload, upload_folder)

BROWSER = "b" * 43


async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"path": request.url.path, "query": request.query_params.get("session_hash"),
                         "header": request.headers.get("session_hash"), "body": body.decode() if body else "",
                         "length": request.headers.get("content-length")})


@pytest.fixture
def echo():
    keys = TabKeys(b"k" * 32)
    app = Starlette(routes=[Route("/{rest:path}", _echo, methods=["GET", "POST"])],
                    middleware=[Middleware(TabBinding, keys=keys)])
    return TestClient(app), keys


def test_each_browser_gets_a_cookie_only_where_no_session_is_named(echo):
    http, _ = echo
    page = http.get("/")
    cookie = page.headers["set-cookie"]
    assert re.match(rf"{COOKIE}=[A-Za-z0-9_-]{{43}}; Path=/; HttpOnly; SameSite=Lax$", cookie)
    # A request naming a session never sets one: a client keeping cookies keeps its key within a session.
    fresh = TestClient(http.app)
    assert "set-cookie" not in fresh.get("/gradio_api/queue/data", params={"session_hash": "abc"}).headers
    # Nor is a browser's cookie replaced.
    assert "set-cookie" not in TestClient(http.app, cookies={COOKIE: BROWSER}).get("/").headers
    secure = TestClient(http.app, base_url="https://testserver").get("/")
    assert secure.headers["set-cookie"].endswith("; Secure")


def test_every_place_gradio_reads_a_session_hash_is_keyed_by_the_browser(echo):
    http, keys = echo
    mine, other = keys.key(BROWSER, "abc"), keys.key("c" * 43, "abc")
    assert mine != other and mine != keys.key(None, "abc") and mine != "abc"
    plain, http = http, TestClient(http.app, cookies={COOKIE: BROWSER})
    seen = http.get("/gradio_api/queue/data", params={"session_hash": "abc", "x": "1"}).json()
    assert seen["query"] == mine
    assert http.get("/gradio_api/heartbeat/abc").json()["path"] == f"/gradio_api/heartbeat/{mine}"
    assert http.get("/gradio_api/stream/abc/run/3/playlist.m3u8").json()["path"] == \
        f"/gradio_api/stream/{mine}/run/3/playlist.m3u8"
    body = {"data": ["session_hash"], "fn_index": 2, "session_hash": "abc"}
    seen = http.post("/gradio_api/queue/join", json=body).json()
    assert json.loads(seen["body"]) == {**body, "session_hash": mine}
    assert int(seen["length"]) == len(seen["body"].encode())
    assert http.post("/gradio_api/upload", headers={"session_hash": "abc"}).json()["header"] == mine
    # Without the cookie (a plain HTTP client) the hash alone keys it, the same on every call.
    assert plain.get("/gradio_api/queue/data", params={"session_hash": "abc"}).json()["query"] == keys.key(None, "abc")
    # A malformed cookie counts as none; other bodies pass as they came.
    malformed = TestClient(http.app, cookies={COOKIE: "short"})
    assert malformed.get("/gradio_api/queue/data", params={"session_hash": "abc"}).json()["query"] == keys.key(None, "abc")
    assert http.post("/x", content=b"session_hash=abc", headers={"content-type": "text/plain"}).json()["body"] == \
        "session_hash=abc"
    assert http.post("/x", content=b'["session_hash", "abc"]', headers={"content-type": "application/json"}).json()["body"] == \
        '["session_hash", "abc"]'


def test_a_huge_json_call_is_refused(echo, monkeypatch):
    import medvqa.ui.tab_binding as tab_binding

    http, _ = echo
    monkeypatch.setattr(tab_binding, "_MAX_JSON_BODY", 1000)
    refused = http.post("/gradio_api/queue/join", json={"session_hash": "abc", "data": ["x" * 2000]})
    assert refused.status_code == 413


def test_a_session_hash_alone_opens_none_of_that_tabs_scan_or_conversation(ui_app):
    demo, url = ui_app
    tab = client(url)
    assert COOKIE in tab.cookies, "gradio_client takes the browser cookie from /config, as a browser does"
    upload(tab, dicom_file("CT_small.dcm"))
    ask_streaming(tab, QUESTION)
    assert tab.cookies[COOKIE] and demo.medvqa_tabs.key(tab.cookies[COOKIE], tab.session_hash) in \
        demo.state_holder.session_data

    stranger = client(url)
    stranger.session_hash = tab.session_hash  # all a proxy's access log shows
    links, markdown, _ = stranger.predict(api_name="/export")
    assert "Nothing to export" in links and QUESTION not in markdown
    viewer = stranger.predict("lung", 1, api_name="/set_preset")[0]
    assert "data:image/png" not in str(viewer)
    # The tab itself still has both.
    assert QUESTION in tab.predict(api_name="/export")[1]
    image_src(tab.predict("lung", 1, api_name="/set_preset")[0])


def test_deep_links_are_off(app_url):
    for path, params in (("gradio_api/deep_link", {"session_hash": "abc"}), ("", {"deep_link": "x"}),
                         ("config", {"deep_link": "x"})):
        answer = httpx.get(app_url + path, params=params, timeout=30)
        assert answer.status_code == 404 and "Deep links are off" in answer.text


def test_upload_folders_of_ended_apps_are_removed(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    now = time.time()
    folders = {
        "ended": tmp_path / f"{PRIVATE_FOLDER_PREFIX}{ended.pid}-abc",
        "running": tmp_path / f"{PRIVATE_FOLDER_PREFIX}{os.getppid()}-abc",
        "mine": tmp_path / f"{PRIVATE_FOLDER_PREFIX}{os.getpid()}-abc",
        "unnamed_idle": tmp_path / f"{PRIVATE_FOLDER_PREFIX}q1w2e3",
        "unnamed_recent": tmp_path / f"{PRIVATE_FOLDER_PREFIX}r4t5y6",
        "other_app": tmp_path / "gradio-uploads-1",
    }
    for name, folder in folders.items():
        (folder / "f00d").mkdir(parents=True)
        (folder / "f00d" / "DOE_JOHN.dcm").write_bytes(b"DICM")
    idle = now - 7200
    for path in (folders["unnamed_idle"], folders["unnamed_idle"] / "f00d", folders["unnamed_idle"] / "f00d" / "DOE_JOHN.dcm"):
        os.utime(path, (idle, idle))
    os.utime(folders["unnamed_recent"], (idle, idle))  # an old folder with a recent upload in it

    assert sweep_abandoned_folders(tmp_path, now=now) == 2
    assert {name for name, folder in folders.items() if folder.exists()} == {
        "running", "mine", "unnamed_recent", "other_app"}


def test_sigterm_ends_the_app_and_removes_its_upload_folder(tiny_pipeline, tiny_cache, tmp_path):
    """`kill` (docker stop, systemctl stop) ends app.py as Ctrl+C does: its private upload folder goes."""
    bench_app = load_script("bench_app")
    port = bench_app.free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MEDVQA_", "GRADIO_TEMP_DIR"))}
    env.update({"MEDVQA_CACHE": str(tiny_cache), "MEDVQA_RETRIEVAL__ENABLED": "false", "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    server = subprocess.Popen([sys.executable, "app.py", "--profile", "tiny", "--port", str(port)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert server.poll() is None, server.stdout.read()[-2000:]
        (folder,) = [p for p in Path(tmp_path).iterdir() if p.name.startswith(PRIVATE_FOLDER_PREFIX)]
        assert folder.name.startswith(f"{PRIVATE_FOLDER_PREFIX}{server.pid}-")
        (folder / "waiting").mkdir()
        (folder / "waiting" / "DOE_JOHN.dcm").write_bytes(b"DICM")  # an upload no handler has read yet
        server.terminate()
        server.wait(timeout=60)
        assert not folder.exists(), server.stdout.read()[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
