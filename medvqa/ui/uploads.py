"""Gradio's upload folder as the app keeps it: an upload is read once and deleted, and nothing else
stays there for long.

The handler gets the upload's path (the event runs with `preprocess=False`) and `_take_upload` is the
only code that opens an upload; it deletes it whatever happens. Gradio names an upload by the
SHA-256 of its content (`<sha>/<name>`), so two tabs uploading the same file at the same moment get
the same path, and the first to read it deletes it for both: the bytes of an upload read in the last
`RECENTLY_READ_S` seconds are kept in memory (never on disk) for the second reader. Files that never reach the handler
are the `UploadFolder`'s job: Gradio's upload route stores whatever is posted to it, whether or not
an /upload event follows, and a refused request (a bad file name, a broken connection) leaves the
multipart parser's temporary file behind. Left alone, Gradio would keep them for an hour and serve
them back. So a refused upload's leftovers are deleted as soon as the request ends, and a sweeper
deletes every file older than `max_age_s` (60 s) in the folder, which the app owns alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradio.utils import get_upload_folder

from ..imaging import ScanError

log = logging.getLogger(__name__)

UPLOAD_MAX_AGE_S = 60.0  # an upload not read by then never will be: the /upload event follows at once
SWEEP_INTERVAL_S = 5.0
RECENTLY_READ_S = 30.0  # how long a read upload's bytes stay in memory for a second tab with the same file
RECENTLY_READ_MAX_BYTES = 256 * 2**20
# The private upload folder an app makes for itself (layout._upload_folder) is named after its process,
# so a later start can tell a folder whose app has ended (killed, or stopped without running its exit
# handlers) from one still in use, and remove it with whatever upload was waiting in it.
PRIVATE_FOLDER_PREFIX = "medvqa-uploads-"
UNNAMED_FOLDER_IDLE_S = 3600.0  # a folder of a release that did not name them: removed after an hour untouched
_OWNED = re.compile(re.escape(PRIVATE_FOLDER_PREFIX) + r"(\d+)-")

_recently_read: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
_recently_read_lock = threading.Lock()


def private_folder_prefix() -> str:
    """The name prefix of this process's private upload folder: it names the process."""
    return f"{PRIVATE_FOLDER_PREFIX}{os.getpid()}-"


def sweep_abandoned_folders(parent: str | Path | None = None, now: float | None = None,
                            unnamed_idle_s: float = UNNAMED_FOLDER_IDLE_S) -> int:
    """Remove the private upload folders (in `parent`, the temporary folder by default) of apps that
    have ended without removing theirs: a folder named after a process no longer running, or an unnamed
    one (made before they were named) with nothing touched in it for `unnamed_idle_s`. Only folders of
    this user; never this process's own. Returns how many were removed (their files' names, which can be
    a patient's, are not logged)."""
    parent = Path(parent or tempfile.gettempdir())
    now = time.time() if now is None else now
    removed = 0
    for entry in parent.glob(PRIVATE_FOLDER_PREFIX + "*"):
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            owner = _OWNED.match(entry.name)
            if owner is not None:
                pid = int(owner.group(1))
                if pid == os.getpid() or _running(pid):
                    continue
            elif now - _last_touched(entry) < unnamed_idle_s:
                continue
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += not entry.exists()
    if removed:
        log.info("removed %d upload folder(s) left by app processes that have ended", removed)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True


def _last_touched(folder: Path) -> float:
    newest = folder.stat().st_mtime
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _take_upload(payload: Any, max_bytes: int) -> bytes:
    """The bytes of an upload, read once; the file and its folder are deleted right away."""
    path_text = payload.get("path") if isinstance(payload, dict) else getattr(payload, "path", payload)
    if not path_text:
        raise ScanError("No file was uploaded.")
    path = Path(str(path_text)).resolve()
    upload_root = Path(get_upload_folder()).resolve()
    if upload_root not in path.parents:  # Gradio checks this too; never read or delete anything else
        raise ScanError("The upload could not be read.")
    data = None
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
        _remember(str(path), data)  # before the file goes: a second tab with it may look any moment
    except FileNotFoundError:
        data = _recall(str(path))  # the same file from another tab, read (and deleted) a moment ago
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError):
            if path.parent != upload_root:
                path.parent.rmdir()  # only when empty
    if data is None:
        raise ScanError("The upload could not be read.")
    if len(data) > max_bytes:
        raise ScanError(f"The file is larger than the {max_bytes / 2**20:.0f} MB upload limit.")
    return data


def _take_uploads(payload: Any, max_bytes: int) -> list[bytes]:
    """The bytes of one upload or several (a list of payloads), each read once and deleted; every
    file is deleted even when an earlier one is refused, and the first refusal is raised after."""
    payloads = payload if isinstance(payload, (list, tuple)) else [payload]
    if not payloads:
        raise ScanError("No file was uploaded.")
    taken, refusal = [], None
    for one in payloads:
        try:
            taken.append(_take_upload(one, max_bytes))
        except ScanError as error:
            refusal = refusal or error
    if refusal is not None:
        raise refusal
    return taken


def _remember(path: str, data: bytes) -> None:
    """Keep an upload's bytes for RECENTLY_READ_S, within RECENTLY_READ_MAX_BYTES in all."""
    now = time.monotonic()
    with _recently_read_lock:
        _recently_read[path] = (now, data)
        _recently_read.move_to_end(path)
        total = sum(len(d) for _, d in _recently_read.values())
        while _recently_read and (total > RECENTLY_READ_MAX_BYTES
                                  or now - next(iter(_recently_read.values()))[0] > RECENTLY_READ_S):
            total -= len(_recently_read.popitem(last=False)[1][1])


def _forget_expired() -> None:
    """Drop remembered uploads older than RECENTLY_READ_S (the sweeper calls this, so none lingers
    once uploads stop)."""
    now = time.monotonic()
    with _recently_read_lock:
        while _recently_read and now - next(iter(_recently_read.values()))[0] > RECENTLY_READ_S:
            _recently_read.popitem(last=False)


def _recall(path: str) -> bytes | None:
    with _recently_read_lock:
        entry = _recently_read.get(path)
    if entry is None or time.monotonic() - entry[0] > RECENTLY_READ_S:
        return None
    return entry[1]


class UploadFolder:
    """The upload folder of one served app: what lies in it, refused uploads' leftovers, the sweeper.

    Gradio's upload route writes each posted file to a temporary file at the folder's top level and
    renames it to `<sha>/<name>` once the request is accepted; top-level files are therefore always
    uploads in progress or leftovers of refused ones. The access middleware (access.py) tells this
    object when an upload request starts and ends."""

    def __init__(self, root: str | os.PathLike, max_age_s: float = UPLOAD_MAX_AGE_S,
                 interval_s: float = SWEEP_INTERVAL_S):
        self.root = Path(root).resolve()
        self.max_age_s = max_age_s
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stop = threading.Event()

    def holds(self, path: str | os.PathLike) -> bool:
        """Whether `path` (absolute, or relative to the working folder, as Gradio reads it) names
        something inside the folder; resolved, so neither `..` nor a link can hide where it points."""
        try:
            resolved = Path(os.path.abspath(path)).resolve()
        except (OSError, ValueError):
            return True  # unreadable as a path: refuse it like an upload
        return resolved == self.root or self.root in resolved.parents

    def upload_started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def upload_refused(self) -> None:
        """As a refused upload request answers (before its answer goes out, so that a client reading it
        finds nothing left): its temporary files go, if it is the only upload in progress."""
        with self._lock:
            if self._in_flight == 1:
                self._discard_leftovers()

    def upload_ended(self, refused: bool) -> None:
        """After an upload request: a refused one's temporary files go now, unless another upload is in
        progress (their files cannot be told apart then; the sweeper takes them within a minute)."""
        with self._lock:
            self._in_flight -= 1
            if refused and self._in_flight == 0:
                self._discard_leftovers()

    def _discard_leftovers(self) -> None:
        """Top-level files (parser temporary files) and empty folders; called with the lock held and no
        upload in progress."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                        os.unlink(entry.path)
                    elif entry.is_dir(follow_symlinks=False):
                        os.rmdir(entry.path)  # only when empty

    def sweep(self, now: float | None = None) -> int:
        """Delete every file older than `max_age_s` under the folder, then the empty folders (while no
        upload is in progress, so a folder about to receive one is never removed); returns the count."""
        _forget_expired()
        now = time.time() if now is None else now
        deleted = 0
        for folder, subfolders, files in os.walk(self.root, topdown=False):
            for name in files:
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError):
                    if now - os.lstat(path).st_mtime >= self.max_age_s:
                        os.unlink(path)
                        deleted += 1
            if folder != str(self.root):
                with self._lock, contextlib.suppress(OSError):
                    if self._in_flight == 0 and now - os.stat(folder).st_mtime >= self.max_age_s:
                        os.rmdir(folder)  # only when empty
        return deleted

    def start_sweeper(self, still_serving: Callable[[], bool]) -> threading.Thread:
        """Sweep every `interval_s` seconds in a daemon thread until `still_serving()` turns false
        (after having been true once) or `stop()` is called."""
        def run() -> None:
            served = False
            while not self._stop.wait(self.interval_s):
                serving = still_serving()
                served = served or serving
                if served and not serving:
                    return
                try:
                    deleted = self.sweep()
                    if deleted:
                        log.info("deleted %d stray upload(s) older than %.0f s", deleted, self.max_age_s)
                except Exception:  # noqa: BLE001 - the sweeper must outlive a failed sweep
                    log.exception("sweeping the upload folder failed")

        thread = threading.Thread(target=run, name="medvqa-upload-sweeper", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
