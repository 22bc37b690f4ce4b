"""The page: its gr.Blocks layout, which event runs which handler, and how the app is served.

Served privately by default: loopback only, uploads capped, no run history, telemetry, MCP or SSR;
with a login, every route but the login page needs it (access.py); uploads live in a folder the app
owns, and any the handler never read are deleted within a minute (uploads.py).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import tempfile

import gradio as gr
from starlette.middleware import Middleware

from ..config import Settings
from ..pipeline import Pipeline
from .access import AccessGuard
from ..pacs import Pacs
from .handlers import _Handlers
from .metrics_route import MetricsRoute
from .remote import _PacsHandlers
from .session import _close_session, _forget_closed_tabs
from .uploads import UPLOAD_MAX_AGE_S, UploadFolder
from .viewer import _EMPTY_VIEWER, _PRESET_LABELS

NOTICE = ("**Research tool — not a diagnosis.** Answers come from a small research model and may be "
          "wrong. Check every statement against the images and the cited literature; do not use it for "
          "clinical decisions.")
DEFAULT_CONCURRENCY = 8  # answers generated at once (llama.cpp runs their steps in shared batches)

# Colours are checked against both of Gradio's schemes (it follows the system's; ".dark" on the page) and
# under the chat's own 0.8 opacity: 4.5:1 or more for text. The notice keeps its light background in both,
# so its text is set dark on every element inside it (Gradio's prose rules would give them the scheme's).
# Ask and Stop are darker than the theme's orange and red (2.8:1 and 3.8:1 with their white text).
_CSS = """
#medvqa-notice { border-left: 4px solid #d97706; background: #fffbeb; padding: 8px 12px; }
#medvqa-notice, #medvqa-notice * { color: #78350f !important; }
.medvqa-viewer { margin: 0; }
.medvqa-viewer img { width: 100%; max-width: 640px; height: auto; image-rendering: auto; background: #000; }
.medvqa-caption { font-size: 0.85em; opacity: 0.8; margin-top: 4px; }
.medvqa-sources { margin-top: 0.6em; font-size: 0.92em; border-top: 1px solid #ccc; padding-top: 0.4em; }
.medvqa-sources ol { margin: 0.2em 0 0 0; padding: 0; list-style: none; }
.medvqa-error { color: #991b1b; }
.dark .medvqa-error { color: #fca5a5; }
.medvqa-withheld { border-left: 4px solid #6b7280; padding: 0 0 0 8px; }
.medvqa-uncertain { font-style: italic; }
.medvqa-mark { display: inline-block; vertical-align: top; font-size: 0.9em; }
.medvqa-mark summary { cursor: pointer; }
.medvqa-contradicts summary { color: #92400e; }
.dark .medvqa-contradicts summary { color: #fcd34d; }
.medvqa-injection { border-left: 4px solid #b91c1c; background: #fef2f2; color: #7f1d1d; padding: 6px 10px; }
#medvqa-frame input[type=range]:focus-visible, #medvqa-center input[type=range]:focus-visible,
#medvqa-width input[type=range]:focus-visible { outline: 2px solid #2563eb; outline-offset: 2px; }
.medvqa-sr-only { position: absolute; width: 1px; height: 1px; overflow: hidden; clip-path: inset(50%); margin: 0; }
#medvqa-question .info-text { color: #52525b; }
.dark #medvqa-question .info-text { color: #d4d4d8; }
.medvqa-out-of-flow { position: absolute !important; z-index: 10; }
.medvqa-skip { position: absolute; left: -10000px; }
.medvqa-skip:focus { position: static; background: #fff; color: #1d4ed8; padding: 4px 8px; }
#medvqa-ask, #medvqa-stop { color: #fff !important; }
#medvqa-ask { background: #c2410c !important; border-color: #c2410c !important; }
#medvqa-ask:hover { background: #9a3412 !important; border-color: #9a3412 !important; }
#medvqa-stop { background: #b91c1c !important; border-color: #b91c1c !important; }
#medvqa-stop:hover { background: #991b1b !important; border-color: #991b1b !important; }
"""

# Run when the page loads.
# - A slider's number box reports its value when it loses focus (Gradio's "release"): Enter there applies
#   the value typed, as Tab would, and the box keeps the focus.
# - The window sliders report a change on "release" only, which the arrow, Page and Home/End keys never
#   send: a key that moved one sends it, as letting go of a drag does.
# - The viewer announces what is shown (a new scan, frame or window) to a screen reader, once it is shown.
# - The chat scrolls to the end of each update, as Gradio's autoscroll does, but where the latest answer
#   is taller than the chat, to the answer's first line, which holds the answer or "Uncertain" (its sources
#   follow); Gradio's own scroll stops once the view is off the end, so the page keeps scrolling itself.
# - The mouse wheel over the scan scrolls a series' slices; a drag on it sets the window.
# - "Skip to the question" (the page's first link, shown on focus) puts the focus in the question box.
# - Gradio's accordions say whether they are open (aria-expanded, from the "open" class Gradio sets), and
#   their ▼ sign is not read out.
# - A screen reader is given each finished answer once (see `speak`), not the chat's every token.
_PAGE_JS = """
() => {
  const KEYS = ["ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown", "PageUp", "PageDown", "Home", "End"];
  document.addEventListener("keydown", (event) => {
    const box = event.target;
    if (event.key === "Enter" && box instanceof HTMLInputElement && box.type === "number"
        && box.closest("#medvqa-center, #medvqa-width, #medvqa-frame")) {
      event.preventDefault();
      box.blur();
      box.focus();
    }
  });
  document.addEventListener("keyup", (event) => {
    const range = event.target;
    if (KEYS.includes(event.key) && range instanceof HTMLInputElement && range.type === "range"
        && range.closest("#medvqa-center, #medvqa-width")) {
      range.dispatchEvent(new PointerEvent("pointerup", {bubbles: true}));
    }
  });
  // The wheel over the scan scrolls a series' slices, as in a PACS viewer (one slice a notch; a touchpad's
  // small steps add up); over a single image, at the first or last slice, or sideways, the page scrolls as
  // usual. The listener sits on the viewer only, so it never holds up the page's own scrolling elsewhere.
  let wheeled = 0;
  const onWheel = (event) => {
    const range = document.querySelector("#medvqa-frame input[type=range]");
    if (!range || range.offsetParent === null || event.ctrlKey || !event.deltaY) return;  // (Ctrl+wheel: zoom)
    wheeled += event.deltaMode === 0 ? event.deltaY : event.deltaY * 40;
    const step = Math.sign(wheeled);
    const value = Math.min(Number(range.max), Math.max(Number(range.min), Number(range.value) + step));
    if (value === Number(range.value)) {  // at the end of the series: the page scrolls on
      wheeled = 0;
      return;
    }
    event.preventDefault();
    if (Math.abs(wheeled) < 40) return;
    wheeled = 0;
    range.value = String(value);
    range.dispatchEvent(new Event("input", {bubbles: true}));
  };
  const hookViewer = () => {  // (settle calls it: the viewer is drawn after this script runs)
    const viewer = document.querySelector("#medvqa-viewer");
    if (viewer && !viewer.dataset.medvqaWheel) {
      viewer.dataset.medvqaWheel = "1";
      viewer.addEventListener("wheel", onWheel, {passive: false});
    }
  };
  // Dragging on the scan sets its window, as in a PACS viewer: right widens it, down raises its centre (darker);
  // each pixel dragged moves it by a thousandth of the slider's range (at least one of its steps). The image
  // follows several times a second while dragging (each as a release of the width slider, which reports both
  // values); the viewer is marked busy meanwhile, so a screen reader reads its caption once, at the end.
  let drag = null;
  const stepOf = (range) => Number(range.step) || 1;
  const slid = (range, value) => {
    const low = Number(range.min), high = Number(range.max), step = stepOf(range);
    const snapped = Math.min(high, Math.max(low, low + Math.round((value - low) / step) * step));
    const text = String(Number(snapped.toFixed((String(range.step).split(".")[1] || "").length)));
    if (Number(text) === Number(range.value)) return false;
    range.value = text;
    range.dispatchEvent(new Event("input", {bubbles: true}));
    return true;
  };
  const windowed = () => drag.width.dispatchEvent(new PointerEvent("pointerup", {bubbles: true}));
  const endDrag = () => {
    if (!drag) return;
    if (drag.moved) windowed();
    document.querySelector("#medvqa-viewer")?.removeAttribute("aria-busy");
    drag = null;
  };
  document.addEventListener("pointerdown", (event) => {
    const center = document.querySelector("#medvqa-center input[type=range]");
    const width = document.querySelector("#medvqa-width input[type=range]");
    if (!event.target.closest || !event.target.closest("#medvqa-scan") || event.button !== 0 || !center || !width
        || center.offsetParent === null) return;
    event.preventDefault();  // no native image drag (and no focus change: a number box being typed in is left
    document.activeElement?.blur?.();  // here, so that its value applies first, as a click elsewhere would)
    drag = {x: event.clientX, y: event.clientY, center, width, from: [Number(center.value), Number(width.value)],
            sent: Date.now(), moved: false};
    document.querySelector("#medvqa-viewer")?.setAttribute("aria-busy", "true");
  });
  document.addEventListener("pointermove", (event) => {
    if (!drag) return;
    if (!(event.buttons & 1)) {  // the button was let go where no pointerup reached the page
      endDrag();
      return;
    }
    const per = (range) => Math.max(stepOf(range), (Number(range.max) - Number(range.min)) / 1000);
    const centred = slid(drag.center, drag.from[0] + (event.clientY - drag.y) * per(drag.center));
    const widened = slid(drag.width, drag.from[1] + (event.clientX - drag.x) * per(drag.width));
    drag.moved = drag.moved || centred || widened;
    if (drag.moved && Date.now() - drag.sent > 250) {
      drag.sent = Date.now();
      windowed();
    }
  });
  document.addEventListener("pointerup", (event) => {
    if (event.isTrusted) endDrag();  // (the release dispatched above bubbles here too)
  });
  document.addEventListener("pointercancel", endDrag);  // a touch the browser took for scrolling the page
  document.addEventListener("click", (event) => {
    if (event.target.closest && event.target.closest(".medvqa-skip")) {
      event.preventDefault();
      document.querySelector("#medvqa-question textarea")?.focus();
    }
  });
  // Gradio's chat is a polite live region, so a screen reader reads a streamed answer token by token, and
  // it names each message by its raw HTML. The chat is kept quiet and unnamed here; each finished answer
  // (its sources, an error, a note of the app's, or "(stopped)"), less its list of sources, is read once from a
  // region of its own.
  const announcer = document.createElement("div");
  announcer.id = "medvqa-announce";
  announcer.className = "medvqa-sr-only";
  announcer.setAttribute("aria-live", "polite");
  document.body.appendChild(announcer);
  // Answers are read in order as they finish; `readUpTo` counts the leading ones read (a finished answer
  // stays as it is, so each pass looks only at the rest), `readBeyond` the later ones already read (an error
  // shown while an answer before it still streams is read at once). A chat replaced (a new scan's note, an
  // error with no scan open) shows in the last answer read having changed: reading starts over.
  let readUpTo = 0, lastRead = null, restoring = null;
  const readBeyond = new Set();
  document.addEventListener("click", (event) => {  // Restore: the conversation it brings is not read out whole
    if (event.target.closest && event.target.closest("#medvqa-restore")) {
      restoring = document.querySelectorAll("#medvqa-chat .message-row.bot-row").length;
    }
  });
  const mark = (row) => [row, row.textContent.length];
  const speak = () => {
    const chat = document.querySelector("#medvqa-chat");
    if (!chat) return;
    const region = chat.querySelector("[role=log]");
    if (region && region.getAttribute("aria-live") !== "off") region.setAttribute("aria-live", "off");
    for (const named of chat.querySelectorAll(`[aria-label^="bot's message"], [aria-label^="user's message"]`)) {
      named.removeAttribute("aria-label");
    }
    const answers = chat.querySelectorAll(".message-row.bot-row");
    const last = readUpTo > 0 ? answers[readUpTo - 1] : null;
    if (readUpTo > answers.length || (last && (last !== lastRead[0] || last.textContent.length !== lastRead[1]))) {
      readUpTo = 0;  // another chat than the one read
      readBeyond.clear();
    }
    if (restoring !== null && answers.length !== restoring && [...answers].every(finished)) {
      restoring = null;  // the restored conversation: only its last answer is read
      readUpTo = answers.length - 1;
      readBeyond.clear();
      if (readUpTo > 0) lastRead = mark(answers[readUpTo - 1]);
    }
    const news = [];
    for (let i = readUpTo; i < answers.length; i++) {
      if (!readBeyond.has(i) && finished(answers[i])) {
        news.push(said(answers[i]));
        readBeyond.add(i);
      }
    }
    while (readBeyond.has(readUpTo)) {
      readBeyond.delete(readUpTo);
      lastRead = mark(answers[readUpTo]);
      readUpTo += 1;
    }
    if (news.length) announcer.textContent = news.join(" ");
  };
  const finished = (row) => row.querySelector(".medvqa-sources, .medvqa-error, .medvqa-note")
    || [...row.querySelectorAll("em")].some((mark) => mark.textContent === "(stopped)");
  const said = (row) => {  // the answer less its list of passages
    const copy = row.cloneNode(true);
    copy.querySelectorAll(".medvqa-sources:not(.medvqa-no-sources), button").forEach((el) => el.remove());
    return copy.textContent.replace(/\\s+/g, " ").trim();
  };
  const settle = () => {
    hookViewer();
    speak();
    const viewer = document.querySelector("#medvqa-viewer");
    if (viewer && !viewer.hasAttribute("aria-live")) {
      viewer.setAttribute("aria-live", "polite");
      viewer.setAttribute("aria-atomic", "true");
    }
    const log = document.querySelector("#medvqa-chat .bubble-wrap");
    const rows = log ? log.querySelectorAll(".message-row") : [];
    const last = rows[rows.length - 1];
    if (!last) return;
    // Not once the reader has scrolled the chat since its last message came: they stay where they went.
    const seen = rows.length + ":" + last.textContent.length;
    const changed = seen !== shown;
    if (rows.length !== messages) scrolled = false;
    shown = seen;
    messages = rows.length;
    if (scrolled) return;
    // "Taller": with the chat's label above it and the answer's buttons below, it would not show whole.
    if (last.classList.contains("bot-row") && last.offsetHeight > log.clientHeight - 96) {
      const top = last.getBoundingClientRect().top - log.getBoundingClientRect().top + log.scrollTop;
      const target = Math.max(0, Math.round(top - 32));  // the answer's first line, clear of the chat's label
      if (Math.abs(log.scrollTop - target) > 1) log.scrollTop = target;
    } else if (changed) {
      log.scrollTop = log.scrollHeight;  // a question, or an answer that fits: the end, as Gradio scrolls
    }
  };
  let pending = null, since = 0, shown = "", messages = 0, scrolled = false;
  for (const kind of ["wheel", "touchmove", "pointerdown", "keydown"]) {
    document.addEventListener(kind, (event) => {
      if (event.target.closest && event.target.closest("#medvqa-chat")) scrolled = true;
    }, {passive: true});
  }
  const later = () => {  // after Gradio's own scroll to the end; at least every 300 ms while the chat streams
    if (pending !== null && Date.now() - since > 300) return;
    if (pending === null) since = Date.now();
    clearTimeout(pending);
    pending = setTimeout(() => {
      pending = null;
      settle();
    }, 60);
  };
  new MutationObserver(later).observe(document.body, {childList: true, subtree: true, characterData: true});
  // Gradio may scroll to the end again after the last change (a scroll, but no user input before it).
  document.addEventListener("scroll", (event) => {
    if (!scrolled && event.target.closest && event.target.closest("#medvqa-chat")) later();
  }, true);
  const accordions = () => {
    for (const button of document.querySelectorAll("button.label-wrap")) {
      const open = String(button.classList.contains("open"));
      if (button.getAttribute("aria-expanded") !== open) button.setAttribute("aria-expanded", open);
      button.querySelector(".icon")?.setAttribute("aria-hidden", "true");
    }
  };
  accordions();
  new MutationObserver(accordions).observe(document.body, {childList: true, subtree: true, attributes: true,
                                                           attributeFilter: ["class"]});
  // Gradio sets a message's aria-label again when its text changes.
  new MutationObserver(later).observe(document.body,
                                      {subtree: true, attributes: true, attributeFilter: ["aria-label"]});
  hookViewer();
  document.body.dataset.medvqa = "ready";  // for the browser tests: the handlers above are in place
}
"""


def footer_text(pipeline, settings) -> str:
    """The line under the chat: the profile, whether literature is retrieved, who answers yes/no or open
    questions when it is not the language model (decoder.closed_answerer, decoder.open_answerer), and that
    each question is answered on its own where the prompt carries no earlier turn (decoder.history_turns)."""
    retrieval = (f"on ({len(pipeline.retriever):,} indexed passages)" if pipeline.retriever is not None
                 else "off — answers are not grounded in literature")
    kinds = [kind for kind, used in (("yes/no questions", getattr(pipeline, "head_closes", False)),
                                     ("open questions", getattr(pipeline, "head_opens", False)))
             if used]
    answerer = (f" · {' and '.join(kinds)} are answered by the image encoder's own answer head, not the language "
                "model" if kinds else "")
    alone = (" · each question is answered on its own (the model does not read the earlier turns), so ask each in "
             "full" if settings.decoder.history_turns == 0 else "")
    return f"Profile `{settings.profile}` · literature retrieval {retrieval}{answerer}{alone}."


def build_app(pipeline: Pipeline, settings: Settings | None = None, max_upload_mb: float = 100,
              concurrency: int = DEFAULT_CONCURRENCY, pacs: Pacs | None = None) -> gr.Blocks:
    """The Blocks app around a loaded pipeline (and, with `pacs`, a panel that opens studies from that
    DICOMweb archive). Launch it with `launch()`."""
    # Before the Blocks exist: Gradio takes the folder it moves uploads to from GRADIO_TEMP_DIR when
    # they are made, and the handlers only read uploads from the folder launch() serves.
    _upload_folder()
    handlers = _Handlers(pipeline, settings or pipeline.settings, max_upload_mb)

    with gr.Blocks(title="MedVQA", analytics_enabled=False, delete_cache=(3600, 3600)) as demo:
        gr.HTML('<a class="medvqa-skip" href="#medvqa-question">Skip to the question</a>', padding=False,
                elem_classes=["medvqa-out-of-flow"])
        gr.Markdown(f"# MedVQA\n{NOTICE}", elem_id="medvqa-notice")
        session = gr.State(None, delete_callback=_close_session)
        with gr.Row():
            with gr.Column(scale=5):
                gr.HTML('<h2 class="medvqa-sr-only">Scan</h2>', padding=False,  # headings to move by
                        elem_classes=["medvqa-out-of-flow"])
                upload = gr.File(label=f"Scan: DICOM, PNG, JPEG or TIFF, or a .zip of a series' DICOM files (up to "
                                       f"{max_upload_mb:g} MB)",
                                 file_count="single", type="filepath", height=140, elem_id="medvqa-upload")
                with gr.Row():  # a series as it lies on disk: its files, or their folder
                    files = gr.UploadButton("Open several files", file_count="multiple", size="sm",
                                            elem_id="medvqa-files")
                    folder = gr.UploadButton("Open a folder", file_count="directory", size="sm",
                                             elem_id="medvqa-folder")
                if pacs is not None:
                    pacs_panel = _pacs_panel()
                # Its choices come with each upload; the handler checks the number (an API client may call
                # /set_series without the page's choices), hence allow_custom_value.
                series_picker = gr.Dropdown([], label="Series", visible=False, allow_custom_value=True,
                                            elem_id="medvqa-series")
                viewer = gr.HTML(_EMPTY_VIEWER, elem_id="medvqa-viewer")
                series_notes = gr.HTML("", elem_id="medvqa-series-notes")
                # A slice of a series or a frame of a file; the arrow keys scroll it once it has focus.
                frame = gr.Slider(1, 2, value=1, step=1, label="Frame", visible=False, elem_id="medvqa-frame")
                preset = gr.Dropdown(_PRESET_LABELS, value="file", label="Window preset", visible=False,
                                     elem_id="medvqa-preset")
                center = gr.Slider(-1100, 3000, value=40, step=1, label="Window centre", visible=False,
                                   elem_id="medvqa-center")
                width = gr.Slider(1, 4000, value=400, step=1, label="Window width", visible=False,
                                  elem_id="medvqa-width")
                with gr.Accordion("Scan metadata (non-identifying fields only)", open=False):
                    meta = gr.JSON(show_label=False, elem_id="medvqa-meta")
            with gr.Column(scale=7):
                # Each message its own bubble: an error after an answer is not read as part of it.
                # At most 520 px, less on a short screen (a 720 px laptop keeps the question box in view).
                gr.HTML('<h2 class="medvqa-sr-only">Conversation</h2>', padding=False,
                        elem_classes=["medvqa-out-of-flow"])
                chatbot = gr.Chatbot(label="Conversation", height="min(520px, 55vh)", elem_id="medvqa-chat",
                                     latex_delimiters=[], feedback_options=None, buttons=["copy"],
                                     group_consecutive_messages=False,
                                     placeholder="Upload a scan, then ask a question about it.")
                # One line to start: Enter asks, Shift+Enter starts a new line (Gradio's rule for one line).
                question = gr.Textbox(label="Question", placeholder="e.g. Is there a pleural effusion?",
                                      info="Enter asks; Shift+Enter starts a new line.", lines=1, max_lines=6,
                                      elem_id="medvqa-question")
                with gr.Row():
                    ask_button = gr.Button("Ask", variant="primary", elem_id="medvqa-ask")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="medvqa-stop")
                    new_button = gr.Button("New conversation", elem_id="medvqa-new")
                # Clearing is undone here until the next question or scan (handlers.restore_conversation).
                restore_button = gr.Button("Restore the cleared conversation", visible=False, size="sm",
                                           elem_id="medvqa-restore")
                with gr.Accordion("Export conversation", open=False):
                    transcript_button = gr.Button("Prepare Markdown and JSON", elem_id="medvqa-export")
                    transcript_links = gr.HTML("", elem_id="medvqa-export-links")
                    transcript_markdown = gr.Textbox(visible=False)
                    transcript_json = gr.Textbox(visible=False)
                gr.Markdown(footer_text(pipeline, handlers.settings))

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
        # After a single-file upload the same warming is also an endpoint (/warm, undocumented): a
        # script that drives the app through gradio_client (scripts/bench_app.py --warm) does what the
        # page does once a scan is shown; the page chains it itself.
        warming_endpoint = {**warming, "api_name": "warm", "api_visibility": "undocumented"}
        study_controls = dict(fn=handlers.study_controls, inputs=[session], outputs=[series_picker, series_notes],
                              api_visibility="private", show_progress="hidden", queue=False)
        restore_offer = dict(fn=handlers.restore_offer, inputs=[session], outputs=[restore_button],
                             api_visibility="private", show_progress="hidden", queue=False)
        upload.upload(handlers.upload, [upload, session], [upload, *viewer_outputs], preprocess=False,
                      api_name="upload", concurrency_limit=2, concurrency_id="scan-decode"
                      ).then(**study_controls).then(**restore_offer).then(**warming_endpoint)
        files.upload(handlers.upload, [files, session], [upload, *viewer_outputs], preprocess=False,
                     api_name="upload_files", concurrency_limit=2, concurrency_id="scan-decode"
                     ).then(**study_controls).then(**restore_offer).then(**warming)
        folder.upload(handlers.upload, [folder, session], [upload, *viewer_outputs], preprocess=False,
                      api_visibility="private", concurrency_limit=2, concurrency_id="scan-decode"
                      ).then(**study_controls).then(**restore_offer).then(**warming)
        if pacs is not None:
            remote = _PacsHandlers(pacs, handlers)
            identifier, find, remote_series, load, cancel, status, found = pacs_panel
            gr.on([find.click, identifier.submit], remote.find, [identifier, found],
                  [identifier, remote_series, status, found], api_name="pacs_find", concurrency_limit=8,
                  concurrency_id="pacs")  # network waits, not work: a slow archive must not queue other tabs
            # Its progress (slices arrived, a stalled archive) on the viewer and the panel, not over the chat.
            load.click(remote.load, [remote_series, found, session], viewer_outputs, api_name="pacs_load",
                       concurrency_limit=8, concurrency_id="pacs", show_progress_on=[viewer, status]
                       ).then(**study_controls).then(**restore_offer).then(**warming)
            # queue=False: a Cancel never waits behind the transfers it stops
            cancel.click(remote.cancel, None, [status], api_name="pacs_cancel", queue=False)
            demo.unload(remote.tab_closed)  # the tab's Find or Load stops with it
        series_picker.input(handlers.set_series, [series_picker, session], viewer_outputs, api_name="set_series",
                            concurrency_limit=4, concurrency_id="scan-render").then(**study_controls).then(**warming)
        preset.input(handlers.set_preset, [preset, frame, session], viewer_outputs, api_name="set_preset",
                     concurrency_limit=4, concurrency_id="scan-render").then(**warming)
        # preprocess=False: a number typed beyond a slider's range reaches the handler, which brings it
        # within range; Gradio's own check would put every output, the chat among them, in an error state.
        gr.on([center.release, width.release], handlers.set_window, [center, width, frame, session],
              viewer_outputs, api_name="set_window", concurrency_limit=4, concurrency_id="scan-render",
              trigger_mode="always_last", preprocess=False).then(**warming)
        # input: the arrow keys scroll the slider (they send no release); always_last collapses a drag.
        gr.on([frame.release, frame.input], handlers.set_frame, [frame, session], viewer_outputs, api_name="set_frame",
              concurrency_limit=4, concurrency_id="scan-render", trigger_mode="always_last",
              preprocess=False).then(**warming)
        question.input(**warming, trigger_mode="always_last")
        # Asking takes the question out of the box at once (not queued), then answers it from a hidden
        # copy: the box is free for the next question straight away, and nothing the answer sends back
        # clears what is typed there meanwhile. Both steps take every click ("multiple"): a question
        # asked while the previous answer finishes is queued by the handler, never dropped.
        asked = gr.Textbox(visible=False, elem_id="medvqa-asked")
        taking = gr.on([ask_button.click, question.submit], _take_question, [question],
                       [question, asked, restore_button],
                       queue=False, api_visibility="private", show_progress="hidden", trigger_mode="multiple")
        answering = taking.then(handlers.ask, [asked, session], [chatbot, question], api_name="ask",
                                concurrency_limit=concurrency, concurrency_id="answer", show_progress="hidden",
                                trigger_mode="multiple")
        answering.then(**restore_offer)  # a question refused (too long) keeps the cleared conversation: offered again
        stop_button.click(handlers.stop, [session], [chatbot], cancels=[answering], api_name="stop")
        new_button.click(handlers.new_conversation, [session], [chatbot, question, transcript_links],
                         cancels=[answering], api_name="new_conversation").then(**restore_offer).then(**warming)
        chatbot.clear(handlers.new_conversation, [session], [chatbot, question, transcript_links],
                      cancels=[answering], api_visibility="private"
                      ).then(**restore_offer).then(**warming)  # the chat's bin icon too
        restore_button.click(handlers.restore_conversation, [session], [chatbot, restore_button],
                             api_name="restore_conversation").then(**warming)
        demo.unload(_forget_closed_tabs(demo))  # a closed tab's session goes now, not an hour later
        # The endpoint keeps its name (/export): clients and tests call it.
        transcript_button.click(handlers.export, [session], [transcript_links, transcript_markdown, transcript_json],
                                api_name="export")
    demo.queue(default_concurrency_limit=4, max_size=16 * max(concurrency, 1))
    return demo


def _take_question(text: str) -> tuple:
    """The question box emptied, its text passed on to the answer (see build_app); a question asked
    lets a cleared conversation go, so its Restore button goes too."""
    return "", text or "", gr.update(visible=False) if (text or "").strip() else gr.skip()


def _pacs_panel() -> tuple:
    """The PACS panel's components: identifier box, Find, the series found, Load, Cancel, a status line,
    and the tab's list of series found (a gr.State). The box is a password field: what is typed is not
    shown."""
    with gr.Accordion("Open a study from the PACS", open=True):
        identifier = gr.Textbox(label="Study Instance UID or accession number", type="password",
                                elem_id="medvqa-pacs-id")
        find = gr.Button("Find series", size="sm", elem_id="medvqa-pacs-find")
        remote_series = gr.Dropdown([], label="Series in the PACS", visible=False, allow_custom_value=True,
                                    elem_id="medvqa-pacs-series")
        with gr.Row():
            load = gr.Button("Load the series", size="sm", elem_id="medvqa-pacs-load")
            cancel = gr.Button("Cancel", size="sm", elem_id="medvqa-pacs-cancel")
        status = gr.HTML("", elem_id="medvqa-pacs-status")
    return identifier, find, remote_series, load, cancel, status, gr.State(None)


def launch(demo: gr.Blocks, *, host: str = "127.0.0.1", port: int | None = 7860, max_upload_mb: float = 100,
           auth: tuple[str, str] | None = None, block: bool = True, quiet: bool = False,
           upload_max_age_s: float = UPLOAD_MAX_AGE_S, metrics=None):
    """Serve the app: loopback by default, uploads capped, no run history, telemetry, MCP or SSR.

    Every route sits behind `AccessGuard` (the login wall when `auth` is set); uploads go to the
    folder named by GRADIO_TEMP_DIR, or to a private one made here, and a sweeper deletes any file
    older than `upload_max_age_s` in it while the app serves (`demo.medvqa_uploads`). With `metrics`
    (a metrics.ServingMetrics) GET /metrics serves them, behind the same wall."""
    uploads = UploadFolder(_upload_folder(), max_age_s=upload_max_age_s)
    demo.medvqa_uploads = uploads
    uploads.start_sweeper(lambda: bool(getattr(demo, "is_running", False)))
    middleware = [Middleware(AccessGuard, uploads=uploads, login_required=auth is not None)]  # outermost first
    if metrics is not None:
        middleware.append(Middleware(MetricsRoute, metrics=metrics))
    try:
        return demo.launch(
            server_name=host, server_port=port, auth=auth, max_file_size=int(max_upload_mb * 2**20),
            prevent_thread_lock=not block, quiet=quiet, show_error=False, ssr_mode=False, pwa=False,
            mcp_server=False, enable_monitoring=False,
            run_history=False,  # would keep every question and answer in the browser's storage
            footer_links=["api"], css=_CSS, js=_PAGE_JS, app_kwargs={"middleware": middleware},
        )
    except BaseException:
        uploads.stop()  # it never served: no sweeper left behind
        raise


def _upload_folder() -> str:
    """Gradio's upload folder for this process: GRADIO_TEMP_DIR when the operator set it (it must then
    be the app's alone: the sweeper deletes what is older than a minute in it), else a private folder
    (mode 0700) made now and removed at exit, rather than /tmp/gradio shared with other apps."""
    folder = os.environ.get("GRADIO_TEMP_DIR")
    if not folder:
        folder = tempfile.mkdtemp(prefix="medvqa-uploads-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ["GRADIO_TEMP_DIR"] = folder  # read by Gradio when the server starts, and by _take_upload
    os.makedirs(folder, exist_ok=True)
    return folder


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_from_env(env: dict[str, str] | None = None) -> tuple[str, str] | None:
    """(user, password) from MEDVQA_USERNAME / MEDVQA_PASSWORD, or None when neither is set."""
    env = os.environ if env is None else env
    user, password = env.get("MEDVQA_USERNAME", ""), env.get("MEDVQA_PASSWORD", "")
    if bool(user) != bool(password):
        raise ValueError("Set both MEDVQA_USERNAME and MEDVQA_PASSWORD to require a login, or neither.")
    return (user, password) if user else None
