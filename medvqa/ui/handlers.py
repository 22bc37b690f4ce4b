"""What each event of the page does to the tab's session: upload, window, frame, warm, ask, stop, new
conversation, transcript download.

The handlers hold no session state themselves; every call gets the tab's `_Session` (or None before
the first upload) and returns it. Each session's lock guards its fields and is never held across a
yield or a model call. Turn-taking between sessions on the model is the pipeline's job: `Pipeline.ask`
takes a first-come-first-served turn for each step of its events and `Pipeline.warm_next_turn` for
its warming, so concurrent answers interleave token by token.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Iterator

import gradio as gr

from ..config import Settings
from ..imaging import ScanError, ScanLimits, Window, check_preset, open_scan, open_study
from ..imaging.archive import is_zip
from ..injection import check_answer
from ..pipeline import Done, Pipeline, Sources, Token
from ..safe_text import visible
from .budget import DecodedBudget
from .render import _error_html, _error_message, _escape_model_text, _note, _render_answer, _status
from .session import _Answer, _Session
from .transcript import _download_links, _transcript_json, _transcript_record, export_markdown
from .uploads import _take_uploads
from .viewer import (_PRESET_LABELS, _pixel_value_text, _preset_value, _probe_html, _scan_meta, _series_choices,
                     _study_notes, _view_key, _viewer_html, _window_controls)

log = logging.getLogger(__name__)

# Said after a refused upload where a scan was open: nothing changed, and the questions go on about that one.
_STILL_SHOWN = " The scan shown before is still open, and questions are still about it."
_STOPPED = "\n\n_(stopped)_"  # under an answer Stop (or a clear) ended
_NOT_ASKED = "Not asked: the conversation was stopped or started over."

# Two asks of the same question (or of the box just emptied) this close together are one double click.
DOUBLE_CLICK_S = 1.0


class _Handlers:
    """The event handlers of one app, bound to its pipeline, settings and upload limit."""

    def __init__(self, pipeline: Pipeline, settings: Settings, max_upload_mb: float):
        self.pipeline = pipeline
        self.settings = settings
        self.limits = ScanLimits(max_bytes=int(max_upload_mb * 2**20))
        self.budget = DecodedBudget(self.settings.serving.decoded_scans_mb * 2**20)

    # --- scan ------------------------------------------------------------------------------

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

    def warm(self, session: _Session | None, draft: str = "") -> None:
        """Prepare the session's conversation for its next question (see Pipeline.warm_next_turn,
        which takes its own turn on the model); with `draft`, the question as typed so far. Only a
        speed-up: skipped while an answer runs (it warms the next turn itself), and a failure here
        is logged, never shown; the question then prefills it all."""
        if session is None or not self.settings.decoder.warm_next_turn:
            return
        with session.lock:
            if session.current is not None:
                return
            conversation = session.conversation

        def still_wanted() -> bool:  # asked once the model's turn comes: the wait may be long
            with session.lock:
                return session.conversation is conversation and session.current is None

        try:
            with self.budget.using(session):
                self.pipeline.warm_next_turn(conversation, draft or "", still_wanted=still_wanted)
            with session.lock:
                ended = session.conversation is not conversation
            if ended:  # replaced while warming (the new scan, window or conversation has its own
                self.pipeline.end_conversation(conversation)  # warming queued): drop what was cached
        except Exception:  # noqa: BLE001 - an optimisation must never break the app
            log.exception("warming the conversation failed")

    # --- chat ------------------------------------------------------------------------------

    def ask(self, question: str, session: _Session | None) -> Iterator[tuple[list[dict], str]]:
        """Stream one answer: the question, then the answer token by token, then its sources. A
        question asked while the previous answer still streams is shown at once and queued: it is
        answered when the ones before it are (in the order asked), never dropped. The question box is
        left as the user has it (the page empties it as the question is sent), except that a refused
        question is given back to it."""
        question, asked_in = _unpack_asked(question or "")
        question = visible(question).strip()  # no bidirectional override reaches the model or the page
        if session is None:
            yield [_error_message("Please upload a scan first, then ask about it.")], question
            return
        with session.lock:  # never held across a yield: a cancelled generator is not resumed
            now, (last, asked_at, last_answer) = time.monotonic(), session.last_asked
            pending = last_answer is not None and (last_answer is session.current or last_answer in session.waiting)
            if asked_in is not None and asked_in != (session.token, session.generation):
                # Asked on the page before a Stop, New conversation or new scan that reached the app
                # first (the page sends the question on after taking it out of the box): it went with
                # what it was asked in, and the chat, already redrawn without it, is left alone.
                snapshot, answer, question = gr.skip(), None, gr.skip()
            elif now - asked_at < DOUBLE_CLICK_S and (not question or (question == last and pending)):
                # The second click of a double click: the page sent the question again while it is being
                # answered (or the box it had just emptied); it is asked once.
                snapshot, answer, question = _copy(session.messages), None, gr.skip()
            elif not question:
                session.messages.append(_error_message("Please type a question about the image."))
                snapshot, answer = _copy(session.messages), None
            else:
                answer = _Answer(question, session.scan)
                session.last_asked = (question, now, answer)
                generation = session.generation
                session.waiting.append(answer)
                session.messages.append({"role": "user", "content": _escape_model_text(question)})
                reply = {"role": "assistant", "content": _status("Searching the literature…" if session.current is None
                                                                 else "Waiting for the previous answer…")}
                session.messages.append(reply)
                answer.reply = reply
                snapshot = _copy(session.messages)
                session.sending(generation)
        if answer is None:
            yield snapshot, question
            return
        # Each chat snapshot is counted from when it is made until the generator resumes after yielding
        # it (session.sending / sent): Stop, New conversation and a new scan wait for those of the
        # generation they end (session.settle), so that a snapshot made just before never reaches the
        # page after what they show.
        counted_last = False
        try:
            try:
                yield snapshot, gr.skip()
            finally:
                session.sent(generation)
            turn = None
            while turn is None:  # this question's turn: the previous answer done, the questions before it taken
                with session.lock:
                    if session.generation != generation:  # stopped, new conversation or new scan meanwhile
                        turn = False  # (what ended it said "Not asked" under it, or cleared the chat)
                    elif session.current is None and session.waiting[0] is answer:
                        session.waiting.pop(0)
                        session.current, answer.scan = answer, session.scan
                        reply["content"] = _status("Searching the literature…")
                        turn = True
                        snapshot = _copy(session.messages)
                        session.sending(generation)
                if turn is None:
                    time.sleep(0.05)
            if turn:
                try:
                    yield snapshot, gr.skip()
                finally:
                    session.sent(generation)
                with self.budget.using(session):  # the model may need the pixels again: never dropped meanwhile
                    for update in self._stream(session, answer, generation, reply):
                        try:
                            # A question the pipeline refused (too long for the model) goes back to the box.
                            yield update, answer.question if answer.refused else gr.skip()
                        finally:
                            session.sent(generation)  # _stream counted it (sending) as it made it
            # Gradio sends an event's last output again when the event completes, after whatever other
            # event has shown meanwhile: the last output is the chat as it is now, counted until the
            # generator ends (the finally below), or, once a Stop, New conversation or new scan has moved
            # the generation on, no change at all, so that what they showed stays.
            with session.lock:
                if session.generation == generation:
                    last = _copy(session.messages)
                    session.sending(generation)
                else:
                    last = None
            if last is None:
                yield gr.skip(), gr.skip()
            else:
                counted_last = True
                yield last, answer.question if answer.refused else gr.skip()
        finally:
            with session.lock:
                if answer in session.waiting:
                    session.waiting.remove(answer)
                if session.generation == generation and session.current is answer:
                    session.current = None
            if counted_last:
                session.sent(generation)

    def _stream(self, session: _Session, answer: _Answer, generation: int, reply: dict) -> Iterator[list[dict]]:
        """The chat after each event of the pipeline's answer; ends quietly once the answer was
        stopped or replaced (`generation` moved on). Each snapshot is counted (session.sending) as it is
        made; the caller counts it sent."""
        conversation = session.conversation
        events = self.pipeline.ask(conversation, answer.question, safe_meta=session.scan.safe_meta)
        retrieval_failed = False
        while True:
            try:
                event = next(events, None)
            except Exception as error:  # noqa: BLE001 - shown in the chat; the app keeps serving
                if _is_retrieval_error(error) and not answer.started and not retrieval_failed:
                    # Answer without literature rather than not at all, and say so.
                    log.warning("retrieval failed: %s", error)
                    retrieval_failed = True
                    answer.note = f"The literature search failed ({_short(error)}), so this answer has no sources."
                    events = self.pipeline.ask(conversation, answer.question, use_retrieval=False,
                                               safe_meta=session.scan.safe_meta)
                    continue
                text = _failure_text(error)
                answer.refused = isinstance(error, ValueError) and not answer.text  # the pipeline's own refusal
                self._count_error(_error_kind(error))
                if not isinstance(error, ValueError):
                    log.exception("answer failed")
                with session.lock:
                    if session.generation != generation:
                        return
                    reply["content"] = (_render_answer(answer, final=False) + "\n\n" if answer.text else "") + \
                        _error_html(text)
                    snapshot = _copy(session.messages)
                    session.sending(generation)
                yield snapshot
                return
            if event is None:
                return
            finding = _injection_finding(event, conversation, answer.question) if isinstance(event, Done) else None
            with session.lock:
                if session.generation != generation:  # stopped, new conversation or new scan
                    return
                if isinstance(event, Sources):
                    answer.passages = list(event.passages)
                    answer.note = answer.note or event.note
                    answer.in_prompt = event.in_prompt
                    answer.started = True
                    if not answer.text:  # passages shown only beside the answer arrive after it
                        reply["content"] = _status("Answering…") if not (answer.passages and answer.in_prompt) \
                            else _status(f"Answering with {len(answer.passages)} literature passage(s)…")
                elif isinstance(event, Token):
                    answer.text += event.text
                    reply["content"] = _render_answer(answer, final=False)
                elif isinstance(event, Done):
                    answer.text, answer.passages, answer.window = event.answer, list(event.passages), event.window
                    answer.support, answer.closed = list(event.support), event.closed
                    answer.confidence_note, answer.head_open = event.confidence_note, event.head_open
                    answer.open_choice = event.open_choice
                    answer.injection = finding
                    reply["content"] = _render_answer(answer, final=True)
                    session.turns.append(answer.record())
                    session.cleared = None  # the new conversation has an answer: the cleared one is let go
                    # The answer is complete: the next question may be asked while the pipeline goes
                    # on to warm the next turn in this generator.
                    session.current = None
                snapshot = _copy(session.messages)
                session.sending(generation)
            yield snapshot

    def _count_error(self, kind: str) -> None:
        if self.pipeline.metrics is not None:
            self.pipeline.metrics.error(kind)

    def stop(self, session: _Session | None):
        """End the running answer (Gradio cancels its generator); what it said so far is kept."""
        if session is None:
            return []
        with session.lock:
            # Always a new generation: a question taken from the box just before Stop, whose answer had not
            # started, is not asked either (ask drops it).
            session.generation += 1
            if session.current is not None:
                session.turns.append(session.current.record(stopped=True))
                session.cleared = None  # a stopped turn is the new conversation's: the cleared one is let go
            for reply, content in _ended(session):  # said at once: their events end so (the generation moved on)
                reply["content"] = content
            session.current = None
            session.settle()  # the stopped answer's last update reaches the page before this
            return _copy(session.messages)

    def new_conversation(self, session: _Session | None):
        """Start over on the same scan: empty chat, no history, a fresh conversation id. A conversation
        with answers is set aside: Restore brings it back until the new one has an answer (or a stopped
        one), or another scan opens."""
        if session is None:
            return [], "", ""
        with session.lock:
            session.generation += 1
            turns = session.turns
            if session.current is not None:  # cleared mid-answer: kept as a stopped turn, as Stop keeps it
                turns = [*turns, session.current.record(stopped=True)]
            if turns:  # (clearing an empty chat keeps what an earlier clear set aside)
                session.cleared = (_set_aside(session), turns, list(session.conversation.history))
            session.current = None
            session.messages = []
            session.turns = []
            old = session.conversation
            session.conversation = self.pipeline.new_conversation(session.scan)
            session.settle()  # the ended answer's last update reaches the page before the empty chat
        self.pipeline.end_conversation(old)
        return [], "", ""

    def restore_offer(self, session: _Session | None):
        """The Restore button: shown, with the count of answers, while a cleared conversation can come back."""
        cleared = _restorable(session)
        if cleared is None:
            return gr.update(visible=False)
        count = len(cleared[1])
        return gr.update(visible=True, value=f"Restore the cleared conversation ({count} answer{'s' * (count > 1)})")

    def restore_conversation(self, session: _Session | None):
        """Bring back the conversation New conversation (or the chat's bin) cleared: its messages, its
        answers for the export and its history for the model, about the scan as it is shown now."""
        if session is None:
            return [], gr.update(visible=False)
        with session.lock:
            cleared = _restorable(session)
            if cleared is None:
                session.messages.append(_error_message(
                    "There is no cleared conversation to restore: a question was asked or a scan opened since."))
                return _copy(session.messages), gr.update(visible=False)
            messages, turns, history = cleared
            session.cleared = None
            session.generation += 1
            session.messages, session.turns = messages, turns
            old = session.conversation
            session.conversation = self.pipeline.new_conversation(session.scan)
            session.conversation.history = list(history)
            snapshot = _copy(session.messages)
        self.pipeline.end_conversation(old)
        return snapshot, gr.update(visible=False)

    def export(self, session: _Session | None):
        """The transcript's download links, Markdown and JSON (the `/export` endpoint)."""
        if session is None or not session.turns:
            return "<p>Nothing to export yet: ask a question first.</p>", "", ""
        with session.lock:
            record = _transcript_record(session, self.settings)
        markdown, as_json = export_markdown(record), _transcript_json(record)
        return (_download_links(markdown, as_json, bool(record["scan"].get("burned_in_annotation"))), markdown,
                as_json)


def _injection_finding(done: Done, conversation, question: str):
    """Whether the finished answer repeats an instruction, markup or a web address from a passage the
    model read in this conversation (earlier turns' passages stay in its prompt) or was shown beside it."""
    seen = list(done.passages) + [p for turn in conversation.history for p in (turn.passages or ())]
    try:
        return check_answer(done.answer, seen, question=question)
    except Exception:  # noqa: BLE001 - a failed check must not lose the answer; it is logged
        log.exception("the injection check failed")
        return None


def _restorable(session: _Session | None) -> tuple | None:
    """The conversation set aside by the last clear, while it can come back: not while a question of
    the new conversation is answered (its first answer, or Stop, lets it go, as a new scan's session does)."""
    if session is None or session.current is not None or session.waiting:
        return None
    return session.cleared


def _emptied(value) -> bool:
    """A number box the user emptied: the page sends nothing, or an empty text."""
    return value is None or (isinstance(value, str) and not value.strip())


_ASKED_IN = re.compile(r"^⟦asked in ([0-9a-f]{1,32}):(\d{1,12})⟧(.*)$", re.DOTALL)


def pack_asked(text: str, session: _Session | None) -> str:
    """The question as the page passes it from the box to the answer (layout._take_question): with the
    session and generation it was asked in, so that `ask` can tell it was asked before a Stop, New
    conversation or new scan that reached the app first."""
    if session is None or not text:
        return text
    with session.lock:
        return f"⟦asked in {session.token}:{session.generation}⟧{text}"


def _unpack_asked(text: str) -> tuple[str, tuple[str, int] | None]:
    """(the question, (session token, generation) it was asked in, or None: a script's /ask call)."""
    match = _ASKED_IN.match(text)
    return (match.group(3), (match.group(1), int(match.group(2)))) if match else (text, None)


def _ended(session: _Session) -> list[tuple[dict, str]]:
    """What Stop (or a clear) makes of the chat's replies (under the session's lock): the answer streaming
    marked stopped (its own reply, not the last message: a question asked meanwhile may follow it), and
    the questions waiting behind it not asked. As (reply, its new content) pairs."""
    ended = [(session.current.reply, str(session.current.reply["content"]) + _STOPPED)] \
        if session.current is not None and session.current.reply is not None else []
    return ended + [(waiting.reply, _note(_NOT_ASKED)) for waiting in session.waiting if waiting.reply is not None]


def _set_aside(session: _Session) -> list[dict]:
    """Copies of the chat's messages as a clear leaves them: as Stop would (`_ended`). Copies, so the
    cancelled answers' threads never change what Restore brings back."""
    ended = {id(reply): content for reply, content in _ended(session)}
    return [{**message, "content": ended[id(message)]} if id(message) in ended else dict(message)
            for message in session.messages]


def _copy(messages: list[dict]) -> list[dict]:
    """A snapshot of the chat for Gradio, so later edits to the session's messages do not leak into it."""
    return [dict(message) for message in messages]


# ── Errors during an answer: a message in the chat ──────────────────────────────────────────

def _is_retrieval_error(error: BaseException) -> bool:
    from ..retrieval import RetrievalError

    return isinstance(error, RetrievalError)


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]


def _error_kind(error: BaseException) -> str:
    """The `kind` label of a failed answer in the metrics (metrics.ERROR_KINDS)."""
    if isinstance(error, ValueError):
        return "question"
    if isinstance(error, MemoryError):
        return "memory"
    return "retrieval" if _is_retrieval_error(error) else "model"


def _failure_text(error: BaseException) -> str:
    """What the chat says when an answer fails: the pipeline's own message for a bad question,
    a hint for running out of memory, and never a traceback."""
    if isinstance(error, ValueError):  # the pipeline's own messages: empty or too long a question
        return _short(error)
    if isinstance(error, MemoryError):
        return "The model ran out of memory on this question. Try a shorter question or a new conversation."
    if _is_retrieval_error(error):
        return f"The literature search failed: {_short(error)}"
    return (f"The model could not answer ({type(error).__name__}). The app is still running; "
            "try again or start a new conversation.")
