"""Reading an upload: once, into memory, and deleting it from Gradio's upload folder right away.

The app never keeps a scan on disk; the handler gets the upload's path (the event runs with
`preprocess=False`) and this is the only code that opens or deletes it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from gradio.utils import get_upload_folder

from ..imaging import ScanError


def _take_upload(payload: Any, max_bytes: int) -> bytes:
    """The bytes of an upload, read once; the file and its folder are deleted right away."""
    path_text = payload.get("path") if isinstance(payload, dict) else getattr(payload, "path", payload)
    if not path_text:
        raise ScanError("No file was uploaded.")
    path = Path(str(path_text)).resolve()
    upload_root = Path(get_upload_folder()).resolve()
    if upload_root not in path.parents:  # Gradio checks this too; never read or delete anything else
        raise ScanError("The upload could not be read.")
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError:
        raise ScanError("The upload could not be read.") from None
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError):
            if path.parent != upload_root:
                path.parent.rmdir()  # only when empty
    if len(data) > max_bytes:
        raise ScanError(f"The file is larger than the {max_bytes / 2**20:.0f} MB upload limit.")
    return data
