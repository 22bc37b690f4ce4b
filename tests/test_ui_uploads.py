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
