"""Check an installation of a profile end to end, on the machine it will run on.

    python scripts/check_install.py --profile llava-med [--n 50] [--json]

For a user with hub access and a GPU or an Apple silicon Mac: loads the profile (downloading its
weights on first use), answers the first N questions of VQA-RAD test (a type-balanced subset, one
question at a time, greedy) in the profile's conversation format, and prints closed accuracy and
open recall, the time to the first token and the time per output token on this device, and
LLaVA-Med's published figures for scale. It is how a user verifies that the `llava-med` profile
runs and answers sensibly; it is not an evaluation (scripts/evaluate.py is). The same code runs in
CI on the `tiny-llava-med` profile (random weights, so the accuracy there means nothing).

The published figures printed beside ours are LLaVA-Med's, fine-tuned on VQA-RAD (Li et al., 2023,
Table 4, as quoted in Med-MoE, arXiv 2404.10237): closed 84.19 %, open recall 61.52 %. The authors
publish no zero-shot VQA-RAD figures for v1.5 in that form; a zero-shot run of the checkpoint is
expected to score well below them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PUBLISHED = {"source": "LLaVA-Med (Li et al., 2023), fine-tuned on VQA-RAD, Table 4 via Med-MoE arXiv 2404.10237",
             "closed_accuracy": 0.8419, "open_recall": 0.6152}


def main(argv: list[str] | None = None) -> int:
    from medvqa.config import PROFILES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="llava-med")
    parser.add_argument("--n", type=int, default=50, help="VQA-RAD test questions to answer")
    parser.add_argument("--data", default=None, help="VQA-RAD folder (default: ../shared/data/vqa_rad)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)

    import torch

    from medvqa.answers import closed_correct, open_recall
    from medvqa.config import load_settings
    from medvqa.datasets import load_examples, read_image
    from medvqa.device import pick_device, pick_dtype
    from medvqa.engines import engine_label
    from medvqa.pipeline import Conversation, Done, Pipeline, Token

    settings = load_settings(args.profile)
    device = pick_device(settings.device)
    print(f"profile {args.profile}: {settings.decoder.name_or_path} on {device} "
          f"({str(pick_dtype(device, settings.dtype)).removeprefix('torch.')}), engine {engine_label(settings)}, "
          f"format {settings.decoder.conversation_format}", file=sys.stderr)
    started = time.perf_counter()
    pipeline = Pipeline.load(settings, with_retrieval=False)
    load_s = time.perf_counter() - started
    examples = _balanced(load_examples("vqa-rad", args.data, "test"), args.n)

    closed, recalls, ttft, tpot = [], [], [], []
    for example in examples:
        conversation = Conversation(image=read_image(example.image))
        start, first, pieces, done = time.perf_counter(), None, 0, None
        for event in pipeline.ask(conversation, example.question, use_retrieval=False,
                                  max_new_tokens=args.max_new_tokens, warm=False):
            if isinstance(event, Token):
                pieces += 1
                first = first if first is not None else time.perf_counter()
            elif isinstance(event, Done):
                done = event
        end = time.perf_counter()
        pipeline.end_conversation(conversation)
        if first is not None:
            ttft.append(first - start)
            if pieces > 1:
                tpot.append((end - first) / (pieces - 1))
        if example.answer_type == "CLOSED":
            closed.append(closed_correct(done.answer, example.answer))
        else:
            recalls.append(open_recall(done.answer, example.answer))

    result = {
        "profile": args.profile, "device": str(device), "n": len(examples), "load_s": round(load_s, 1),
        "closed_accuracy": round(sum(closed) / max(1, len(closed)), 4), "n_closed": len(closed),
        "open_recall": round(sum(recalls) / max(1, len(recalls)), 4), "n_open": len(recalls),
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "tpot_p50_ms": round(1000 * statistics.median(tpot), 1) if tpot else None,
        "published": PUBLISHED,
    }
    if torch.cuda.is_available() and device.type == "cuda":
        result["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    print(f"VQA-RAD test, first {len(examples)} questions (balanced): closed accuracy "
          f"{100 * result['closed_accuracy']:.1f} % of {len(closed)}, open recall {100 * result['open_recall']:.1f} % "
          f"of {len(recalls)}")
    print(f"published for scale ({PUBLISHED['source']}): closed {100 * PUBLISHED['closed_accuracy']:.2f} %, "
          f"open recall {100 * PUBLISHED['open_recall']:.2f} %")
    print(f"time to first token p50 {result['ttft_p50_s']} s, time per output token p50 {result['tpot_p50_ms']} ms, "
          f"load {result['load_s']} s on {device}")
    if args.json:
        print(json.dumps(result))
    return 0


def _balanced(examples, n: int):
    """The first n questions, closed and open alternating while both last (a fixed, readable subset)."""
    closed = [e for e in examples if e.answer_type == "CLOSED"]
    open_ = [e for e in examples if e.answer_type != "CLOSED"]
    picked = []
    while len(picked) < n and (closed or open_):
        for pool in (closed, open_):
            if pool and len(picked) < n:
                picked.append(pool.pop(0))
    return picked


if __name__ == "__main__":
    sys.exit(main())
