"""Choose `decoder.yes_bias` on questions training left out, never on a test split.

    python scripts/tune_closed.py --profile offline --data vqa-rad:train slake:train --val 300

Takes the same held-out closed yes/no questions as `train_projector.py --val 300` (same data, same
seed; add --val-by-image if training held out whole images) and scores Yes and No with the real
image and with another held-out question's image (the shuffled condition, paired as training pairs
them). For each bias in the grid, "Yes" scores s(Yes) + yes_bias; it prints accuracy with the real and
the shuffled image. The scores are saved (--scores) so the grid can be re-read without the model. The
last line is JSON: the grid and the bias with the best real-image accuracy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from medvqa.answers import normalise, surface_forms
from medvqa.config import PROFILES, load_settings

FORMS = [form for option in ("Yes", "No") for form in surface_forms(option)]


def score_held_out(args) -> dict[str, np.ndarray]:
    from tqdm import tqdm

    from medvqa.datasets import load_specs
    from medvqa.datasets import read_image
    from medvqa.engines import engine_label
    from medvqa.pipeline import Pipeline
    from medvqa_train.data import held_out_split

    settings = load_settings(args.profile)
    if args.engine:
        settings.decoder.engine = args.engine
    examples = load_specs(args.data)
    picked = held_out_split(examples, args.val, args.val_by_image, args.seed, args.holdout_percent)[0]
    held_out = [examples[i] for i in picked]
    pipeline = Pipeline.load(settings, with_retrieval=False)
    images = [read_image(example.image) for example in held_out]
    real, shuffled = [], []
    for k, example in enumerate(tqdm(held_out, desc="held-out questions", unit="q")):
        prompt = pipeline.prompts.build(example.question)
        other = images[(k + len(held_out) // 2) % len(held_out)]
        real.append(pipeline.option_scores(images[k], prompt, FORMS))
        shuffled.append(pipeline.option_scores(other, prompt, FORMS))
    from medvqa.presuppose import presupposition

    return {"real": np.asarray(real), "shuffled": np.asarray(shuffled),
            "answers": np.asarray([normalise(example.answer) for example in held_out]),
            # Questions the app scores through the open question they presuppose when
            # decoder.presupposed_closed is on: Yes and No are not compared there, so no bias applies.
            "presupposed": np.asarray([presupposition(example.question, settings.decoder.presupposed_kinds) is not None
                                       for example in held_out]),
            "engine": np.asarray(engine_label(settings))}


def source_rows(args, total: int, kept: np.ndarray | None) -> dict[str, np.ndarray]:
    """Positions (among the questions the grid is chosen on) of each --data spec's held-out questions,
    rebuilt from the data as score_held_out picks them."""
    from medvqa_train.data import held_out_split, load_named_specs

    examples, spec_of = load_named_specs(args.data)
    picked = held_out_split(examples, args.val, args.val_by_image, args.seed, args.holdout_percent)[0]
    if len(picked) != total:
        raise SystemExit(f"--by-source: the data give {len(picked)} held-out questions, the scores {total}; "
                         "pass the --data, --val and --holdout-percent the scores were made with")
    names = np.asarray([spec_of[i] for i in picked])
    if kept is not None:
        names = names[kept]
    return {name: np.flatnonzero(names == name) for name in dict.fromkeys(names)}


def print_grid(real: np.ndarray, shuffled: np.ndarray, answers: np.ndarray, biases: list[float]) -> list[dict]:
    """Accuracy with the real and the shuffled image, and the share answered Yes, for each bias."""
    grid = [{"yes_bias": bias, "real": accuracy(real, answers, bias), "shuffled": accuracy(shuffled, answers, bias)}
            for bias in biases]
    print("| yes_bias | real | shuffled | answered Yes |")
    print("|---|---|---|---|")
    for row in grid:
        said_yes = np.mean(picks(real, row["yes_bias"]) == "yes")
        print(f"| {row['yes_bias']:g} | {100 * row['real']:.1f} | {100 * row['shuffled']:.1f} | {100 * said_yes:.1f} |")
    return grid


def picks(scores: np.ndarray, yes_bias: float) -> np.ndarray:
    scores = scores + yes_bias * np.asarray([form == "Yes" for form in FORMS])
    return np.asarray([FORMS[i].lower() for i in scores.argmax(1)])


def accuracy(scores: np.ndarray, answers: np.ndarray, yes_bias: float) -> float:
    return float(np.mean(picks(scores, yes_bias) == answers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="offline", choices=sorted(PROFILES))
    parser.add_argument("--engine", default="", help="decoder engine (default: the profile's choice)")
    parser.add_argument("--data", nargs="+", default=["vqa-rad:train", "slake:train"],
                        help="the training data, as given to train_projector.py")
    parser.add_argument("--val", type=int, default=300, help="held-out questions, as given to train_projector.py")
    parser.add_argument("--val-by-image", action="store_true", help="as given to train_projector.py")
    parser.add_argument("--holdout-percent", type=float, default=0.0, help="as given to train_projector.py")
    parser.add_argument("--seed", type=int, default=0, help="as given to train_projector.py")
    parser.add_argument("--yes-bias", type=float, nargs="+",
                        default=[0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5])
    parser.add_argument("--scores", default="runs/tune-closed-scores.npz",
                        help="where the scores are saved; read from there with --reuse")
    parser.add_argument("--reuse", action="store_true", help="read the saved scores instead of running the model")
    parser.add_argument("--by-source", action="store_true",
                        help="also print the grid for each --data spec's questions (reads the data, not the model)")
    args = parser.parse_args()

    if args.reuse:
        saved = dict(np.load(args.scores))
    else:
        saved = score_held_out(args)
        Path(args.scores).parent.mkdir(parents=True, exist_ok=True)
        np.savez(args.scores, **saved)
    answers = saved["answers"]
    kept = None
    if load_settings(args.profile).decoder.presupposed_closed and "presupposed" in saved:
        # The bias only moves the questions still scored Yes against No: it is chosen on those.
        kept = ~saved["presupposed"].astype(bool)
        print(f"decoder.presupposed_closed: {int((~kept).sum())} of {len(answers)} questions are scored through "
              "the open question they presuppose; the bias is chosen on the others. Those, scored Yes against No "
              f"at bias 0: {100 * accuracy(saved['real'][~kept], answers[~kept], 0.0):.1f} % right "
              f"(shuffled image {100 * accuracy(saved['shuffled'][~kept], answers[~kept], 0.0):.1f} %)")
        saved = {**saved, "real": saved["real"][kept], "shuffled": saved["shuffled"][kept]}
        answers = answers[kept]
    print(f"{len(answers)} held-out yes/no questions ({100 * np.mean(answers == 'yes'):.1f} % yes), "
          f"engine {saved['engine']}; accuracy real image (shuffled image), %")
    grid = print_grid(saved["real"], saved["shuffled"], answers, args.yes_bias)
    best = max(grid, key=lambda row: (row["real"], -row["yes_bias"]))
    if args.by_source:
        total = len(saved["presupposed"]) if "presupposed" in saved else len(answers)
        for name, rows in source_rows(args, total, kept).items():
            print(f"\n{name}: {len(rows)} questions ({100 * np.mean(answers[rows] == 'yes'):.1f} % yes)")
            print_grid(saved["real"][rows], saved["shuffled"][rows], answers[rows], args.yes_bias)
    print(json.dumps({"n": len(answers), "engine": str(saved["engine"]), "grid": grid,
                      "best": {"yes_bias": best["yes_bias"]}}))


if __name__ == "__main__":
    main()
