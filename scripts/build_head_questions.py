"""Write the answer head's training questions, embedded, and how its training answers are written, beside
the heads (weights/offline/head_questions.safetensors).

With decoder.open_answerer "encoder_head" the head answers an open question only when the question is
like one it learned to answer in words: the cosine similarity of its MiniLM embedding to the nearest of
these questions is at least decoder.head_open_min_similarity (scripts/tune_open_head.py chooses it). A
question unlike them all ("Describe the findings in this scan.", "What could cause this consolidation?")
goes to the decoder, which writes a sentence, instead of getting one of the head's answer words.

    python scripts/build_head_questions.py --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15

The questions are those of the training images the head trained on whose answer is one of its words
(in its vocabulary, not yes or no): the images held out of every training step (--holdout-percent, by
content, as scripts/train_encoder.py holds them out) are left out, so that a held-out question measured
by tune_open_head.py is compared with questions of other images only. Distinct questions in
answer_head.question_form (closing punctuation made one "?"), sorted; embeddings L2-normalised, stored in
float16. The file
names the heads it belongs to (answer_head_digest); the app refuses it beside other heads.

It also holds the same images' yes/no questions, embedded (yes_no_embeddings): a calibration of the
closed answers may fit questions worded like them apart from the rest (calibrate_closed.py
--wording-similarity).

The head's vocabulary is lower-cased with punctuation dropped ("hashimoto s thyroiditis", "left lobe mass 1
5 x 1 8 cm"); the file also keeps, for each of its answers, the way the training answers most often write
it ("Hashimoto's thyroiditis"), which the app shows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def training_examples(specs: list[str], holdout_percent: float) -> list:
    """The examples of the training images not held out."""
    from medvqa.datasets import load_specs
    from medvqa_train.data import held_out_by_content

    kept = []
    for spec in specs:
        examples = load_specs([spec])
        left_out = set(held_out_by_content(examples, holdout_percent)[1]) if holdout_percent > 0 else set()
        kept += [example for i, example in enumerate(examples) if i not in left_out]
    return kept


def training_questions(examples: list, vocabulary: list[str]) -> list[str]:
    """The distinct questions (in question_form, sorted) that the head learned to answer in words: those
    with an answer in its vocabulary other than yes and no (its answer loss reads no other answer)."""
    from medvqa.answer_head import question_form
    from medvqa.answers import normalise

    answers = set(vocabulary) - {"yes", "no"}
    return sorted({question_form(example.question) for example in examples
                   if example.question.strip() and normalise(example.answer) in answers})


def yes_no_questions(examples: list) -> list[str]:
    """The distinct questions (in question_form, sorted) answered yes or no: a closed answer's
    calibration may tell the questions worded like them from the rest (scripts/calibrate_closed.py
    --wording-similarity)."""
    from medvqa.answer_head import question_form
    from medvqa.answers import normalise

    return sorted({question_form(example.question) for example in examples
                   if example.question.strip() and normalise(example.answer) in ("yes", "no")})


def answer_spellings(examples: list, vocabulary: list[str]) -> dict[str, str]:
    """For each answer of the head's vocabulary (lower-cased, punctuation dropped: "hashimoto s
    thyroiditis"), the way the training answers most often write it ("Hashimoto's thyroiditis"); the
    first in alphabetical order on a tie."""
    import collections

    from medvqa.answers import normalise

    written: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for example in examples:
        written[normalise(example.answer)][example.answer.strip()] += 1
    return {answer: min(written[answer].items(), key=lambda item: (-item[1], item[0]))[0]
            for answer in vocabulary if written.get(answer)}


def questions_sha256(questions: list[str]) -> str:
    return hashlib.sha256("\n".join(questions).encode()).hexdigest()


def training_parser(description: str) -> argparse.ArgumentParser:
    """Arguments naming the training data and the images held out of them (--data, --holdout-percent)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True,
                        help="training data specs, as for train_encoder.py (vqa-rad:train slake:train pathvqa:DIR:train)")
    parser.add_argument("--holdout-percent", type=float, default=15.0)
    return parser


def main(argv=None) -> int:
    parser = training_parser(__doc__)
    parser.add_argument("--heads", default=str(REPO / "weights" / "offline" / "encoder_heads.safetensors"))
    parser.add_argument("--out", default=str(REPO / "weights" / "offline" / "head_questions.safetensors"))
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from medvqa.answer_head import QUESTION_EMBEDDER, AnswerHead

    examples = training_examples(args.data, args.holdout_percent)
    head = AnswerHead.load(args.heads)
    questions = training_questions(examples, head.vocabulary)
    if not questions:
        raise SystemExit(f"no question in {args.data} has an answer in the head's vocabulary")
    spellings = answer_spellings(examples, [a for a in head.vocabulary if a not in ("yes", "no")])
    yes_no = yes_no_questions(examples)
    def embedded(texts: list[str]) -> torch.Tensor:
        vectors = torch.nn.functional.normalize(head.embed(texts).float(), dim=1)
        return vectors.to(torch.float16).contiguous()

    embeddings, yes_no_embeddings = embedded(questions), embedded(yes_no)
    metadata = {"questions": json.dumps(questions), "questions_sha256": questions_sha256(questions),
                "answer_head_digest": head.digest, "answer_spellings": json.dumps(spellings, sort_keys=True),
                "yes_no_questions": json.dumps(yes_no), "yes_no_questions_sha256": questions_sha256(yes_no), "embedder": QUESTION_EMBEDDER,
                "data": json.dumps(args.data), "holdout_percent": f"{args.holdout_percent:g}",
                "command": "python scripts/build_head_questions.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({"embeddings": embeddings, "yes_no_embeddings": yes_no_embeddings}, args.out, metadata=metadata)
    print(f"{len(questions)} questions ({metadata['questions_sha256'][:12]}…), {len(yes_no)} yes/no questions "
          f"({metadata['yes_no_questions_sha256'][:12]}…), the spelling of "
          f"{len(spellings)} answers -> {args.out} "
          f"({Path(args.out).stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
