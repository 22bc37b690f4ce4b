"""How much of the yes/no answer is in the image features and the question, without the decoder.

    python scripts/probe_features.py [--train vqa-rad:train] [--test vqa-rad:test]

Fits logistic regressions on the closed yes/no questions of --train and prints their accuracy on
--test: from the question's MiniLM embedding alone, from the mean-pooled, standardised encoder
features alone, from both, and from both with question x image products (first 64 channels). A
diagnostic of what a trained projector could pass to the decoder, not a model the app uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


import numpy as np
import torch

from medvqa.answers import normalise
from medvqa.config import load_settings
from medvqa.datasets import load_examples
from medvqa.retrieval.embed import load_embedder
from medvqa.datasets import read_image
from medvqa_train.data import FeatureCache, encoder_key
from medvqa.vision import build_vision


def yes_no_data(specs: list[str], cache: FeatureCache, embedder):
    examples = []
    for spec in specs:
        dataset, split = spec.split(":")
        examples += [e for e in load_examples(dataset, None, split)
                     if e.answer_type == "CLOSED" and normalise(e.answer) in ("yes", "no")]
    pooled = {}
    for example in examples:
        if example.image not in pooled:
            pooled[example.image] = cache.features(read_image(example.image)).mean(0).numpy()
    images = np.stack([pooled[e.image] for e in examples])
    questions = embedder.encode([e.question for e in examples])
    answers = np.array([normalise(e.answer) == "yes" for e in examples])
    return images, questions, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="offline")
    parser.add_argument("--train", nargs="+", default=["vqa-rad:train"])
    parser.add_argument("--test", nargs="+", default=["vqa-rad:test"])
    args = parser.parse_args()
    from sklearn.linear_model import LogisticRegression

    settings = load_settings(args.profile)
    vision = build_vision(settings.vision, torch.device("cpu"), torch.float32, settings.offline)
    cache = FeatureCache(Path(settings.cache_dir) / "features", vision, encoder_key(vision, settings.vision))
    embedder = load_embedder(settings.retrieval.embedder)
    train_images, train_questions, train_answers = yes_no_data(args.train, cache, embedder)
    test_images, test_questions, test_answers = yes_no_data(args.test, cache, embedder)
    mean, std = train_images.mean(0), train_images.std(0) + 1e-6
    train_images, test_images = (train_images - mean) / std, (test_images - mean) / std

    def products(questions, images):
        return (questions[:, :, None] * images[:, None, :64]).reshape(len(questions), -1)

    inputs = {
        "question": (train_questions, test_questions),
        "image": (train_images, test_images),
        "question + image": (np.hstack([train_questions, train_images]), np.hstack([test_questions, test_images])),
        "question x image": (np.hstack([train_questions, train_images, products(train_questions, train_images)]),
                             np.hstack([test_questions, test_images, products(test_questions, test_images)])),
    }
    result = {"train": args.train, "test": args.test, "n_train": len(train_answers), "n_test": len(test_answers),
              "majority": round(float(max(test_answers.mean(), 1 - test_answers.mean())), 3)}
    print(f"yes/no questions: {len(train_answers)} train, {len(test_answers)} test; "
          f"majority answer {100 * result['majority']:.1f} %")
    for name, (train, test) in inputs.items():
        scores = {C: float((LogisticRegression(C=C, max_iter=2000).fit(train, train_answers).predict(test)
                            == test_answers).mean()) for C in (0.01, 0.1, 1.0)}
        result[name] = {str(C): round(score, 3) for C, score in scores.items()}
        print(f"  {name:>17}: " + ", ".join(f"C={C}: {100 * score:.1f} %" for C, score in scores.items()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
