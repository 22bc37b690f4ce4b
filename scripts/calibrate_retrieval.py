"""Calibrate an index's relevance cut-offs for its embedder, on questions anyone can get.

    python scripts/calibrate_retrieval.py --profile llava-med [--data vqa-rad:train slake:train] [--write]

The cut-offs (retrieval.min_dense_score, min_topic_score, strong_match_score, relevance_margin) are in
the embedder's own units: cosine for MiniLM, raw inner product for MedCPT. MiniLM's were measured by
hand on the default corpus and stay in the profile; an embedder without measured ones (MedCPT) gets
them here and, with --write, into the index's manifest, where they replace the profile's.

On-topic questions: up to --limit questions of the training splits given (never a test split).
Off-topic questions: the fixed general-knowledge list below. For each question: its topic score
(cosine with the corpus centroid) and its best passage score among the dense candidates. Proposed:

- min_topic_score: midway between the highest off-topic topic score and the on-topic 10th percentile
  (or the highest off-topic score when the two overlap, which the output says);
- strong_match_score: above every off-topic question's best passage, by a tenth of the on-topic spread;
- min_dense_score: the median off-topic best passage score (a passage matching a question as well as
  an off-topic question's best match does is not cited);
- relevance_margin: the on-topic median best score minus min_dense_score.

The last line is JSON: the distributions' summaries and the proposal.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from medvqa.config import PROFILES, load_settings

OFF_TOPIC = [
    "What is the capital of France?", "How do I bake sourdough bread?", "Who won the football world cup in 2018?",
    "What is the best programming language for beginners?", "How far is the moon from the earth?",
    "When was the Eiffel Tower built?", "How do I change a car tyre?", "What is the plot of Hamlet?",
    "Which planet has the most moons?", "How do I grow tomatoes on a balcony?", "What is inflation in economics?",
    "Who painted the Mona Lisa?", "How many strings does a violin have?", "What is the speed of light?",
    "How do I write a cover letter?", "What time zone is Tokyo in?", "Which river is the longest in Europe?",
    "How do I make a cup of green tea?", "What does a blockchain do?", "How do airplanes stay in the air?",
    "What is the tallest mountain in Africa?", "How do I learn to play chess?", "What is a haiku?",
    "Who invented the telephone?", "How is paper recycled?", "What is the population of Canada?",
    "How do solar panels work?", "What language is spoken in Brazil?", "How do I knit a scarf?",
    "What is the rule of offside in football?",
]


def scores(retriever, questions: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(topic scores, best dense passage scores) of the questions."""
    topic, best = [], []
    for question in questions:
        ranking = retriever.rank(question)
        if ranking.question_vector is None or not ranking.dense_scores:
            continue
        topic.append(retriever.topic_score(ranking.question_vector))
        best.append(max(ranking.dense_scores))
    return np.asarray(topic), np.asarray(best)


def propose(on_topic: tuple[np.ndarray, np.ndarray], off_topic: tuple[np.ndarray, np.ndarray]) -> dict:
    (on_topic_scores, on_best), (off_topic_scores, off_best) = on_topic, off_topic
    low_on, high_off = float(np.percentile(on_topic_scores, 10)), float(off_topic_scores.max())
    separable = high_off < low_on
    spread = float(np.percentile(on_best, 90) - np.percentile(on_best, 10))
    min_dense = float(np.median(off_best))
    return {
        "min_topic_score": (high_off + low_on) / 2 if separable else high_off,
        "strong_match_score": float(off_best.max()) + 0.1 * spread,
        "min_dense_score": min_dense,
        "relevance_margin": max(0.0, float(np.median(on_best)) - min_dense),
        "topic_separable": separable,
    }


def summary(values: np.ndarray) -> dict:
    return {"n": int(len(values)), "min": round(float(values.min()), 4), "p10": round(float(np.percentile(values, 10)), 4),
            "median": round(float(np.median(values)), 4), "p90": round(float(np.percentile(values, 90)), 4),
            "max": round(float(values.max()), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="llava-med")
    parser.add_argument("--data", nargs="+", default=["vqa-rad:train", "slake:train"],
                        help="training splits to take on-topic questions from (DATASET:SPLIT or jsonl:DIR:SPLIT)")
    parser.add_argument("--limit", type=int, default=300, help="on-topic questions used (a fixed random sample)")
    parser.add_argument("--write", action="store_true", help="store the proposal in the index manifest")
    args = parser.parse_args(argv)

    from medvqa.datasets import load_specs
    from medvqa.retrieval import Retriever
    from medvqa.retrieval.index import MANIFEST

    settings = load_settings(args.profile)
    retriever = Retriever.open(settings.retrieval)
    questions = sorted({example.question for example in load_specs(args.data)})
    questions = random.Random(0).sample(questions, min(args.limit, len(questions)))
    on_topic, off_topic = scores(retriever, questions), scores(retriever, OFF_TOPIC)
    if not len(on_topic[0]) or not len(off_topic[0]):
        print("error: no question was scored (an empty index?)", file=sys.stderr)
        return 2
    proposal = propose(on_topic, off_topic)
    if not proposal["topic_separable"]:
        print("warning: on- and off-topic questions overlap in topic score; the gate cannot separate them "
              "cleanly", file=sys.stderr)
    result = {"index": str(retriever.index_dir), "embedder": settings.retrieval.embedder,
              "on_topic": {"topic": summary(on_topic[0]), "best_passage": summary(on_topic[1])},
              "off_topic": {"topic": summary(off_topic[0]), "best_passage": summary(off_topic[1])},
              "proposal": {key: round(value, 4) if isinstance(value, float) else value
                           for key, value in proposal.items()}}
    if args.write:
        path = Path(retriever.index_dir) / MANIFEST
        manifest = json.loads(path.read_text())
        manifest["thresholds"] = {key: value for key, value in proposal.items() if key != "topic_separable"}
        manifest["thresholds_calibration"] = {"data": args.data, "on_topic": len(on_topic[0]),
                                              "off_topic": len(off_topic[0]),
                                              "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        path.write_text(json.dumps(manifest, indent=2))
        print(f"wrote the cut-offs into {path}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
