"""The clinician web app (Gradio only; every answer comes from `Pipeline.ask`).

    demo = build_app(pipeline, settings, max_upload_mb=100)
    launch(demo, host="127.0.0.1", port=7860, max_upload_mb=100, auth=auth_from_env())

One browser tab is one session: its scan, window, conversation and export live in a `gr.State`
(`_Session`) and nowhere else. Uploads are read into memory and deleted from Gradio's upload folder
before they are decoded; the scan is shown as an inline PNG and exports are inline downloads, so
nothing of a session is written to disk by the app.

Model text is escaped before it is shown (it can neither inject markup nor create links); the only
links in an answer are built from `Passage.url` of the passages the answer was given.

API endpoints (gradio_client): /upload, /set_preset, /set_window, /set_frame, /ask, /stop,
/new_conversation, /export.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import datetime as dt
import html
import io
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

# Before gradio is imported: its import-time version check and telemetry read this.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import gradio as gr  # noqa: E402
import numpy as np  # noqa: E402
from gradio.utils import get_upload_folder  # noqa: E402
from PIL import Image  # noqa: E402

from .config import Settings  # noqa: E402
from .imaging import WINDOW_PRESETS, Scan, ScanError, ScanLimits, ScanSource, Window, open_scan  # noqa: E402
from .pipeline import Conversation, Done, Pipeline, Sources, Token  # noqa: E402

log = logging.getLogger(__name__)

NOTICE = ("**Research tool — not a diagnosis.** Answers come from a small research model and may be "
          "wrong. Check every statement against the images and the cited literature; do not use it for "
          "clinical decisions.")
DISPLAY_MAX_SIDE = 1024  # the viewer shows at most this many pixels a side (the model gets all of them)
DEFAULT_CONCURRENCY = 8  # answers generated at once; their decoding steps take turns on the model

_CSS = """
#medvqa-notice { border-left: 4px solid #d97706; background: #fffbeb; padding: 8px 12px; color: #78350f; }
.medvqa-viewer img { width: 100%; max-width: 640px; height: auto; image-rendering: auto; background: #000; }
.medvqa-caption { font-size: 0.85em; opacity: 0.8; margin-top: 4px; }
.medvqa-sources { margin-top: 0.6em; font-size: 0.92em; border-top: 1px solid #ccc; padding-top: 0.4em; }
.medvqa-sources ol { margin: 0.2em 0 0 0; padding: 0; list-style: none; }
.medvqa-error { color: #b91c1c; }
"""

_PRESET_LABELS = [("File default", "file"), ("Automatic (0.5–99.5 %)", "auto")] + [
    (f"{name.replace('_', ' ').capitalize()} (C {w.center:g} / W {w.width:g})", name)
    for name, w in WINDOW_PRESETS.items()] + [("Custom (sliders)", "custom")]


# ── Public entry points ──────────────────────────────────────────────────────────────────────

def build_app(pipeline: Pipeline, settings: Settings | None = None, max_upload_mb: float = 100,
              concurrency: int = DEFAULT_CONCURRENCY) -> gr.Blocks:
    """The Blocks app around a loaded pipeline. Launch it with `launch()`."""
    handlers = _Handlers(pipeline, settings or pipeline.settings, max_upload_mb)
    retrieval = (f"on ({len(pipeline.retriever):,} indexed passages)" if pipeline.retriever is not None
                 else "off — answers are not grounded in literature")

    with gr.Blocks(title="MedVQA", analytics_enabled=False, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(f"# MedVQA\n{NOTICE}", elem_id="medvqa-notice")
        session = gr.State(None, delete_callback=_close_session)
        with gr.Row():
            with gr.Column(scale=5):
                upload = gr.File(label=f"Scan: DICOM, PNG or JPEG (up to {max_upload_mb:g} MB)",
                                 file_count="single", type="filepath", height=140, elem_id="medvqa-upload")
                viewer = gr.HTML(_EMPTY_VIEWER, elem_id="medvqa-viewer")
                preset = gr.Dropdown(_PRESET_LABELS, value="file", label="Window preset", visible=False,
                                     elem_id="medvqa-preset")
                center = gr.Slider(-1100, 3000, value=40, step=1, label="Window centre", visible=False,
                                   elem_id="medvqa-center")
                width = gr.Slider(1, 4000, value=400, step=1, label="Window width", visible=False,
                                  elem_id="medvqa-width")
                frame = gr.Slider(1, 2, value=1, step=1, label="Frame", visible=False, elem_id="medvqa-frame")
                with gr.Accordion("Scan metadata (non-identifying fields only)", open=False):
                    meta = gr.JSON(show_label=False, elem_id="medvqa-meta")
            with gr.Column(scale=7):
                chatbot = gr.Chatbot(label="Conversation", height=520, elem_id="medvqa-chat",
                                     latex_delimiters=[], feedback_options=None, buttons=["copy"],
                                     placeholder="Upload a scan, then ask a question about it.")
                question = gr.Textbox(label="Question", placeholder="e.g. Is there a pleural effusion?",
                                      lines=2, max_lines=6, elem_id="medvqa-question")
                with gr.Row():
                    ask_button = gr.Button("Ask", variant="primary", elem_id="medvqa-ask")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="medvqa-stop")
                    new_button = gr.Button("New conversation", elem_id="medvqa-new")
                with gr.Accordion("Export conversation", open=False):
                    export_button = gr.Button("Prepare Markdown and JSON", elem_id="medvqa-export")
                    export_links = gr.HTML("", elem_id="medvqa-export-links")
                    export_markdown = gr.Textbox(visible=False)
                    export_json = gr.Textbox(visible=False)
                gr.Markdown(f"Profile `{handlers.settings.profile}` · literature retrieval {retrieval}.")

        viewer_outputs = [viewer, preset, center, width, frame, meta, chatbot, session]
        # preprocess=False: the handler gets the upload's path and deletes the file itself; gr.File's
        # own preprocessing would leave an (empty) temporary file in the cache for every upload.
        # Gradio still checks that the path lies in its upload folder before the handler runs.
        # Each change of what the model will see, and of the question being typed, is followed by
        # warming: the image is encoded and the conversation's prompt up to the question (as typed
        # so far) is prefilled while the clinician types. One warming runs at a time; keystrokes
        # that arrive meanwhile collapse into the latest text.
        warming = dict(fn=handlers.warm, inputs=[session, question], outputs=None, api_visibility="private",
                       show_progress="hidden", concurrency_limit=1, concurrency_id="warm", queue=True)
        upload.upload(handlers.upload, [upload, session], [upload, *viewer_outputs], preprocess=False,
                      api_name="upload", concurrency_limit=2, concurrency_id="scan-decode").then(**warming)
        preset.input(handlers.set_preset, [preset, frame, session], viewer_outputs, api_name="set_preset",
                     concurrency_limit=4, concurrency_id="scan-render").then(**warming)
        gr.on([center.release, width.release], handlers.set_window, [center, width, frame, session],
              viewer_outputs, api_name="set_window", concurrency_limit=4, concurrency_id="scan-render",
              trigger_mode="always_last").then(**warming)
        frame.release(handlers.set_frame, [frame, session], viewer_outputs, api_name="set_frame",
                      concurrency_limit=4, concurrency_id="scan-render", trigger_mode="always_last").then(**warming)
        question.input(**warming, trigger_mode="always_last")
        answering = gr.on([ask_button.click, question.submit], handlers.ask, [question, session],
                          [chatbot, question], api_name="ask", concurrency_limit=concurrency,
                          concurrency_id="answer", show_progress="hidden")
        stop_button.click(handlers.stop, [session], [chatbot], cancels=[answering], api_name="stop")
        new_button.click(handlers.new_conversation, [session], [chatbot, question, export_links],
                         cancels=[answering], api_name="new_conversation").then(**warming)
        chatbot.clear(handlers.new_conversation, [session], [chatbot, question, export_links], cancels=[answering],
                      api_visibility="private").then(**warming)  # the chat's own bin icon starts over too
        export_button.click(handlers.export, [session], [export_links, export_markdown, export_json],
                            api_name="export")
    demo.queue(default_concurrency_limit=4, max_size=16 * max(concurrency, 1))
    return demo


def launch(demo: gr.Blocks, *, host: str = "127.0.0.1", port: int | None = 7860, max_upload_mb: float = 100,
           auth: tuple[str, str] | None = None, block: bool = True, quiet: bool = False):
    """Serve the app: loopback by default, uploads capped, no run history, telemetry, MCP or SSR."""
    return demo.launch(
        server_name=host, server_port=port, auth=auth, max_file_size=int(max_upload_mb * 2**20),
        prevent_thread_lock=not block, quiet=quiet, show_error=False, ssr_mode=False, pwa=False,
        mcp_server=False, enable_monitoring=False,
        run_history=False,  # would keep every question and answer in the browser's storage
        footer_links=["api"], css=_CSS,
    )


def auth_from_env(env: dict[str, str] | None = None) -> tuple[str, str] | None:
    """(user, password) from MEDVQA_USERNAME / MEDVQA_PASSWORD, or None when neither is set."""
    env = os.environ if env is None else env
    user, password = env.get("MEDVQA_USERNAME", ""), env.get("MEDVQA_PASSWORD", "")
    if bool(user) != bool(password):
        raise ValueError("Set both MEDVQA_USERNAME and MEDVQA_PASSWORD to require a login, or neither.")
    return (user, password) if user else None


# ── Per-session state ────────────────────────────────────────────────────────────────────────

@dataclass
class _Session:
    """One browser tab: never shared, dropped by Gradio when the tab goes away."""

    pipeline: Pipeline
    source: ScanSource
    scan: Scan
    conversation: Conversation
    messages: list[dict] = field(default_factory=list)  # what the chat shows
    turns: list[dict] = field(default_factory=list)  # answered (or stopped) turns, for the export
    generation: int = 0  # bumped by Stop / New conversation / a new scan: a running answer then ends
    current: "_Answer | None" = None  # the answer being streamed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def look_at(self, scan: Scan) -> None:
        """Show `scan` and let the model see exactly it from the next question on. The conversation
        keeps its history but gets a new id, so no decoder cache built on the old pixels is reused."""
        self.scan = scan
        old = self.conversation
        self.conversation = Conversation(image=scan.pixels, window=scan.describe_window(), history=old.history)
        self.pipeline.end_conversation(old)

    def close(self) -> None:
        self.pipeline.end_conversation(self.conversation)


def _close_session(session: _Session | None) -> None:
    """Gradio's delete callback for a session whose tab is gone."""
    if session is not None:
        session.close()


class _TurnTaking:
    """A first-come-first-served lock. Each decoding step of each running answer takes one turn, so
    concurrent answers interleave token by token instead of contending for the CPU cores (and the
    tokenizer, which is not thread-safe)."""

    def __init__(self):
        self._condition = threading.Condition()
        self._waiting: collections.deque = collections.deque()

    @contextlib.contextmanager
    def turn(self):
        ticket = object()
        with self._condition:
            self._waiting.append(ticket)
            while self._waiting[0] is not ticket:
                self._condition.wait()
        try:
            yield
        finally:
            with self._condition:
                self._waiting.popleft()
                self._condition.notify_all()


# ── Handlers ─────────────────────────────────────────────────────────────────────────────────

class _Handlers:
    def __init__(self, pipeline: Pipeline, settings: Settings, max_upload_mb: float):
        self.pipeline = pipeline
        self.settings = settings
        self.limits = ScanLimits(max_bytes=int(max_upload_mb * 2**20))
        self.model_turns = _TurnTaking()

    # --- scan ------------------------------------------------------------------------------

    def upload(self, payload: dict | None, session: _Session | None):
        """Read the upload into memory, delete it, decode it; a new scan starts a new conversation."""
        try:
            data = _take_upload(payload, self.limits.max_bytes)
            source = open_scan(data, self.limits)
            scan = source.render()
        except ScanError as error:
            return (None, *self._viewer_unchanged(session, _error_message(f"The scan could not be opened: {error}")))
        except Exception:  # noqa: BLE001 - the app must keep serving whatever the upload does
            log.exception("upload failed")
            return (None, *self._viewer_unchanged(session, _error_message("The scan could not be opened.")))
        if session is not None:
            with session.lock:
                session.generation += 1
            session.close()
        session = _Session(self.pipeline, source, scan, self.pipeline.new_conversation(scan))
        return (None, *self._viewer_update(session, controls=True))

    def set_preset(self, preset: str, frame: float, session: _Session | None):
        if preset == "custom":
            return self._viewer_unchanged(session)
        return self._render(session, preset, frame)

    def set_window(self, center: float, width: float, frame: float, session: _Session | None):
        try:
            window = Window(float(center), float(width), "user")
        except (TypeError, ValueError):
            return self._viewer_unchanged(session, _error_message("The window centre and width must be numbers."))
        return self._render(session, window, frame)

    def set_frame(self, frame: float, session: _Session | None):
        window = session.scan.window if session else None
        if window is not None and window.name in ("file", "file-lut"):
            window = None  # each frame with its own window from the file, as a viewer scrolls a stack
        return self._render(session, window, frame)

    def _render(self, session: _Session | None, window, frame):
        if session is None:
            return self._viewer_unchanged(None, _error_message("Please upload a scan first."))
        try:
            index = session.source.default_frame if frame is None else int(round(float(frame))) - 1
            scan = session.source.render(window=window, frame=index)
        except ScanError as error:
            return self._viewer_unchanged(session, _error_message(str(error)))
        except Exception:  # noqa: BLE001
            log.exception("render failed")
            return self._viewer_unchanged(session, _error_message("The scan could not be shown with that window."))
        with session.lock:
            session.look_at(scan)
        return self._viewer_update(session, controls=True)

    def _viewer_update(self, session: _Session, controls: bool):
        scan, source = session.scan, session.source
        windowed = source.is_dicom and scan.window is not None
        outputs = [_viewer_html(scan)]
        if controls:
            window = scan.window or Window(40, 400, "none")
            center_range, width_max = _slider_ranges(source.default_window or window, window)
            outputs += [
                gr.Dropdown(choices=_PRESET_LABELS, value=_preset_value(window), visible=windowed),
                gr.Slider(minimum=center_range[0], maximum=center_range[1], value=round(window.center, 3),
                          visible=windowed),
                gr.Slider(minimum=1, maximum=width_max, value=round(window.width, 3), visible=windowed),
                gr.Slider(minimum=1, maximum=max(source.frame_count, 2), value=scan.frame_index + 1,
                          visible=source.frame_count > 1, label=f"Frame (of {source.frame_count})"),
            ]
        outputs += [_scan_meta(scan), _copy(session.messages), session]
        return tuple(outputs)

    @staticmethod
    def _viewer_unchanged(session: _Session | None, message: dict | None = None):
        if message is not None and session is not None:
            with session.lock:
                session.messages.append(message)
        messages = _copy(session.messages) if session is not None else ([message] if message else [])
        return (gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), messages, session)

    def warm(self, session: _Session | None, draft: str = "") -> None:
        """Prepare the session's conversation for its next question (see Pipeline.warm_next_turn),
        in one model turn; with `draft`, the question as typed so far. Only a speed-up: skipped while
        an answer runs (it warms the next turn itself), and a failure here is logged, never shown;
        the question then prefills it all."""
        if session is None or not self.settings.decoder.warm_next_turn:
            return
        with session.lock:
            if session.current is not None:
                return
            conversation = session.conversation
        try:
            with self.model_turns.turn():
                with session.lock:
                    # A scan, window or conversation replaced meanwhile has its own warming queued.
                    current = session.conversation is conversation and session.current is None
                if current:
                    self.pipeline.warm_next_turn(conversation, draft or "")
                with session.lock:
                    ended = session.conversation is not conversation
                if ended:  # replaced while warming: drop what was cached for it
                    self.pipeline.end_conversation(conversation)
        except Exception:  # noqa: BLE001 - an optimisation must never break the app
            log.exception("warming the conversation failed")

    # --- chat ------------------------------------------------------------------------------

    def ask(self, question: str, session: _Session | None) -> Iterator[tuple[list[dict], str]]:
        """Stream one answer: the question, then the answer token by token, then its sources."""
        question = (question or "").strip()
        if session is None:
            yield [_error_message("Please upload a scan first, then ask about it.")], question
            return
        refusal = None
        with session.lock:  # never held across a yield: a cancelled generator is not resumed
            if session.current is not None:
                refusal = "Please wait for the current answer, or press Stop."
            elif not question:
                refusal = "Please type a question about the image."
            else:
                answer = session.current = _Answer(question, session.scan)
                generation = session.generation
                session.messages.append({"role": "user", "content": _escape_model_text(question)})
                reply = {"role": "assistant", "content": _status("Searching the literature…")}
                session.messages.append(reply)
            if refusal:
                session.messages.append(_error_message(refusal))
            snapshot = _copy(session.messages)
        if refusal:
            yield snapshot, question
            return
        yield snapshot, ""
        try:
            for update in self._stream(session, answer, generation, reply):
                yield update, ""
        finally:
            with session.lock:
                if session.generation == generation:
                    session.current = None

    def _stream(self, session: _Session, answer: "_Answer", generation: int, reply: dict) -> Iterator[list[dict]]:
        conversation = session.conversation
        events = self.pipeline.ask(conversation, answer.question, safe_meta=session.scan.safe_meta)
        retrieval_failed = False
        while True:
            try:
                with self.model_turns.turn():
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
                if not isinstance(error, ValueError):
                    log.exception("answer failed")
                with session.lock:
                    if session.generation != generation:
                        return
                    reply["content"] = (_render_answer(answer, final=False) + "\n\n" if answer.text else "") + \
                        _error_html(text)
                    snapshot = _copy(session.messages)
                yield snapshot
                return
            if event is None:
                return
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
                    reply["content"] = _render_answer(answer, final=True)
                    session.turns.append(answer.record())
                snapshot = _copy(session.messages)
            yield snapshot

    def stop(self, session: _Session | None):
        if session is None:
            return []
        with session.lock:
            if session.current is not None:
                session.generation += 1
                session.turns.append(session.current.record(stopped=True))
                session.current = None
                reply = session.messages[-1] if session.messages else None
                if reply is not None and reply["role"] == "assistant":
                    reply["content"] = str(reply["content"]) + "\n\n_(stopped)_"
            return _copy(session.messages)

    def new_conversation(self, session: _Session | None):
        if session is None:
            return [], "", ""
        with session.lock:
            session.generation += 1
            session.current = None
            session.messages = []
            session.turns = []
            old = session.conversation
            session.conversation = self.pipeline.new_conversation(session.scan)
        self.pipeline.end_conversation(old)
        return [], "", ""

    def export(self, session: _Session | None):
        if session is None or not session.turns:
            return "<p>Nothing to export yet: ask a question first.</p>", "", ""
        with session.lock:
            record = _export_record(session, self.settings)
        markdown, as_json = export_markdown(record), json.dumps(record, indent=2, ensure_ascii=False)
        links = (f'<p>{_download_link("medvqa-conversation.md", "text/markdown", markdown, "Download Markdown")} · '
                 f'{_download_link("medvqa-conversation.json", "application/json", as_json, "Download JSON")}</p>'
                 f'<p class="medvqa-caption">The export holds questions, answers, citations and windows; '
                 f'no patient data, no image.</p>')
        return links, markdown, as_json


@dataclass
class _Answer:
    question: str
    scan: Scan
    text: str = ""
    passages: list = field(default_factory=list)
    note: str = ""
    window: str = ""
    started: bool = False
    in_prompt: bool = True  # the model read the passages (else they are related literature only)

    def record(self, stopped: bool = False) -> dict:
        return {"question": self.question, "answer": self.text.strip(), "stopped": stopped,
                "window": self.window or self.scan.describe_window(), "frame": self.scan.frame_index + 1,
                "citations": [_citation(n, p) for n, p in enumerate(self.passages, start=1)],
                "citations_read_by_model": self.in_prompt,
                **({"note": self.note} if not self.passages and self.note else {})}


# ── Rendering ────────────────────────────────────────────────────────────────────────────────

_EMPTY_VIEWER = '<div class="medvqa-viewer medvqa-empty"><p>No scan loaded.</p></div>'
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>])")
_MARKER = re.compile(r"\\\[(\d{1,2}(?:\s*,\s*\d{1,2})*)\\\]")  # an escaped [n] or [n, m]
_HTTP_URL = re.compile(r"^https?://[^\s<>\"'`]+$", re.IGNORECASE)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]")


def _escape_model_text(text: str) -> str:
    """Text the model (or the user) wrote, made inert: no HTML, no Markdown, no autolinks."""
    text = html.escape(_CONTROL.sub("", text), quote=False)
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    text = re.sub(r"://", ":&#47;&#47;", text)  # GFM autolinks need a literal "://"
    text = re.sub(r"(?i)\bwww\\\.", "www&#46;", text)  # ... or "www."
    return text.replace("@", "&#64;")  # ... or an e-mail address


def _link(url: str, label: str, css_class: str = "") -> str:
    """An anchor to a passage URL; anything but http(s) gives plain text."""
    if not isinstance(url, str) or not _HTTP_URL.match(url.strip()):
        return html.escape(label)
    class_attr = f' class="{css_class}"' if css_class else ""
    return (f'<a{class_attr} href="{html.escape(url.strip(), quote=True)}" target="_blank" '
            f'rel="noopener noreferrer">{html.escape(label)}</a>')


def _render_answer(answer: _Answer, final: bool) -> str:
    body = _escape_model_text(answer.text.strip()) if answer.text.strip() else ""
    if answer.passages:
        def cite(match: re.Match) -> str:
            numbers = [int(n) for n in re.split(r"\s*,\s*", match.group(1))]
            if not all(1 <= n <= len(answer.passages) for n in numbers):
                return match.group(0)
            return "[" + ", ".join(_link(answer.passages[n - 1].url, str(n), "medvqa-cite") for n in numbers) + "]"
        body = _MARKER.sub(cite, body)
    if not final:
        return body or _status("Answering…")
    if not body:
        body = "_(The model gave no answer.)_"
    return body + "\n\n" + _sources_html(answer.passages, answer.note, answer.in_prompt)


def _sources_html(passages: list, note: str, in_prompt: bool = True) -> str:
    """The numbered sources of an answer. One HTML block with no blank line, so Markdown leaves it be."""
    if not passages:
        reason = html.escape(note or "No literature passage was retrieved.")
        return f'<div class="medvqa-sources medvqa-no-sources"><b>No literature support.</b> {reason}</div>'
    items = []
    for n, passage in enumerate(passages, start=1):
        origin = " · ".join(html.escape(part) for part in (passage.id, passage.source, passage.license) if part)
        items.append(
            f'<li value="{n}" class="medvqa-source" data-passage-id="{html.escape(passage.id, quote=True)}">'
            f'[{n}] {_link(passage.url, _passage_label(passage), "medvqa-source-link")}'
            + (f' <small>({origin})</small>' if origin else "")
            + f'<details><summary>Passage text</summary><blockquote>{html.escape(passage.text)}</blockquote>'
              f'</details></li>')
    heading = "<b>Sources</b>" if in_prompt else \
        "<b>Related literature</b> <small>(retrieved for your question; this model answers from the image alone)</small>"
    return f'<div class="medvqa-sources">{heading}<ol>{"".join(items)}</ol></div>'


def _passage_label(passage, limit: int = 90) -> str:
    """The link text of a source: its title, or (captions have none) the start of its text."""
    label = (passage.title or passage.text or passage.id).strip()
    return label if len(label) <= limit else label[:limit].rsplit(" ", 1)[0] + "…"


def _status(text: str) -> str:
    return f'<span class="medvqa-status"><em>{html.escape(text)}</em></span>'


def _error_html(text: str) -> str:
    return f'<div class="medvqa-error">⚠ {html.escape(text)}</div>'


def _error_message(text: str) -> dict:
    return {"role": "assistant", "content": _error_html(text)}


def _copy(messages: list[dict]) -> list[dict]:
    return [dict(message) for message in messages]


def _viewer_html(scan: Scan) -> str:
    pixels = scan.pixels  # (H, W, 3) uint8
    image = Image.fromarray(np.ascontiguousarray(pixels))
    if max(image.size) > DISPLAY_MAX_SIDE:
        image.thumbnail((DISPLAY_MAX_SIDE, DISPLAY_MAX_SIDE), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=3)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    caption = (f"{scan.source_format.upper()} · {pixels.shape[1]}×{pixels.shape[0]} px · "
               f"frame {scan.frame_index + 1} of {scan.frame_count} · {scan.describe_window()}")
    return (f'<div class="medvqa-viewer"><img id="medvqa-scan" alt="The scan as the model sees it" '
            f'src="data:image/png;base64,{encoded}"/><div class="medvqa-caption">{html.escape(caption)}</div></div>')


def _scan_meta(scan: Scan) -> dict:
    return {"format": scan.source_format, **scan.safe_meta}


def _preset_value(window: Window) -> str:
    if window.name in ("file", "file-lut"):
        return "file"
    if window.name == "auto-percentile":
        return "auto"
    return window.name if window.name in WINDOW_PRESETS else "custom"


def _slider_ranges(default: Window, current: Window) -> tuple[tuple[float, float], float]:
    """Centre range covering the CT presets and a generous span around the file's window."""
    low = min(-1100.0, default.center - 2 * default.width, current.center)
    high = max(3000.0, default.center + 2 * default.width, current.center)
    return (float(np.floor(low)), float(np.ceil(high))), float(np.ceil(max(4000.0, 4 * default.width, current.width)))


def _citation(n: int, passage) -> dict:
    url = passage.url if isinstance(passage.url, str) and _HTTP_URL.match(passage.url) else ""
    return {"n": n, "id": passage.id, "title": passage.title, "url": url, "source": passage.source,
            "license": passage.license}


def _export_record(session: _Session, settings: Settings) -> dict:
    source = session.source
    return {
        "tool": "MedVQA",
        "notice": "Research tool, not a diagnosis.",
        "exported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "profile": settings.profile,
        "scan": {"format": source.source_format, "frames": source.frame_count,
                 "modality": source.safe_meta.get("Modality", "")},
        "turns": [dict(turn) for turn in session.turns],
    }


def export_markdown(record: dict) -> str:
    lines = ["# MedVQA conversation", "",
             f"_{record['notice']}_ Exported {record['exported_at']} (profile `{record['profile']}`). "
             "No patient data.", "",
             f"Scan: {record['scan']['format'].upper()}"
             + (f", {record['scan']['modality']}" if record['scan']['modality'] else "")
             + f", {record['scan']['frames']} frame(s).", ""]
    for number, turn in enumerate(record["turns"], start=1):
        # Question and answer are escaped like in the chat: a link the model wrote stays text.
        lines += [f"## {number}. {_escape_model_text(turn['question'])}", "",
                  f"- Window: {turn['window']}; frame {turn['frame']}", "",
                  _escape_model_text(turn["answer"]) or "_(no answer)_", ""]
        if turn["stopped"]:
            lines += ["_(stopped by the user before the answer was complete)_", ""]
        if turn["citations"]:
            lines.append("Sources:" if turn.get("citations_read_by_model", True) else
                         "Related literature (not read by the model):")
            lines += [_markdown_citation(citation) for citation in turn["citations"]]
            lines.append("")
        elif not turn["stopped"]:
            lines += [f"No literature support. {turn.get('note', '')}".strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def _markdown_citation(citation: dict) -> str:
    label = _MARKDOWN_SPECIAL.sub(r"\\\1", citation["title"] or citation["id"])
    if not citation["url"]:
        return f"{citation['n']}. {label}"
    return f"{citation['n']}. [{label}](<{citation['url']}>) ({citation['id']})"


def _download_link(name: str, mime: str, text: str, label: str) -> str:
    encoded = base64.b64encode(text.encode("utf-8")).decode("ascii")
    return f'<a download="{name}" href="data:{mime};charset=utf-8;base64,{encoded}">{html.escape(label)}</a>'


# ── Uploads and errors ───────────────────────────────────────────────────────────────────────

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


def _is_retrieval_error(error: BaseException) -> bool:
    from .retrieval import RetrievalError

    return isinstance(error, RetrievalError)


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]


def _failure_text(error: BaseException) -> str:
    if isinstance(error, ValueError):  # the pipeline's own messages: empty or too long a question
        return _short(error)
    if isinstance(error, MemoryError):
        return "The model ran out of memory on this question. Try a shorter question or a new conversation."
    if _is_retrieval_error(error):
        return f"The literature search failed: {_short(error)}"
    return (f"The model could not answer ({type(error).__name__}). The app is still running; "
            "try again or start a new conversation.")
