"""Write organ-presence questions for SLAKE's training images as a JSONL split (medvqa_train/organs.py).

    python scripts/make_organ_questions.py --slake ../shared/data/slake --slake-annotations SLAKE_IMGS \
        --out runs/organs
    python scripts/train_projector.py --data vqa-rad:train slake:train pathvqa:DIR:train \
        jsonl:runs/organs:slake-organs ...

SLAKE_IMGS is a folder laid out as SLAKE's `imgs/` holding `xmlabN/detection.json` for the training
images (as scripts/train_encoder.py --slake-annotations). Only SLAKE's train.json is read.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from medvqa_train.organs import organ_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slake", default="../shared/data/slake", help="SLAKE folder (train.json, imgs/)")
    parser.add_argument("--slake-annotations", default=None, help="folder of xmlabN/detection.json (optional)")
    parser.add_argument("--per-image", type=int, default=3, help="present organs (and as many absent) per image")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--holdout-percent", type=float, default=15.0,
                        help="skip the images train_encoder.py / train_projector.py --holdout-percent hold out")
    parser.add_argument("--out", default="runs/organs", help="folder; writes OUT/slake-organs.jsonl")
    args = parser.parse_args()
    rows = organ_questions(Path(args.slake), Path(args.slake_annotations) if args.slake_annotations else None,
                           args.per_image, args.seed, args.holdout_percent)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "slake-organs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    answers = Counter(row["answer"] for row in rows)
    organs = Counter(row["question"].split(" contain ")[1].rstrip("?") for row in rows)
    print(f"{path}: {len(rows)} questions on {len({row['image'] for row in rows})} images; {dict(answers)}")
    print("organs:", ", ".join(f"{organ} {n}" for organ, n in organs.most_common()))


if __name__ == "__main__":
    main()
