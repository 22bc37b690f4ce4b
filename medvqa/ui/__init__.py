"""The clinician web app (Gradio only; every answer comes from `Pipeline.ask`).

    demo = build_app(pipeline, settings, max_upload_mb=100)
    launch(demo, host="127.0.0.1", port=7860, max_upload_mb=100, auth=auth_from_env())

One browser tab is one session: its scan, window, conversation and transcript live in a `gr.State`
(`_Session`) and nowhere else. Uploads are read into memory and deleted from Gradio's upload folder
before they are decoded (and any the handler never sees are swept within a minute); the scan is shown as an inline PNG and the transcript downloads are inline
links, so nothing of a session is written to disk by the app.

Model text is escaped before it is shown (it can neither inject markup nor create links); the only
links in an answer are built from `Passage.url` of the passages the answer was given.

API endpoints (gradio_client): /upload (a file or a .zip), /upload_files (several files), /set_series,
/set_preset, /set_window, /set_frame (a frame, or a slice of a series), /ask, /stop, /new_conversation,
/export; with a PACS (`build_app(..., pacs=Pacs(url))`), /pacs_find and /pacs_load.

The modules, one job each:
    layout      the gr.Blocks page, its event wiring, `build_app`, `launch`, `auth_from_env`, `is_loopback`
    access      the ASGI middleware in front of every route: login wall, no upload served back
    handlers    what each event does to a session (upload, window/preset/frame, warm, ask, stop, ...)
    session     one tab's state (`_Session`), the answer being streamed (`_Answer`)
    render      the chat's HTML: answers, citations, sources, status and error lines
    viewer      the scan viewer: its inline PNG, the window controls' choices and ranges, the series picker
    remote      the PACS panel: find a study's series over DICOMweb, load one with progress
    transcript  the conversation download: record, Markdown, JSON, download links
    uploads     reading an upload once and deleting it; the upload folder's sweeper
"""

from __future__ import annotations

import os

# Before gradio is imported (by the modules below): its import-time version check and telemetry
# read this. Importing any medvqa.ui module runs this file first.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from .handlers import _Handlers  # noqa: E402
from .layout import DEFAULT_CONCURRENCY, NOTICE, auth_from_env, build_app, is_loopback, launch  # noqa: E402
from .render import _render_answer  # noqa: E402
from .session import _Answer, _Session  # noqa: E402
from .transcript import export_markdown  # noqa: E402
from .viewer import DISPLAY_MAX_SIDE  # noqa: E402

__all__ = ["build_app", "launch", "auth_from_env", "is_loopback", "export_markdown", "NOTICE",
           "DEFAULT_CONCURRENCY", "DISPLAY_MAX_SIDE"]
# The private names above (_Handlers, _Answer, _Session, _render_answer) stay importable from
# medvqa.ui as they were before the module became a package; they are not part of the API.
