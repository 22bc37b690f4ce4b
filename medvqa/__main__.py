"""Command line (`medvqa`, or `python -m medvqa`):

    medvqa ask IMAGE "QUESTION"          answer a question about an image (or --series N --slice K of a study)
    medvqa scan FILE                     the safe metadata, window and frames of a file
    medvqa scan PATH --json              the series in a file, folder or .zip: slices in display order
    medvqa scan --pacs-url URL --json    the series of a study in a PACS (its identifier read from stdin)
    medvqa prompt "QUESTION"             the exact prompt text the profile's decoder would get
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import PROFILES


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineErrors(prog="python -m medvqa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)

    ask = commands.add_parser("ask", help="answer a question about an image (DICOM, PNG, JPEG or TIFF), or about one "
                                          "slice of a series in a folder or .zip of DICOM files")
    ask.add_argument("image", help="a file, a folder or a .zip")
    ask.add_argument("question")
    ask.add_argument("--profile", choices=PROFILES, default=None)
    ask.add_argument("--no-retrieval", action="store_true", help="answer from the image alone")
    ask.add_argument("--window", default=None, help="auto, file, a CT preset name (for a CT), or CENTER,WIDTH")
    ask.add_argument("--series", type=int, default=1,
                     help="series N of a folder or .zip, numbered as `scan` lists them (largest first); default 1")
    ask.add_argument("--slice", type=int, default=None,
                     help="slice K (1 to N, in display order) of the series; default: the middle one")

    scan = commands.add_parser("scan", help="show the safe metadata, window and frames of a file, or the "
                                            "series of a folder or .zip")
    scan.add_argument("file", nargs="?", help="a file, a folder or a .zip")
    scan.add_argument("--pacs-url", default=None,
                      help="instead of a file: a DICOMweb endpoint; the Study Instance UID or accession number is "
                           "read from standard input (so that it stays out of the shell history and process list)")
    scan.add_argument("--json", action="store_true",
                      help='print {"series": [{"modality", "slices", "positions_mm", "warnings", "burned_in_slices"}, '
                           '...], "notes"}')

    prompt = commands.add_parser("prompt", help="print the prompt text the decoder would get (the image as "
                                                "<image>; no model is loaded for formats that need no tokenizer)")
    prompt.add_argument("question")
    prompt.add_argument("--profile", choices=PROFILES, default=None)
    prompt.add_argument("--history", default=None,
                        help='earlier turns: a JSON file [{"question": ..., "answer": ...}, ...]')
    prompt.add_argument("--passages", type=_count, default=0,
                        help="put N stand-in passages where retrieved literature goes")

    args = parser.parse_args(argv)
    if getattr(args, "window", None) is not None and not args.window.strip():
        parser.error("--window needs a value: auto, file, a CT preset name, or CENTER,WIDTH")
    if args.command in ("ask", "prompt") and not args.question.strip():  # before any file or model is read
        print("error: Please type a question about the image.", file=sys.stderr)
        return 2
    if args.command == "prompt":
        return _print_prompt(args)
    if args.command == "scan" and args.pacs_url:
        if args.file:  # one of them would be ignored without a word
            print("error: scan reads a file, a folder or a .zip, or a study from --pacs-url, not both.",
                  file=sys.stderr)
            return 2
        return _scan_pacs(args.pacs_url, as_json=args.json)
    if args.command == "scan" and not args.file:
        parser.error("scan needs a file, a folder or a .zip, or --pacs-url")
    path = args.file if args.command == "scan" else args.image
    if not os.path.exists(path):  # said here, where the path is the user's own: the imaging package names no file
        print(f"error: No such file or folder: {path}", file=sys.stderr)
        return 2
    if args.command == "scan":
        from .imaging import cli_scan, cli_scan_study

        if args.json or not _is_single_file(args.file):
            return cli_scan_study(args.file, as_json=args.json)
        return cli_scan(args.file)
    return _ask(args)


def _scan_pacs(url: str, as_json: bool) -> int:
    """`medvqa scan --pacs-url URL`: every series of the study named on standard input, fetched and
    opened as an upload would be; printed as `scan PATH` prints them."""
    import json

    from .pacs import Pacs, PacsError

    try:
        pacs = Pacs(url)
        studies = [pacs.fetch(remote) for remote in pacs.find_series(sys.stdin.readline())]
    except (PacsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summaries = [dict(series.summary(), series=series.number) for study in studies for series in study.series]
    if as_json:
        print(json.dumps({"series": summaries, "notes": [note for study in studies for note in study.notes]}))
    else:
        for summary in summaries:
            print(f"Series {summary['series']}: {summary['modality']}, {summary['slices']} slices"
                  + "".join(f"\n  warning: {warning}" for warning in summary["warnings"]))
    return 0


class _OneLineErrors(argparse.ArgumentParser):
    """A wrong argument is said in one line (argparse prints its whole usage block first), with where
    the usage is; exit status 2, as argparse's."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def _count(text: str) -> int:
    """A number of things: 0 or more (argparse says so when it is not)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not 0 or more")
    return value


def _is_single_file(path: str) -> bool:
    """A regular file that is not a .zip (those open as a study)."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return not f.read(4).startswith((b"PK\x03\x04", b"PK\x05\x06"))


def _settings(profile: str | None):
    """The profile's settings, or None once a bad setting (an unknown profile, in --profile or
    MEDVQA_PROFILE; an unreadable MEDVQA_CONFIG) is said in one line."""
    from .config import load_settings

    try:
        return load_settings(profile)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return None


def _print_prompt(args) -> int:
    from .prompt import FORMATS, PromptBuilder

    settings = _settings(args.profile)
    if settings is None:
        return 2
    style = FORMATS[settings.decoder.conversation_format]
    tokenizer = None
    if style.uses_chat_template:  # the text comes from the decoder's own template
        from transformers import AutoTokenizer

        from .language_model import ModelMissingError, hub_offline_env, resolve_decoder_folder

        hub_offline_env(settings.offline)
        try:
            folder = resolve_decoder_folder(settings.decoder, settings.cache_dir)
        except ModelMissingError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        tokenizer = AutoTokenizer.from_pretrained(folder)
    try:
        history = _read_history(args.history) if args.history else []
    except (OSError, ValueError) as error:
        print(f'error: --history needs a JSON list of {{"question": "...", "answer": "..."}} objects ({error})',
              file=sys.stderr)
        return 2
    passages = [_StandIn(f"(passage {n}: retrieved literature text)") for n in range(1, args.passages + 1)]
    if passages and settings.retrieval.prompt_gate == "never":
        print(f"note: the {settings.profile!r} profile shows passages beside the answer, never in the prompt "
              f"(retrieval.prompt_gate = never); printed with them as asked.", file=sys.stderr)
    builder = PromptBuilder(tokenizer, 0, format=style)
    print(builder.render(builder.messages(args.question, history, passages)))
    return 0


def _read_history(path: str) -> list:
    """The turns in a --history file. Raises ValueError naming the first turn that is not a pair of
    texts: anything else would reach the prompt builder and fail there with a traceback."""
    import json
    from pathlib import Path

    from .prompt import Turn

    turns = json.loads(Path(path).read_text())
    if not isinstance(turns, list):
        raise ValueError("the file holds no JSON list")
    for number, turn in enumerate(turns, start=1):
        if not (isinstance(turn, dict) and isinstance(turn.get("question"), str)
                and isinstance(turn.get("answer"), str)):
            raise ValueError(f"turn {number} is not an object whose question and answer are texts")
    return [Turn(turn["question"], turn["answer"]) for turn in turns]


class _StandIn:
    """A passage as the prompt sees it (its text)."""

    def __init__(self, text: str):
        self.text = text


def _ask(args) -> int:
    from .imaging import BURNED_IN_NOTE, ScanError, burned_in, check_preset, open_study, parse_window
    from .language_model import ModelMissingError
    from .pipeline import Pipeline
    from .projector import ProjectorShapeError

    try:
        study = open_study(args.image)
        series = next((series for series in study.series if series.number == args.series), None)
        if series is None:
            count = len(study.series)
            raise ScanError(f"Series {args.series} was requested, but this upload has {count} "
                            f"series (1 to {count}).")
        window = parse_window(args.window) if args.window else None
        check_preset(series, window)
        scan = series.render(window=window,
                             frame=None if args.slice is None else args.slice - 1)
    except ScanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = _settings(args.profile)
    if settings is None:
        return 2
    if settings.profile.startswith("tiny"):
        print(f"(the {settings.profile} profile's models are random weights for tests: its answers mean nothing)",
              file=sys.stderr)
    try:
        pipeline = Pipeline.load(settings, with_retrieval=False if args.no_retrieval else None)
    except (ModelMissingError, ProjectorShapeError) as error:  # the message says how to get or rebuild the
        # weights; a traceback adds nothing
        print(f"error: {error}", file=sys.stderr)
        return 2
    if pipeline.retrieval_unavailable:
        print(f"warning: literature retrieval is unavailable, answering without it: {pipeline.retrieval_unavailable}",
              file=sys.stderr)
    if burned_in(scan.safe_meta):
        print(f"warning: {BURNED_IN_NOTE}", file=sys.stderr)
    from .retrieval import RetrievalError

    use_retrieval = True
    while True:
        try:
            return _print_answer(pipeline, pipeline.new_conversation(scan), args.question, scan.safe_meta,
                                 use_retrieval)
        except RetrievalError as error:  # the index failed under the search: the answer again, without it
            if not use_retrieval:
                raise
            print(f"\nwarning: the literature search failed, answering again without it: {error}", file=sys.stderr)
            use_retrieval = False


def _print_answer(pipeline, conversation, question: str, safe_meta: dict, use_retrieval: bool) -> int:
    """`medvqa ask`'s output for one answer: its text as it streams, then its notes and sources."""
    from .answer_head import open_note
    from .confidence import confidence_text
    from .engines.openai import RemoteError
    from .injection import check_answer
    from .open_choices import choice_note
    from .pipeline import Done, Sources, Token
    from .presuppose import reading_text
    from .safe_text import inert, safe_url, visible

    mid_line = False  # the answer's last line is not ended yet
    try:
        for event in pipeline.ask(conversation, question, safe_meta=safe_meta, use_retrieval=use_retrieval):
            if isinstance(event, Token):
                print(visible(event.text), end="", flush=True)  # a bidirectional override never reaches the terminal
                mid_line = True
            elif isinstance(event, Done):
                if mid_line:
                    print()
                finding = check_answer(event.answer, event.passages, question=question)
                if finding is not None:
                    print(f"WARNING: {finding.warning}")
                if event.confidence_note:
                    print(f"({event.confidence_note})")
                elif event.closed and "kind" in event.closed and not event.closed["abstained"]:
                    # A scored closed answer given, with its confidence as the page shows it ("Uncertain"
                    # answers already say theirs).
                    print(f"(Confidence: {confidence_text(event.closed)})")
                if reading := reading_text(event.closed) or open_note(event.head_open) or choice_note(event.open_choice):
                    print(f"({visible(reading)})")  # it may quote a training question (dataset text)
                if event.passages:
                    print("Sources:" if event.in_prompt else "Related literature (not read by this model):")
                for number, passage in enumerate(event.passages, start=1):
                    # Passage fields come from the corpus: escaped as on the page and in the exports.
                    print(f"[{number}] {safe_url(passage.url) or '(no link)'}  {inert(passage.text[:100])}")
                if event.window:
                    print(f"(image window: {event.window})")
            elif isinstance(event, Sources) and event.note:
                if mid_line:  # the note (on stderr) starts a line of its own, after the answer
                    print(flush=True)
                    mid_line = False
                print(f"({event.note})", file=sys.stderr)
    except (ValueError, RemoteError) as error:  # a bad question; a model server that failed (openai engine)
        if mid_line:
            print()
        print(f"error: {error}", file=sys.stderr)
        if getattr(error, "detail", ""):  # what the server itself said, as the app's log has it
            print(f"(the model server said: {str(error.detail)[:4096]!r})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
