"""How checkable the app's answers are: citation support, support marks, closed answers against
coverage and image reliance, on VQA-RAD, SLAKE or any JSONL split laid out like them.

    python scripts/evaluate_grounding.py --dataset vqa-rad --split test [--limit N] [--json FILE]
    python scripts/evaluate_grounding.py --labelled [FILE]

With --labelled the support check alone (trust.claim and trust.mark_support, no model) is measured
against scripts/data/grounding_labels.jsonl: (question, answer, passage) triples a person labelled
supports / contradicts / related by reading (scripts/data/grounding_labels.md says how). The last
line is one JSON object: per split ("dev", "held_out", "all"), support precision and recall,
contradiction precision and recall, and the rows whose mark differs from the label.

Per question the app answers as it does for a clinician (retrieval on, the profile's prompt gate,
constrained closed answers with their image-reliance scores), and the script also retrieves for the
question alone and for the question with the *reference* answer. The last line is one JSON object:

- support_at_3: {"question_only", "app_query_reference"}: of the open questions whose reference is a
  term (not yes/no, not a number), the share with a top-3 passage containing the reference answer,
  retrieved for the question alone / with the app's citation query built from the reference answer
  (trust.claim_query): what the corpus can support;
- claim_support: the share of the model's own term answers (same questions) with a cited passage
  marked "supports", of those it gives: an open answer chosen among training answers and withheld as
  "Uncertain" (term_answers_withheld) asserts nothing;
- marks: how many cited passages were marked supports / contradicts / related. How right a
  "supports" mark is cannot be read off the marks themselves (that would re-apply the check it
  measures): --labelled measures it against labels a person wrote;
- risk_coverage: {"1.0", "0.75", "0.5"}: closed accuracy (of the option chosen, or leaned to when the
  app abstained) over the answers with the highest calibrated confidence (medvqa/confidence.py; the
  option margin without a calibration) at those coverages; abstention_rate: the share of closed
  answers given as "Uncertain" at min_confidence (the profile's decoder.min_confidence, or the
  threshold its calibration file chose), accuracy_answered: accuracy over the rest;
- image_reliance: {"flagged", "accuracy_flagged", "accuracy_unflagged"} over closed answers.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from medvqa.answers import closed_correct, normalise
from medvqa.config import PROFILES, load_settings

REPO = Path(__file__).resolve().parents[1]
LABELS = REPO / "scripts" / "data" / "grounding_labels.jsonl"


def is_term(reference: str) -> bool:
    text = normalise(reference)
    return bool(text) and text not in ("yes", "no") and not re.fullmatch(r"[\d .]+", text)


def contains(passages, phrase: str) -> bool:
    wanted = f" {normalise(phrase)} "
    return any(wanted in f" {normalise(passage.text)} " for passage in passages)


def accuracy_at(rows: list[tuple[float, bool]], coverage: float) -> float | None:
    ranked = sorted(rows, key=lambda row: -row[0])
    kept = ranked[:max(1, round(coverage * len(ranked)))] if ranked else []
    return round(sum(correct for _, correct in kept) / len(kept), 4) if kept else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labelled", nargs="?", const=str(LABELS), default=None, metavar="FILE",
                        help="measure the support check against hand-labelled triples (default: %(const)s)")
    parser.add_argument("--corpus", default=None,
                        help="folder of the corpus JSONL files the labels name (default: ../shared/data/corpus)")
    parser.add_argument("--dataset", choices=("vqa-rad", "slake", "jsonl"))
    parser.add_argument("--data", default=None, help="dataset folder (default: ../shared/data/<dataset>)")
    parser.add_argument("--split")
    parser.add_argument("--limit", type=int, default=None, help="deterministic type-balanced subset of N")
    parser.add_argument("--profile", choices=PROFILES, default="offline")
    parser.add_argument("--engine", default=None, help="decoder engine (default: the profile's)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--json", default=None, help="write the summary object here")
    args = parser.parse_args(argv)
    if args.labelled:
        summary = evaluate_labelled(read_labels(args.labelled), corpus_texts(args.corpus))
        for split, figures in summary.items():
            print(f"{split}: {figures['n']} triples, support precision {figures['support_precision']}, recall "
                  f"{figures['support_recall']}, contradiction precision {figures['contradiction_precision']}",
                  file=sys.stderr)
        _write(summary, args.json)
        return 0
    if not (args.dataset and args.split):
        parser.error("--dataset and --split are required (or --labelled)")

    from tqdm import tqdm

    from medvqa.datasets import load_examples, read_image
    from medvqa.pipeline import Conversation, Done, Pipeline
    from medvqa.trust import claim_query

    from evaluate import balanced_subset  # beside this script

    settings = load_settings(args.profile)
    if args.engine:
        settings.decoder.engine = args.engine
    pipeline = Pipeline.load(settings, with_retrieval=True)
    examples = balanced_subset(load_examples(args.dataset, args.data, args.split), args.limit)
    question_only = reference_query = claim_supported = terms = withheld = 0
    marks = {"supports": 0, "contradicts": 0, "related": 0}
    closed_rows: list[tuple[float, bool]] = []
    reliance_rows: list[tuple[bool, bool]] = []
    answered_rows: list[tuple[bool, bool]] = []  # (abstained, right) per closed answer
    for example in tqdm(examples, desc=f"{args.dataset} {args.split}", unit="q", file=sys.stderr):
        conversation = Conversation(image=read_image(example.image))
        done = [event for event in pipeline.ask(conversation, example.question, max_new_tokens=args.max_new_tokens,
                                                warm=False) if isinstance(event, Done)][-1]
        pipeline.end_conversation(conversation, keep_image=True)
        abstained = bool(done.closed and done.closed.get("abstained"))
        for mark, _ in done.support:
            marks[mark] += 1
        if example.answer_type == "CLOSED":
            # An abstained answer is scored by its leaning: coverage is what the ranking below decides.
            correct = closed_correct(done.closed["choice"] if done.closed else done.answer, example.answer)
            if done.closed:
                rank = done.closed["confidence"] if done.closed.get("confidence") is not None else done.closed["margin"]
                closed_rows.append((rank, correct))
                answered_rows.append((abstained, correct))
                if "flagged" in done.closed:
                    reliance_rows.append((done.closed["flagged"], correct))
        elif is_term(example.answer):
            terms += 1
            question_only += contains(pipeline.retrieve(example.question), example.answer)
            reference_query += contains(pipeline.retrieve(claim_query(example.question, example.answer)),
                                        example.answer)
            if done.open_choice and done.open_choice.get("abstained"):
                withheld += 1  # "Uncertain": the answer asserts nothing a passage could support
            else:
                claim_supported += any(mark == "supports" for mark, _ in done.support)
    flagged = [correct for was_flagged, correct in reliance_rows if was_flagged]
    unflagged = [correct for was_flagged, correct in reliance_rows if not was_flagged]
    summary = {
        "dataset": args.dataset, "split": args.split, "n": len(examples), "profile": args.profile,
        "term_questions": terms, "closed_questions": len(closed_rows),
        "support_at_3": {"question_only": round(question_only / max(1, terms), 4),
                         "app_query_reference": round(reference_query / max(1, terms), 4)},
        "claim_support": round(claim_supported / (terms - withheld), 4) if terms > withheld else None,
        "term_answers_withheld": withheld,
        "marks": marks,
        "risk_coverage": {str(c): accuracy_at(closed_rows, c) for c in (1.0, 0.75, 0.5)},
        "abstention_rate": round(sum(a for a, _ in answered_rows) / len(answered_rows), 4) if answered_rows else None,
        "accuracy_answered": (round(sum(c for a, c in answered_rows if not a) / answered, 4)
                              if (answered := sum(not a for a, _ in answered_rows)) else None),
        # The abstention threshold: one number, or one per image group the calibration fits.
        "min_confidence": _thresholds(pipeline.calibration, settings.decoder),
        "image_reliance": {"flagged": round(len(flagged) / max(1, len(reliance_rows)), 4),
                           "accuracy_flagged": round(sum(flagged) / len(flagged), 4) if flagged else None,
                           "accuracy_unflagged": round(sum(unflagged) / len(unflagged), 4) if unflagged else None},
    }
    print(f"{args.dataset} {args.split}: {len(examples)} questions, {terms} open term answers, "
          f"{len(closed_rows)} closed", file=sys.stderr)
    _write(summary, args.json)
    return 0


def read_labels(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def corpus_texts(folder: str | None = None) -> dict[str, str]:
    """Passage id -> text, from every JSONL file of the corpus folder."""
    folder = Path(folder) if folder else REPO.parent / "shared" / "data" / "corpus"
    if not folder.is_dir():
        raise SystemExit(f"corpus folder not found: {folder} (the labels name its passages by id)")
    texts = {}
    for path in sorted(folder.glob("*.jsonl")):
        with path.open() as lines:
            for line in lines:
                row = json.loads(line)
                texts[row["id"]] = row["text"]
    return texts


def evaluate_labelled(rows: list[dict], texts: dict[str, str]) -> dict:
    """trust.mark_support on each labelled triple, scored against its label, per split and overall."""
    from medvqa.trust import claim, mark_support

    missing = sorted({row["passage"] for row in rows} - texts.keys())
    if missing:
        raise SystemExit(f"{len(missing)} labelled passages are not in the corpus, e.g. {missing[:3]}")
    marked = []
    for row in rows:
        mark, evidence = mark_support(claim(row["question"], row["answer"]), texts[row["passage"]])
        marked.append((row, mark, evidence))
    summary = {}
    for split in sorted({row.get("split", "all") for row in rows}) + ["all"]:
        chosen = [item for item in marked if split == "all" or item[0].get("split", "all") == split]
        summary[split] = _scores(chosen)
    return summary


def _scores(marked: list) -> dict:
    def share(numerator: int, denominator: int) -> float | None:
        return round(numerator / denominator, 4) if denominator else None

    def count(label: str | None, mark: str | None) -> int:
        return sum((label is None or row["label"] == label) and (mark is None or got == mark)
                   for row, got, _ in marked)

    kinds = sorted({row["kind"] for row, _, _ in marked})
    return {
        "n": len(marked),
        "support_precision": share(count("supports", "supports"), count(None, "supports")),
        "support_recall": share(count("supports", "supports"), count("supports", None)),
        "contradiction_precision": share(count("contradicts", "contradicts"), count(None, "contradicts")),
        "contradiction_recall": share(count("contradicts", "contradicts"), count("contradicts", None)),
        "agreement_by_kind": {kind: share(sum(row["kind"] == kind and row["label"] == got for row, got, _ in marked),
                                          sum(row["kind"] == kind for row, _, _ in marked)) for kind in kinds},
        "disagreements": [{"question": row["question"], "answer": row["answer"], "passage": row["passage"],
                           "label": row["label"], "mark": got,
                           "sentence": evidence.sentence if evidence else None} for row, got, evidence in marked
                          if row["label"] != got],
    }


def _write(summary: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


def _thresholds(calibration, decoder):
    """The app's abstention threshold (None without a calibration); {group: threshold} for a file
    fitted per image group (medvqa/confidence.py; None for a part answering nothing, confidence.NEVER)."""
    if not calibration.fits:
        return None
    pooled = calibration.min_confidence(decoder.min_confidence, decoder.threshold_from_calibration)
    if calibration.groups:  # images of a group the file does not fit get the pooled threshold
        chosen = {name: group.min_confidence(decoder.min_confidence, decoder.threshold_from_calibration)
                  for name, group in sorted(calibration.groups.items())}
        return {**{name: None if value == math.inf else value for name, value in chosen.items()},
                "other images": pooled}
    return pooled


if __name__ == "__main__":
    sys.exit(main())
