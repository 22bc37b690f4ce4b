"""The app's memory budget for decoded scans, shared by all its sessions (`serving.decoded_scans_mb`).

A session holds its scan's pixels twice: the decoded frame its source keeps for re-windowing, and the
rendered RGB image the viewer and the model see. A 34 KB PNG can decode to 5,900 × 5,900 pixels,
about 200 MiB a session, so a few tabs with such images would take the server past the memory its
profile is documented to need. The budget keeps the sum within `max_bytes`:

- a session in use (an answer streaming, a warming, a render) is pinned and never dropped;
- past the budget, the least recently used sessions that are not in use drop their decoded pixels
  (`_Session.drop_decoded`); they are decoded and rendered again, identically, when next used
  (`_Session.restore_decoded`), from the file's bytes they keep;
- a scan that alone needs more than the budget is refused with a message naming the setting.

When every other session is in use the budget is exceeded for that while rather than fail anyone.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..imaging import ScanError

if TYPE_CHECKING:
    from .session import _Session

SETTING = "serving.decoded_scans_mb (MEDVQA_SERVING__DECODED_SCANS_MB)"


class DecodedBudget:
    """Decoded pixels held by the sessions of one app, within `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        # id(session) → [weak reference, bytes held, pins]; least recently used first
        self._entries: OrderedDict[int, list] = OrderedDict()

    def check(self, needed: int) -> None:
        """Refuse a scan that alone needs more than the budget (before it replaces anything)."""
        if needed > self.max_bytes:
            raise ScanError(f"This image needs {needed / 2**20:,.0f} MB of memory once decoded, more than the "
                            f"{self.max_bytes / 2**20:,.0f} MB the server keeps for decoded scans ({SETTING}). "
                            "Please upload a smaller version of it.")

    def charge(self, session: _Session) -> None:
        """Record what `session` holds now, as the most recently used; drop others past the budget."""
        with self._lock:
            entry = self._entry(session)
            entry[1] = session.decoded_bytes()
            self._entries.move_to_end(id(session))
            self._evict()

    @contextlib.contextmanager
    def using(self, session: _Session | None) -> Iterator[None]:
        """Pin `session` while a handler uses its pixels, decoding them again first if they were
        dropped; on leaving, charge what it holds then."""
        if session is None:
            yield
            return
        with self._lock:
            self._entry(session)[2] += 1
        try:
            session.restore_decoded()
            self.charge(session)
            yield
        finally:
            with self._lock:
                entry = self._entries.get(id(session))
                if entry is not None:
                    entry[2] -= 1
            self.charge(session)

    def forget(self, session: _Session) -> None:
        """The session is gone (tab closed, replaced by a new scan)."""
        with self._lock:
            self._entries.pop(id(session), None)

    def held(self) -> int:
        """Bytes recorded as held, all sessions together."""
        with self._lock:
            return sum(entry[1] for entry in self._entries.values())

    def _entry(self, session: _Session) -> list:
        entry = self._entries.get(id(session))
        if entry is None or entry[0]() is not session:
            entry = self._entries[id(session)] = [weakref.ref(session), 0, 0]
        return entry

    def _evict(self) -> None:
        """Drop the least recently used unpinned sessions' pixels until the total fits (lock held: a
        session is never pinned and dropped at once; a session's own lock is taken after this one,
        never before)."""
        total = 0
        for key, entry in list(self._entries.items()):
            if entry[0]() is None:
                del self._entries[key]
            else:
                total += entry[1]
        for key, entry in list(self._entries.items())[:-1]:  # never the one just used
            if total <= self.max_bytes:
                break
            session = entry[0]()
            if entry[2] == 0 and entry[1] > 0 and session is not None:
                session.drop_decoded()
                total -= entry[1]
                entry[1] = 0
