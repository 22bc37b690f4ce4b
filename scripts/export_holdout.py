"""Write the by-image training hold-out as a JSONL benchmark, so scripts/evaluate.py measures it as it
measures a test split (closed accuracy, shuffled image, open recall).

    python scripts/export_holdout.py --data vqa-rad:train slake:train pathvqa:DIR:train \
        --holdout-percent 15 --per-source 300 --out runs/holdout
    python scripts/evaluate.py --dataset jsonl --data runs/holdout --split heldout-slake \
        --conditions no_retrieval shuffled_image --no-free-closed

One file per data spec (`SPLIT-<dataset>.jsonl`), so that the shuffled image evaluate.py gives a
question is another image of the same dataset (a pathology slide for a radiology question would be
too easy to tell apart).
The questions are those of the images train_encoder.py and train_projector.py --holdout-percent left
out (by content hash); --per-source keeps a fixed random sample of each data spec's questions (0: all).
Image paths are written absolute, so the JSONL folder needs no copy of the images.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from medvqa.answers import normalise  # noqa: E402
from medvqa.datasets import load_specs  # noqa: E402
from medvqa.presuppose import KINDS, presupposition  # noqa: E402
from medvqa_train.data import held_out_by_content  # noqa: E402
from medvqa_train.medical import content_hash  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="as given to train_projector.py")
    parser.add_argument("--holdout-percent", type=float, default=15.0)
    parser.add_argument("--per-source", type=int, default=0, help="questions kept per data spec (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/holdout")
    parser.add_argument("--split", default="heldout", help="files written: SPLIT-<dataset>.jsonl")
    parser.add_argument("--presupposed", default=None, choices=KINDS,
                        help="keep only the yes/no questions medvqa/presuppose.py reads as naming a value of this "
                             "attribute (e.g. organ: \"Does the picture contain liver?\")")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for spec in args.data:
        examples = load_specs([spec])
        left_out = held_out_by_content(examples, args.holdout_percent)[1]
        if args.presupposed:
            left_out = [i for i in left_out if presupposition(examples[i].question, (args.presupposed,))
                        and normalise(examples[i].answer) in ("yes", "no")]
        if args.per_source and len(left_out) > args.per_source:
            left_out = sorted(random.Random(args.seed).sample(left_out, args.per_source))
        name = spec.split(":")[0]
        # One path per image content (PathVQA repeats an image under many names), so that the shuffled
        # condition never pairs a question with its own image under another name.
        canonical: dict[str, str] = {}
        paths = {i: canonical.setdefault(content_hash(examples[i].image), str(Path(examples[i].image).resolve()))
                 for i in left_out}
        counts[name] = {"questions": len(left_out), "images": len(canonical)}
        rows = [{"qid": f"{name}-{examples[i].qid}", "image": paths[i], "question": examples[i].question,
                 "answer": examples[i].answer, "answer_type": examples[i].answer_type} for i in left_out]
        (out / f"{args.split}-{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(json.dumps({"written": str(out), "by_source": counts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
