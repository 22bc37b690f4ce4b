"""The page: its gr.Blocks layout, which event runs which handler, and how the app is served (its own
style and script are in page.py).

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
from .handlers import _Handlers, pack_asked
from .metrics_route import MetricsRoute
from .tab_binding import TabBinding, TabKeys
from .page import ZOOM_TOOLBAR, PAGE_CSS, PAGE_JS
from .remote import _PacsHandlers
from .session import _close_session, _forget_closed_tabs, _Session
from .uploads import UPLOAD_MAX_AGE_S, UploadFolder, private_folder_prefix, sweep_abandoned_folders
from .viewer import _EMPTY_VIEWER, _PRESET_LABELS

NOTICE = ("**Research tool — not a diagnosis.** Answers come from a small research model and may be "
          "wrong. Check every statement against the images and the cited literature; do not use it for "
          "clinical decisions.")
LITERATURE_POLL_S = 5  # how often a page asks how far the literature index's first build is
DEFAULT_CONCURRENCY = 8  # answers generated at once (llama.cpp runs their steps in shared batches)


def footer_text(pipeline, settings) -> str:
    """The line under the chat: the profile, whether literature is retrieved, who answers yes/no or open
    questions when it is not the language model (decoder.closed_answerer, decoder.open_answerer), and that
    each question is answered on its own where the prompt carries no earlier turn (decoder.history_turns)."""
    retrieval = pipeline.literature_state()
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
                # Zoom is the page's alone (page.js): the model sees the whole scan whatever is shown.
                gr.HTML(ZOOM_TOOLBAR, padding=False, elem_id="medvqa-zoom-bar")
                # The Value tool: the page writes the point clicked here, the pixel's value comes back below.
                probe_at = gr.Textbox(visible="hidden", elem_id="medvqa-probe-at", show_label=False)
                probe_value = gr.HTML("", padding=False, elem_id="medvqa-probe")
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
                footer = gr.Markdown(footer_text(pipeline, handlers.settings), elem_id="medvqa-footer")
                # While the literature index is built beside the app (its first start), the line says how far
                # it is; each page asks at load and every few seconds until the build has ended.
                building = pipeline.index_build is not None and pipeline.index_build.building
                literature_timer = gr.Timer(LITERATURE_POLL_S, active=building)

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
            # A Load pressed while one runs replaces it: the running one is stopped at once (queue=False), and
            # the new one runs when it has ended (always_last: Gradio would otherwise drop the second press).
            load.click(remote.load_starts, None, [status], queue=False, api_visibility="private",
                       show_progress="hidden", trigger_mode="multiple"
                       ).then(remote.load, [remote_series, found, session], viewer_outputs, api_name="pacs_load",
                              concurrency_limit=8, concurrency_id="pacs", show_progress_on=[viewer, status],
                              trigger_mode="always_last"
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
        taking = gr.on([ask_button.click, question.submit], _take_question, [question, session],
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
        if pipeline.index_build is not None:
            def literature(pipeline=pipeline, settings=handlers.settings) -> tuple:
                return (footer_text(pipeline, settings),
                        gr.Timer(active=pipeline.index_build is not None and pipeline.index_build.building))

            literature_timer.tick(literature, None, [footer, literature_timer], queue=False,
                                  api_visibility="private", show_progress="hidden")
            demo.load(literature, None, [footer, literature_timer], queue=False, api_visibility="private",
                      show_progress="hidden")
        # (.change: the page sets the box and sends an input event, which Gradio's .input does not take as typing)
        probe_at.change(handlers.probe, [probe_at, session], [probe_value], api_name="probe",
                        show_progress="hidden", concurrency_limit=4, concurrency_id="probe")
        demo.unload(_forget_closed_tabs(demo))  # a closed tab's session goes now, not an hour later
        # The endpoint keeps its name (/export): clients and tests call it.
        transcript_button.click(handlers.export, [session], [transcript_links, transcript_markdown, transcript_json],
                                api_name="export")
    demo.queue(default_concurrency_limit=4, max_size=16 * max(concurrency, 1))
    return demo


def _take_question(text: str, session: _Session | None) -> tuple:
    """The question box emptied, its text passed on to the answer (see build_app) with the session and
    generation it was asked in (handlers.pack_asked); a question asked lets a cleared conversation go,
    so its Restore button goes too."""
    return "", pack_asked(text or "", session), gr.update(visible=False) if (text or "").strip() else gr.skip()


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

    Every route sits behind `AccessGuard` (the login wall when `auth` is set) and `TabBinding` (a tab's
    session is reached only from the browser that opened it); uploads go to the
    folder named by GRADIO_TEMP_DIR, or to a private one made here, and a sweeper deletes any file
    older than `upload_max_age_s` in it while the app serves (`demo.medvqa_uploads`). With `metrics`
    (a metrics.ServingMetrics) GET /metrics serves them, behind the same wall."""
    uploads = UploadFolder(_upload_folder(), max_age_s=upload_max_age_s)
    demo.medvqa_uploads = uploads
    uploads.start_sweeper(lambda: bool(getattr(demo, "is_running", False)))
    demo.medvqa_tabs = TabKeys()  # each tab's session keyed by its browser's cookie too (tab_binding.py)
    middleware = [Middleware(AccessGuard, uploads=uploads, login_required=auth is not None),  # outermost first
                  Middleware(TabBinding, keys=demo.medvqa_tabs)]
    if metrics is not None:
        middleware.append(Middleware(MetricsRoute, metrics=metrics))
    try:
        return demo.launch(
            server_name=host, server_port=port, auth=auth, max_file_size=int(max_upload_mb * 2**20),
            prevent_thread_lock=not block, quiet=quiet, show_error=False, ssr_mode=False, pwa=False,
            mcp_server=False, enable_monitoring=False,
            run_history=False,  # would keep every question and answer in the browser's storage
            footer_links=["api"], css=PAGE_CSS, js=PAGE_JS, app_kwargs={"middleware": middleware},
        )
    except BaseException:
        uploads.stop()  # it never served: no sweeper left behind
        raise


def _upload_folder() -> str:
    """Gradio's upload folder for this process: GRADIO_TEMP_DIR when the operator set it (it must then
    be the app's alone: the sweeper deletes what is older than a minute in it), else a private folder
    (mode 0700) made now and removed at exit, rather than /tmp/gradio shared with other apps. The private
    folder is named after this process, and a later start removes it if this one ended without doing so
    (`uploads.sweep_abandoned_folders`)."""
    folder = os.environ.get("GRADIO_TEMP_DIR")
    if not folder:
        sweep_abandoned_folders()  # earlier apps' folders, with any upload they were killed holding
        folder = tempfile.mkdtemp(prefix=private_folder_prefix())
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
