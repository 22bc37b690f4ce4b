"""What the encoder's answer head answers to open questions about one image, benchmark-like or free-form
(decoder.open_answerer "encoder_head"; medvqa/answer_head.py), and two signals that might tell the two
kinds apart.

    python scripts/probe_head_questions.py
    python scripts/probe_head_questions.py --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15

Per question: the answer the app would show, its probability among the head's answers other than yes
and no, and the share of the head's whole distribution on Yes and No (a question the head reads as a
yes/no one). With --data, also how many distinct answers (other than yes and no) the training questions
most like it were given (MiniLM neighbours among the training images' questions that have such an
answer, the hold-out left out as train_encoder.py leaves it out): a guard that only let the head give those answers would
leave it that many to choose from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from medvqa.datasets import SHARED_DATA  # noqa: E402

QUESTIONS = ["What modality is used to take this image?", "How many kidneys are there?",
             "Which organ is abnormal?", "Describe the findings in this scan.", "What is shown here?",
             "Hello, who are you?", "Why?", "What is the differential diagnosis?"]


def neighbour_answers(head, questions: list[str], specs: list[str], holdout_percent: float, k: int) -> list[int]:
    """Per question, the distinct answers in the head's vocabulary (but yes and no) given to the k
    training questions most like it."""
    import numpy as np

    from medvqa.answers import normalise
    from medvqa.datasets import load_specs
    from medvqa_train.data import held_out_by_content

    index = {answer: i for i, answer in enumerate(head.vocabulary)}
    given: dict[str, set[int]] = {}
    for spec in specs:
        examples = load_specs([spec])
        left_out = set(held_out_by_content(examples, holdout_percent)[1])
        for i, example in enumerate(examples):
            answer = normalise(example.answer)
            if i not in left_out and answer in index and answer not in ("yes", "no"):
                given.setdefault(example.question.strip(), set()).add(index[answer])
    known = sorted(given)
    similarity = head.embed(questions).numpy() @ head.embed(known).numpy().T
    return [len(set().union(*(given[known[j]] for j in np.argsort(-row)[:k]))) for row in similarity]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default=str(SHARED_DATA / "slake" / "imgs" / "xmlab101" / "source.jpg"))
    parser.add_argument("--questions", nargs="+", default=QUESTIONS)
    parser.add_argument("--data", nargs="*", default=[], help="training data specs, as for train_encoder.py")
    parser.add_argument("--holdout-percent", type=float, default=15.0)
    parser.add_argument("--neighbours", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line at the end")
    args = parser.parse_args(argv)

    import torch

    from medvqa.answer_head import AnswerHead, AnswerHeadError
    from medvqa.config import load_settings, resolve_path
    from medvqa.datasets import read_image
    from medvqa.vision import build_vision

    settings = load_settings("offline")
    head = AnswerHead.load(resolve_path(settings.decoder.answer_head))
    questions_file = resolve_path(settings.decoder.head_questions) if settings.decoder.head_questions else None
    try:  # the training questions it learned to answer, and its answers' spelling, as the app has them
        head.attach_questions(questions_file or "")
    except AnswerHeadError as error:
        print(f"(no similarity: {error})")
    vision = build_vision(settings.vision, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        tokens = vision.encode(vision.preprocess([read_image(args.image)]))
    rows = []
    for question in args.questions:
        answer, probability = head.open_answer(tokens, question)
        whole = torch.softmax(head.logits(tokens, [question])[0], dim=0)
        rows.append({"question": question, "answer": answer, "probability": round(probability, 3),
                     "yes_no_share": round(float(whole[head.vocabulary.index("yes")] + whole[head.vocabulary.index("no")]), 3)})
    if head.questions:
        for row, (similarity, nearest) in zip(rows, head.nearest_questions(args.questions)):
            row["similarity"], row["nearest"] = round(similarity, 3), nearest
    if args.data:
        for row, count in zip(rows, neighbour_answers(head, args.questions, args.data, args.holdout_percent,
                                                      args.neighbours)):
            row["neighbour_answers"] = count
    print(f"image: {args.image}")
    for row in rows:
        extra = f", {row['neighbour_answers']} answers among its {args.neighbours} nearest training questions" \
            if "neighbour_answers" in row else ""
        if "similarity" in row:
            extra += f"; nearest training question {row['nearest']!r}, similarity {row['similarity']:.3f}"
        print(f"{row['question']!r} -> {row['answer']!r} ({100 * row['probability']:.0f} %; Yes+No "
              f"{100 * row['yes_no_share']:.1f} %{extra})")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
