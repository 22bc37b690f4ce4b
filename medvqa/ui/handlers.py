"""What each event of the page does to the tab's session: warm, ask, stop, new conversation, restore,
transcript download; and, from scan_handlers.py, upload, series, window, frame and pixel value.

The handlers hold no session state themselves; every call gets the tab's `_Session` (or None before
the first upload) and returns it. Each session's lock guards its fields and is never held across a
yield or a model call. Turn-taking between sessions on the model is the pipeline's job: `Pipeline.ask`
takes a first-come-first-served turn for each step of its events and `Pipeline.warm_next_turn` for
its warming, so concurrent answers interleave token by token.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Iterator

import gradio as gr

from ..config import Settings
from ..engines.openai import RemoteError
from ..imaging import ScanLimits
from ..injection import check_answer
from ..pipeline import Done, Pipeline, Sources, Token
from ..safe_text import visible
from .budget import DecodedBudget
from .render import _error_html, _error_message, _escape_model_text, _note, _render_answer, _status
from .scan_handlers import _ScanHandlers
from .session import _Answer, _copy, _Session
from .transcript import _download_links, _transcript_json, _transcript_record, export_markdown

log = logging.getLogger(__name__)

_STOPPED = "\n\n_(stopped)_"  # under an answer Stop (or a clear) ended
_NOT_ASKED = "Not asked: the conversation was stopped or started over."

# Two asks of the same question (or of the box just emptied) this close together are one double click.
DOUBLE_CLICK_S = 1.0


class _Handlers(_ScanHandlers):
    """The event handlers of one app, bound to its pipeline, settings and upload limit: the scan and
    viewer's (scan_handlers._ScanHandlers) and the conversation's."""

    def __init__(self, pipeline: Pipeline, settings: Settings, max_upload_mb: float):
        self.pipeline = pipeline
        self.settings = settings
        self.limits = ScanLimits(max_bytes=int(max_upload_mb * 2**20))
        self.budget = DecodedBudget(self.settings.serving.decoded_scans_mb * 2**20)

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
                    # (The error names files on the server: its log has it, the chat and the transcript do not.)
                    answer.note = "The literature search failed (the server's log says why), so this answer has no sources."
                    events = self.pipeline.ask(conversation, answer.question, use_retrieval=False,
                                               safe_meta=session.scan.safe_meta)
                    continue
                text = _failure_text(error)
                answer.refused = isinstance(error, ValueError) and not answer.text  # the pipeline's own refusal
                self._count_error(_error_kind(error))
                if not isinstance(error, ValueError):
                    log.exception("answer failed")
                if getattr(error, "detail", ""):  # what a model server said (RemoteError): the log only
                    log.warning("the model server said: %r", str(error.detail)[:4096])  # %r: its newlines forge no lines
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
                    answer.open_choice, answer.dropped_turns = event.open_choice, event.dropped_turns
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
        return "The literature search failed (the server's log says why). The app is still running; try again."
    if isinstance(error, RemoteError):  # the openai engine's words, written for whoever runs the app
        return f"{_short(error)} The app is still running."
    return (f"The model could not answer ({type(error).__name__}). The app is still running; "
            "try again or start a new conversation.")
