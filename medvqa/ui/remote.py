"""Opening a study from the PACS (`--pacs-url`): find its series by Study Instance UID or accession
number, then load the one chosen, slice by slice with progress.

The identifier typed is passed to the query and dropped: the box is cleared, and neither the page,
the chat, the logs nor the export ever show it. What the tab keeps is the list of series found
(`RemoteSeries`, their UIDs inside, never shown) in a gr.State of its own.
"""

from __future__ import annotations

import html
import logging

import gradio as gr

from ..imaging import ScanError
from ..pacs import Pacs, PacsError, RemoteSeries
from .handlers import _Handlers
from .render import _error_message
from .session import _Session

log = logging.getLogger(__name__)


class _PacsHandlers:
    """The PACS panel's events, bound to one archive and the app's handlers."""

    def __init__(self, pacs: Pacs, handlers: _Handlers):
        self.pacs = pacs
        self.handlers = handlers

    def find(self, identifier: str, found: list[RemoteSeries] | None):
        """List the study's series (modality, slice count); returns the cleared box, the series
        choices, a status line and the tab's list of series."""
        try:
            series = self.pacs.find_series(identifier)
        except PacsError as error:
            return "", gr.Dropdown(choices=[], value=None, visible=False), _status(str(error)), None
        except Exception:  # noqa: BLE001 - the app keeps serving; the message may hold the identifier
            log.error("the PACS query failed unexpectedly")
            return "", gr.Dropdown(choices=[], value=None, visible=False), _status("The PACS query failed."), None
        choices = [(item.describe(), item.number) for item in series]
        return ("", gr.Dropdown(choices=choices, value=series[0].number, visible=True),
                _status(f"Found {len(series)} series. Choose one and press Load."), series)

    def load(self, number: float, found: list[RemoteSeries] | None, session: _Session | None,
             progress=gr.Progress()):
        """Fetch the chosen series, showing progress per slice, and show it like an upload."""
        chosen = next((item for item in found or [] if item.number == _as_int(number)), None)
        if chosen is None:
            return self.handlers.viewer_unchanged(session, _error_message("Find a study in the PACS first, then "
                                                                          "choose one of its series."))
        try:
            study = self.pacs.fetch(chosen, progress=lambda done, total: progress((done, total), unit="slices"),
                                    limits=self.handlers.limits)
            source = study.series[0]
            scan = source.render()
        except (PacsError, ScanError) as error:
            return self.handlers.viewer_unchanged(session, _error_message(str(error)))
        except Exception:  # noqa: BLE001
            log.error("loading a series from the PACS failed unexpectedly")
            return self.handlers.viewer_unchanged(session, _error_message("The series could not be loaded."))
        return self.handlers.show(source, scan, study, session)


def _status(text: str) -> str:
    return f'<p class="medvqa-caption">{html.escape(text)}</p>'


def _as_int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
