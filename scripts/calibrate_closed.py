"""Fit the confidence of closed answers on held-out training images (medvqa/confidence.py).

    python scripts/calibrate_closed.py --profile offline --data vqa-rad:train slake:train --val 400 \\
        --val-by-image --out weights/offline/calibration.json

Takes the images `train_projector.py --val 400 --val-by-image` left out of training (same data, same
seed: whole images the projector never saw), asks the app every closed question about them as a
clinician would (constrained options, the profile's yes_bias; no abstention while fitting) and fits
P(right | option margin) per kind of question (yes/no, "A or B", and yes/no questions scored through the
open question they presuppose, medvqa/presuppose.py). Never run it on a validation or test
split. The fit is written to --out with where it came from; the scores are kept (--scores) so that
--reuse refits without the model.

Besides the in-sample reliability table, it reports the fit out of sample: 5 folds by image, each
fitted on the other four, give each question a confidence it was not fitted on (the folds are drawn
FOLD_DRAWS = 10 times and each question gets the mean of its 10 out-of-fold confidences, so that the
threshold does not hang on one draw); the share answered
and their accuracy at decoder.min_confidence, the reliability table the app shows the clinician, and
the risk-coverage curve come from those. From the same confidences it chooses the abstention
threshold: the lowest on a grid (0.50-0.95) at which the answered questions (20 at least) are right
at least --target-accuracy of the time, so the most are answered at that accuracy; when none reaches
it the file says so and the app keeps decoder.min_confidence. The last line is JSON.

The same is done for each group of images (medvqa.confidence.image_group: with colour, such as stained
slides, or grey, such as radiographs) holding at least 200 of the questions: its own fits, out-of-fold
table and threshold, which the app uses for images of that group (`groups` in the file). The pooled
fields stay, for images of groups too small to fit and for comparison; `app_out_of_fold` is what the
app does with both: the share answered and their accuracy, out of fold, each question judged by its
group's fit and threshold.

With --wording-similarity S, each image group is split by the question's wording: the questions at least
S similar (MiniLM cosine, in answer_head.question_form) to one of the training images' yes/no questions
(kept in decoder.head_questions by scripts/build_head_questions.py) and the rest ("grey, worded like
training", "grey, worded otherwise") each get their own fits, table and threshold when they number
MIN_PER_GROUP or more (else the image group's); a part whose threshold reaches no target gets
decoder.min_confidence, as the app does. SLAKE's templated questions are
right more often at the same margin than VQA-RAD's freely worded ones, which set the grey threshold
(docs/evaluation.md). The file's `wording` names S and the yes/no questions (by SHA-256).

With --head-agreement, each image group's yes/no questions the decoder answers (Yes against No, or through the
presupposed open question) are split by whether the encoder's answer head (decoder.answer_head) reads them the
same way: "grey, image encoder agrees" and "grey, image encoder disagrees" each get their own fits, table and
threshold when they number MIN_PER_GROUP or more (the app says "Uncertain" to every answer of a part reaching
no target, where decoder.min_confidence would answer some below it); the
questions naming their options keep the image group's. Each part's fits also weigh how firmly the head reads
the question (P(right) = sigmoid(a * margin + b + c * strength); the strength is the head's |Yes − No| logit for
a question at least --strength-similarity like a training yes/no question, as --wording-similarity measures it,
and 0 for the rest, whose wording the head was not trained on); --no-head-strength fits the margin alone. The
decoder still answers every question; the app uses these parts with decoder.head_agreement on. The file's
`agreement` names the head (heads_digest) and how it weighs the strength (`strength`: the similarity, and the
yes/no questions by SHA-256; null for the margin alone).

With decoder.closed_answerer "encoder_head" (MEDVQA_DECODER__CLOSED_ANSWERER=encoder_head) the yes/no
questions of the kinds in decoder.head_answers (organ presence and those naming no attribute, by default)
are answered by the encoder's answer head, fitted as their own kind ("head"); the file, written to
decoder.head_calibration by default, names the heads (by content) and head_answers, so the app uses it
only with that answerer and those questions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np

from medvqa.config import PROFILES, load_settings
from medvqa.confidence import (AGREES, DISAGREES, HEAD, KINDS, MIN_BIN_ANSWERS, NEVER, PRESUPPOSED, WORDED,
                               WORDED_OTHERWISE, YES_NO, Calibration, fit_platt, image_group, reliability)

MIN_PER_KIND = 40  # fewer questions of a kind than this: that kind gets the pooled fit
MIN_PER_GROUP = 200  # fewer questions about an image group than this: its images get the pooled fit
THRESHOLDS = np.round(np.arange(50, 96) / 100, 2)  # the abstention thresholds the choice is made from
MIN_ANSWERED = 20  # a threshold answering fewer questions than this measures no accuracy: not chosen
# The folds are drawn this many times and each question's out-of-fold confidence is the mean over the draws. With
# one draw the chosen threshold moved with the draw: the accuracy of the answered questions is flat near the target
# over a range of thresholds (chosen open answers about grey images: 0.67-0.74 over four draws; ten draws: 0.69-0.70).
FOLD_DRAWS = 10


def score_held_out(args, settings) -> dict:
    from tqdm import tqdm

    from medvqa.answers import closed_correct
    from medvqa.datasets import read_image
    from medvqa.pipeline import Conversation, Done, Pipeline

    closed = [example for _, example in held_out_closed(args)]
    settings.decoder.abstain = False
    settings.decoder.image_reliance = False
    pipeline = Pipeline.load(settings, with_retrieval=False)
    rows = {"margin": [], "kind": [], "correct": [], "image": [], "group": [], "choice": []}
    for example in tqdm(closed, desc="held-out closed questions", unit="q", file=sys.stderr):
        conversation = Conversation(image=read_image(example.image))
        done = [e for e in pipeline.ask(conversation, example.question, use_retrieval=False, warm=False)
                if isinstance(e, Done)][-1]
        pipeline.end_conversation(conversation, keep_image=True)
        rows["margin"].append(done.closed["margin"])
        rows["kind"].append(done.closed["kind"])
        rows["correct"].append(bool(closed_correct(done.closed["choice"], example.answer)))
        rows["choice"].append(str(done.closed["choice"]))
        rows["image"].append(str(example.image))
        rows["group"].append(image_group(conversation.image))
    return {key: np.asarray(value) for key, value in rows.items()}


def held_out_closed(args) -> list[tuple[str, object]]:
    """(data spec name, example) of every closed question about the held-out images, in scoring order."""
    from medvqa.answers import closed_candidates
    from medvqa_train.data import held_out_split, load_named_specs

    examples, spec_of = load_named_specs(args.data)
    left_out = held_out_split(examples, args.val, args.val_by_image, args.seed, args.holdout_percent)[1]
    return [(spec_of[i], examples[i]) for i in left_out
            if examples[i].answer_type == "CLOSED" and closed_candidates(examples[i].question)]


def accuracy_by_kind(args, scores: dict) -> dict:
    """The app's accuracy on the held-out closed questions by kind, by data spec ("all, SPEC"), and for those
    scored through a presupposed open question by data spec and attribute (medvqa/presuppose.py)."""
    from medvqa.presuppose import presupposition

    kind, correct = scores["kind"], scores["correct"].astype(bool)
    groups = {name: kind == name for name in KINDS}
    groups["yes/no, either way"] = (kind == "yes/no") | (kind == "presupposed") | (kind == HEAD)
    questions = held_out_closed(args)
    if len(questions) == len(kind):  # the same questions (the data and hold-out the scores were made with)
        for k, (spec, _) in enumerate(questions):
            groups.setdefault(f"all, {spec}", np.zeros(len(kind), bool))[k] = True
        for k, (spec, example) in enumerate(questions):
            if kind[k] == "presupposed":
                name = f"presupposed, {spec} {presupposition(example.question).kind}"
                groups.setdefault(name, np.zeros(len(kind), bool))[k] = True
    table = {name: {"n": int(mask.sum()), "accuracy": round(float(correct[mask].mean()), 4)}
             for name, mask in groups.items() if mask.any()}
    for name, mask in groups.items():
        if mask.any():
            print(f"  {name}: {mask.sum()} questions, {100 * correct[mask].mean():.1f} % right", file=sys.stderr)
    return table


def groups_by_data(scores: dict) -> dict:
    """How many held-out closed questions of each --data spec fall in each image group ({} when the
    scores' data specs are not known)."""
    if "data" not in scores:
        return {}
    table: dict[str, dict[str, int]] = {}
    for spec, group in zip(scores["data"].tolist(), scores["group"].tolist()):
        table.setdefault(spec, {}).setdefault(group, 0)
        table[spec][group] += 1
    return table


def fit(margin: np.ndarray, kind: np.ndarray, correct: np.ndarray, strength: np.ndarray | None = None) -> Calibration:
    """Per kind, P(right | margin) (and the answer head's `strength`, when given); a kind with fewer than
    MIN_PER_KIND questions gets the fit of all of them."""
    pooled = fit_platt(margin, correct, strength)
    fits = {}
    for name in KINDS:
        mine = kind == name
        if name == HEAD and not mine.any():  # the decoder answered every yes/no question
            continue
        fits[name] = (fit_platt(margin[mine], correct[mine], None if strength is None else strength[mine])
                      if mine.sum() >= MIN_PER_KIND else pooled)
    return Calibration(fits)


def kind_counts(kinds: np.ndarray) -> dict[str, int]:
    """Questions of each kind (the answer head's only when it answered some)."""
    return {name: int((kinds == name).sum()) for name in KINDS if name != HEAD or (kinds == HEAD).any()}


def folds_by_content(content: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Each question's fold, drawn by its image's content with `seed` (PathVQA repeats one image under many file
    names, and the copies must fall in one fold)."""
    images = sorted(set(content.tolist()))
    random.Random(seed).shuffle(images)
    fold_of = {image: i % folds for i, image in enumerate(images)}
    return np.asarray([fold_of[image] for image in content.tolist()])


def out_of_fold(scores: dict, folds: int = 5, seed: int = 0, draws: int = 1) -> np.ndarray:
    """Each question's confidence from a fit on the other folds (folds_by_content); with the scores' "strength"
    (the answer head's), fitted on it too. With `draws` > 1, the folds are drawn that many times (seeds `seed`,
    `seed` + 1, ...) and each question gets the mean of its out-of-fold confidences: still from fits that
    never saw it, and no longer hanging on one draw of the folds (FOLD_DRAWS)."""
    content = image_contents(scores["image"])
    strength = scores.get("strength")

    def one_draw(which: np.ndarray) -> np.ndarray:
        confidence = np.zeros(len(which))
        for k in range(folds):
            rest = which != k
            calibration = fit(scores["margin"][rest], scores["kind"][rest], scores["correct"][rest],
                              None if strength is None else strength[rest])
            for i in np.flatnonzero(~rest):
                confidence[i] = calibration.confidence(float(scores["margin"][i]), str(scores["kind"][i]),
                                                       None if strength is None else float(strength[i]))
        return confidence

    return np.mean([one_draw(folds_by_content(content, folds, seed + k)) for k in range(draws)], axis=0)


def load_scores(path) -> tuple[dict, str | None]:
    """Scores this script kept (--scores), margins as floats and `correct` as booleans, and the engine that made
    them (None for scores kept before it was recorded)."""
    scores = dict(np.load(path))
    engine = str(scores.pop("engine")) if "engine" in scores else None
    return {**scores, "margin": scores["margin"].astype(float), "correct": scores["correct"].astype(bool)}, engine


_CONTENT: dict[str, str] = {}


def image_contents(paths) -> np.ndarray:
    """Each image file's content hash (the path itself for a file not found), computed once per file."""
    from medvqa_train.medical import content_hash

    missing = 0
    for path in set(map(str, paths)) - _CONTENT.keys():
        found = Path(path).is_file()
        missing += not found
        _CONTENT[path] = content_hash(path) if found else path
    if missing:
        print(f"warning: {missing} image files of the scores are not found here: their questions are folded by file "
              "name, so copies of one image may fall in two folds and the thresholds differ from a refit beside the "
              "images", file=sys.stderr)
    return np.asarray([_CONTENT[str(path)] for path in paths])


def image_groups(paths) -> np.ndarray:
    """image_group of each image file (scores saved before the groups were kept)."""
    from medvqa.datasets import read_image

    seen: dict[str, str] = {}
    for path in map(str, paths):
        if path not in seen:
            seen[path] = image_group(read_image(path))
    return np.asarray([seen[str(path)] for path in paths])


def fit_groups(scores: dict, configured: float, target: float) -> dict[str, tuple[Calibration, np.ndarray]]:
    """Per image group with MIN_PER_GROUP questions or more: its fit (meta: what it was fitted on, its
    out-of-fold table and chosen threshold) and its questions' out-of-fold confidences."""
    fitted = {}
    for name in sorted(set(scores["group"].tolist())):
        mine = scores["group"] == name
        if mine.sum() < MIN_PER_GROUP:
            continue
        part = {key: value[mine] for key, value in scores.items()}
        correct = part["correct"]
        calibration = fit(part["margin"], part["kind"], correct, part.get("strength"))
        held = out_of_fold(part, draws=FOLD_DRAWS)
        threshold = choose_threshold(held, correct, target)
        calibration.meta = {
            "questions": int(mine.sum()), "images": distinct_images(part["image"].tolist()),
            "by_kind": kind_counts(part["kind"]),
            "out_of_fold": {"min_confidence": configured, **summary_at(held, correct, configured),
                            "reliability": reliability(held, correct, split_at=threshold["min_confidence"],
                                                       min_count=MIN_BIN_ANSWERS),
                            "risk_coverage": risk_coverage(held, correct)},
            "threshold": threshold, "group": name}
        fitted[name] = (calibration, held)
    return fitted


def worded_groups(groups: np.ndarray, similarity: np.ndarray, like: float | None) -> np.ndarray:
    """Each question's image group split by its wording: confidence.WORDED added where its similarity to
    the nearest training yes/no question is at least `like` ("grey, worded like training"),
    WORDED_OTHERWISE elsewhere (None: the image groups)."""
    if like is None:
        return groups
    return np.asarray([group + (WORDED if value >= like else WORDED_OTHERWISE)
                       for group, value in zip(groups.tolist(), np.asarray(similarity).tolist())])


def fit_worded(scores: dict, worded: np.ndarray, configured: float, target: float) -> dict:
    """fit_groups for both parts of each image group (worded like training, and otherwise), each with
    MIN_PER_GROUP questions or more; a part with fewer keeps its image group's fit."""
    return fit_groups({**scores, "group": worded}, configured, target)


def head_margins(settings, questions: list) -> np.ndarray:
    """The encoder's answer head's Yes-minus-No logit for each (data spec, example) of `questions`, each image
    encoded once (the head reads the encoder's tokens before the projector). On the CPU in fp32, as the
    offline profile runs; on a GPU the app's encoder may run in half precision, which can flip a reading
    whose margin is near 0."""
    import torch
    from tqdm import tqdm

    from medvqa.answer_head import AnswerHead
    from medvqa.config import resolve_path
    from medvqa.datasets import read_image
    from medvqa.vision import build_vision, encoder_sha256

    head = AnswerHead.load(resolve_path(settings.decoder.answer_head))
    vision = build_vision(settings.vision, torch.device("cpu"), torch.float32, settings.offline)
    head.check_encoder(encoder_sha256(settings.vision), vision.hidden_size, vision.num_tokens)
    tokens: dict[str, torch.Tensor] = {}
    margins = []
    for _, example in tqdm(questions, desc="the answer head's readings", unit="q", file=sys.stderr):
        key = str(example.image)
        if key not in tokens:
            with torch.inference_mode():
                tokens[key] = vision.encode(vision.preprocess([read_image(example.image)]))
        yes, no = head.yes_no_logits(tokens[key], [example.question])[0].tolist()
        margins.append(yes - no)
    return np.asarray(margins)


def decoder_choices(scores: dict, path) -> np.ndarray:
    """The decoder's answer to each question, lower-cased, as kept with the scores (score_held_out)."""
    if "choice" not in scores:
        raise SystemExit(f"{path} was scored before the decoder's answers were kept with the scores: score again "
                         "(without --reuse)")
    return np.asarray([str(choice).strip().lower() for choice in scores["choice"].tolist()])


def agreement_groups(groups: np.ndarray, kinds: np.ndarray, choices: np.ndarray, margins: np.ndarray) -> np.ndarray:
    """Each yes/no question the decoder answered (kinds YES_NO and PRESUPPOSED, answer yes or no) labelled
    with its image group and whether the head's reading (margin ≥ 0: yes) is the decoder's answer
    (confidence.AGREES, DISAGREES); other questions keep their image group."""
    labels = []
    for group, kind, choice, margin in zip(groups.tolist(), kinds.tolist(), choices.tolist(), margins.tolist()):
        if kind in (YES_NO, PRESUPPOSED) and choice in ("yes", "no"):
            labels.append(group + (AGREES if (margin >= 0) == (choice == "yes") else DISAGREES))
        else:
            labels.append(group)
    return np.asarray(labels)


def agreement_by_data(scores: dict, labels: np.ndarray) -> dict:
    """The decoder's accuracy per --data spec on the questions the head agrees with, those it does not, and
    those it does not read (printed, and kept in the file's `agreement`); {} without the scores' data specs."""
    if "data" not in scores:
        return {}
    part = np.asarray(["agrees" if label.endswith(AGREES) else "disagrees" if label.endswith(DISAGREES)
                       else "not read" for label in labels.tolist()])
    table: dict[str, dict] = {}
    for spec in sorted(set(scores["data"].tolist())):
        for name in ("agrees", "disagrees", "not read"):
            mine = (scores["data"] == spec) & (part == name)
            if mine.any():
                table.setdefault(spec, {})[name] = {"n": int(mine.sum()),
                                                     "accuracy": round(float(scores["correct"][mine].mean()), 4)}
                print(f"  {spec}, the head {name if name != 'not read' else 'not reading'}: {int(mine.sum())} "
                      f"questions, the decoder {100 * scores['correct'][mine].mean():.1f} % right", file=sys.stderr)
    return table


def fit_agreement(scores: dict, labels: np.ndarray, configured: float, target: float,
                  margins: np.ndarray | None = None) -> dict:
    """fit_groups for the agreeing and disagreeing part of each image group (MIN_PER_GROUP questions or
    more each); the questions left with their image group are not fitted again. With the head's `margins`
    (head_margins), each part's fits also weigh the reading's strength (|margin|). A part whose threshold
    reaches no target is marked `abstain` (Calibration.min_confidence: NEVER)."""
    read = np.char.endswith(labels.astype(str), AGREES) | np.char.endswith(labels.astype(str), DISAGREES)
    parts = {**scores, "group": labels, **({} if margins is None else {"strength": np.abs(margins)})}
    fitted = fit_groups({key: value[read] for key, value in parts.items()}, configured, target)
    for calibration, _ in fitted.values():
        # No confidence of the part reached the target out of fold: the app says "Uncertain" to all of them
        # (decoder.min_confidence would answer some at an accuracy measured below the target).
        if not calibration.meta["threshold"]["met"]:
            calibration.meta["threshold"]["abstain"] = True
    return fitted


def app_out_of_fold(scores: dict, held: np.ndarray, threshold: float, fitted: dict,
                    parts: np.ndarray | None = None, parts_fitted: dict | None = None,
                    configured: float | None = None) -> dict:
    """What the app does out of fold: each question judged by its group's confidence and threshold
    (the pooled ones for a group without a fit), and, where the file splits the groups into parts (by
    wording or by the head's agreement), by its part's (`parts`: worded_groups' or agreement_groups'
    labels, `parts_fitted`: fit_worded's or fit_agreement's). A group or part whose threshold reached no
    target gets `configured` (decoder.min_confidence), as in the app."""
    confidence, bar, thresholds = held.copy(), np.full(len(held), threshold), {}
    for labels, fits in ((scores["group"], fitted), (parts, parts_fitted or {})):
        for name, (calibration, group_held) in fits.items():
            mine = labels == name
            confidence[mine] = group_held
            chosen = calibration.meta["threshold"]
            bar[mine] = (chosen["min_confidence"] if chosen["met"] else NEVER if chosen.get("abstain")
                         else threshold if configured is None else configured)
            thresholds[name] = None if bar[mine][0] == NEVER else float(bar[mine][0])
    kept, correct = confidence >= bar, scores["correct"]
    result = {"answered": round(float(kept.mean()), 4),
              "accuracy_answered": round(float(correct[kept].mean()), 4) if kept.any() else None,
              "thresholds": thresholds}
    if "data" in scores:  # per --data spec, with the pooled fit and threshold alone for comparison
        pooled = held >= threshold
        result["by_data"] = {}
        for spec in sorted(set(scores["data"].tolist())):
            mine = scores["data"] == spec
            result["by_data"][spec] = {
                "questions": int(mine.sum()),
                "answered": round(float(kept[mine].mean()), 4),
                "accuracy_answered": round(float(correct[mine & kept].mean()), 4) if (mine & kept).any() else None,
                "pooled_answered": round(float(pooled[mine].mean()), 4),
                "pooled_accuracy_answered": (round(float(correct[mine & pooled].mean()), 4)
                                             if (mine & pooled).any() else None)}
    return result


def summary_at(confidence: np.ndarray, correct: np.ndarray, threshold: float) -> dict:
    kept = confidence >= threshold
    return {"answered": round(float(kept.mean()), 4),
            "accuracy_answered": round(float(correct[kept].mean()), 4) if kept.any() else None,
            "accuracy_all": round(float(correct.mean()), 4)}


def risk_coverage(confidence: np.ndarray, correct: np.ndarray) -> dict:
    """Answering only the questions at or above each confidence, highest first: the share answered and
    their accuracy. One point per distinct confidence, since no threshold can split a tie."""
    order = np.argsort(-confidence, kind="stable")
    ranked_confidence, ranked_correct = confidence[order], correct[order].astype(np.float64)
    answered = np.arange(1, len(order) + 1)
    last_of_tie = np.append(ranked_confidence[1:] != ranked_confidence[:-1], True)
    return {"min_confidence": np.round(ranked_confidence[last_of_tie], 4).tolist(),
            "coverage": np.round(answered[last_of_tie] / len(order), 4).tolist(),
            "accuracy_answered": np.round((np.cumsum(ranked_correct) / answered)[last_of_tie], 4).tolist()}


def choose_threshold(confidence: np.ndarray, correct: np.ndarray, target: float) -> dict:
    """The lowest threshold in THRESHOLDS at which the answered questions' accuracy reaches `target`:
    the share answered only falls as the threshold rises (their accuracy need not rise), so it answers
    the most at that accuracy. On out-of-fold confidences, so the fit does not grade itself; and on at
    least MIN_ANSWERED answered questions, so that a lucky handful does not pass for a measured accuracy."""
    for threshold in THRESHOLDS:
        kept = confidence >= threshold
        if kept.sum() >= MIN_ANSWERED and correct[kept].mean() >= target:
            at = summary_at(confidence, correct, threshold)
            return {"target_accuracy": target, "min_answered": MIN_ANSWERED, "min_confidence": float(threshold),
                    "met": True,
                    "answered_share_out_of_fold": at["answered"],
                    "accuracy_answered_out_of_fold": at["accuracy_answered"]}
    return {"target_accuracy": target, "min_answered": MIN_ANSWERED, "min_confidence": None, "met": False,
            "answered_share_out_of_fold": None, "accuracy_answered_out_of_fold": None}


def check_scored(questions: list, scores: dict, path) -> None:
    """Refuse scores made on other questions than held_out_closed's (by count and image, in order)."""
    if len(questions) != len(scores["correct"]) or any(
            str(example.image) != image for (_, example), image in zip(questions, scores["image"].tolist())):
        raise SystemExit(f"{path} was not scored on the held-out questions of --data: give the --data and hold-out "
                         "it was scored with, or score again")


def questions_head(settings):
    """The answer head with its training questions (decoder.head_questions), for their yes/no questions."""
    from medvqa.answer_head import AnswerHead
    from medvqa.config import resolve_path

    head = AnswerHead.load(resolve_path(settings.decoder.answer_head))
    head.attach_questions(resolve_path(settings.decoder.head_questions) if settings.decoder.head_questions else "")
    if not head.yes_no_questions:
        raise SystemExit(f"{settings.decoder.head_questions} holds no yes/no questions: rebuild it with "
                         "scripts/build_head_questions.py")
    return head


def training_similarity(settings, args, questions: list) -> tuple[np.ndarray, str]:
    """(each question's similarity to the nearest training yes/no question of decoder.head_questions, those
    questions' digest); refused when the file was built with another hold-out than these scores."""
    with_questions = questions_head(settings)
    built_with = with_questions.questions_meta.get("holdout_percent")
    if built_with is not None and float(built_with) != float(args.holdout_percent or 0):
        raise SystemExit(f"{settings.decoder.head_questions} was built with --holdout-percent {built_with}, these "
                         f"scores with {args.holdout_percent}: its yes/no questions may hold the held-out ones")
    similarity = np.asarray(with_questions.yes_no_similarity([example.question for _, example in questions]))
    return similarity, with_questions.yes_no_digest


def answer_head_digest(settings) -> str:
    from medvqa.answer_head import AnswerHead
    from medvqa.config import resolve_path

    return AnswerHead.digest_of(resolve_path(settings.decoder.answer_head))


def distinct_images(paths: list[str]) -> int:
    """Images by content: PathVQA repeats one image under many file names."""
    from medvqa_train.medical import content_hash

    return len({content_hash(path) if Path(path).is_file() else path for path in set(paths)})


def add_held_out_arguments(parser: argparse.ArgumentParser, scores: str, setting: str) -> None:
    """The profile and engine to score with, the training data and hold-out as train_projector.py takes them, the
    file to write (by default the profile's decoder.`setting`), where the scores are kept (`scores`), and the target
    accuracy (this script's and calibrate_open.py's)."""
    parser.add_argument("--profile", default="offline", choices=sorted(PROFILES))
    parser.add_argument("--engine", default="", help="decoder engine (default: the profile's choice)")
    parser.add_argument("--data", nargs="+", default=["vqa-rad:train", "slake:train"],
                        help="the training data, as given to train_projector.py")
    parser.add_argument("--val", type=int, default=400, help="as given to train_projector.py")
    parser.add_argument("--val-by-image", action="store_true", help="as given to train_projector.py")
    parser.add_argument("--holdout-percent", type=float, default=0.0, help="as given to train_projector.py")
    parser.add_argument("--seed", type=int, default=0, help="as given to train_projector.py")
    parser.add_argument("--out", default=None, help=f"calibration file (default: the profile's decoder.{setting})")
    parser.add_argument("--scores", default=scores)
    parser.add_argument("--reuse", action="store_true", help="refit from the saved scores")
    parser.add_argument("--target-accuracy", type=float, default=0.8,
                        help="the out-of-fold accuracy of answered questions the abstention threshold is chosen for")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_held_out_arguments(parser, "runs/calibrate-closed-scores.npz", "calibration")
    parser.add_argument("--head-agreement", action="store_true",
                        help="also fit, within each image group, the decoder's yes/no answers the encoder's answer "
                             "head agrees with and those it does not apart (used with decoder.head_agreement)")
    parser.add_argument("--no-head-strength", dest="head_strength", action="store_false",
                        help="with --head-agreement, fit each part on the decoder's margin alone, not also on how "
                             "firmly the head reads the question")
    parser.add_argument("--strength-similarity", type=float, default=0.9,
                        help="with --head-agreement: the head's strength counts for questions at least this similar to "
                             "a training yes/no question (0: every question); the rest count as read with strength 0")
    parser.add_argument("--wording-similarity", type=float, default=None,
                        help="also fit, within each image group, the questions at least this similar to a training "
                             "yes/no question apart (the yes/no questions of decoder.head_questions)")
    args = parser.parse_args(argv)
    if not args.val_by_image and not args.holdout_percent:
        print("warning: without --val-by-image the held-out questions share images with training; "
              "the confidence will be too high on new images", file=sys.stderr)

    if args.head_agreement and args.wording_similarity is not None:
        parser.error("--head-agreement and --wording-similarity split the image groups two ways; give one")
    settings = load_settings(args.profile)
    if args.engine:
        settings.decoder.engine = args.engine
    head = settings.decoder.closed_answerer == "encoder_head"
    out = Path(args.out or (settings.decoder.head_calibration if head else settings.decoder.calibration))
    if args.reuse:
        scores, engine = load_scores(args.scores)
        if head != bool((scores["kind"] == HEAD).any()):
            raise SystemExit(f"{args.scores} holds answers {'without' if head else 'with'} the answer head; "
                             f"score again, or {'unset' if head else 'set'} MEDVQA_DECODER__CLOSED_ANSWERER")
    else:
        from medvqa.engines import engine_label

        scores = score_held_out(args, settings)
        engine = engine_label(settings)
        Path(args.scores).parent.mkdir(parents=True, exist_ok=True)
        np.savez(args.scores, **scores, engine=np.asarray(engine))
    if "group" not in scores:  # scores kept before the image groups were: from the image files
        scores["group"] = image_groups(scores["image"])
    margin, kind, correct = scores["margin"].astype(float), scores["kind"], scores["correct"].astype(bool)
    scores = {**scores, "margin": margin, "correct": correct}
    calibration = fit(margin, kind, correct)
    in_sample = np.asarray([calibration.confidence(float(m), str(k)) for m, k in zip(margin, kind)])
    held = out_of_fold(scores, draws=FOLD_DRAWS)
    configured = settings.decoder.min_confidence
    questions = held_out_closed(args)
    if len(questions) == len(correct):  # the questions the scores were made with: their data specs
        scores["data"] = np.asarray([spec for spec, _ in questions])
    fitted = fit_groups(scores, configured, args.target_accuracy)
    calibration.groups = {name: group for name, (group, _) in fitted.items()}
    worded, worded_fitted, wording = None, {}, None
    if args.wording_similarity is not None:
        check_scored(questions, scores, args.scores)
        similarity, yes_no_digest = training_similarity(settings, args, questions)
        worded = worded_groups(scores["group"], similarity, args.wording_similarity)
        worded_fitted = fit_worded(scores, worded, configured, args.target_accuracy)
        calibration.groups.update({name: group for name, (group, _) in worded_fitted.items()})
        wording = {"min_similarity": args.wording_similarity, "yes_no_questions_sha256": yes_no_digest,
                   "questions": {name: int((worded == name).sum()) for name in sorted(set(worded.tolist()))}}
    agreement = None
    if args.head_agreement:
        if head:
            raise SystemExit("--head-agreement splits the decoder's answers by the head's reading; with "
                             "decoder.closed_answerer 'encoder_head' the head answers them itself")
        check_scored(questions, scores, args.scores)
        margins = head_margins(settings, questions)
        labels = agreement_groups(scores["group"], kind, decoder_choices(scores, args.scores), margins)
        strength, weighed = None, None
        if args.head_strength and args.strength_similarity > 0:
            similarity, yes_no_digest = training_similarity(settings, args, questions)
            strength = np.where(similarity >= args.strength_similarity, margins, 0.0)
            weighed = {"min_similarity": args.strength_similarity, "yes_no_questions_sha256": yes_no_digest}
        elif args.head_strength:
            strength, weighed = margins, {"min_similarity": 0.0}
        agreed = fit_agreement(scores, labels, configured, args.target_accuracy, strength)
        calibration.groups.update({name: group for name, (group, _) in agreed.items()})
        worded, worded_fitted = labels, agreed  # the parts app_out_of_fold judges each question by
        agreement = {"answer_head_digest": answer_head_digest(settings), "strength": weighed,
                     "questions": {name: int((labels == name).sum()) for name in sorted(set(labels.tolist()))},
                     "accuracy_by_data": agreement_by_data(scores, labels)}
    projector = Path(settings.projector.weights)
    pooled_threshold = choose_threshold(held, correct, args.target_accuracy)
    calibration.meta = {
        "fitted_on": {"data": args.data, "val": args.val, "val_by_image": args.val_by_image,
                      "holdout_percent": args.holdout_percent or None, "seed": args.seed,
                      "questions": int(len(correct)), "images": distinct_images(scores["image"].tolist()),
                      "by_kind": kind_counts(kind), "out_of_fold_draws": FOLD_DRAWS},
        "projector_sha256": hashlib.sha256(projector.read_bytes()).hexdigest() if projector.is_file() else None,
        "yes_bias": settings.decoder.yes_bias,
        "engine": engine,  # the engine that scored the answers (recorded, not checked: docs/evaluation.md)
        **({"closed_answerer": "encoder_head", "answer_head_digest": answer_head_digest(settings),
            "head_answers": sorted(settings.decoder.head_answers)} if head else {}),
        "reliability_in_sample": reliability(in_sample, correct),
        "out_of_fold": {"min_confidence": configured, **summary_at(held, correct, configured),
                        "reliability": reliability(held, correct, split_at=pooled_threshold["min_confidence"],
                                                   min_count=MIN_BIN_ANSWERS),
                        "risk_coverage": risk_coverage(held, correct)},
        "threshold": pooled_threshold,
        "group_sizes": {name: int((scores["group"] == name).sum()) for name in sorted(set(scores["group"].tolist()))},
        "groups_by_data": groups_by_data(scores),
        **({"wording": wording} if wording else {}),
        **({"agreement": agreement} if agreement else {}),
        "command": ("MEDVQA_DECODER__CLOSED_ANSWERER=encoder_head " if head else "") + "python "
                   + " ".join(["scripts/calibrate_closed.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    chosen = calibration.meta["threshold"]
    calibration.meta["app_out_of_fold"] = app_out_of_fold(
        scores, held, chosen["min_confidence"] if chosen["met"] else configured, fitted, worded, worded_fitted,
        configured)
    out.parent.mkdir(parents=True, exist_ok=True)
    calibration.save(out)
    print(f"{len(correct)} held-out closed questions on {calibration.meta['fitted_on']['images']} images; "
          f"accuracy {correct.mean():.3f}; written to {out}", file=sys.stderr)
    if not calibration.meta["threshold"]["met"]:
        print(f"no threshold up to {THRESHOLDS[-1]} reaches an out-of-fold accuracy of {args.target_accuracy} on "
              f"{MIN_ANSWERED} or more answered questions: the app keeps decoder.min_confidence ({configured})",
              file=sys.stderr)
    by_kind = accuracy_by_kind(args, scores)
    summary = {key: value for key, value in calibration.meta["out_of_fold"].items() if key != "risk_coverage"}
    print(json.dumps({"fits": {k: {"a": round(a, 4), "b": round(b, 4)} for k, (a, b) in calibration.fits.items()},
                      "part_fits": {name: {k: dict(zip("abc", (round(v, 4) for v in fit)))
                                           for k, fit in group.fits.items()}
                                    for name, group in calibration.groups.items() if group.weighs_strength},
                      "out_of_fold": summary, "threshold": calibration.meta["threshold"],
                      "groups": {name: {"questions": group.meta["questions"], "threshold": group.meta["threshold"]}
                                 for name, group in calibration.groups.items()},
                      "app_out_of_fold": calibration.meta["app_out_of_fold"], "accuracy_by_kind": by_kind}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
