"""Fit the confidence of open answers chosen among training answers (decoder.open_choices "training_answers",
medvqa/open_choices.py) on held-out training images, and choose when the app says "Uncertain" to them.

    python scripts/calibrate_open.py --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15

Takes the images the encoder, the projector and the open answers file all left out (the same --data and
hold-out as scripts/calibrate_closed.py), asks the app every open question about them that it answers by
choosing among training answers (a training question's words with two or more answers given for at least
decoder.open_choices_min_images other images), as a clinician would, and fits P(right | margin) per image
group (medvqa.confidence.image_group): the margin is the chosen answer's score over the runner-up's, and an
answer is right when it holds every word of the reference (evaluate.py's open recall of 1). The fit is kind
"open choice" of a calibration file (medvqa/confidence.py), written to decoder.open_calibration; it names the
projector, the open answers file and the open-choice settings, so the app uses it only with those.

As for closed answers, the fit is also scored out of fold (5 folds drawn by image content: PathVQA repeats one
image under many file names; drawn 10 times, each answer's confidence the mean of its 10 out-of-fold ones): the app shows the clinician how often answers with such a confidence were right
out of fold, and the threshold is the lowest on a grid (0.50-0.95) at which the answered questions (20 at
least) are right --target-accuracy of the time out of fold. A group whose answers reach that accuracy at no
threshold is marked `abstain`: the app says "Uncertain" to all of its chosen answers, naming the answer it
leans to. Each group also keeps how often the answers it withholds were right out of fold
(`withheld_out_of_fold`), which is what a withheld answer says of itself. Groups with fewer than --min-group
questions get the pooled fit. Each fit also weighs the log of the chosen answer's share of the candidates'
training counts (how usual an answer it is for that question): P(right) = sigmoid(a * margin + b + c * log
share); out of fold it measured better than the margin alone (--no-share) in both image groups
(docs/evaluation.md). The scores are kept (--scores) with the projector, open answers file, open-choice
settings, engine and hold-out they were made with, so that --reuse refits without the model, and only scores
of the model and hold-out given now. Never run it on a validation or test split. The last line is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from medvqa.config import load_settings
from medvqa.confidence import MIN_BIN_ANSWERS, NEVER, OPEN_CHOICE, Calibration, fit_platt, reliability

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate_closed import (FOLD_DRAWS, add_held_out_arguments, choose_threshold, folds_by_content,  # noqa: E402
                              risk_coverage, summary_at)

MIN_GROUP = 100  # fewer chosen answers about an image group than this: its images get the pooled fit
FOLDS = 5


def held_out_open(args, open_answers, decoder) -> list[tuple[str, object]]:
    """(data spec name, example) of every open question about the held-out images that the app answers
    among training answers, in scoring order."""
    from medvqa.answers import closed_candidates
    from medvqa_train.data import held_out_split, load_named_specs

    examples, spec_of = load_named_specs(args.data)
    left_out = held_out_split(examples, args.val, args.val_by_image, args.seed, args.holdout_percent)[1]
    return [(spec_of[i], examples[i]) for i in left_out
            if examples[i].answer_type != "CLOSED" and closed_candidates(examples[i].question) is None
            and open_answers.find(examples[i].question, decoder.open_choices_min_similarity,
                                  decoder.open_choices_max, decoder.open_choices_min_images) is not None]


def score_held_out(args, settings) -> dict:
    from tqdm import tqdm

    from medvqa.answers import open_recall
    from medvqa.confidence import image_group
    from medvqa.datasets import read_image
    from medvqa.pipeline import Conversation, Done, Pipeline
    from medvqa_train.medical import content_hash

    settings.decoder.abstain = False
    settings.decoder.image_reliance = False
    settings.decoder.open_calibration = ""  # the margins do not depend on it; no file from another model is judged
    pipeline = Pipeline.load(settings, with_retrieval=False)
    if pipeline.open_answers is None:
        raise SystemExit("this profile and engine answer no open question among training answers "
                         "(decoder.open_choices 'training_answers' with an engine that scores answers)")
    questions = held_out_open(args, pipeline.open_answers, settings.decoder)
    rows = {key: [] for key in ("margin", "correct", "recall", "share", "image", "content", "group", "data",
                                "question", "reference", "choice", "runner_up")}
    for spec, example in tqdm(questions, desc="held-out open questions", unit="q", file=sys.stderr):
        conversation = Conversation(image=read_image(example.image))
        done = [e for e in pipeline.ask(conversation, example.question, use_retrieval=False, warm=False)
                if isinstance(e, Done)][-1]
        pipeline.end_conversation(conversation, keep_image=True)
        chosen = done.open_choice
        if chosen is None:  # answered by the encoder's answer head (decoder.open_answerer "encoder_head")
            continue
        recall = open_recall(chosen["answer"], example.answer)
        rows["margin"].append(float(chosen["margin"]))
        rows["recall"].append(recall)
        rows["correct"].append(recall >= 1.0)
        rows["share"].append(float(chosen["share"]))
        rows["image"].append(str(example.image))
        rows["content"].append(content_hash(example.image))
        rows["group"].append(image_group(conversation.image))
        rows["data"].append(spec)
        rows["question"].append(example.question)
        rows["reference"].append(example.answer)
        rows["choice"].append(chosen["answer"])
        rows["runner_up"].append(chosen["runner_up"])
    return {key: np.asarray(value) for key, value in rows.items()}


def features(scores: dict, share: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(margins, the second feature or None): the log of the chosen answer's training share with `share`."""
    return scores["margin"].astype(float), (np.log(scores["share"].astype(float)) if share else None)


def fit_one(scores: dict, mask: np.ndarray, share: bool) -> tuple[float, ...]:
    margin, extra = features(scores, share)
    return fit_platt(margin[mask], scores["correct"][mask], None if extra is None else extra[mask])


def confidences(fit: tuple[float, ...], scores: dict, mask: np.ndarray, share: bool) -> np.ndarray:
    margin, extra = features(scores, share)
    z = fit[0] * margin[mask] + fit[1] + (fit[2] * extra[mask] if extra is not None else 0.0)
    return 1.0 / (1.0 + np.exp(-z))


def out_of_fold(scores: dict, mask: np.ndarray, share: bool, seed: int = 0, draws: int = 1) -> np.ndarray:
    """Each masked question's confidence from a fit on the other folds, drawn by image content
    (calibrate_closed.folds_by_content); with `draws` > 1 the mean over that many draws of the folds (seeds
    `seed`, `seed` + 1, ...), as calibrate_closed.out_of_fold."""
    part = {key: value[mask] for key, value in scores.items()}

    def one_draw(which: np.ndarray) -> np.ndarray:
        held = np.zeros(len(which))
        for k in range(FOLDS):
            rest = which != k
            held[~rest] = confidences(fit_one(part, rest, share), part, ~rest, share)
        return held

    return np.mean([one_draw(folds_by_content(part["content"], FOLDS, seed + k)) for k in range(draws)], axis=0)


def log_loss(confidence: np.ndarray, correct: np.ndarray) -> float:
    p = np.clip(confidence, 1e-6, 1 - 1e-6)
    return float(-np.mean(np.where(correct, np.log(p), np.log(1 - p))))


def fitted_part(scores: dict, mask: np.ndarray, share: bool, target: float, name: str | None) -> tuple[Calibration, np.ndarray]:
    """The calibration of the masked questions (meta: their count, out-of-fold table, threshold) and their
    out-of-fold confidences."""
    correct = scores["correct"][mask]
    fit = fit_one(scores, mask, share)
    held = out_of_fold(scores, mask, share, draws=FOLD_DRAWS)
    in_sample = confidences(fit, scores, mask, share)
    threshold = choose_threshold(held, correct, target)
    if not threshold["met"]:
        threshold["abstain"] = True  # no confidence answers these at the target: the app says "Uncertain" to all
    # What the answers the app withholds were worth (all of them where no threshold is met): what it says then.
    withheld = held < threshold["min_confidence"] if threshold["met"] else np.ones(len(held), bool)
    meta = {"questions": int(mask.sum()), "images": len(set(scores["content"][mask].tolist())),
            "accuracy": round(float(correct.mean()), 4),
            "reliability_in_sample": reliability(in_sample, correct),
            "out_of_fold": {**summary_at(held, correct, threshold["min_confidence"] or 1.0),
                            "log_loss": round(log_loss(held, correct), 4),
                            "reliability": reliability(held, correct, split_at=threshold["min_confidence"],
                                                       min_count=MIN_BIN_ANSWERS),
                            "risk_coverage": risk_coverage(held, correct)},
            "threshold": threshold,
            "withheld_out_of_fold": {"n": int(withheld.sum()),
                                     "accuracy": round(float(correct[withheld].mean()), 4) if withheld.any() else None}}
    if name:
        meta["group"] = name
    return Calibration({OPEN_CHOICE: fit}, meta), held


def by_data(scores: dict, answered: np.ndarray) -> dict:
    """Per data spec: the chosen questions, their accuracy, and the share the app answers with their accuracy."""
    table = {}
    for spec in sorted(set(scores["data"].tolist())):
        mine = scores["data"] == spec
        kept = mine & answered
        table[spec] = {"questions": int(mine.sum()), "accuracy": round(float(scores["correct"][mine].mean()), 4),
                       "answered": round(float(kept.sum() / mine.sum()), 4),
                       "accuracy_answered": round(float(scores["correct"][kept].mean()), 4) if kept.any() else None}
    return table


def open_choices_meta(settings) -> dict:
    """What the file was fitted with, which Calibration.unusable_for_open checks against the app's settings."""
    from medvqa.config import resolve_path
    from medvqa.open_choices import OpenAnswers, fitted_settings

    head = None
    if settings.decoder.open_answerer == "encoder_head":
        from calibrate_closed import answer_head_digest

        head = answer_head_digest(settings)
    return fitted_settings(settings.decoder, OpenAnswers.load(resolve_path(settings.decoder.open_answers)).digest, head)


def stamp(args, settings) -> dict:
    """What the scores depend on, kept with them so that --reuse refits only scores of this model, these open
    choices and this hold-out."""
    from medvqa.engines import engine_label

    projector = Path(settings.projector.weights)
    return {"projector_sha256": hashlib.sha256(projector.read_bytes()).hexdigest() if projector.is_file() else None,
            "open_choices": open_choices_meta(settings), "engine": engine_label(settings),
            "held_out": {"data": list(args.data), "val": args.val, "val_by_image": args.val_by_image,
                         "holdout_percent": args.holdout_percent or None, "seed": args.seed}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_held_out_arguments(parser, "runs/calibrate-open-scores.npz", "open_calibration")
    parser.add_argument("--no-share", dest="share", action="store_false",
                        help="fit the margin alone, not also the chosen answer's share of the candidates' training counts")
    parser.add_argument("--min-group", type=int, default=MIN_GROUP,
                        help="an image group with fewer chosen questions gets the pooled fit")
    args = parser.parse_args(argv)
    if not args.val_by_image and not args.holdout_percent:
        print("warning: without --val-by-image the held-out questions share images with training; "
              "the confidence will be too high on new images", file=sys.stderr)
    settings = load_settings(args.profile)
    if args.engine:
        settings.decoder.engine = args.engine
    if settings.decoder.open_choices != "training_answers":
        raise SystemExit(f"the {args.profile} profile writes its open answers (decoder.open_choices "
                         f"{settings.decoder.open_choices!r}): there is no chosen answer to calibrate")
    out = Path(args.out or settings.decoder.open_calibration or "weights/offline/calibration-open.json")
    fitted_with = stamp(args, settings)
    if args.reuse:
        scores = dict(np.load(args.scores))
        kept = json.loads(str(scores.pop("stamp"))) if "stamp" in scores else None
        if kept != fitted_with:
            raise SystemExit(f"{args.scores} was scored with {kept or 'an unrecorded model, data and hold-out'}, not "
                             f"{fitted_with}: score again (without --reuse), or give the --data and hold-out it was "
                             "scored with")
    else:
        scores = score_held_out(args, settings)
        Path(args.scores).parent.mkdir(parents=True, exist_ok=True)
        np.savez(args.scores, **scores, stamp=np.asarray(json.dumps(fitted_with)))
    scores["correct"] = scores["correct"].astype(bool)
    everything = np.ones(len(scores["correct"]), bool)
    calibration, pooled_held = fitted_part(scores, everything, args.share, args.target_accuracy, None)
    app_held = pooled_held.copy()
    thresholds = np.full(len(app_held), calibration.meta["threshold"]["min_confidence"] or NEVER)
    for name in sorted(set(scores["group"].tolist())):
        mine = scores["group"] == name
        if mine.sum() < args.min_group:
            continue
        part, held = fitted_part(scores, mine, args.share, args.target_accuracy, name)
        calibration.groups[name] = part
        app_held[mine] = held
        thresholds[mine] = part.meta["threshold"]["min_confidence"] or NEVER
    answered = app_held >= thresholds
    calibration.meta = {
        "fitted_on": {**fitted_with["held_out"], "questions": int(len(scores["correct"])),
                      "images": len(set(scores["content"].tolist())),
                      "answer_right_when": "it holds every word of the reference (open recall 1)",
                      "out_of_fold_draws": FOLD_DRAWS},
        "kind": OPEN_CHOICE,
        "projector_sha256": fitted_with["projector_sha256"],
        "open_choices": fitted_with["open_choices"],
        "engine": fitted_with["engine"],  # recorded, not checked (as for closed answers)
        "features": ["margin", *(["log training share of the chosen answer"] if args.share else [])],
        **calibration.meta,
        "group_sizes": {name: int((scores["group"] == name).sum()) for name in sorted(set(scores["group"].tolist()))},
        "app_out_of_fold": {"answered": round(float(answered.mean()), 4),
                            "accuracy_answered": (round(float(scores["correct"][answered].mean()), 4)
                                                  if answered.any() else None),
                            "log_loss": round(log_loss(app_held, scores["correct"]), 4),
                            "by_data": by_data(scores, answered)},
        "command": "python " + " ".join(["scripts/calibrate_open.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    calibration.save(out)
    print(f"{len(scores['correct'])} held-out open questions chosen among training answers, on "
          f"{calibration.meta['fitted_on']['images']} images; right {scores['correct'].mean():.3f}; written to {out}",
          file=sys.stderr)
    print(json.dumps({"fits": {name: dict(zip("abc", (round(v, 4) for v in part.fits[OPEN_CHOICE])))
                               for name, part in {"pooled": calibration, **calibration.groups}.items()},
                      "groups": {name: {"questions": part.meta["questions"], "accuracy": part.meta["accuracy"],
                                        "log_loss_out_of_fold": part.meta["out_of_fold"]["log_loss"],
                                        "threshold": part.meta["threshold"]}
                                 for name, part in calibration.groups.items()},
                      "threshold": calibration.meta["threshold"],
                      "app_out_of_fold": calibration.meta["app_out_of_fold"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
