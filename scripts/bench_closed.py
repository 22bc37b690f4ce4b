"""Time to a closed answer on this machine, with yes/no questions that name a value scored Yes against
No and through the open question they presuppose (decoder.presupposed_closed).

    python scripts/bench_closed.py [--profile offline] [--runs 3] [--json] [--head] [--open]

Each question is asked in a fresh conversation about one VQA-RAD image (one pixel changed each
time, so the image is encoded and the prompt prefilled, as for a first question); the figure is the median over --runs
of the time from asking to the answer (the pipeline's `ttft_s`: a closed answer comes in one
piece), and of the whole turn with the image-reliance check (`total_s`). Retrieval is off. --head
also times the questions with decoder.closed_answerer "encoder_head" (the encoder's answer head answers
the yes/no questions in decoder.head_answers; medvqa/answer_head.py). --open times open questions
instead: written by the decoder, chosen by the decoder among the answers training gave to the question
(decoder.open_choices "training_answers", where the profile sets it) and answered with
decoder.open_answerer "encoder_head" (the head answers those above decoder.head_open_min_probability):
time to the first piece of the answer, and to its end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from medvqa.config import PROFILES, load_settings  # noqa: E402
from medvqa.presuppose import presupposition  # noqa: E402

QUESTIONS = ["Does the picture contain the liver?", "Is this a CT?", "Is this a study of the chest?",
             "Is this a transverse plane?", "Is the lung healthy?", "Is there a pleural effusion?"]
OPEN_QUESTIONS = ["What modality is used to take this image?", "Which organ is abnormal?",
                  "What diseases are included in the picture?"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="offline", choices=sorted(PROFILES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--image", default=str(REPO.parent / "shared" / "data" / "vqa_rad" / "images" / "synpic42202.jpg"),
                        help="the scan asked about (a grey square when the file is absent)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line at the end")
    parser.add_argument("--head", action="store_true", help="also with the encoder's answer head answering")
    parser.add_argument("--open", action="store_true", help="open questions: the decoder against the head")
    args = parser.parse_args(argv)

    import numpy as np

    from medvqa.datasets import read_image
    from medvqa.pipeline import Conversation, Done, Pipeline

    settings = load_settings(args.profile)
    settings.retrieval.enabled = False
    pipeline = Pipeline.load(settings, with_retrieval=False)
    image = read_image(args.image) if Path(args.image).is_file() else np.full((512, 512, 3), 90, np.uint8)
    results = {}
    modes = [("yes_no", pipeline, False), ("presupposed", pipeline, True)]
    questions = QUESTIONS
    if args.open:
        import copy

        if settings.decoder.open_answerer != "decoder":
            parser.error("--open compares the decoder with the head: unset MEDVQA_DECODER__OPEN_ANSWERER")
        written = copy.deepcopy(settings)
        written.decoder.open_choices = "free"
        with_head = copy.deepcopy(written)
        with_head.decoder.open_answerer = "encoder_head"
        modes = [("open, decoder writes", Pipeline(written, pipeline.engine, pipeline.model), settings.decoder.presupposed_closed),
                 *([("open, decoder chooses", pipeline, settings.decoder.presupposed_closed)]
                   if pipeline.open_answers is not None else []),
                 ("open, head", Pipeline(with_head, pipeline.engine, pipeline.model), settings.decoder.presupposed_closed)]
        questions = OPEN_QUESTIONS
    elif args.head:
        import copy

        with_head = copy.deepcopy(settings)
        with_head.decoder.closed_answerer, with_head.decoder.presupposed_closed = "encoder_head", True
        modes.append(("head", Pipeline(with_head, pipeline.engine, pipeline.model), True))
    for mode, asked, presupposed in modes:
        settings.decoder.presupposed_closed = presupposed
        for question in questions:
            answer_s, turn_s = [], []
            for run in range(args.runs + 1):  # the first run warms the caches and is not counted
                picture = image.copy()
                picture.flat[run] ^= 1 + len(results)  # other pixels each time: no cache holds this image
                conversation = Conversation(image=picture)
                done = [e for e in asked.ask(conversation, question, use_retrieval=False, warm=False)
                        if isinstance(e, Done)][-1]
                asked.end_conversation(conversation)
                if run:
                    answer_s.append(done.timings["ttft_s"])
                    turn_s.append(done.timings["total_s"])
            key = f"{mode}: {question}"
            results[key] = {"read": bool(presupposed and presupposition(question, settings.decoder.presupposed_kinds)),
                            "by_head": (done.closed or {}).get("answerer") == "encoder_head"
                            or bool((done.head_open or {}).get("answered")),
                            "chosen": done.open_choice is not None,
                            "answer_s": round(statistics.median(answer_s), 4),
                            "turn_s": round(statistics.median(turn_s), 4)}
            turn = "to the answer's end" if args.open else "turn with image check"
            print(f"{key:60s} answer {results[key]['answer_s']:.3f} s, {turn} "
                  f"{results[key]['turn_s']:.3f} s" + (" (the head)" if results[key]["by_head"] else
                                                       " (chosen)" if results[key]["chosen"] else
                                                       "" if results[key]["read"] or not presupposed or args.open else " (not read)"))
    if args.json:
        print(json.dumps({"profile": args.profile, "runs": args.runs, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
