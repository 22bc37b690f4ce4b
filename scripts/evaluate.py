"""Evaluate a profile on VQA-RAD, SLAKE or a JSONL benchmark, under four conditions.

    python scripts/evaluate.py --dataset vqa-rad --split test --json runs/eval-vqa-rad.json
    python scripts/evaluate.py --dataset slake --split validate --limit 300

Conditions: with retrieval, without retrieval, with a shuffled image (each question paired with
another image of the same split, a fixed derangement: inputs stay in distribution, so this is the
fair test of whether the image is used) and with a blank (all-black) image; on request also
`random_image`, another image of the split drawn at random (a seeded derangement): the shuffled
image is the next one in sorted order, often a scan of the same series, which tests whether the
model tells similar scans apart rather than whether it reads one at all. Closed questions are
answered by constrained decoding over the options they name (the offline profile's default) and, in the main
condition, also by free generation. Greedy decoding, fixed seeds. Per-question results are appended
to a JSONL file so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import sys
from pathlib import Path


import numpy as np
import torch
from tqdm import tqdm

from medvqa.answers import (CLOSED_DECODING, closed_candidates, closed_correct, first_yes_no, open_exact,
                            open_recall)
from medvqa.confidence import HEAD, NEVER, PRESUPPOSED, image_group
from medvqa.config import PROFILES, load_settings, resolve_path
from medvqa.datasets import VQAExample, load_examples, read_image
from medvqa.engines import engine_label
from medvqa.model import BLANK_IMAGE
from medvqa.open_choices import judged
from medvqa.pipeline import Pipeline
from medvqa.presuppose import KINDS as PRESUPPOSED_KINDS

CONDITIONS = ("retrieval", "no_retrieval", "shuffled_image", "blank_image", "random_image")
DEFAULT_CONDITIONS = CONDITIONS[:4]


def balanced_subset(examples: list[VQAExample], limit: int | None) -> list[VQAExample]:
    """A deterministic subset with closed and open questions in equal numbers (as far as they go)."""
    if not limit or limit >= len(examples):
        return examples
    key = lambda e: hashlib.sha256(e.qid.encode()).hexdigest()  # noqa: E731
    closed = sorted((e for e in examples if e.answer_type == "CLOSED"), key=key)
    open_ = sorted((e for e in examples if e.answer_type != "CLOSED"), key=key)
    n_closed = min(len(closed), max(limit // 2, limit - len(open_)))
    chosen = closed[:n_closed] + open_[:limit - n_closed]
    order = {e.qid: i for i, e in enumerate(examples)}
    return sorted(chosen, key=lambda e: order[e.qid])


def derangement(examples: list[VQAExample], seed: int | None = None) -> dict[Path, Path]:
    """Each image -> the next distinct image of the split in sorted order (no image maps to itself);
    with a seed, in an order shuffled by it instead (random_image). Neighbours in sorted order are
    often scans of the same series (scripts/pairing_similarity.py counts how often, on SLAKE)."""
    images = sorted({e.image for e in examples})
    if seed is not None:
        random.Random(seed).shuffle(images)
    return {image: images[(i + 1) % len(images)] for i, image in enumerate(images)}


def score(rows: list[dict], field: str) -> dict[str, float]:
    closed = [r for r in rows if r["answer_type"] == "CLOSED"]
    open_ = [r for r in rows if r["answer_type"] != "CLOSED"]
    return {
        "closed_accuracy": sum(closed_correct(r[field], r["reference"]) for r in closed) / max(1, len(closed)),
        "open_recall": sum(open_recall(r[field], r["reference"]) for r in open_) / max(1, len(open_)),
        "open_exact": sum(open_exact(r[field], r["reference"]) for r in open_) / max(1, len(open_)),
    }


def correct(row: dict, field: str) -> bool:
    if row["answer_type"] == "CLOSED":
        return closed_correct(row[field], row["reference"])
    return open_recall(row[field], row["reference"]) >= 1.0


def answered_already(row: dict, example: VQAExample, conditions: list[str], head_opens: bool) -> bool:
    """Whether a kept row holds all this run needs: an answer per condition, a closed question's margin,
    and (with decoder.open_answerer "encoder_head") an open question's head reading, but for an "open"
    question naming its options, which is scored over them and never read by the head."""
    if not all(condition in row for condition in conditions):
        return False
    if example.answer_type == "CLOSED":
        return "margin" in row
    return "head_open" in row or not head_opens or closed_candidates(example.question) is not None


def rerouted(row: dict, example: VQAExample, pipeline) -> bool:
    """Whether a kept closed row was answered along another route than the pipeline takes now (through a
    presupposed open question, by the answer head, or neither): the question's reading changed since (a kind
    added to decoder.presupposed_kinds, a phrasing no longer read), so its answer is computed again."""
    if example.answer_type != "CLOSED" or row.get("closed_kind") is None:
        return False
    options = closed_candidates(example.question)
    route = pipeline._closed_route(example.question, options)[0] if options else None
    if route in (HEAD, PRESUPPOSED):
        return row["closed_kind"] != route
    return row["closed_kind"] in (HEAD, PRESUPPOSED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("vqa-rad", "slake", "jsonl"), required=True)
    parser.add_argument("--data", default=None, help="dataset folder (default: ../shared/data/<dataset>)")
    parser.add_argument("--split", required=True)
    parser.add_argument("--limit", type=int, default=None, help="deterministic type-balanced subset of N")
    parser.add_argument("--profile", choices=PROFILES, default="offline")
    parser.add_argument("--engine", default=None, help="decoder engine (default: the profile's)")
    parser.add_argument("--json", default=None, help="write the summary object here")
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(DEFAULT_CONDITIONS))
    parser.add_argument("--no-free-closed", action="store_true",
                        help="skip free generation for closed questions (constrained decoding only)")
    parser.add_argument("--closed-only", action="store_true",
                        help="only the closed questions (open answers do not depend on decoder.closed_answerer)")
    parser.add_argument("--open-only", action="store_true",
                        help="only the open questions (closed answers do not depend on decoder.open_answerer)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--run-dir", default="runs", help="where per-question results are kept (resumable)")
    args = parser.parse_args()

    settings = load_settings(args.profile)
    if args.engine:
        settings.decoder.engine = args.engine
    # Accuracy is that of the option the model picks, at full coverage: an "Uncertain" answer would
    # hide it. How often the app would abstain is printed after (each closed answer's option margin is
    # kept, and calibrated when summarising); accuracy against coverage: scripts/evaluate_grounding.py.
    settings.decoder.abstain = False
    torch.manual_seed(settings.seed)
    examples = balanced_subset(load_examples(args.dataset, args.data, args.split), args.limit)
    shuffled = derangement(examples)  # over the whole split, so --closed-only pairs images as a full run does
    randomly = derangement(examples, seed=0)
    if args.closed_only and args.open_only:
        parser.error("--closed-only and --open-only leave no question")
    if args.closed_only:
        examples = [e for e in examples if e.answer_type == "CLOSED"]
    if args.open_only:
        examples = [e for e in examples if e.answer_type != "CLOSED"]
    pipeline = Pipeline.load(settings, with_retrieval="retrieval" in args.conditions)
    projector_id = _file_digest(settings.projector.weights)
    engine = engine_label(settings)
    gate = settings.retrieval.prompt_gate  # answers with retrieval depend on it: part of the run's name
    # Closed answers depend on how options are read and scored (answers.CLOSED_DECODING, the Yes bias).
    # and whether yes/no questions naming a value are scored through the open question they presuppose.
    presupposed = ""
    kinds = settings.decoder.presupposed_kinds
    if settings.decoder.presupposed_closed and kinds:
        # "p": the first four kinds (runs kept before "abnormality" was added); any other set is named.
        presupposed = ("p" if set(kinds) == set(PRESUPPOSED_KINDS) - {"abnormality"}
                       else "p-" + "-".join(sorted(set(kinds))) + "-")
    closed = f"{CLOSED_DECODING}{presupposed}y{settings.decoder.yes_bias:g}"
    if pipeline.head_closes:  # decoder.closed_answerer "encoder_head": which head, which questions
        closed += f"-head-{pipeline.answer_head.digest[:10]}-" + "-".join(sorted(settings.decoder.head_answers))
    if pipeline.head_opens:  # decoder.open_answerer "encoder_head": which head, above which probability
        closed += f"-openhead-{pipeline.answer_head.digest[:10]}-{settings.decoder.head_open_min_probability:g}"
        if settings.decoder.head_open_min_similarity > 0:  # and only questions like its training questions
            closed += f"-like{settings.decoder.head_open_min_similarity:g}-{pipeline.answer_head.questions_digest[:8]}"
    if pipeline.open_answers is not None:  # decoder.open_choices "training_answers": which answers, chosen how
        closed += (f"-choices{settings.decoder.open_choices_min_similarity:g}-{settings.decoder.open_choices_max}-"
                   f"{settings.decoder.open_choices_prior:g}-i{settings.decoder.open_choices_min_images}-"
                   f"{pipeline.open_answers.digest[:8]}")
    run_name = (f"eval-{args.profile}-{engine}-{args.dataset}-{args.split}-{args.limit or 'all'}-{gate}-"
                f"{closed}-{projector_id}-{_decoder_digest(settings.decoder.name_or_path)}.jsonl")
    results_path = Path(args.run_dir) / run_name
    results_path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if results_path.is_file():
        for line in results_path.read_text().splitlines():
            row = json.loads(line)
            done[row["qid"]] = row
    images: dict[Path, np.ndarray] = {}

    def image(path: Path) -> np.ndarray:
        if path not in images:
            images.clear() if len(images) > 64 else None
            images[path] = read_image(path)
        return images[path]

    main = "retrieval" if "retrieval" in args.conditions else args.conditions[0]
    with results_path.open("a") as out:
        for example in tqdm(examples, desc=f"{args.dataset} {args.split}", unit="q"):
            kept = done.get(example.qid)
            if (kept and answered_already(kept, example, args.conditions, pipeline.head_opens)
                    and not rerouted(kept, example, pipeline)):
                continue
            row = {"qid": example.qid, "question": example.question, "reference": example.answer,
                   "answer_type": example.answer_type}
            # no_retrieval first: where the prompt gate keeps passages out of this question's prompt,
            # the decoder's input with retrieval is the same, and so is its (greedy) answer.
            for condition in sorted(args.conditions, key=lambda c: c != "no_retrieval"):
                if (condition == "retrieval" and "no_retrieval" in row
                        and not pipeline.passages_in_prompt(example.question)):
                    row[condition] = row["no_retrieval"]
                    row["passages"] = [p.id for p in pipeline.retrieve(example.question)]
                    continue
                picture = {"shuffled_image": lambda: image(shuffled[example.image]),
                           "random_image": lambda: image(randomly[example.image]),
                           "blank_image": lambda: BLANK_IMAGE}.get(condition, lambda: image(example.image))()
                answered = pipeline.answer_done(picture, example.question, use_retrieval=condition == "retrieval",
                                                constrained=True, max_new_tokens=args.max_new_tokens)
                answer, passages = answered.answer, answered.passages
                row[condition] = answer
                if condition == main and example.answer_type == "CLOSED":
                    # The option margin the app's confidence is calibrated on (abstention is off while
                    # measuring); None for a closed question answered in free text, which the app never
                    # withholds. The confidence is computed from it when summarising, with the calibration
                    # in force then, so results kept from before a refit are judged by the current fit.
                    row["margin"] = (answered.closed or {}).get("margin")
                    row["closed_kind"] = (answered.closed or {}).get("kind")
                if condition == main and answered.head_open is not None:
                    # decoder.open_answerer "encoder_head": the head's answer and probability, also when
                    # the decoder answered (scripts/tune_open_head.py chooses the threshold from them).
                    row["head_open"] = {key: answered.head_open[key] for key in ("answer", "probability", "answered",
                                                                                 "similarity") if key in answered.head_open}
                if condition == main and example.answer_type != "CLOSED":
                    # decoder.open_choices: which training question's answers the decoder chose among (None:
                    # it wrote the answer freely).
                    chosen = answered.open_choice
                    row["open_choice"] = ({key: chosen[key] for key in ("nearest", "similarity", "choices", "margin")}
                                          if chosen else None)
                if condition == "retrieval":
                    row["passages"] = [p.id for p in passages]
            if example.answer_type == "CLOSED" and not args.no_free_closed and "retrieval" in args.conditions:
                row["retrieval_free"], _ = pipeline.answer(image(example.image), example.question,
                                                           use_retrieval=True, constrained=False,
                                                           max_new_tokens=args.max_new_tokens)
            done[example.qid] = row
            out.write(json.dumps(row) + "\n")
            out.flush()

    rows = [done[e.qid] for e in examples]
    main_condition = main
    summary = {"dataset": args.dataset, "split": args.split, "main_condition": main_condition, "n": len(rows),
               "n_closed": sum(r["answer_type"] == "CLOSED" for r in rows),
               "n_open": sum(r["answer_type"] != "CLOSED" for r in rows), **score(rows, main_condition)}
    for condition in CONDITIONS[1:]:
        if condition in args.conditions:
            summary[condition] = score(rows, condition)
    closed_rows = [r for r in rows if r["answer_type"] == "CLOSED"]
    decoder = settings.decoder
    for example, r in zip(examples, rows):
        if r["answer_type"] == "CLOSED":
            # As the app judges it: the fit and threshold of the image's group when the file has groups
            # (and of the question's wording, or of the answer head's agreement, where the file fits that).
            picture = image(example.image)
            reading, agrees, strength = pipeline.encoder_agrees(example.question, str(r.get(main_condition) or ""),
                                                                r.get("closed_kind"), picture)
            if reading is not None:  # as Done.closed has it
                r["encoder_reading"] = {"answer": reading.capitalize(), "agrees": agrees,
                                        **({} if strength is None else {"strength": round(strength, 4)})}
            calibration = (pipeline.calibration.for_image(picture, pipeline.wording_similarity(example.question), agrees)
                           if pipeline.calibration.groups else pipeline.calibration)
            r["confidence"] = (None if r.get("margin") is None
                               else calibration.confidence(r["margin"], r["closed_kind"], strength))
            r["threshold"] = calibration.min_confidence(decoder.min_confidence, decoder.threshold_from_calibration)
            r["calibration_group"] = calibration.group or "all"
    free = bool(closed_rows) and all("retrieval_free" in r for r in closed_rows)  # only run with retrieval
    if free:
        summary["closed_accuracy_free_generation"] = score(closed_rows, "retrieval_free")["closed_accuracy"]
    if closed_rows:
        # By what the question offers: yes/no, or options it names ("left or right"); constrained vs free.
        summary["closed_by_kind"] = {}
        for kind in ("yes_no", "options"):
            kind_rows = [r for r in closed_rows if _closed_kind(r["question"]) == kind]
            if kind_rows:
                entry = summary["closed_by_kind"][kind] = {
                    "n": len(kind_rows), "constrained": score(kind_rows, main_condition)["closed_accuracy"]}
                if free:
                    entry["free"] = score(kind_rows, "retrieval_free")["closed_accuracy"]
                for condition in ("shuffled_image", "random_image"):
                    if all(condition in r for r in kind_rows):
                        entry[condition] = score(kind_rows, condition)["closed_accuracy"]
                if kind == "yes_no":  # does the model lean to one answer?
                    entry["answered_yes"] = float(np.mean([first_yes_no(r[main_condition]) == "yes"
                                                           for r in kind_rows]))
                    entry["reference_yes"] = float(np.mean([first_yes_no(r["reference"]) == "yes"
                                                            for r in kind_rows]))
    if {"retrieval", "no_retrieval"} <= set(args.conditions):
        summary["retrieval_flips"] = {
            "right_to_wrong": sum(correct(r, "no_retrieval") and not correct(r, "retrieval") for r in rows),
            "wrong_to_right": sum(not correct(r, "no_retrieval") and correct(r, "retrieval") for r in rows)}
    if closed_rows and any(r["confidence"] is not None for r in closed_rows):
        # What the app does with these answers: below the calibrated threshold it says "Uncertain"
        # (an answer without a confidence, a closed question answered in free text, is given).
        # (a part answering nothing, confidence.NEVER, is None: JSON has no infinity)
        thresholds = {r["calibration_group"]: None if r["threshold"] == NEVER else r["threshold"] for r in closed_rows}
        kept = [r for r in closed_rows if r["confidence"] is None or r["confidence"] >= r["threshold"]]
        summary["abstention"] = {
            # One number, or one per image group met when the calibration fits groups.
            "threshold": thresholds["all"] if set(thresholds) == {"all"} else dict(sorted(thresholds.items())),
            "answered": round(len(kept) / len(closed_rows), 4),
            "accuracy_answered": round(score(kept, main_condition)["closed_accuracy"], 4) if kept else None,
            "unscored": sum(r["confidence"] is None for r in closed_rows)}
        if set(thresholds) != {"all"}:
            summary["abstention"]["by_group"] = {}
            for group in sorted(thresholds):
                mine = [r for r in closed_rows if r["calibration_group"] == group]
                answered = [r for r in mine if r["confidence"] is None or r["confidence"] >= r["threshold"]]
                summary["abstention"]["by_group"][group] = {
                    "n": len(mine), "answered": round(len(answered) / len(mine), 4),
                    "accuracy_answered": (round(score(answered, main_condition)["closed_accuracy"], 4)
                                          if answered else None)}
    elif closed_rows and pipeline.calibration.unused:
        # The configured calibration was fitted for another projector or yes_bias: no abstention figures.
        used = settings.decoder.head_calibration if pipeline.head_closes else settings.decoder.calibration
        summary["abstention_not_measured"] = f"{used} was {pipeline.calibration.unused}"
    majority = _majority_baseline(args, examples)
    summary["majority_closed_accuracy"] = majority
    summary["profile"] = args.profile
    summary["closed_decoding"] = {"options": CLOSED_DECODING, "yes_bias": settings.decoder.yes_bias,
                                  "presupposed": settings.decoder.presupposed_closed,
                                  "presupposed_kinds": settings.decoder.presupposed_kinds,
                                  "closed_answerer": settings.decoder.closed_answerer,
                                  **({"head_answers": settings.decoder.head_answers}
                                     if pipeline.head_closes else {})}
    open_rows = [r for r in rows if r["answer_type"] != "CLOSED"]
    if pipeline.head_opens and open_rows:
        summary["open_answerer"] = {"answerer": "encoder_head",
                                    "min_probability": settings.decoder.head_open_min_probability,
                                    "min_similarity": settings.decoder.head_open_min_similarity}
        summary["open_by_answerer"] = {
            name: {"n": len(mine), **{condition: round(score(mine, condition)["open_recall"], 4)
                                      for condition in args.conditions if all(condition in r for r in mine)}}
            for name, mine in (("encoder_head", [r for r in open_rows if r.get("head_open", {}).get("answered")]),
                               ("decoder", [r for r in open_rows if not r.get("head_open", {}).get("answered")]))
            if mine}
    if pipeline.open_answers is not None and open_rows:
        summary["open_choices"] = {"min_similarity": settings.decoder.open_choices_min_similarity,
                                   "max": settings.decoder.open_choices_max, "prior": settings.decoder.open_choices_prior,
                                   "min_images": settings.decoder.open_choices_min_images}
        summary["open_by_route"] = {
            name: {"n": len(mine), **{condition: round(score(mine, condition)["open_recall"], 4)
                                      for condition in args.conditions if all(condition in r for r in mine)}}
            for name, mine in (("chosen", [r for r in open_rows if r.get("open_choice")]),
                               # written by the decoder, or scored over the options they name, or the head's
                               ("not_chosen", [r for r in open_rows if not r.get("open_choice")]))
            if mine}
    if pipeline.open_calibration is not None and any(r.get("open_choice") for r in open_rows):
        summary["open_abstention"] = open_abstention(examples, rows, pipeline, settings, main_condition, image)
    if pipeline.head_closes:
        summary["closed_by_answerer"] = {
            name: {"n": len(mine), "accuracy": round(score(mine, main_condition)["closed_accuracy"], 4),
                   **{condition: round(score(mine, condition)["closed_accuracy"], 4)
                      for condition in ("shuffled_image", "random_image") if all(condition in r for r in mine)}}
            for name, mine in (("encoder_head", [r for r in closed_rows if r.get("closed_kind") == HEAD]),
                               ("decoder", [r for r in closed_rows if r.get("closed_kind") != HEAD])) if mine}
    summary["engine"] = engine
    _print_table(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


def open_abstention(examples: list[VQAExample], rows: list[dict], pipeline: Pipeline, settings, main: str,
                    image) -> dict:
    """What the app does with the open answers it chose among training answers: judged by the open-answer
    calibration in force now (decoder.open_calibration, each image by its group's fit and threshold), the share
    it gives rather than saying "Uncertain", and their open recall and share right (every reference word)."""
    if pipeline.open_calibration.unused or not (pipeline.open_calibration.fits or pipeline.open_calibration.groups):
        return {"not_measured": pipeline.open_calibration.unused or "no open-answer calibration"}
    judge = copy.copy(settings.decoder)
    judge.abstain = True  # evaluate.py measures with abstention off; this is what the app would do
    chosen = []
    for example, r in zip(examples, rows):
        if r.get("open_choice"):
            # How usual the chosen answer is (the rows keep the answer, not its share): from the answers file.
            choices = pipeline.open_answers.find(example.question, judge.open_choices_min_similarity,
                                                 judge.open_choices_max, judge.open_choices_min_images)
            share = choices.share(r[main]) if choices is not None and r[main] in choices.answers else None
            verdict = judged({"answer": r[main], "margin": r["open_choice"]["margin"], "share": share},
                             pipeline.open_calibration, image_group(image(example.image)), judge)
            r["open_confidence"], r["open_abstained"] = verdict["confidence"], verdict["abstained"]
            chosen.append(r)
    kept = [r for r in chosen if not r["open_abstained"]]
    right = lambda mine: round(float(np.mean([open_recall(r[main], r["reference"]) >= 1.0 for r in mine])), 4)  # noqa: E731
    # An answer the fit cannot judge (its answer not among the choices: rows of another answers file) is given by
    # the app without a confidence: counted among those given, and how many there were is said.
    return {"chosen": len(chosen), "unscored": sum(r["open_confidence"] is None for r in chosen),
            "answered": round(len(kept) / len(chosen), 4),
            "recall_answered": round(score(kept, main)["open_recall"], 4) if kept else None,
            "right_answered": right(kept) if kept else None, "right_chosen": right(chosen)}


def _closed_kind(question: str) -> str:
    candidates = closed_candidates(question)
    return "none" if candidates is None else "yes_no" if candidates == ["Yes", "No"] else "options"


def _majority_baseline(args, examples: list[VQAExample]) -> float:
    """Closed accuracy of always giving the split's most common closed answer (a floor to beat)."""
    from collections import Counter

    from medvqa.answers import normalise

    closed = [normalise(e.answer) for e in examples if e.answer_type == "CLOSED"]
    if not closed:
        return 0.0
    return Counter(closed).most_common(1)[0][1] / len(closed)


def _file_digest(path: str) -> str:
    if path and Path(path).is_file():
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:10]
    return "untrained"


def _decoder_digest(name_or_path: str) -> str:
    """Content key of the decoder's weights (a GGUF file, or a folder's model.safetensors), so a run
    with another decoder (e.g. train_projector.py --lora) never resumes from this one's answers."""
    path = Path(resolve_path(name_or_path))
    weights = path / "model.safetensors" if path.is_dir() else path
    if weights.is_file():
        return _file_digest(str(weights))
    return hashlib.sha256(name_or_path.encode()).hexdigest()[:10]  # a hub id


def _print_table(summary: dict) -> None:
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    print(f"\n{summary['dataset']} {summary['split']}: n={summary['n']} "
          f"(closed {summary['n_closed']}, open {summary['n_open']}); "
          f"majority closed answer {pct(summary['majority_closed_accuracy'])} %\n")
    print("| condition | closed accuracy % | open recall % | open exact % |")
    print("|---|---|---|---|")
    names = {"retrieval": "with retrieval", "no_retrieval": "without retrieval",
             "shuffled_image": "shuffled image", "blank_image": "blank image",
             "random_image": "random other image"}
    main = summary["main_condition"]
    print(f"| {names[main]} | {pct(summary['closed_accuracy'])} | {pct(summary['open_recall'])} | "
          f"{pct(summary['open_exact'])} |")
    for key, name in names.items():
        if key in summary and key != main:
            s = summary[key]
            print(f"| {name} | {pct(s['closed_accuracy'])} | {pct(s['open_recall'])} | {pct(s['open_exact'])} |")
    if "closed_accuracy_free_generation" in summary:
        print(f"\nclosed accuracy with free generation instead of constrained decoding: "
              f"{pct(summary['closed_accuracy_free_generation'])} %")
        for kind, s in summary.get("closed_by_kind", {}).items():
            print(f"  {kind} questions ({s['n']}): constrained {pct(s['constrained'])} %, free {pct(s['free'])} %"
                  + (f", shuffled image {pct(s['shuffled_image'])} %" if "shuffled_image" in s else "")
                  + (f"; answered Yes {pct(s['answered_yes'])} % (references {pct(s['reference_yes'])} %)"
                     if "answered_yes" in s else ""))
    if "abstention" in summary:
        held = summary["abstention"]
        right = "" if held["accuracy_answered"] is None else f", {pct(held['accuracy_answered'])} % of them right"
        at = (f"the calibrated threshold {held['threshold']:g}" if not isinstance(held["threshold"], dict) else
              "the calibrated thresholds " + ", ".join(f"{g} {'none (all Uncertain)' if t is None else f'{t:g}'}"
                                                       for g, t in held["threshold"].items()))
        print(f"\nat {at} the app answers {pct(held['answered'])} % of the "
              f"closed questions{right}; it says \"Uncertain\" to the rest")
    if "abstention_not_measured" in summary:
        print(f"\nabstention not measured: the calibration file {summary['abstention_not_measured']}")
    if "open_abstention" in summary:
        held = summary["open_abstention"]
        if "not_measured" in held:
            print(f"\nopen answers chosen among training answers: abstention not measured ({held['not_measured']})")
        else:
            right = ("" if held["right_answered"] is None else
                     f", {pct(held['right_answered'])} % of them right (recall {pct(held['recall_answered'])} %)")
            print(f"\nof the {held['chosen']} open answers chosen among training answers "
                  f"({pct(held['right_chosen'])} % right), the app gives {pct(held['answered'])} %{right}; "
                  "it says \"Uncertain\" to the rest")
    if "retrieval_flips" in summary:
        flips = summary["retrieval_flips"]
        print(f"retrieval flips: right->wrong {flips['right_to_wrong']}, wrong->right {flips['wrong_to_right']}")


if __name__ == "__main__":
    main()
