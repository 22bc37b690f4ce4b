"""Command line: `python -m medvqa ask IMAGE "QUESTION"` and `python -m medvqa scan FILE`."""

from __future__ import annotations

import argparse
import sys

from .config import PROFILES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medvqa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    ask = commands.add_parser("ask", help="answer a question about an image (PNG, JPEG or DICOM)")
    ask.add_argument("image")
    ask.add_argument("question")
    ask.add_argument("--profile", choices=PROFILES, default=None)
    ask.add_argument("--no-retrieval", action="store_true", help="answer from the image alone")
    ask.add_argument("--window", default=None, help="window preset name, or CENTER,WIDTH (DICOM)")

    scan = commands.add_parser("scan", help="show the safe metadata, window and frames of a file")
    scan.add_argument("file")

    args = parser.parse_args(argv)
    if args.command == "scan":
        from .imaging import cli_scan

        return cli_scan(args.file)
    return _ask(args)


def _ask(args) -> int:
    from .config import load_settings
    from .imaging import ScanError, load_scan, parse_window
    from .pipeline import Done, Pipeline, Sources, Token

    try:
        scan = load_scan(args.image, window=parse_window(args.window) if args.window else None)
    except ScanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = load_settings(args.profile)
    pipeline = Pipeline.load(settings, with_retrieval=False if args.no_retrieval else None)
    conversation = pipeline.new_conversation(scan)
    try:
        for event in pipeline.ask(conversation, args.question, safe_meta=scan.safe_meta):
            if isinstance(event, Token):
                print(event.text, end="", flush=True)
            elif isinstance(event, Done):
                print()
                if event.passages:
                    print("Sources:" if event.in_prompt else "Related literature (not read by this model):")
                for number, passage in enumerate(event.passages, start=1):
                    print(f"[{number}] {passage.url}  {passage.text[:100]}")
                if event.window:
                    print(f"(image window: {event.window})")
            elif isinstance(event, Sources) and event.note:
                print(f"({event.note})", file=sys.stderr)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
