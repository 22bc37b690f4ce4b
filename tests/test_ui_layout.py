"""Serving the app (medvqa/ui/layout.py, app.py): a login needs both its user name and password.

The served app itself (private config, login required) is tested end to end in tests/test_ui.py.
"""

from __future__ import annotations

import pytest


def test_auth_from_env():
    from medvqa.ui.layout import auth_from_env

    assert auth_from_env({}) is None
    assert auth_from_env({"MEDVQA_USERNAME": "doc", "MEDVQA_PASSWORD": "pw"}) == ("doc", "pw")
    with pytest.raises(ValueError, match="both"):
        auth_from_env({"MEDVQA_USERNAME": "doc"})


def test_app_refuses_half_a_login(monkeypatch, capsys):
    import app

    monkeypatch.setenv("MEDVQA_USERNAME", "doc")
    monkeypatch.delenv("MEDVQA_PASSWORD", raising=False)
    assert app.main(["--profile", "tiny"]) == 2
    assert "MEDVQA_PASSWORD" in capsys.readouterr().err


def test_the_line_under_the_chat_says_when_each_question_is_answered_on_its_own(tiny_pipeline, monkeypatch):
    """decoder.history_turns 0 (the offline profile's): the page says the model does not read earlier turns."""
    from medvqa.config import load_settings
    from medvqa.ui.layout import footer_text

    assert load_settings("offline").decoder.history_turns == 0 and load_settings("llava-med").decoder.history_turns == -1
    assert "answered on its own" not in footer_text(tiny_pipeline, tiny_pipeline.settings)
    monkeypatch.setattr(tiny_pipeline.settings.decoder, "history_turns", 0)
    assert "each question is answered on its own (the model does not read the earlier turns), so ask each in full" \
        in footer_text(tiny_pipeline, tiny_pipeline.settings)


def test_a_second_pacs_load_is_queued_behind_the_first_not_dropped(tiny_pipeline):
    """Gradio drops a click on an event still running (trigger_mode "once"): the PACS Load runs behind a
    step that stops the tab's running load at once, and queues the new one (always_last)."""
    from medvqa.pacs import Pacs
    from medvqa.ui import build_app

    demo = build_app(tiny_pipeline, tiny_pipeline.settings, max_upload_mb=1, pacs=Pacs("http://127.0.0.1:9/dicom-web",
                                                                                       env={}))
    by_name = {fn.name: fn for fn in demo.fns.values()}
    assert by_name["load"].trigger_mode == "always_last" and by_name["load"].api_name == "pacs_load"
    assert by_name["load_starts"].trigger_mode == "multiple" and by_name["load_starts"].queue is False


def test_the_page_script_is_the_function_in_page_js(tmp_path, monkeypatch):
    """page.js's comments stay in the file; Gradio gets the function, and a file without one is refused."""
    import shutil
    import subprocess

    from medvqa.ui import page

    assert page.PAGE_JS.startswith("() => {\n") and page.PAGE_JS.rstrip().endswith("}")
    assert "// - A slider's number box" not in page.PAGE_JS
    if shutil.which("node"):  # a syntax error would otherwise show only in the browser tests
        source = page.Path(page.__file__).with_name("page.js")
        assert subprocess.run(["node", "--check", str(source)], capture_output=True).returncode == 0
    (tmp_path / "page.py").write_text("")
    (tmp_path / "broken.js").write_text("// a comment only\n")
    monkeypatch.setattr(page, "__file__", str(tmp_path / "page.py"))
    with pytest.raises(RuntimeError, match="broken.js"):
        page.page_script("broken.js")
