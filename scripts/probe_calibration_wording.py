"""Would the closed answers' calibration answer more, at the same accuracy, if it told apart questions
worded like the training yes/no questions from the rest? A measurement for the owners; nothing in the app
uses it.

    MEDVQA_DECODER__CLOSED_ANSWERER=encoder_head python scripts/calibrate_closed.py --data vqa-rad:train \\
        slake:train pathvqa:DIR:train --holdout-percent 15 --scores runs/calibrate-head.npz
    python scripts/probe_calibration_wording.py --scores runs/calibrate-head.npz \\
        --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15

calibrate_closed.py fits the confidence per image group (grey, colour) and chooses each group's threshold
out of fold for --target-accuracy. The held-out questions about grey images are SLAKE's, worded from a
small set of templates, and VQA-RAD's, worded freely by clinicians, which are right less often at the
same margin; one threshold for both answers few of SLAKE's. This script splits each image group by how
alike its question is to a training yes/no question (MiniLM cosine similarity of
answer_head.question_form to the nearest of the training images' yes/no questions, the held-out images'
left out) at each --like value, refits and rechooses per group as calibrate_closed.py does (a group under
its 200-question minimum keeps its image group's fit and threshold), and prints what the app would answer
out of fold, per data set: the share answered and how often those answers were right.
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


def worded_groups(groups: np.ndarray, similarity: np.ndarray, like: float | None) -> np.ndarray:
    """Each question's calibration group: its image group, split at `like` into "<group>, worded like
    training" and "<group>, worded otherwise" (None: the image group alone)."""
    if like is None:
        return groups
    return np.asarray([f"{group}, worded {'like training' if value >= like else 'otherwise'}"
                       for group, value in zip(groups.tolist(), similarity.tolist())])


def app_answers(scores: dict, groups: np.ndarray, target: float, configured: float) -> dict:
    """What the app would answer out of fold (calibrate_closed.py's app_out_of_fold) with these groups:
    each question judged by its group's fit and threshold, a group under calibrate_closed.py's minimum by
    its image group's (then the pooled ones); the answered share and its accuracy, overall and per data set."""
    held = calibrate_closed.out_of_fold(scores)
    pooled = calibrate_closed.choose_threshold(held, scores["correct"], target)
    confidence = held.copy()
    bar = np.full(len(held), pooled["min_confidence"] if pooled["met"] else configured)
    thresholds = {}
    for level in (scores["group"], groups):  # image groups, then the groups within them that can be fitted
        fitted = calibrate_closed.fit_groups({**scores, "group": level}, configured, target)
        for name, (calibration, group_held) in fitted.items():
            mine = level == name
            confidence[mine] = group_held
            chosen = calibration.meta["threshold"]
            bar[mine] = chosen["min_confidence"] if chosen["met"] else bar[mine]
            thresholds[name] = float(bar[mine][0])
    kept, correct = confidence >= bar, scores["correct"]
    result = {"answered": float(kept.mean()), "accuracy_answered": float(correct[kept].mean()) if kept.any() else None,
              "thresholds": thresholds, "by_data": {}}
    for spec in sorted(set(scores["data"].tolist())):
        mine = scores["data"] == spec
        result["by_data"][spec] = {"questions": int(mine.sum()), "answered": float(kept[mine].mean()),
                                   "accuracy_answered": float(correct[mine & kept].mean()) if (mine & kept).any()
                                   else None}
    return result


def yes_no_similarity(questions: list[str], reference: list[str]) -> np.ndarray:
    """Cosine similarity of each question to the nearest reference question (both in question_form)."""
    from medvqa.answer_head import QUESTION_EMBEDDER, question_form
    from medvqa.retrieval.embed import load_embedder

    embedder = load_embedder(QUESTION_EMBEDDER, device="cpu")
    mine = embedder.encode([question_form(q) for q in questions], batch_size=128)
    theirs = embedder.encode(sorted({question_form(q) for q in reference}), batch_size=128)
    return (mine @ theirs.T).max(axis=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scores", required=True, help="calibrate_closed.py's --scores file")
    parser.add_argument("--data", nargs="+", required=True, help="as given to calibrate_closed.py")
    parser.add_argument("--val", type=int, default=400)
    parser.add_argument("--val-by-image", action="store_true")
    parser.add_argument("--holdout-percent", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--like", type=float, nargs="+", default=[0.9, 0.95, 0.97, 0.99])
    parser.add_argument("--target-accuracy", type=float, default=0.8)
    parser.add_argument("--min-confidence", type=float, default=0.7, help="decoder.min_confidence (the fallback)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from medvqa.answers import normalise
    from medvqa_train.data import held_out_split, load_named_specs

    scores = dict(np.load(args.scores))
    scores = {**scores, "margin": scores["margin"].astype(float), "correct": scores["correct"].astype(bool)}
    split = SimpleNamespace(data=args.data, val=args.val, val_by_image=args.val_by_image, seed=args.seed,
                            holdout_percent=args.holdout_percent)
    questions = calibrate_closed.held_out_closed(split)
    if len(questions) != len(scores["correct"]) or any(
            str(example.image) != image for (_, example), image in zip(questions, scores["image"].tolist())):
        raise SystemExit(f"{args.scores} was not scored on these questions: give the --data and hold-out "
                         "calibrate_closed.py was run with")
    scores["data"] = np.asarray([spec for spec, _ in questions])
    if "group" not in scores:
        scores["group"] = calibrate_closed.image_groups(scores["image"])
    examples, _ = load_named_specs(args.data)
    left_out = set(held_out_split(examples, args.val, args.val_by_image, args.seed, args.holdout_percent)[1])
    reference = [e.question for i, e in enumerate(examples)
                 if i not in left_out and normalise(e.answer) in ("yes", "no")]
    similarity = yes_no_similarity([example.question for _, example in questions], reference)

    results = []
    for like in [None, *args.like]:
        groups = worded_groups(scores["group"], similarity, like)
        result = app_answers(scores, groups, args.target_accuracy, args.min_confidence)
        result["like"] = like
        result["group_sizes"] = {name: int((groups == name).sum()) for name in sorted(set(groups.tolist()))}
        results.append(result)
    names = sorted(set(scores["data"].tolist()))
    print(f"{len(scores['correct'])} held-out closed questions ({args.scores}); {len(set(reference))} training "
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
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
