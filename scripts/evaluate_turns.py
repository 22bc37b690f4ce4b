"""Do earlier turns of a conversation change the answers? Each image's questions asked one after another in
one conversation, as the app asks them (the earlier questions and the model's own answers in the prompt),
against each question asked on its own (as scripts/evaluate.py asks them).

    python scripts/evaluate_turns.py --dataset jsonl --data runs/holdout --split heldout-slake

Prints closed accuracy (of the option the model leans to: abstention off, as in evaluate.py) and open
recall, alone and in conversation, by the question's place in its conversation, how many answers changed,
and how many open questions (neither yes/no nor naming options) were answered "Yes" or "No". With
`--history-turns N`, the conversation keeps only its last N turns in the prompt (decoder.history_turns).
Literature retrieval is off: the offline profile keeps passages out of the prompt (retrieval.prompt_gate).
Per-question rows are kept in --run-dir (resumable).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from medvqa.answers import closed_candidates, first_yes_no
from medvqa.config import PROFILES, load_settings
from medvqa.datasets import load_examples, read_image
from medvqa.pipeline import Conversation, Done, Pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate import score  # noqa: E402 - scripts/evaluate.py's scoring

PLACES = (("1st", 1, 1), ("2nd-3rd", 2, 3), ("4th-6th", 4, 6), ("7th or later", 7, 10**9))


def ask(pipeline: Pipeline, conversation: Conversation, question: str) -> Done:
    done = None
    for event in pipeline.ask(conversation, question, use_retrieval=False, warm=False):
        if isinstance(event, Done):
            done = event
    return done


def summarise(rows: list[dict]) -> dict:
    def measure(subset: list[dict]) -> dict:
        closed = [r for r in subset if r["answer_type"] == "CLOSED"]
        open_ = [r for r in subset if r["answer_type"] != "CLOSED"]
        entry = {"n_closed": len(closed), "n_open": len(open_)}
        for field in ("alone", "in_conversation"):
            scored = score(subset, field)  # evaluate.py's: closed accuracy and open recall
            if closed:
                entry[f"closed_{field}"] = round(scored["closed_accuracy"], 4)
            if open_:
                entry[f"open_recall_{field}"] = round(scored["open_recall"], 4)
        entry["changed"] = sum(r["alone"].strip().lower() != r["in_conversation"].strip().lower() for r in subset)
        return entry

    summary = {"all": measure(rows)}
    for name, low, high in PLACES:
        subset = [r for r in rows if low <= r["place"] <= high]
        if subset:
            summary[name] = measure(subset)
    # Open questions (no options named, not yes/no) answered with a bare Yes or No.
    wordy = [r for r in rows if r["answer_type"] != "CLOSED" and closed_candidates(r["question"]) is None]
    summary["open_answered_yes_no"] = {field: sum(first_yes_no(r[field]) is not None
                                                  and len(r[field].split()) <= 2 for r in wordy)
                                       for field in ("alone", "in_conversation")}
    summary["open_questions"] = len(wordy)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("vqa-rad", "slake", "jsonl"), required=True)
    parser.add_argument("--data", default=None)
    parser.add_argument("--split", required=True)
    parser.add_argument("--profile", choices=PROFILES, default="offline")
    parser.add_argument("--history-turns", type=int, default=None,
                        help="earlier turns kept in the prompt (decoder.history_turns; default: the profile's)")
    parser.add_argument("--max-questions", type=int, default=10,
                        help="at most this many questions per image (a conversation's length)")
    parser.add_argument("--run-dir", default="runs")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)

    settings = load_settings(args.profile)
    settings.decoder.abstain = False  # the leaning, as evaluate.py measures it
    if args.history_turns is not None:
        settings.decoder.history_turns = args.history_turns
    torch.manual_seed(settings.seed)
    examples = load_examples(args.dataset, args.data, args.split)
    by_image = defaultdict(list)
    for example in examples:
        if len(by_image[example.image]) < args.max_questions:
            by_image[example.image].append(example)
    pipeline = Pipeline.load(settings, with_retrieval=False)
    history = settings.decoder.history_turns
    # Kept rows are of this projector only (the decoder, encoder and calibrations are the profile's).
    weights = Path(settings.projector.weights or "")
    projector_digest = hashlib.sha256(weights.read_bytes() if weights.is_file()
                                      else str(settings.projector.weights).encode()).hexdigest()
    path = Path(args.run_dir) / (f"turns-{args.profile}-{args.dataset}-{args.split}-h{history}-"
                                 f"q{args.max_questions}-{projector_digest[:10]}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {}
    if path.is_file():
        kept = {row["qid"]: row for row in map(json.loads, path.read_text().splitlines())}
    rows = []
    with path.open("a") as out:
        for image_path, questions in tqdm(sorted(by_image.items()), desc="conversations", unit="image"):
            if all(e.qid in kept for e in questions):
                rows += [kept[e.qid] for e in questions]
                continue
            image = read_image(image_path)
            conversation = Conversation(image=image)
            for place, example in enumerate(questions, start=1):
                in_conversation = ask(pipeline, conversation, example.question).answer
                alone = Conversation(image=image)
                row = {"qid": example.qid, "question": example.question, "reference": example.answer,
                       "answer_type": example.answer_type, "place": place,
                       "alone": ask(pipeline, alone, example.question).answer, "in_conversation": in_conversation}
                pipeline.end_conversation(alone, keep_image=True)
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
            pipeline.end_conversation(conversation, keep_image=True)
    summary = {"dataset": args.dataset, "split": args.split, "history_turns": history,
               "projector_sha256": projector_digest,
               "max_questions": args.max_questions, **summarise(rows)}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
