"""What the scan and viewer events do to the tab's session: an upload (one file, a .zip, a folder's
files), a series, window preset, window or frame chosen, a pixel's value. A new scan starts a new
conversation; everything else keeps it, and the model sees exactly what is shown from then on.
`handlers._Handlers` adds the conversation's events to these.
"""

from __future__ import annotations

import logging
import math

import gradio as gr

from ..imaging import ScanError, Window, check_preset, open_scan, open_study
from ..imaging.archive import is_zip
from .render import _error_message, _note
from .session import _copy, _Session
from .uploads import _take_uploads
from .viewer import (_PRESET_LABELS, _pixel_value_text, _preset_value, _probe_html, _scan_meta, _series_choices,
                     _study_notes, _view_key, _viewer_html, _window_controls)

log = logging.getLogger(__name__)

# Said after a refused upload where a scan was open: nothing changed, and the questions go on about that one.
_STILL_SHOWN = " The scan shown before is still open, and questions are still about it."


class _ScanHandlers:
    """The scan and viewer events; `_Handlers` sets `pipeline`, `settings`, `limits` and `budget`."""


    def upload(self, payload: dict | list[dict] | None, session: _Session | None):
        """Read the upload (one file, or several: a .zip, a folder's files) into memory, delete it,
        decode it; a new scan starts a new conversation. Several files open as a study: its largest
        series is shown first."""
        try:
            data = _take_uploads(payload, self.limits.max_bytes)
            if len(data) == 1 and not is_zip(data[0]):
                source, study = open_scan(data[0], self.limits), None
            else:
                study = open_study(data, self.limits)
                source = study.series[0]
            scan = source.render()
            return (None, *self.show(source, scan, study, session))
        except ScanError as error:
            self._count_error("scan")
            return (None, *self.viewer_unchanged(session, _error_message(
                f"The scan could not be opened: {error}{_STILL_SHOWN if session is not None else ''}")))
        except Exception:  # noqa: BLE001 - the app must keep serving whatever the upload does
            log.exception("upload failed")
            self._count_error("scan")
            return (None, *self.viewer_unchanged(session, _error_message(
                f"The scan could not be opened.{_STILL_SHOWN if session is not None else ''}")))

    def show(self, source, scan, study, session: _Session | None):
        """A newly opened scan or study replaces the tab's session: a new conversation about it.
        Raises ScanError when the scan alone needs more memory than the budget for decoded scans."""
        self.budget.check(scan.pixels.nbytes + source.decoded_bytes)
        closed_turns = 0
        if session is not None:
            with session.lock:
                session.generation += 1
                closed_turns = len(session.turns)
                session.settle()  # its answer's last update reaches the page before the new scan's chat
            session.close()
        session = _Session(self.pipeline, source, scan, self.pipeline.new_conversation(scan), study=study,
                           budget=self.budget)
        if closed_turns:  # said, so that a clinician who meant to keep it knows it is gone and how to keep one
            session.messages.append({"role": "assistant", "content": _note(
                f"A new scan starts a new conversation: the previous one ({closed_turns} "
                f"answer{'s' if closed_turns > 1 else ''}, about the other scan) is closed and no longer kept. "
                "To keep a conversation, export it before opening another scan.")})
        with self.budget.using(session):
            return self._viewer_update(session, controls=True)

    def study_controls(self, session: _Session | None):
        """The series picker and the notes on the series shown (after an upload or a change of series)."""
        study = session.study if session is not None else None
        number = session.scan.series or 1 if session is not None else 1
        return (gr.Dropdown(choices=_series_choices(study), value=number if study else None, visible=study is not None),
                _study_notes(study, number))

    def set_series(self, number: float, session: _Session | None):
        """Show another series of the study, at its middle slice, in the window chosen so far (a
        preset or the user's; else the series' own)."""
        if session is None:
            return self.viewer_unchanged(session, _error_message("Please upload a series first."))
        if session.study is None:
            # The picker is hidden with a single file: a late event from it (closed with Escape just before
            # the file opened) changes nothing and says nothing.
            return self.viewer_unchanged(session)
        try:
            number = int(number)
        except (TypeError, ValueError):
            number = 0
        # By number, not place: a study from the PACS holds the series loaded, numbered as its list numbers them.
        series = next((series for series in session.study.series if series.number == number), None)
        if series is None:
            return self.viewer_unchanged(session, _error_message("There is no such series in this upload."))
        window = session.scan.window
        if window is not None and window.name in ("file", "file-lut", "auto-percentile", "none"):
            window = None
        with session.lock:
            session.source = series
        return self._render(session, window, None)

    def set_preset(self, preset: str, frame: float, session: _Session | None):
        """A window preset from the dropdown; "custom" only means the sliders are in charge. The CT
        presets are for DICOM only: a picture's values are in no unit (see viewer._PICTURE_PRESET_LABELS)."""
        if preset == "custom":
            return self.viewer_unchanged(session)
        if session is not None:
            try:
                check_preset(session.source, preset)
            except ScanError as error:
                return self.viewer_unchanged(session, _error_message(str(error)))
        return self._render(session, preset, frame)

    def set_window(self, center: float, width: float, frame: float, session: _Session | None):
        """A window set with the centre and width sliders, or typed in their boxes: a value beyond a
        slider's range is brought to its nearest end, as a drag would be (the page sends the values
        unchecked, so that a typed value out of range never puts the page in an error state)."""
        if session is None:
            return self.viewer_unchanged(None, _error_message("Please upload a scan first."))
        if _emptied(center) or _emptied(width):
            return self._controls_as_shown(session)  # a box emptied and left: it shows the window again
        try:
            center, width = float(center), float(width)
            if not (math.isfinite(center) and math.isfinite(width)):
                raise ValueError("not finite")
        except (TypeError, ValueError):
            return self.viewer_unchanged(session, _error_message("The window centre and width must be numbers."))
        shown = session.scan.window
        if shown is not None and (center, width) == (shown.center, shown.width):
            # Focus passing through a box sends its value unchanged: the window, and where it came from
            # (the file's, a preset), stay as they are.
            return self.viewer_unchanged(session)
        offered = _window_controls(session.source, session.scan)
        (lowest, highest), (narrowest, widest) = offered.center_range, offered.width_range
        within = min(max(center, lowest), highest), min(max(width, narrowest), widest)
        # A value as the user typed it is not sent back (it would overwrite what they type next); a clamped one is.
        kept = {name for name, typed, used in (("center", center, within[0]), ("width", width, within[1]))
                if typed == used}
        return self._render(session, Window(*within, "user", offered.user_function), frame, kept=kept)

    def set_frame(self, frame: float, session: _Session | None):
        """Another frame of a multi-frame scan, or slice of a series, in the window chosen so far; a
        number typed beyond the first or last is taken as that one."""
        if session is None:
            return self.viewer_unchanged(None, _error_message("Please upload a scan first."))
        if _emptied(frame):
            return self._controls_as_shown(session)  # the box emptied and left: it shows the frame again
        try:
            frame = float(frame)
            if not math.isfinite(frame):
                raise ValueError("not finite")
        except (TypeError, ValueError):
            return self.viewer_unchanged(session, _error_message("The frame must be a number."))
        window = session.scan.window
        if window is not None and window.name in ("file", "file-lut"):
            window = None  # each frame with its own window from the file, as a viewer scrolls a stack
        within = min(max(round(frame), 1), session.source.frame_count)
        # As for the window: a frame as the user set it is not sent back, a clamped one is.
        return self._render(session, window, within, kept={"frame"} if within == frame else set())

    @staticmethod
    def _controls_as_shown(session: _Session):
        """The viewer as it is, its window and frame boxes set back to what is shown."""
        window, scan = session.scan.window, session.scan
        offered = _window_controls(session.source, scan)
        center = gr.update(value=offered.rounded(window.center)) if window is not None else gr.skip()
        width = gr.update(value=offered.rounded(window.width)) if window is not None else gr.skip()
        return (gr.skip(), gr.skip(), center, width, gr.update(value=scan.frame_index + 1), gr.skip(), gr.skip(),
                session)

    def _render(self, session: _Session | None, window, frame, kept: frozenset | set = frozenset()):
        """Render the session's scan anew; the model sees exactly what is shown from then on."""
        if session is None:
            return self.viewer_unchanged(None, _error_message("Please upload a scan first."))
        with self.budget.using(session):
            try:
                index = session.source.default_frame if frame is None else int(round(float(frame))) - 1
                scan = session.source.render(window=window, frame=index)
            except ScanError as error:
                return self.viewer_unchanged(session, _error_message(str(error)))
            except Exception:  # noqa: BLE001
                log.exception("render failed")
                return self.viewer_unchanged(session, _error_message("The scan could not be shown with that window."))
            with session.lock:
                old = session.look_at(scan)
            self.pipeline.end_conversation(old)  # a warming that ran meanwhile ends it too (see warm)
            return self._viewer_update(session, controls=True, kept=kept)

    def _viewer_update(self, session: _Session, controls: bool, kept: frozenset | set = frozenset()):
        """The viewer and its controls for the session's scan. The values of the sliders in `kept` ("center",
        "width", "frame": those the user has just set, as they set them) are left alone: sent back, they
        would overwrite what the user types or scrolls while the scan renders."""
        scan, source = session.scan, session.source
        outputs = [_viewer_html(scan, _view_key(source))]
        if controls:
            window = scan.window or Window(40, 400, "none")
            offered = _window_controls(source, scan)
            windowed = bool(offered.presets)
            (lowest, highest), (narrowest, widest) = offered.center_range, offered.width_range
            outputs += [
                gr.Dropdown(choices=offered.presets or _PRESET_LABELS, value=_preset_value(window), visible=windowed),
                gr.skip() if "center" in kept else
                gr.Slider(minimum=lowest, maximum=highest, step=offered.step, value=offered.rounded(window.center),
                          visible=windowed),
                gr.skip() if "width" in kept else
                gr.Slider(minimum=narrowest, maximum=widest, step=offered.step, value=offered.rounded(window.width),
                          visible=windowed),
                gr.skip() if "frame" in kept else
                gr.Slider(minimum=1, maximum=max(source.frame_count, 2), value=scan.frame_index + 1,
                          visible=source.frame_count > 1,
                          label=f"{'Frame' if scan.series is None else 'Slice'} (of {source.frame_count})"),
            ]
        outputs += [_scan_meta(scan), _copy(session.messages), session]
        return tuple(outputs)

    def probe(self, at: str, session: _Session | None) -> str:
        """The value of the scan's pixel under a click of the page's Value tool. `at` is "X,Y,CLICK,SHOWN":
        the point as fractions of the image shown, the page's count of clicks (the answer carries it back),
        and the view and frame clicked on (viewer._view_key:frame). A frame no longer shown gives nothing:
        the value of another slice must not be read as the one clicked."""
        if session is None:
            return ""
        try:
            x_text, y_text, click, shown = (at or "").split(",", 3)
            x, y = float(x_text), float(y_text)
            if not (math.isfinite(x) and math.isfinite(y)):
                raise ValueError("not finite")
        except ValueError:
            return ""
        with self.budget.using(session):
            with session.lock:
                source, scan = session.source, session.scan
            if shown != f"{_view_key(source)}:{scan.frame_index}":
                return ""
            rows, columns = scan.pixels.shape[:2]
            row, column = (min(count - 1, max(0, int(where * count))) for where, count in ((y, rows), (x, columns)))
            try:
                value = source.value_at(scan.frame_index, row, column)
            except ScanError as error:
                return _probe_html(shown, click, str(error))
        return _probe_html(shown, click, _pixel_value_text(source, value, row, column))

    @staticmethod
    def viewer_unchanged(session: _Session | None, message: dict | None = None):
        """Leave the viewer and its controls as they are; `message` (an error) goes to the chat."""
        if message is not None and session is not None:
            with session.lock:
                session.messages.append(message)
        messages = _copy(session.messages) if session is not None else ([message] if message else [])
        return (gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), messages, session)


def _emptied(value) -> bool:
    """A number box the user emptied: the page sends nothing, or an empty text."""
    return value is None or (isinstance(value, str) and not value.strip())
