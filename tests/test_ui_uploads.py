"""Reading an upload (medvqa/ui/uploads.py): once, then deleted; nothing outside Gradio's upload
folder is read or deleted, whatever path a request names.
"""

from __future__ import annotations

import pytest

from medvqa.imaging import ScanError
from medvqa.ui.uploads import _take_upload


def test_an_upload_is_read_once_and_deleted_and_nothing_outside_the_upload_folder_is_touched(
        tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    inside = tmp_path / "uploads" / "abc123" / "scan.png"
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"pixels")
    assert _take_upload({"path": str(inside)}, max_bytes=100) == b"pixels"
    assert not inside.parent.exists(), "the file and its (now empty) folder are deleted"

    outside = tmp_path / "notes.txt"
    outside.write_bytes(b"not an upload")
    with pytest.raises(ScanError, match="could not be read"):
        _take_upload({"path": str(outside)}, max_bytes=100)
    assert outside.read_bytes() == b"not an upload"
    with pytest.raises(ScanError, match="No file"):
        _take_upload(None, max_bytes=100)


def test_the_sweeper_deletes_what_is_older_than_its_age_and_stops_with_the_app(tmp_path):
    import os
    import time

    from medvqa.ui.uploads import UploadFolder

    old, young, loose = tmp_path / "a1" / "old.dcm", tmp_path / "b2" / "young.dcm", tmp_path / "tmpabc"
    for path in (old, young, loose):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
    past = time.time() - 120
    os.utime(old, (past, past))
    folder = UploadFolder(tmp_path, max_age_s=60)
    assert folder.sweep() == 1 and not old.exists() and young.exists() and loose.exists()
    assert folder.holds(young) and folder.holds(tmp_path / "b2" / ".." / "a1") and not folder.holds(tmp_path.parent)

    serving = [True]
    quick = UploadFolder(tmp_path, max_age_s=0.2, interval_s=0.05)
    thread = quick.start_sweeper(lambda: serving[0])
    deadline = time.time() + 10
    while (young.exists() or loose.exists()) and time.time() < deadline:
        time.sleep(0.05)
    assert not young.exists() and not loose.exists(), "the sweeper runs on its own"
    serving[0] = False
    thread.join(timeout=5)
    assert not thread.is_alive(), "the sweeper ends when the app stops serving"


def test_a_refused_upload_request_loses_its_temporary_file_at_once(tmp_path):
    from medvqa.ui.uploads import UploadFolder

    folder = UploadFolder(tmp_path)
    (tmp_path / "tmp123").write_bytes(b"parser temporary file")
    (tmp_path / "abc").mkdir()  # the empty <sha> folder a refused name leaves
    folder.upload_started()
    folder.upload_started()
    folder.upload_ended(refused=True)  # another upload is in progress: its files cannot be told apart
    assert (tmp_path / "tmp123").exists()
    folder.upload_ended(refused=True)
    assert not list(tmp_path.iterdir())
    (tmp_path / "tmp456").write_bytes(b"parser temporary file")
    folder.upload_started()
    folder.upload_refused()  # as the refusal is answered, before the client can look
    assert not list(tmp_path.iterdir())
    folder.upload_ended(refused=True)


def test_a_second_tab_reading_as_the_first_deletes_the_file_gets_its_bytes(tmp_path, monkeypatch):
    """The bytes are remembered before the file is deleted, so a second tab whose read comes between
    the two is served them (it used to find neither the file nor the bytes)."""
    import pathlib

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    shared = tmp_path / "4567cdef" / "scan.png"
    shared.parent.mkdir()
    shared.write_bytes(b"racing pixels")
    unlink, second = pathlib.Path.unlink, []

    def unlink_then_the_other_tab_reads(self, *args, **kwargs):
        unlink(self, *args, **kwargs)
        if self == shared and not second:
            second.append(None)
            second[0] = _take_upload({"path": str(shared)}, max_bytes=100)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink_then_the_other_tab_reads)
    assert _take_upload({"path": str(shared)}, max_bytes=100) == b"racing pixels"
    assert second == [b"racing pixels"]


def test_the_same_file_from_two_tabs_at_once_is_read_by_both(tmp_path, monkeypatch):
    """Gradio names an upload by its content, so two tabs sending the same file share one path: the
    second reader gets the bytes the first read (and deleted) a moment ago."""
    from medvqa.ui import uploads

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    shared = tmp_path / "0123abcd" / "scan.png"
    shared.parent.mkdir()
    shared.write_bytes(b"same pixels")
    assert _take_upload({"path": str(shared)}, max_bytes=100) == b"same pixels"
    assert not shared.exists()
    assert _take_upload({"path": str(shared)}, max_bytes=100) == b"same pixels"
    monkeypatch.setattr(uploads, "RECENTLY_READ_S", 0.0)
    uploads._forget_expired()
    with pytest.raises(ScanError, match="could not be read"):
        _take_upload({"path": str(shared)}, max_bytes=100)
