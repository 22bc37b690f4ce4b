"""Write the training open questions, embedded, with the answers training gave to each
(weights/offline/open_answers.safetensors; decoder.open_choices "training_answers", medvqa/open_choices.py).

    python scripts/build_open_answers.py --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15

Open questions are those answered neither yes nor no. The images held out of every training step
(--holdout-percent, by content, as scripts/train_encoder.py holds them out) are left out, so that a
held-out question measured by scripts/tune_open_choices.py chooses among other images' answers only.
Questions are kept in answer_head.question_form (closing punctuation made one "?"), grouped case-insensitively,
answers grouped by answers.normalise and written as the training answers most often write them (the first in
alphabetical order on a tie), most frequent first, each with how often it was given and for how many different
images (by content hash); the app scores only answers given for at least decoder.open_choices_min_images. Embeddings are MiniLM's (the retrieval embedder), L2-normalised,
stored in float16.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def open_table(examples: list, image_of=None) -> tuple[list[str], list[list[list]], list[int]]:
    """(questions sorted, per question [[spelling, count, images], ...] most frequent first, per question the
    number of images it was asked of) of the open questions among `examples`. Questions are grouped
    case-insensitively (open_choices.match_key) and written as training most often writes them; `image_of(example)`
    names an example's image (default: its content hash, so one image under two names counts once)."""
    from medvqa.answer_head import question_form
    from medvqa.answers import normalise
    from medvqa.open_choices import match_key

    if image_of is None:
        from medvqa_train.medical import content_hash

        hashes: dict = {}

        def image_of(example):
            if example.image not in hashes:
                hashes[example.image] = content_hash(example.image)
            return hashes[example.image]

    def usual(forms: collections.Counter) -> str:
        return min(forms.items(), key=lambda item: (-item[1], item[0]))[0]

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    answer_images: dict[tuple[str, str], set] = collections.defaultdict(set)
    question_images: dict[str, set] = collections.defaultdict(set)
    asked: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    written: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for example in examples:
        answer = normalise(example.answer)
        if not answer or answer in ("yes", "no") or not example.question.strip():
            continue
        key, image = match_key(example.question), image_of(example)
        counts[key][answer] += 1
        answer_images[key, answer].add(image)
        question_images[key].add(image)
        asked[key][question_form(example.question)] += 1
        written[answer][" ".join(example.answer.split())] += 1
    keys = sorted(counts, key=lambda key: usual(asked[key]))
    answers = [[[usual(written[answer]), count, len(answer_images[key, answer])]
                for answer, count in sorted(counts[key].items(), key=lambda item: (-item[1], item[0]))] for key in keys]
    return [usual(asked[key]) for key in keys], answers, [len(question_images[key]) for key in keys]


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO / "scripts"))
    from build_head_questions import training_examples, training_parser

    parser = training_parser(__doc__)
    parser.add_argument("--out", default=str(REPO / "weights" / "offline" / "open_answers.safetensors"))
    args = parser.parse_args(argv)

    import numpy as np
    from safetensors.numpy import save_file

    from medvqa.answer_head import QUESTION_EMBEDDER
    from medvqa.open_choices import OpenAnswers, content_digest

    questions, answers, images = open_table(training_examples(args.data, args.holdout_percent))
    if not questions:
        raise SystemExit(f"no open question in {args.data}")
    vectors = OpenAnswers(questions, answers, np.zeros((len(questions), 1)), images=images).embed(questions)
    vectors = vectors.astype(np.float16)
    metadata = {"questions": json.dumps(questions, ensure_ascii=False), "answers": json.dumps(answers, ensure_ascii=False),
                "images": json.dumps(images), "content_sha256": content_digest(questions, answers, images),
                "embedder": QUESTION_EMBEDDER,
                "data": json.dumps(args.data), "holdout_percent": f"{args.holdout_percent:g}",
                "command": "python scripts/build_open_answers.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({"embeddings": np.ascontiguousarray(vectors)}, args.out, metadata=metadata)
    pairs = sum(len(a) for a in answers)
    print(f"{len(questions)} open questions, {pairs} question-answer pairs ({metadata['content_sha256'][:12]}…) -> "
          f"{args.out} ({Path(args.out).stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
