"""Choose decoder.head_open_min_probability: above it the encoder's answer head answers an open question,
below it the decoder generates (decoder.open_answerer "encoder_head"; medvqa/answer_head.py).

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


def recall_at(rows: list[dict], threshold: float, condition: str = "no_retrieval") -> tuple[float, float]:
    """(open recall of the answers given with this threshold, share the head gives)."""
    total, by_head = 0.0, 0
    for row in rows:
        head = "head_open" in row and row["head_open"]["probability"] > threshold
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
    args = parser.parse_args(argv)
    tables = {short_name(path): load_rows(path) for path in args.runs}
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
    if args.json:
        Path(args.json).write_text(json.dumps({"chosen": chosen, "thresholds": lines,
                                               "questions": {n: len(r) for n, r in tables.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
