"""Choose how open questions are answered among training answers (decoder.open_choices "training_answers":
open_choices_prior, open_choices_max, open_choices_min_similarity; medvqa/open_choices.py), on the
training images held out of every training step, never on a test split.

    python scripts/export_holdout.py --data vqa-rad:train slake:train pathvqa:DIR:train \\
        --holdout-percent 15 --per-source 300 --out runs/holdout
    python scripts/tune_open_choices.py --data runs/holdout --splits heldout-slake heldout-vqa-rad heldout-pathvqa

For each held-out open question (one not naming its options) it finds the training question most like it
in decoder.open_answers (built from the other images' questions: scripts/build_open_answers.py) and has the
decoder score the answers training gave to it, up to --max of them, with the question's own image and with
another held-out image (the next one in the file that differs: a shuffled image). For a question not word
for word a training question it also has the decoder write its answer freely, as it does below the
similarity threshold. Scores are kept per question in --scores (resumable). Then, for each prior, number of
answers and similarity threshold in the grids, it prints the open recall of the answers the app would give
(as evaluate.py scores it), per split and their mean (each split counts once), with the shuffled image's in
brackets. Of the settings within --tolerance points of the best mean (1 point, as the answer head's
similarity was chosen: about what the decoder's own figures move between two installs) it chooses the
highest similarity (the fewest questions given a training answer instead of a written one: a question
unlike the training questions, "Describe the findings in this scan.", should get a sentence), then the
fewest answers scored (the cheapest), then the smallest prior (the least weight on how often training gave
an answer). The grid also shows decoder.open_choices_min_images (only answers training gave for at least
this many different images are scored, and a question needs two of them), but the choice keeps it at
--min-images (2): an answer given for one image is that image's finding ("What is the condition of the
patient?" → "Blind loop syndrome"), which the app would otherwise give for any image, and that is not a
measurement choice; the grid shows what the rule costs. --free-form FILE prints, per similarity, the share of other questions (one per line, or a JSONL
file with a "text" field such as LLaVA-Med's llava_med_eval_qa50_qa.jsonl) that the app would answer among
training answers at the chosen setting otherwise. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

PRIORS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0]
MAXES = [4, 8, 16, 32]
SIMILARITIES = [0.8, 0.85, 0.9, 0.93, 0.96, 0.98, 1.0]
IMAGES = [1, 2, 3]


def score_split(pipeline, data: Path, split: str, out: Path, max_answers: int) -> list[dict]:
    """Per open question of `split`, the decoder's scores of the nearest training question's most frequent
    answers (with its image and another), and where some setting of the grid leaves it to the decoder, its
    written answers; resumed from `out`."""
    from tqdm import tqdm

    from medvqa.answers import closed_candidates
    from medvqa.datasets import load_examples, read_image
    from medvqa.open_choices import match_key
    from medvqa.answer_head import question_form

    answers = pipeline.open_answers
    examples = [e for e in load_examples("jsonl", str(data), split)
                if e.answer_type != "CLOSED" and closed_candidates(e.question) is None]
    done = {}
    if out.is_file():
        done = {row["qid"]: row for row in map(json.loads, out.read_text().splitlines()) if row.get("max") == max_answers}
    with out.open("a") as handle:
        for k, example in enumerate(tqdm(examples, desc=split, unit="q")):
            if example.qid in done:
                continue
            other = other_image(examples, k)
            similarity, index = answers.nearest(example.question)
            kept = answers.answers[index][:max_answers]
            forms = [str(row[0]) for row in kept]
            prompt = pipeline.prompts.build(example.question)
            began = time.perf_counter()
            row = {"qid": example.qid, "question": example.question, "reference": example.answer, "max": max_answers,
                   "other": str(other), "nearest": answers.questions[index], "similarity": similarity,
                   "exact": match_key(question_form(example.question)) in answers._index,
                   "answers": forms, "counts": [int(r[1]) for r in kept], "images": [int(r[2]) for r in kept],
                   "real": pipeline.option_scores(read_image(example.image), prompt, forms),
                   "shuffled": pipeline.option_scores(read_image(other), prompt, forms)}
            row["score_s"] = round(time.perf_counter() - began, 3)
            if needs_written(row):  # the grid has it written somewhere
                row["written"] = {condition: written(pipeline, read_image(path), example.question)
                                  for condition, path in (("real", example.image), ("shuffled", other))}
            done[example.qid] = row
            handle.write(json.dumps(row) + "\n")
            handle.flush()
    return [done[e.qid] for e in examples]


def pipeline_find(pipeline, question: str, min_similarity: float, chosen: dict) -> bool:
    """Whether the app, at this similarity and the chosen setting's others, answers `question` among answers."""
    return pipeline.open_answers.find(question, min_similarity, chosen["max"], chosen["min_images"]) is not None


def other_image(examples: list, k: int):
    """The shuffled image of question k: the next question's in the file whose image is another."""
    return next((examples[(k + j) % len(examples)].image for j in range(1, len(examples))
                 if examples[(k + j) % len(examples)].image != examples[k].image), examples[k].image)


def candidates(row: dict, max_answers: int, min_images: int) -> list[int]:
    """Positions of the answers the app scores (open_choices.OpenAnswers.find); [] when fewer than two."""
    kept = [i for i, images in enumerate(row["images"]) if images >= min_images][:max_answers]
    return kept if len(kept) >= 2 else []


def needs_written(row: dict) -> bool:
    """Whether some setting of the grid has the decoder write this question's answer."""
    return not row["exact"] or not candidates(row, max(MAXES), max(IMAGES))


def written(pipeline, image, question: str) -> str:
    """The decoder's written answer (greedy, as evaluate.py's default 24 new tokens), as the app gives it
    where it does not choose."""
    kept, pipeline.open_answers = pipeline.open_answers, None
    try:
        return pipeline.answer_done(image, question, use_retrieval=False, max_new_tokens=24).answer
    finally:
        pipeline.open_answers = kept


def answer(row: dict, condition: str, prior: float, max_answers: int, min_similarity: float, min_images: int) -> str:
    from medvqa.open_choices import choose

    similar = row["exact"] if min_similarity >= 1.0 else row["similarity"] >= min_similarity
    kept = candidates(row, max_answers, min_images) if similar else []
    if not kept:
        return row["written"][condition]
    best, _ = choose([row[condition][i] for i in kept], [row["counts"][i] for i in kept], prior)
    return row["answers"][kept[best]]


def recall(rows: list[dict], condition: str, prior: float, max_answers: int, min_similarity: float,
           min_images: int) -> float:
    from medvqa.answers import open_recall

    return sum(open_recall(answer(r, condition, prior, max_answers, min_similarity, min_images), r["reference"])
               for r in rows) / max(len(rows), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the folder scripts/export_holdout.py wrote")
    parser.add_argument("--splits", nargs="+", required=True, help="its files, e.g. heldout-slake heldout-pathvqa")
    parser.add_argument("--profile", default="offline")
    parser.add_argument("--engine", default="", help="decoder engine (default: the profile's)")
    parser.add_argument("--max", type=int, default=max(MAXES), help="answers scored per question (the grid reads fewer)")
    parser.add_argument("--scores", default=str(REPO / "runs" / "tune-open-choices"),
                        help="folder of per-question scores, one file per split (resumable)")
    parser.add_argument("--tolerance", type=float, default=1.0, help="points of mean recall counted as a tie")
    parser.add_argument("--min-images", type=int, default=2, choices=IMAGES,
                        help="decoder.open_choices_min_images, fixed rather than chosen (see above)")
    parser.add_argument("--free-form", nargs="*", default=[], help="files of other questions (see above)")
    args = parser.parse_args(argv)

    from medvqa.config import load_settings
    from medvqa.pipeline import Pipeline

    settings = load_settings(args.profile)
    if args.engine:
        settings.decoder.engine = args.engine
    settings.decoder.open_choices = "training_answers"
    pipeline = Pipeline.load(settings, with_retrieval=False, progress=False)
    if pipeline.open_answers is None:
        raise SystemExit(f"the {settings.decoder.engine!r} engine cannot score answers")
    folder = Path(args.scores)
    folder.mkdir(parents=True, exist_ok=True)
    per_split = {split: score_split(pipeline, Path(args.data), split,
                                    folder / f"{split}-{pipeline.open_answers.digest[:8]}.jsonl", args.max)
                 for split in args.splits}

    grid = []
    for max_answers in [m for m in MAXES if m <= args.max]:
        for prior in PRIORS:
            for min_similarity in SIMILARITIES:
                for min_images in IMAGES:
                    entry = {"max": max_answers, "prior": prior, "min_similarity": min_similarity, "min_images": min_images}
                    for split, rows in per_split.items():
                        entry[split] = [round(100 * recall(rows, c, prior, max_answers, min_similarity, min_images), 2)
                                        for c in ("real", "shuffled")]
                    entry["mean"] = round(sum(entry[s][0] for s in per_split) / len(per_split), 2)
                    entry["mean_shuffled"] = round(sum(entry[s][1] for s in per_split) / len(per_split), 2)
                    grid.append(entry)
    allowed = [e for e in grid if e["min_images"] == args.min_images]
    best = max(entry["mean"] for entry in allowed)
    chosen = min((e for e in allowed if e["mean"] >= best - args.tolerance),
                 key=lambda e: (-e["min_similarity"], e["max"], e["prior"]))
    print("max prior min_sim images " + " ".join(f"{s:>22}" for s in per_split) + "   mean (shuffled)")
    for e in grid:
        print(f"{e['max']:>3} {e['prior']:>5} {e['min_similarity']:>7} {e['min_images']:>6} "
              + " ".join(f"{e[s][0]:>13.1f} ({e[s][1]:>5.1f})" for s in per_split) + f"   {e['mean']:.1f} ({e['mean_shuffled']:.1f})")
    free_form = {}
    if args.free_form:
        from tune_open_head import read_questions

        others = [q for path in args.free_form for q in read_questions(Path(path))]
        chosen_at = {f"{t:g}": [q for q in others if pipeline_find(pipeline, q, t, chosen)] for t in SIMILARITIES}
        free_form = {t: round(len(found) / len(others), 4) for t, found in chosen_at.items()}
        print(f"other questions ({len(others)}) that would be answered among training answers, by similarity: "
              + ", ".join(f"{t} {100 * share:.1f} %" for t, share in free_form.items()))
        for question in chosen_at[f"{chosen['min_similarity']:g}"]:
            print(f"  at the chosen setting: {question!r}")
    timing = {split: round(sum(r["score_s"] for r in rows) / max(len(rows), 1) / 2, 3) for split, rows in per_split.items()}
    print(json.dumps({"chosen": chosen, "best_mean": best,
                      "questions": {s: len(r) for s, r in per_split.items()},
                      "exact": {s: sum(x["similarity"] >= 1.0 for x in r) for s, r in per_split.items()},
                      "score_s_per_image": timing, "free_form": free_form, "open_answers": pipeline.open_answers.digest}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
