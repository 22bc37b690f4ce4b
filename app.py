"""Start the MedVQA web app: `python app.py [--profile NAME] [--host H] [--port P]`.

The first start converts the decoder (progress shown; later starts take seconds) and then serves
at once: a missing literature index is built beside the running app, which answers without sources
until it is ready (--wait-for-index builds it first instead). The app listens on 127.0.0.1 unless --host says
otherwise, and asks for a login when MEDVQA_USERNAME and MEDVQA_PASSWORD are set. It refuses to
listen on any other address without a login (exit status 2) unless --insecure-no-login says that
something else guards it.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys

from medvqa.config import PROFILES


def main(argv: list[str] | None = None) -> int:
    _tune_malloc()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default=None,
                        help="model profile (default: $MEDVQA_PROFILE, else offline)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--max-upload-mb", type=float, default=100, help="largest upload accepted (default 100)")
    parser.add_argument("--concurrency", type=int, default=8, help="answers generated at once (default 8)")
    parser.add_argument("--pacs-url", default=None,
                        help="a DICOMweb endpoint (QIDO-RS, WADO-RS) to open studies from, e.g. "
                             "http://pacs:8042/dicom-web; credentials from MEDVQA_PACS_USERNAME and "
                             "MEDVQA_PACS_PASSWORD, or MEDVQA_PACS_TOKEN")
    parser.add_argument("--metrics", action="store_true",
                        help="serve live Prometheus metrics at /metrics (behind the login when one is set)")
    parser.add_argument("--wait-for-index", action="store_true",
                        help="build a missing literature index before serving, so that the first answers have "
                             "sources too (default: serve at once and build it meanwhile)")
    parser.add_argument("--insecure-no-login", action="store_true",
                        help="listen on a non-loopback --host without a login (only behind a layer that has its "
                             "own, e.g. a reverse proxy or a Docker port published on 127.0.0.1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per internal request otherwise

    from medvqa.config import load_settings
    from medvqa.language_model import ModelMissingError
    from medvqa.pipeline import Pipeline
    from medvqa.projector import ProjectorShapeError
    from medvqa.retrieval import RetrievalError, ensure_default_index
    from medvqa.retrieval.background import room_to_build_beside
    from medvqa.retrieval.index import check_buildable, default_index_ready
    from medvqa.ui import auth_from_env, build_app, is_loopback, launch

    try:
        auth = auth_from_env()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if auth is None and not is_loopback(args.host) and not args.insecure_no_login:
        print(f"error: refusing to listen on {args.host} without a login: anyone who can reach that address "
              f"would see the scans and the conversations. Set MEDVQA_USERNAME and MEDVQA_PASSWORD, listen on "
              f"127.0.0.1, or pass --insecure-no-login if something else (a reverse proxy with its own login, "
              f"a port published on 127.0.0.1 only) guards it.", file=sys.stderr)
        return 2
    try:
        settings = load_settings(args.profile)
    except (OSError, ValueError) as error:  # an unknown profile in MEDVQA_PROFILE, a bad setting or config file
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Loading the {settings.profile!r} profile (a first start converts the decoder; this takes a few "
          f"minutes once).", file=sys.stderr)
    with_retrieval = None
    beside = not args.wait_for_index  # a missing index built beside the serving app (else before it serves)
    if settings.retrieval.enabled:
        try:
            if not beside:
                ensure_default_index(settings.retrieval, progress=True)
            elif not default_index_ready(settings.retrieval):
                check_buildable(settings.retrieval)
                if room_to_build_beside():
                    print("The literature index is built while the app serves (several minutes on 2 cores); "
                          "answers have no sources until it is ready.", file=sys.stderr)
                else:
                    print("This machine has too little free memory to build the literature index beside the app; "
                          "it is built first (several minutes on 2 cores).", file=sys.stderr)
                    beside = False
                    ensure_default_index(settings.retrieval, progress=True)
        except RetrievalError as error:
            print(f"warning: literature retrieval is unavailable, serving without it: {error}", file=sys.stderr)
            with_retrieval = False
    metrics = None
    if args.metrics:
        from medvqa.metrics import ServingMetrics

        metrics = ServingMetrics()
    try:
        pipeline = Pipeline.load(settings, with_retrieval=with_retrieval, progress=True, metrics=metrics,
                                 index_in_background=beside)
    except (ModelMissingError, ProjectorShapeError) as error:  # the message says how to get or rebuild the
        # weights; a traceback adds nothing
        print(f"error: {error}", file=sys.stderr)
        return 2
    if pipeline.retrieval_unavailable:
        print(f"warning: literature retrieval is unavailable, serving without it: {pipeline.retrieval_unavailable}",
              file=sys.stderr)
    if auth is None and not is_loopback(args.host):
        print(f"warning: listening on {args.host} without a login (--insecure-no-login).", file=sys.stderr)
    pacs = None
    if args.pacs_url:
        from medvqa.pacs import Pacs, PacsLimits

        try:
            pacs = Pacs(args.pacs_url, limits=PacsLimits(find_s=settings.serving.pacs_find_s,
                                                         open_s=settings.serving.pacs_open_s))
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    demo = build_app(pipeline, settings, max_upload_mb=args.max_upload_mb, concurrency=args.concurrency, pacs=pacs)
    _stop_on_sigterm()
    launch(demo, host=args.host, port=args.port, max_upload_mb=args.max_upload_mb, auth=auth, metrics=metrics)
    return 0


def _stop_on_sigterm() -> None:
    """Let SIGTERM (`kill`, `docker stop`, `systemctl stop`) end the app as Ctrl+C does: the server
    closes and the exit handlers run, removing the private upload folder with any upload waiting in it.
    Python's default would end the process at once and leave the folder behind."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _tune_malloc(arenas: int = 2, mmap_threshold_mb: int = 4) -> None:
    """Why: glibc keeps freed memory for reuse rather than hand it back, and the app's pattern (many
    threads, now and then a scan of hundreds of MB decoded and dropped) makes it keep a lot.

    - Each thread that allocates under contention gets a heap of its own (an arena), and their free
      pages are seldom handed back: the worker threads grew RSS by 134-211 MB in a 10-minute, 8-client
      soak (scripts/soak_app.py) against 35 MB with two arenas (as MALLOC_ARENA_MAX=2).
    - Buffers over the mmap threshold get pages of their own, returned when freed; below it they come
      from the heaps. glibc raises the threshold (up to 32 MB) each time such a buffer is freed, so the
      buffers of a huge image's decoding then land in the heaps and stay there: with 5,900 x 5,900
      PNGs among normal sessions (scripts/soak_app.py --minutes 4 --clients 4) the app ended 495 MB
      above its RSS after the warm-up, every session closed. A fixed 4 MB threshold (as
      MALLOC_MMAP_THRESHOLD_=4194304) gives that back; a normal scan's buffers are smaller.

    An explicit MALLOC_ARENA_MAX or MALLOC_MMAP_THRESHOLD_ wins; this must run before the threads
    start. Does nothing where the C library has no mallopt."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_arena_max, m_mmap_threshold = -8, -3  # glibc's M_ARENA_MAX, M_MMAP_THRESHOLD
    if not os.environ.get("MALLOC_ARENA_MAX"):
        mallopt(ctypes.c_int(m_arena_max), ctypes.c_int(arenas))
    if not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(mmap_threshold_mb * 2**20))


if __name__ == "__main__":
    sys.exit(main())
