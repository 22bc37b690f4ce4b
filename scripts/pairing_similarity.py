"""How alike the other image of evaluate.py's image conditions is to the question's own, on SLAKE: how
many of the image pairs share modality and body region (SLAKE's `modality` and `location` fields).

    python scripts/pairing_similarity.py --split validate
    python scripts/pairing_similarity.py --jsonl runs/holdout/heldout-slake.jsonl   # export_holdout.py's file

The shuffled image is the next image of the split in sorted order; the random image is drawn by a
seeded derangement (evaluate.derangement). SLAKE numbers its images by series, so sorted neighbours
are often scans of the same series. Also prints the share of all pairs of distinct images that match,
the expectation for a random pairing.

It also measures how far reading the scan can lift a model above each other image: of the closed
questions whose other image was asked the same question (the same words), the share with the same
reference answer there. A model that read every scan perfectly would score that share on those
questions with the other image, so 100 minus it is the most any model can gain over that pairing on them.
Only SLAKE's training and validation metadata and questions are read (and, with --rows, evaluate.py's rows of
a whole-split run).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from medvqa.datasets import SHARED_DATA, load_examples  # noqa: E402


def folder_metadata(slake: Path) -> dict[str, tuple[str, str]]:
    """Image folder (xmlabN) -> (modality, location), from SLAKE's training and validation files."""
    found = {}
    for name in ("train.json", "validate.json"):
        path = slake / name
        if path.is_file():
            for row in json.loads(path.read_text()):
                found[Path(row["img_name"]).parent.name] = (row.get("modality", ""), row.get("location", ""))
    return found


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def answers_alike(examples, pairing: dict, rows: dict | None = None, condition: str = "shuffled_image") -> dict:
    """Closed questions whose other image (pairing) was asked the same words, and of those how many have
    the same reference answer there (any of its answers, where it was asked twice). With `rows` (evaluate.py's
    rows by qid, answered with the question's own image in `no_retrieval` and with the other in `condition`), how
    often the model was right with each image, for the questions whose other image has the same answer and for
    those where it has another: a model that reads the scan is right with its own image and, where the answer
    there differs, wrong with the other."""
    asked = {}
    for e in examples:
        asked.setdefault(e.image, {}).setdefault(_words(e.question), set()).add(_words(e.answer))
    closed = [e for e in examples if e.answer_type == "CLOSED"]
    there = [asked[pairing[e.image]].get(_words(e.question)) for e in closed]
    result = {"closed": len(closed), "asked_there": sum(a is not None for a in there),
              "same_answer": sum(a is not None and _words(e.answer) in a for a, e in zip(there, closed))}
    if rows is not None:
        from medvqa.answers import closed_correct

        lacking = [e.qid for e in closed if not {"no_retrieval", condition} <= set(rows.get(e.qid, ()))]
        if lacking:
            # evaluate.py pairs the images of the questions it ran (a --limit run: a subset), so rows of another
            # set of questions were answered with other images than this pairing's
            raise SystemExit(f"{len(lacking)} closed questions of the split have no row answered with no_retrieval "
                             f"and {condition} (e.g. {lacking[0]}): give the rows of a whole-split run")
        for part, keep in (("same_answer_there", lambda a, e: _words(e.answer) in a),
                           ("other_answer_there", lambda a, e: _words(e.answer) not in a)):
            mine = [rows[e.qid] for a, e in zip(there, closed) if a is not None and keep(a, e)]
            result[part] = {"n": len(mine),
                            "right_own_image": sum(closed_correct(r["no_retrieval"], r["reference"]) for r in mine),
                            "right_other_image": sum(closed_correct(r[condition], r["reference"]) for r in mine)}
    return result


def load_rows(path: str) -> dict:
    """evaluate.py's per-question rows (its run's JSONL) by qid."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[str(row["qid"])] = row
    return rows


def main(argv=None) -> int:
    from evaluate import derangement

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(SHARED_DATA / "slake"), help="SLAKE's folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--split", choices=("train", "validate"), help="a SLAKE split")
    source.add_argument("--jsonl", help="a JSONL benchmark of SLAKE images (scripts/export_holdout.py)")
    parser.add_argument("--rows", help="evaluate.py's per-question rows of the same split (run with the "
                                       "no_retrieval and shuffled_image or random_image conditions): how often the "
                                       "model was right with each image on the questions asked of both")
    args = parser.parse_args(argv)

    rows = load_rows(args.rows) if args.rows else None
    meta = folder_metadata(Path(args.data))
    examples = (load_examples("slake", args.data, args.split) if args.split else
                load_examples("jsonl", str(Path(args.jsonl).parent), Path(args.jsonl).stem))
    of = {e.image: meta.get(Path(e.image).parent.name) for e in examples}
    if None in of.values():
        raise SystemExit("some images are not SLAKE training or validation images")
    counts = Counter(of.values())
    n = len(of)
    result = {"images": n,
              "shuffled_pairs_alike": sum(of[a] == of[b] for a, b in derangement(examples).items()),
              "random_pairs_alike": sum(of[a] == of[b] for a, b in derangement(examples, seed=0).items()),
              "all_pairs_alike_share": round(sum(c * (c - 1) for c in counts.values()) / (n * (n - 1)), 4)}
    for name, pairing in (("shuffled", derangement(examples)), ("random", derangement(examples, seed=0))):
        alike = result[f"{name}_closed_answers"] = answers_alike(examples, pairing, rows, f"{name}_image")
        asked = alike["asked_there"]
        print(f"{name} image: {asked} of {alike['closed']} closed questions were asked of it too, "
              f"{alike['same_answer']} with the same answer"
              + (f" ({100 * alike['same_answer'] / asked:.1f} %: a perfect reader gains at most "
                 f"{100 - 100 * alike['same_answer'] / asked:.1f} points over it on those)" if asked else ""))
        for part in ("same_answer_there", "other_answer_there"):
            if alike.get(part, {}).get("n"):
                found = alike[part]
                print(f"  {part.replace('_', ' ')}: the model is right on {found['right_own_image']} of {found['n']} "
                      f"with the question's image, {found['right_other_image']} with the {name} image")
    print(f"{n} images: the shuffled image shares modality and body region for {result['shuffled_pairs_alike']}, "
          f"the random image for {result['random_pairs_alike']}; of all pairs of distinct images "
          f"{100 * result['all_pairs_alike_share']:.1f} % do")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
