"""The documented login, on the real thing: `app.py` started as its own process with MEDVQA_USERNAME
and MEDVQA_PASSWORD set (tiny profile, no retrieval, a free loopback port). Without the login the
page shows only the login form and every other route answers 401, whatever Gradio does route by
route; with it, the page, the API and gradio_client work. And app.py refuses to listen beyond
loopback without a login unless told --insecure-no-login.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, load_script, stop_process

httpx = pytest.importorskip("httpx")
gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402

from .ui_helpers import dicom_file, last_reply  # noqa: E402

USER, PASSWORD = "radiology", "correct horse battery staple"
BENCH_APP = load_script("bench_app")  # its free_port
# Routes that answer without the login: the page (Gradio's login form), logging in and out, static
# assets, the route the page asks whether it is logged in (Gradio answers it 401 itself), and the one
# Gradio's launch() calls once to run startup events (a later call does nothing).
PUBLIC = re.compile(r"^/(login|logout|favicon\.ico|theme\.css|robots\.txt|manifest\.json|pwa_icon(/.*)?|"
                    r"assets/.*|static/.*|svelte/.*|gradio_api/theme\.css|gradio_api/login_check|"
                    r"gradio_api/startup-events)?/?$")


def app_env(tiny_cache, upload_dir, **extra) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MEDVQA_", "GRADIO_TEMP_DIR"))}
    env.update({"MEDVQA_CACHE": str(tiny_cache), "MEDVQA_RETRIEVAL__ENABLED": "false", "HF_HUB_OFFLINE": "1",
                "GRADIO_TEMP_DIR": str(upload_dir), "PYTHONPATH": str(REPO)}, **extra)
    return env


@pytest.fixture(scope="module")
def served(tiny_pipeline, tiny_cache, tmp_path_factory):
    """app.py --profile tiny with a login, as an operator starts it. (tiny_pipeline: the tiny models are
    built once, in the test process, and the app finds them in the shared cache.)"""
    upload_dir = tmp_path_factory.mktemp("login-uploads")
    port = BENCH_APP.free_port()
    url = f"http://127.0.0.1:{port}/"
    env = app_env(tiny_cache, upload_dir, MEDVQA_USERNAME=USER, MEDVQA_PASSWORD=PASSWORD)
    server = subprocess.Popen([sys.executable, "app.py", "--profile", "tiny", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"app.py exited with {server.returncode}: {server.stdout.read()[-2000:]}")
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("app.py did not start within 600 s")
        yield url, upload_dir
    finally:
        stop_process(server)


def all_routes() -> list[tuple[str, str]]:
    """(method, path) of every route Gradio serves for a Blocks app, path parameters filled in."""
    import gradio as gr
    from gradio.routes import App

    def walk(routes):  # included routers (/gradio_api/...) hold routes of their own
        for route in routes:
            inner = getattr(getattr(route, "original_router", route), "routes", None)
            if inner is not None and not hasattr(route, "endpoint"):
                yield from walk(inner)
            else:
                yield route

    with gr.Blocks() as blocks:
        gr.Textbox()
    routes = []
    for route in walk(App.create_app(blocks).routes):
        path = re.sub(r"\{[^}:]+(:path)?\}", "x", getattr(route, "path", ""))
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            routes.append((method, path))
    return routes


def test_every_route_but_the_login_page_needs_the_login(served):
    url, upload_dir = served
    routes = all_routes()
    assert len(routes) > 60 and ("POST", "/gradio_api/upload") in routes and ("GET", "/config") in routes
    assert ("POST", "/gradio_api/cancel") in routes  # one of the routes Gradio itself leaves open
    open_routes = []
    with httpx.Client(base_url=url.rstrip("/"), timeout=30) as anonymous:
        for method, path in routes:
            if method not in ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH"):
                continue
            files = {"files": ("scan.png", b"x")} if method == "POST" else None
            with anonymous.stream(method, path, files=files) as response:  # headers only: some routes stream
                status = response.status_code
            if status != 401 and not PUBLIC.match(path):
                open_routes.append((method, path, status))
        assert not open_routes, f"answered without a login: {open_routes}"
        page = anonymous.get("/")
        assert page.status_code == 200 and '"auth_required":true' in page.text.replace(" ", "")
        assert "medvqa-chat" not in page.text  # the login form only, none of the app's components
        assert anonymous.get("/config").status_code == 401
        assert anonymous.get("/gradio_api/info").status_code == 401
        assert anonymous.get("/gradio_api/heartbeat/abc").status_code == 401
        assert anonymous.post("/gradio_api/queue/join", json={}).status_code == 401
        assert anonymous.post("/gradio_api/upload", files={"files": ("scan.png", b"pixels")}).status_code == 401
    assert not [p for p in upload_dir.rglob("*") if p.is_file()], "a refused upload must leave nothing"


def test_the_login_opens_the_page_the_api_and_gradio_client(served):
    url, upload_dir = served
    with pytest.raises(Exception):
        Client(url, verbose=False)
    with pytest.raises(Exception):
        Client(url, auth=(USER, "wrong"), verbose=False)

    with httpx.Client(base_url=url.rstrip("/"), timeout=60) as browser:
        assert browser.post("/login", data={"username": USER, "password": "wrong"}).status_code == 400
        assert browser.get("/config").status_code == 401
        assert browser.post("/login", data={"username": USER, "password": PASSWORD}).json() == {"success": True}
        page = browser.get("/")
        assert page.status_code == 200 and "medvqa-chat" in page.text
        config = browser.get("/config")
        assert config.status_code == 200
        assert {"upload", "ask"} <= {d.get("api_name") for d in config.json()["dependencies"]}
        assert browser.get("/gradio_api/info").status_code == 200
        stored = browser.post("/gradio_api/upload", files={"files": ("scan.png", b"pixels")})
        assert stored.status_code == 200
        (path,) = stored.json()
        assert upload_dir.resolve() in Path(path).resolve().parents
        # An upload is never served back, logged in or not: the scan is shown as an inline image.
        assert browser.get(f"/gradio_api/file={path}").status_code == 404

    c = Client(url, auth=(USER, PASSWORD), verbose=False)
    try:
        shown = c.predict(handle_file(dicom_file("CT_small.dcm")), api_name="/upload")
        assert shown[-2]["Modality"] == "CT"
        chat, _ = c.predict("Is there a pleural effusion?", api_name="/ask")
        assert "medvqa-error" not in last_reply(chat) and "No literature support" in last_reply(chat)
    finally:
        c.close()


def test_listening_beyond_loopback_without_a_login_is_refused(tmp_path, tiny_cache):
    env = app_env(tiny_cache, tmp_path)
    result = subprocess.run([sys.executable, "app.py", "--profile", "tiny", "--host", "0.0.0.0", "--port", "9"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "refusing to listen on 0.0.0.0 without a login" in result.stderr
    assert "MEDVQA_USERNAME" in result.stderr and "--insecure-no-login" in result.stderr


def test_insecure_no_login_is_an_explicit_choice(monkeypatch, capsys, tiny_pipeline):
    import app
    import medvqa.ui
    from medvqa.pipeline import Pipeline

    launched = {}
    monkeypatch.setenv("MEDVQA_RETRIEVAL__ENABLED", "false")
    monkeypatch.delenv("MEDVQA_USERNAME", raising=False)
    monkeypatch.delenv("MEDVQA_PASSWORD", raising=False)
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline))
    monkeypatch.setattr(medvqa.ui, "build_app", lambda *a, **k: "demo")
    monkeypatch.setattr(medvqa.ui, "launch", lambda demo, **kwargs: launched.update(kwargs))
    assert app.main(["--profile", "tiny", "--host", "0.0.0.0", "--insecure-no-login"]) == 0
    assert launched["host"] == "0.0.0.0" and launched["auth"] is None
    assert "without a login (--insecure-no-login)" in capsys.readouterr().err


def test_loopback_addresses():
    from medvqa.ui import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "192.168.1.10", "example.org"))


def test_an_unknown_profile_or_a_missing_decoder_is_one_line(monkeypatch, capsys):
    import app
    from medvqa.language_model import ModelMissingError
    from medvqa.pipeline import Pipeline

    monkeypatch.delenv("MEDVQA_USERNAME", raising=False)
    monkeypatch.delenv("MEDVQA_PASSWORD", raising=False)
    monkeypatch.setenv("MEDVQA_PROFILE", "nosuch")
    assert app.main([]) == 2
    err = capsys.readouterr().err
    assert err == "error: Unknown profile 'nosuch'; choose one of offline, llava-med, tiny, tiny-llava-med.\n"

    def missing(cls, *args, **kwargs):
        raise ModelMissingError("The decoder 'x' is not available locally. Download it once.")

    monkeypatch.setenv("MEDVQA_RETRIEVAL__ENABLED", "false")
    monkeypatch.setattr(Pipeline, "load", classmethod(missing))
    assert app.main(["--profile", "llava-med"]) == 2
    assert capsys.readouterr().err.endswith("\nerror: The decoder 'x' is not available locally. Download it once.\n")


def test_a_tab_logged_out_elsewhere_says_so(served):
    """Logged out in another tab, a page's calls fail without a word from Gradio: the page asks whether it
    is still logged in when a question is asked, and says it is not, with a way back to the login form."""
    from .test_browser import CHROMIUM, CHROMIUM_ARGS

    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    url, _ = served
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context()
            page = context.new_page()
            page.goto(url)
            page.fill("input[type=password]", PASSWORD)
            page.locator("input:not([type=password])").first.fill(USER)
            page.click("button:has-text('Login')")
            page.wait_for_selector("#medvqa-ask")
            page.fill("#medvqa-question textarea", "Is there an effusion?")
            page.click("#medvqa-ask")
            page.wait_for_timeout(1000)
            assert page.locator("#medvqa-logged-out").count() == 0  # logged in: nothing said
            context.new_page().goto(url + "logout")
            page.bring_to_front()
            page.fill("#medvqa-question textarea", "Is it a CT?")
            page.click("#medvqa-ask")
            banner = page.locator("#medvqa-logged-out")
            banner.wait_for()
            assert "You are logged out" in banner.inner_text() and banner.get_attribute("role") == "alert"
            banner.locator("button").click()
            page.wait_for_selector("input[type=password]")  # the login form again
        finally:
            browser.close()
