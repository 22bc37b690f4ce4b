"""The closed answers' calibration split by the question's wording (questions worded like the training
yes/no questions, and the rest), at each similarity of a grid, against the image groups alone: the grid
calibrate_closed.py --wording-similarity is chosen from (of the split values, the one with the largest
share answered out of fold, those answers right at least --target-accuracy of the time).

    MEDVQA_DECODER__CLOSED_ANSWERER=encoder_head python scripts/calibrate_closed.py --data vqa-rad:train \\
        slake:train pathvqa:DIR:train --holdout-percent 15 --scores runs/calibrate-head.npz
    python scripts/probe_calibration_wording.py --scores runs/calibrate-head.npz \\
        --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15

calibrate_closed.py fits the confidence per image group (grey, colour) and chooses each group's threshold
out of fold for --target-accuracy. The held-out questions about grey images are SLAKE's, worded from a
small set of templates, and VQA-RAD's, worded freely by clinicians, which are right less often at the
same margin; one threshold for both answers few of SLAKE's. This script splits each image group by how
alike its question is to a training yes/no question (MiniLM cosine similarity of
answer_head.question_form to the nearest of the training images' yes/no questions that
scripts/build_head_questions.py keeps in decoder.head_questions, the held-out images' left out) at each
--like value: the questions worded like training get their own fit and threshold,
chosen as calibrate_closed.py chooses them (when they number 200 or more), and the rest keep their image
group's. It prints what the app would answer out of fold, per data set: the share answered and how often
those answers were right.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import calibrate_closed  # noqa: E402


def app_answers(scores: dict, similarity: np.ndarray, like: float | None, target: float, configured: float) -> dict:
    """What the app would answer out of fold (calibrate_closed.py's app_out_of_fold) with the questions
    at least `like` similar fitted apart within each image group (None: image groups only)."""
    held = calibrate_closed.out_of_fold(scores, draws=calibrate_closed.FOLD_DRAWS)  # as fit_groups draws them
    pooled = calibrate_closed.choose_threshold(held, scores["correct"], target)
    fitted = calibrate_closed.fit_groups(scores, configured, target)
    worded = calibrate_closed.worded_groups(scores["group"], similarity, like)
    worded_fitted = calibrate_closed.fit_worded(scores, worded, configured, target) if like is not None else {}
    return calibrate_closed.app_out_of_fold(scores, held, pooled["min_confidence"] if pooled["met"] else configured,
                                            fitted, worded, worded_fitted, configured)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scores", required=True, help="calibrate_closed.py's --scores file")
    parser.add_argument("--data", nargs="+", required=True, help="as given to calibrate_closed.py")
    parser.add_argument("--val", type=int, default=400)
    parser.add_argument("--val-by-image", action="store_true")
    parser.add_argument("--holdout-percent", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--like", type=float, nargs="+", default=[0.8, 0.85, 0.9, 0.95, 0.97, 0.99])
    parser.add_argument("--target-accuracy", type=float, default=0.8)
    parser.add_argument("--min-confidence", type=float, default=0.7, help="decoder.min_confidence (the fallback)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from medvqa.config import load_settings

    scores, _ = calibrate_closed.load_scores(args.scores)
    split = SimpleNamespace(data=args.data, val=args.val, val_by_image=args.val_by_image, seed=args.seed,
                            holdout_percent=args.holdout_percent)
    questions = calibrate_closed.held_out_closed(split)
    calibrate_closed.check_scored(questions, scores, args.scores)
    scores["data"] = np.asarray([spec for spec, _ in questions])
    if "group" not in scores:
        scores["group"] = calibrate_closed.image_groups(scores["image"])
    head = calibrate_closed.questions_head(load_settings("offline"))
    similarity = np.asarray(head.yes_no_similarity([example.question for _, example in questions]))

    results = []
    for like in [None, *args.like]:
        result = app_answers(scores, similarity, like, args.target_accuracy, args.min_confidence)
        result["like"] = like
        results.append(result)
    names = sorted(set(scores["data"].tolist()))
    print(f"{len(scores['correct'])} held-out closed questions ({args.scores}); {len(head.yes_no_questions)} training "
          f"yes/no questions to compare with; out of fold, answered share % (right %):\n")
    print("| groups | " + " | ".join(names) + " | all | thresholds |")
    print("|---|" + "---|" * (len(names) + 2))
    for result in results:
        label = "image group only" if result["like"] is None else f"image group × worded like training (≥ {result['like']:g})"
        cells = [f"{100 * result['by_data'][n]['answered']:.1f} ({100 * (result['by_data'][n]['accuracy_answered'] or 0):.1f})"
                 for n in names]
        bars = ", ".join(f"{name} {value:g}" for name, value in result["thresholds"].items())
        print(f"| {label} | " + " | ".join(cells)
              + f" | {100 * result['answered']:.1f} ({100 * (result['accuracy_answered'] or 0):.1f}) | {bars} |")
    best = choose(results, args.target_accuracy)
    print(f"most answered out of fold when split: --wording-similarity {best:g}" if best is not None
          else f"no split keeps its answers {100 * args.target_accuracy:.0f} % right out of fold")
    if args.json:
        Path(args.json).write_text(json.dumps({"chosen": best, "results": results}, indent=2) + "\n")
    return 0


def choose(results: list[dict], target: float) -> float | None:
    """The --like value (not None) whose app answers the most questions out of fold with those answers
    right at least `target` of the time; on a tie the lower value. None when no value reaches it. Whether
    to split at all is not this choice: splitting makes each part's answers as right as the page says
    (docs/experiments.md), which the image groups alone do not, and may answer fewer."""
    met = [r for r in results if r["like"] is not None and (r["accuracy_answered"] or 0) >= target - 1e-9]
    if not met:
        return None
    top = max(result["answered"] for result in met)
    return min(r["like"] for r in met if r["answered"] >= top - 1e-12)


if __name__ == "__main__":
    raise SystemExit(main())
