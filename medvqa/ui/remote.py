"""Opening a study from the PACS (`--pacs-url`): find its series by Study Instance UID or accession
number, then load the one chosen, slice by slice with progress.

The identifier typed is passed to the query and dropped: the box is cleared, and neither the page,
the chat, the logs nor the export ever show it. What the tab keeps is the list of series found
(`RemoteSeries`, their UIDs inside, never shown) in a gr.State of its own.

A Find or a Load runs in the "pacs" concurrency group, never in the one that decodes uploads, and
takes no lock others wait on (medvqa/pacs.py): a slow archive costs its own user time only. When the
tab goes away, or its Cancel is pressed, its Find or Load is cancelled (`tab_closed`, the page's
unload event; `cancel`): no further request is made for it. One still queued when the tab goes never
starts: Gradio drops a tab's queued events when its data stream closes.

Gradio runs the unload event when the tab's heartbeat connection (/gradio_api/heartbeat/{session})
closes: at once when a browser tab closes. A gradio_client Client's close() only lets its heartbeat
thread end when the next heartbeat arrives (every 15 s by default), so a script's "tab" ends up to
15 s after close().
"""

from __future__ import annotations

import html
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import gradio as gr

from ..imaging import ScanError
from ..pacs import Pacs, PacsError, RemoteSeries, RemoteStudy
from .handlers import _Handlers
from .render import _error_message
from .session import _Session

log = logging.getLogger(__name__)


class _PacsHandlers:
    """The PACS panel's events, bound to one archive and the app's handlers."""

    def __init__(self, pacs: Pacs, handlers: _Handlers):
        self.pacs = pacs
        self.handlers = handlers
        self._running: dict[str, set[threading.Event]] = {}  # tab (session hash) → its transfers' cancel events
        self._lock = threading.Lock()

    @contextmanager
    def _transfer(self, request: gr.Request | None) -> Iterator[threading.Event]:
        """A cancel event for one Find or Load of the tab, set by `tab_closed`. A call without a
        session (no tab) has nothing to close it, and is not cancelled with another's tab."""
        cancel, tab = threading.Event(), getattr(request, "session_hash", None)
        if not tab:
            yield cancel
            return
        with self._lock:
            self._running.setdefault(tab, set()).add(cancel)
        try:
            yield cancel
        finally:
            with self._lock:
                events = self._running.get(tab, set())
                events.discard(cancel)
                if not events:
                    self._running.pop(tab, None)

    def tab_closed(self, request: gr.Request) -> None:
        """The page's unload event: the tab's transfers stop (no request is made for it after this)."""
        self._stop(request)

    def cancel(self, request: gr.Request = None) -> str:
        """The panel's Cancel: the tab's Find or Load stops, as when the tab closes; the scan shown stays."""
        if not self._stop(request):
            return _status("Nothing is being found or loaded.")
        return _status("Cancelled. The scan shown before is still open.")

    def _stop(self, request: gr.Request | None) -> bool:
        """Set the cancel events of the request's tab; whether it had a transfer running."""
        tab = getattr(request, "session_hash", None)
        if not tab:
            return False
        with self._lock:
            events = self._running.pop(tab, set())
        for cancel in events:
            cancel.set()
        return bool(events)

    def load_starts(self, request: gr.Request = None) -> str:
        """The panel's Load, at once (before the load itself, which queues behind one still running): a Find
        or Load of the tab still running is stopped, since the series now chosen replaces it, and the status
        line left by an earlier one ("Cancelled.") is cleared."""
        if self._stop(request):
            return _status("The load in progress was stopped: the series chosen now is loaded instead.")
        return ""

    def find(self, identifier: str, found: list[RemoteSeries] | None, request: gr.Request = None):
        """List the study's series (modality, slice count); returns the cleared box, the series
        choices, a status line and the tab's list of series."""
        cancel = None
        try:
            with self._transfer(request) as cancel:
                series = self.pacs.find_series(identifier, cancel=cancel)
        except PacsError as error:
            if cancel is not None and cancel.is_set():  # Cancel pressed (its status line says so): the series
                return "", gr.skip(), gr.skip(), gr.skip()  # found before stay listed
            return "", gr.Dropdown(choices=[], value=None, visible=False), _status(str(error)), None
        except Exception:  # noqa: BLE001 - the app keeps serving; the message may hold the identifier
            log.error("the PACS query failed unexpectedly")
            return "", gr.Dropdown(choices=[], value=None, visible=False), _status("The PACS query failed."), None
        choices = [(item.describe(), item.number) for item in series]
        capped = (" The PACS listed more than the app takes from one search: only the first are shown."
                  if getattr(series, "capped", False) else "")
        return ("", gr.Dropdown(choices=choices, value=series[0].number, visible=True),
                _status(f"Found {len(series)} series.{capped} Choose one and press Load."), list(series))

    def load(self, number: float, found: list[RemoteSeries] | None, session: _Session | None,
             request: gr.Request = None, progress=gr.Progress()):
        """Fetch the chosen series, showing progress per slice, and show it like an upload: a new
        conversation about it, unless it is another series of the study the tab shows (see _add)."""
        chosen = next((item for item in found or [] if item.number == _as_int(number)), None)
        if chosen is None:
            return self.handlers.viewer_unchanged(session, _error_message("Find a study in the PACS first, then "
                                                                          "choose one of its series."))
        unit = "slices" if chosen.slices == chosen.instances else "images"  # a multi-frame image arrives whole
        arrived = [0, chosen.instances]  # the progress last shown: the stall note keeps it

        def show_progress(done: int, total: int) -> None:
            arrived[:] = done, total
            progress((done, total), unit=unit)  # without a description: a stall note goes once data comes

        def stalled(seconds: float) -> None:
            note = (f"The PACS has sent nothing for {seconds:.0f} s. Still waiting (the Load gives up after "
                    f"{self.pacs.limits.open_s:.0f} s).")
            progress(tuple(arrived), unit=unit, desc=note)

        cancel = None
        try:
            with self._transfer(request) as cancel:
                study = self.pacs.fetch(chosen, progress=show_progress, limits=self.handlers.limits, cancel=cancel,
                                        stalled=stalled)
            if cancel.is_set():  # Cancel pressed as the last slice arrived: the load is still not shown
                return self.handlers.viewer_unchanged(session)
            source = study.series[0]
            scan = source.render()
            current = session.study if session is not None else None
            if isinstance(current, RemoteStudy) and current.is_study_of(study):
                if current.names_other_patients(study):  # one study UID, two patients: never one conversation
                    study = study.with_series(study.series, [
                        "This series names another patient than the series shown before, though the PACS files "
                        "both under one study: it opens as a new conversation. Check the study with the "
                        "archive's administrator."] + study.notes)
                else:
                    self.handlers.budget.check(scan.pixels.nbytes + source.decoded_bytes)
                    return self._add(source, study, session)
        except (PacsError, ScanError) as error:
            if cancel is not None and cancel.is_set():  # stopped by Cancel (its status line says so) or the tab
                return self.handlers.viewer_unchanged(session)
            return self.handlers.viewer_unchanged(session, _error_message(str(error)))
        except Exception:  # noqa: BLE001
            log.error("loading a series from the PACS failed unexpectedly")
            return self.handlers.viewer_unchanged(session, _error_message("The series could not be loaded."))
        return self.handlers.show(source, scan, study, session)

    def _add(self, source, study: RemoteStudy, session: _Session):
        """Another series of the study shown: it joins the study's series (in place of a copy loaded
        before) and is shown, and the conversation goes on, as after a change of series in an upload;
        each question records its series."""
        with session.lock:
            kept = [series for series in session.study.series if series.number != source.number]
            notes = session.study.notes + [note for note in study.notes if note not in session.study.notes]
            # The patients of every series joined so far: a later series naming another is still told apart.
            session.study = study.with_series(sorted(kept + [source], key=lambda series: series.number), notes,
                                              session.study.patients | study.patients)
        return self.handlers.set_series(source.number, session)


def _status(text: str) -> str:
    return f'<p class="medvqa-caption">{html.escape(text)}</p>'


def _as_int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
