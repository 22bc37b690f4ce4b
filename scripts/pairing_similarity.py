"""How alike the other image of evaluate.py's image conditions is to the question's own, on SLAKE: how
many of the image pairs share modality and body region (SLAKE's `modality` and `location` fields).

    python scripts/pairing_similarity.py --split validate
    python scripts/pairing_similarity.py --jsonl runs/holdout/heldout-slake.jsonl   # export_holdout.py's file

The shuffled image is the next image of the split in sorted order; the random image is drawn by a
seeded derangement (evaluate.derangement). SLAKE numbers its images by series, so sorted neighbours
are often scans of the same series. Also prints the share of all pairs of distinct images that match,
the expectation for a random pairing. Only SLAKE's training and validation metadata are read.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> int:
    from evaluate import derangement

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(SHARED_DATA / "slake"), help="SLAKE's folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--split", choices=("train", "validate"), help="a SLAKE split")
    source.add_argument("--jsonl", help="a JSONL benchmark of SLAKE images (scripts/export_holdout.py)")
    args = parser.parse_args(argv)

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
    print(f"{n} images: the shuffled image shares modality and body region for {result['shuffled_pairs_alike']}, "
          f"the random image for {result['random_pairs_alike']}; of all pairs of distinct images "
          f"{100 * result['all_pairs_alike_share']:.1f} % do")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
