"""Choose decoder.head_open_min_probability (and head_open_min_similarity): above it the encoder's answer
head answers an open question, below it the decoder generates (decoder.open_answerer "encoder_head"; medvqa/answer_head.py).

Run scripts/evaluate.py on the open questions of the training images held out of every training step,
with the head's threshold at 1, so that the decoder answers every question and each row also records the
head's answer and its probability; then give this script those per-question files:

    python scripts/export_holdout.py --data vqa-rad:train slake:train pathvqa:DIR:train \\
        --holdout-percent 15 --out runs/holdout-all
    for s in slake vqa-rad pathvqa; do
      MEDVQA_DECODER__OPEN_ANSWERER=encoder_head MEDVQA_DECODER__HEAD_OPEN_MIN_PROBABILITY=1 \\
        python scripts/evaluate.py --engine llama.cpp --dataset jsonl --data runs/holdout-all \\
        --split heldout-$s --conditions no_retrieval --no-free-closed --open-only
    done
    python scripts/tune_open_head.py runs/eval-*-heldout-*-openhead-*-1-*.jsonl

For each threshold it prints the open recall (the share of the reference's words in the answer, as
evaluate.py scores it) of the answers the app would give, per file, and the share the head gives; it
chooses the threshold with the best mean over the files (each data set counts once, whatever its size),
the highest such threshold on a tie (the fewest answers outside the LLaVA design).

Then, at that threshold, decoder.head_open_min_similarity: the head answers only questions whose
MiniLM embedding is this similar (cosine) to one of the training questions it learned to answer in words
(scripts/build_head_questions.py; the held-out questions are compared with the other images' questions
only). Every similarity threshold
is scored the same way, and the highest whose mean open recall is within --tolerance points of the best
is chosen (default 1 point, about what the decoder's figures moved between two installs). For the
chosen one it prints, per file, how the decoder and the head do on the questions handed to the decoder. --free-form FILE prints the share of other questions (one per line, or a JSONL file with a
"text" field such as LLaVA-Med's llava_med_eval_qa50_qa.jsonl) at least this similar: those the head
could still answer (the probability threshold, which needs their images, not applied).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from medvqa.answers import closed_candidates, open_recall  # noqa: E402

GRID = [round(0.05 * step, 2) for step in range(21)]


def load_rows(path: Path, condition: str = "no_retrieval") -> list[dict]:
    """The open rows of an evaluate.py run file, each with the decoder's answer and the head's (but those
    whose question names its options, "the cystic lesions or the kidney parenchyma?": the app scores
    the options named, whoever answers open questions)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["answer_type"] != "CLOSED"]
    missing = [r["qid"] for r in rows if condition not in r
               or ("head_open" not in r and closed_candidates(r["question"]) is None)]
    if missing:
        raise SystemExit(f"{path}: {len(missing)} open rows lack the head's reading or the {condition!r} answer "
                         f"(e.g. {missing[0]}); run evaluate.py with MEDVQA_DECODER__OPEN_ANSWERER=encoder_head "
                         "MEDVQA_DECODER__HEAD_OPEN_MIN_PROBABILITY=1")
    if any(r.get("head_open", {}).get("answered") for r in rows):
        raise SystemExit(f"{path}: the head gave some of these answers; run with its threshold at 1 so that "
                         "every row holds the decoder's answer")
    return rows


def recall_at(rows: list[dict], threshold: float, condition: str = "no_retrieval",
              min_similarity: float = 0.0) -> tuple[float, float]:
    """(open recall of the answers given with this threshold, share the head gives); with
    min_similarity, only rows whose question's similarity (attach_similarities) reaches it go to the head."""
    total, by_head = 0.0, 0
    for row in rows:
        head = "head_open" in row and row["head_open"]["probability"] > threshold and (
            min_similarity <= 0 or row["head_open"]["similarity"] >= min_similarity)
        by_head += head
        total += open_recall(row["head_open"]["answer"] if head else row[condition], row["reference"])
    return total / max(1, len(rows)), by_head / max(1, len(rows))


def choose(tables: dict[str, list[dict]]) -> tuple[float, list[dict]]:
    """(the chosen threshold, one line per threshold: its mean recall and each file's recall and head share)."""
    lines = []
    for threshold in GRID:
        per = {name: recall_at(rows, threshold) for name, rows in tables.items()}
        lines.append({"threshold": threshold, "mean_recall": sum(r for r, _ in per.values()) / len(per),
                      "by_file": {name: {"recall": r, "head_share": s} for name, (r, s) in per.items()}})
    best = max(line["mean_recall"] for line in lines)
    chosen = max(line["threshold"] for line in lines if line["mean_recall"] >= best - 1e-12)
    return chosen, lines


# Up to 0.99 (finer from 0.9): a question word for word like a training one scores 1 (float16 embeddings:
# give or take 0.001).
SIMILARITY_GRID = [0.0] + [round(0.5 + 0.05 * step, 2) for step in range(8)] + [round(0.9 + 0.01 * step, 2)
                                                                                for step in range(10)]


def attach_similarities(tables: dict[str, list[dict]], similarities) -> None:
    """Give each row the head read its question's similarity to the nearest training question, where the
    run did not record it; `similarities(questions) -> list[float]`."""
    rows = [row for table in tables.values() for row in table
            if "head_open" in row and "similarity" not in row["head_open"]]
    for row, value in zip(rows, similarities([row["question"] for row in rows]) if rows else []):
        row["head_open"]["similarity"] = float(value)


def choose_similarity(tables: dict[str, list[dict]], threshold: float, tolerance: float,
                      free_form: list[float] | None = None) -> tuple[float, list[dict]]:
    """(the chosen decoder.head_open_min_similarity, one line per similarity threshold at probability
    `threshold`): the highest whose mean open recall is within `tolerance` points of the best."""
    lines = []
    for similarity in SIMILARITY_GRID:
        per = {name: recall_at(rows, threshold, min_similarity=similarity) for name, rows in tables.items()}
        line = {"min_similarity": similarity, "mean_recall": sum(r for r, _ in per.values()) / len(per),
                "by_file": {name: {"recall": r, "head_share": s} for name, (r, s) in per.items()}}
        if free_form is not None:  # by similarity alone (no image, so no probability)
            line["free_form_to_head"] = sum(value >= similarity for value in free_form) / max(1, len(free_form))
        lines.append(line)
    best = max(line["mean_recall"] for line in lines)
    chosen = max(line["min_similarity"] for line in lines if line["mean_recall"] >= best - tolerance / 100 - 1e-12)
    return chosen, lines


def handed_over(rows: list[dict], threshold: float, min_similarity: float,
                condition: str = "no_retrieval") -> tuple[int, float, float]:
    """(how many questions the head would answer above `threshold` but hands to the decoder for their
    similarity, the decoder's open recall on them, the head's)."""
    mine = [row for row in rows if "head_open" in row and row["head_open"]["probability"] > threshold
            and row["head_open"]["similarity"] < min_similarity]
    return (len(mine), sum(open_recall(row[condition], row["reference"]) for row in mine) / max(1, len(mine)),
            sum(open_recall(row["head_open"]["answer"], row["reference"]) for row in mine) / max(1, len(mine)))


def read_questions(path: Path) -> list[str]:
    """Questions of a text file (one per line) or a JSONL file of objects with a "text" field (the
    "<image>" placeholder line dropped)."""
    questions = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        text = json.loads(line)["text"] if line.lstrip().startswith("{") else line
        questions.append("\n".join(part for part in text.splitlines() if part.strip() != "<image>").strip())
    return [q for q in questions if q]


def head_similarities(questions_file: str):
    """similarities(questions) -> each one's cosine similarity to the nearest of the head's training questions."""
    from medvqa.answer_head import AnswerHead
    from medvqa.config import load_settings, resolve_path

    head = AnswerHead.load(resolve_path(load_settings("offline").decoder.answer_head)).attach_questions(questions_file)
    return lambda questions: [value for value, _ in head.nearest_questions(questions)]


def short_name(path: Path) -> str:
    """The data set of an evaluate.py run file ("heldout-slake"), or the file's name."""
    for part in ("heldout-slake", "heldout-vqa-rad", "heldout-pathvqa"):
        if part in path.name:
            return part
    return path.stem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="evaluate.py per-question files (runs/eval-*.jsonl)")
    parser.add_argument("--json", default=None, help="write the table and the choice here")
    parser.add_argument("--head-questions", default=None,
                        help="scripts/build_head_questions.py's file (default: the offline profile's decoder.head_questions)")
    parser.add_argument("--no-similarity", action="store_true", help="choose only the probability threshold")
    parser.add_argument("--tolerance", type=float, default=1.0,
                        help="points of mean open recall the similarity threshold may cost (default 1)")
    parser.add_argument("--free-form", nargs="*", type=Path, default=[],
                        help="other questions (text, one per line, or JSONL with a 'text' field): the share each "
                             "similarity threshold gives the head")
    args = parser.parse_args(argv)
    names = [short_name(path) for path in args.runs]
    if len(set(names)) < len(names):
        parser.error("two runs of the same data set (" + ", ".join(sorted({n for n in names if names.count(n) > 1}))
                     + "): give one per data set, each run with the head's threshold at 1")
    tables = {name: load_rows(path) for name, path in zip(names, args.runs)}
    chosen, lines = choose(tables)
    names = list(tables)
    print("| head answers above | mean open recall % | " + " | ".join(f"{n} recall % (head's share %)" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for line in lines:
        mark = " **chosen**" if line["threshold"] == chosen else ""
        cells = " | ".join(f"{100 * line['by_file'][n]['recall']:.1f} ({100 * line['by_file'][n]['head_share']:.0f})"
                           for n in names)
        print(f"| {line['threshold']:.2f}{mark} | {100 * line['mean_recall']:.1f} | {cells} |")
    print(f"questions: " + ", ".join(f"{n} {len(rows)}" for n, rows in tables.items()))
    print(f"chosen decoder.head_open_min_probability = {chosen:g}")
    result = {"chosen": chosen, "thresholds": lines, "questions": {n: len(r) for n, r in tables.items()}}
    if not args.no_similarity:
        if args.head_questions is None:
            from medvqa.config import load_settings, resolve_path

            args.head_questions = resolve_path(load_settings("offline").decoder.head_questions)
        free_form = [q for path in args.free_form for q in read_questions(path)]
        # The head and its embedder are loaded only when a run did not record the similarities.
        loaded = []

        def similarities(questions: list[str]) -> list[float]:
            if not loaded:
                loaded.append(head_similarities(args.head_questions))
            return loaded[0](questions)

        attach_similarities(tables, similarities)
        free_values = similarities(free_form) if free_form else None
        chosen_similarity, similarity_lines = choose_similarity(tables, chosen, args.tolerance, free_values)
        print(f"\nAt {chosen:g}, and only questions this like a training question (cosine similarity):\n")
        print("| similarity at least | mean open recall % | " + " | ".join(f"{n} recall % (head's share %)" for n in names)
              + " |" + (f" other questions this similar % (of {len(free_form)}) |" if free_form else ""))
        print("|---|---|" + "---|" * len(names) + ("---|" if free_form else ""))
        for line in similarity_lines:
            mark = " **chosen**" if line["min_similarity"] == chosen_similarity else ""
            cells = " | ".join(f"{100 * line['by_file'][n]['recall']:.1f} ({100 * line['by_file'][n]['head_share']:.0f})"
                               for n in names)
            extra = f" {100 * line['free_form_to_head']:.1f} |" if free_form else ""
            print(f"| {line['min_similarity']:.2f}{mark} | {100 * line['mean_recall']:.1f} | {cells} |{extra}")
        for name, rows in tables.items():
            count, decoder, head = handed_over(rows, chosen, chosen_similarity)
            print(f"{name}: {count} questions go to the decoder for their similarity; its open recall on them "
                  f"{100 * decoder:.1f} %, the head's would be {100 * head:.1f} %")
        if free_form:
            reached = [q for q, value in zip(free_form, free_values) if value >= chosen_similarity]
            print(f"other questions this similar ({len(reached)}): " + "; ".join(dict.fromkeys(reached)))
        print(f"chosen decoder.head_open_min_similarity = {chosen_similarity:g} "
              f"(the highest within {args.tolerance:g} point{'' if args.tolerance == 1 else 's'} of the best mean)")
        result.update(chosen_similarity=chosen_similarity, similarity_thresholds=similarity_lines,
                      tolerance=args.tolerance, free_form_questions=len(free_form))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
