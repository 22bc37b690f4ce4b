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
