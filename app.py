"""Start the MedVQA web app: `python app.py [--profile NAME] [--host H] [--port P]`.

The first start builds what is missing (the converted decoder, the default retrieval index), with
progress shown; later starts take seconds. The app listens on 127.0.0.1 unless --host says
otherwise, and asks for a login when MEDVQA_USERNAME and MEDVQA_PASSWORD are set.
"""

from __future__ import annotations

import argparse
import logging
import sys

from medvqa.config import PROFILES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default=None,
                        help="model profile (default: $MEDVQA_PROFILE, else offline)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--max-upload-mb", type=float, default=100, help="largest upload accepted (default 100)")
    parser.add_argument("--concurrency", type=int, default=8, help="answers generated at once (default 8)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per internal request otherwise

    from medvqa.config import load_settings
    from medvqa.pipeline import Pipeline
    from medvqa.retrieval import RetrievalError, ensure_default_index
    from medvqa.ui import auth_from_env, build_app, launch

    try:
        auth = auth_from_env()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
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
    pipeline = Pipeline.load(settings, with_retrieval=with_retrieval, progress=True)
    if auth is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host} without a login; set MEDVQA_USERNAME and MEDVQA_PASSWORD.",
              file=sys.stderr)
    demo = build_app(pipeline, settings, max_upload_mb=args.max_upload_mb, concurrency=args.concurrency)
    launch(demo, host=args.host, port=args.port, max_upload_mb=args.max_upload_mb, auth=auth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
