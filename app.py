"""Start the MedVQA web app: `python app.py [--profile NAME] [--host H] [--port P]`.

The first start builds what is missing (the converted decoder, the default retrieval index), with
progress shown; later starts take seconds. The app listens on 127.0.0.1 unless --host says
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
    _limit_malloc_arenas()
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
    parser.add_argument("--insecure-no-login", action="store_true",
                        help="listen on a non-loopback --host without a login (only behind a layer that has its "
                             "own, e.g. a reverse proxy or a Docker port published on 127.0.0.1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per internal request otherwise

    from medvqa.config import load_settings
    from medvqa.pipeline import Pipeline
    from medvqa.retrieval import RetrievalError, ensure_default_index
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
    settings = load_settings(args.profile)
    print(f"Loading the {settings.profile!r} profile (a first start converts the decoder and builds the "
          f"retrieval index; this takes a few minutes once).", file=sys.stderr)
    with_retrieval = None
    if settings.retrieval.enabled:
        try:
            ensure_default_index(settings.retrieval, progress=True)
        except RetrievalError as error:
            print(f"warning: literature retrieval is unavailable, serving without it: {error}", file=sys.stderr)
            with_retrieval = False
    metrics = None
    if args.metrics:
        from medvqa.metrics import ServingMetrics

        metrics = ServingMetrics()
    pipeline = Pipeline.load(settings, with_retrieval=with_retrieval, progress=True, metrics=metrics)
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
    launch(demo, host=args.host, port=args.port, max_upload_mb=args.max_upload_mb, auth=auth, metrics=metrics)
    return 0


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Why: glibc gives each thread that allocates under contention a heap of its own (an arena) and
    seldom hands their free pages back, so the app's worker threads grew its RSS by 134-211 MB in a
    10-minute, 8-client soak (scripts/soak_app.py) against 35 MB with two arenas. The same as
    MALLOC_ARENA_MAX=2, which, when set, wins; it must run before the threads start. Does nothing
    where the C library has no mallopt."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_arena_max = -8  # glibc's M_ARENA_MAX
    mallopt(ctypes.c_int(m_arena_max), ctypes.c_int(arenas))


if __name__ == "__main__":
    sys.exit(main())
