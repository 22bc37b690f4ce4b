"""Latency and memory of one profile on this machine: cold start, vision, retrieval, time to first
token on the first and the next turn, prefill and decode speed, peak memory, and the decode speed
the memory bandwidth allows.

    python scripts/bench_latency.py [--profile offline] [--engine transformers] [--runs 5] [--json]

Every figure is a median over --runs runs. The decode limit is measured read bandwidth (sampled
beside each decode run) divided by the bytes of decoder weights read per generated token (every
weight once, in the dtype as loaded). Open questions are written by the decoder (decoder.open_choices
"free"): answers chosen among training answers are timed by scripts/bench_closed.py --open.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path


import numpy as np
import torch

from medvqa.config import PROFILES, load_settings, resolve_path
from medvqa.engines import Engine, EngineRequest
from medvqa.pipeline import Conversation, Done, Pipeline, Token
from medvqa.prompt import Prompt

LLAMA_BENCH = Path(__file__).resolve().parent.parent / ".cache" / "llama-bench" / "llama-bench"
QUESTIONS = ["What abnormality is seen in the lungs?", "Where is the lesion located?",
             "What organ system is shown?", "Describe the findings.", "What imaging modality is this?"]
NEXT_QUESTION = "Is it on the left side?"


_BANDWIDTH_PROBE = """
import statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
buffer = torch.rand(int(sys.argv[1]) * 1024 * 1024 // 4, dtype=torch.float32)
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    buffer.sum()
    times.append(time.perf_counter() - start)
print(buffer.numel() * 4 / statistics.median(times) / 1e9)
"""


def measure_bandwidth_gbps(megabytes: int = 1024, repeats: int = 9) -> float:
    """Read bandwidth: the median of several full reads of a buffer far larger than any cache.

    The median, not the best: on a shared virtual machine single reads vary widely (best-of-5 gave
    35 to 58 GB/s between runs here), and decoding sees the typical rate, not the luckiest. The buffer
    lives in a child process, with this process's thread count, so that the benchmark's peak memory
    is the app's own (a 1 GiB buffer in this process had added 1 GiB to `peak_rss_mb`)."""
    probe = subprocess.run([sys.executable, "-c", _BANDWIDTH_PROBE, str(megabytes), str(repeats),
                            str(torch.get_num_threads())], capture_output=True, text=True, check=True)
    return float(probe.stdout.strip().splitlines()[-1])


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen:
            continue  # tied embeddings are read once, by the output head
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    embeddings = model.get_input_embeddings().weight
    if embeddings.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= embeddings.numel() * embeddings.element_size()  # an untied input table is read one row at a time
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="offline")
    parser.add_argument("--engine", default="transformers")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--llama-bench", default=str(LLAMA_BENCH),
                        help="llama.cpp's llama-bench binary (scripts/build_llama_bench.sh); with the llama.cpp "
                             "engine it runs on the same GGUF, prompt and thread count for comparison")
    args = parser.parse_args()

    settings = load_settings(args.profile)
    settings.decoder.engine = args.engine
    # It times the decoder writing answers; an open question answered among training answers
    # (decoder.open_choices) is timed by scripts/bench_closed.py --open.
    settings.decoder.open_choices = "free"
    pipeline = Pipeline.load(settings)
    cold_start = time.perf_counter() - STARTED
    engine = pipeline.engine
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (512, 512, 3), dtype=np.uint8) for _ in range(3 * args.runs + 1)]

    vision_ms = []
    for image in images[1:]:
        start = time.perf_counter()
        pipeline.model.image_tokens(image)
        vision_ms.append(1000 * (time.perf_counter() - start))
    for image in images[1:]:
        pipeline.model.forget_image(Conversation(image=image).digest)

    retrieval_ms = []
    if pipeline.retriever is not None:
        pipeline.retrieve(QUESTIONS[0])  # warm-up
        for question in QUESTIONS:
            start = time.perf_counter()
            pipeline.retrieve(question)
            retrieval_ms.append(1000 * (time.perf_counter() - start))

    first_ttft, next_ttft, prompt_lengths = [], [], []
    for run, image in enumerate(images[:args.runs]):
        conversation = Conversation(image=image, window="lung window (C -600 / W 1500)")
        for turn, question in enumerate([QUESTIONS[run % len(QUESTIONS)], NEXT_QUESTION]):
            ttft, done = _time_to_first_token(pipeline, conversation, question)
            (first_ttft if turn == 0 else next_ttft).append(ttft)
            prompt_lengths.append(done.timings["prompt_tokens"])
        pipeline.end_conversation(conversation)

    # The web app warms a conversation as soon as its scan is shown (vision encoder, system prompt,
    # image tokens, user header), so a first question typed after that has only its own words to
    # prefill. Fresh images, not timed: the warming runs while the clinician types.
    warmed_ttft = []
    for run, image in enumerate(images[args.runs:2 * args.runs]):
        conversation = Conversation(image=image, window="lung window (C -600 / W 1500)")
        pipeline.warm_next_turn(conversation)
        warmed_ttft.append(_time_to_first_token(pipeline, conversation, QUESTIONS[run % len(QUESTIONS)])[0])
        pipeline.end_conversation(conversation)

    # The web app also prefills the question as it is typed (the question box's input events), so a
    # question asked as typed has one token left to prefill. The first turn as above; the next
    # question is warmed as a draft (not timed: it runs while the clinician types), then asked.
    typed_ttft = []
    for run, image in enumerate(images[2 * args.runs:3 * args.runs]):
        conversation = Conversation(image=image, window="lung window (C -600 / W 1500)")
        _time_to_first_token(pipeline, conversation, QUESTIONS[run % len(QUESTIONS)])
        pipeline.warm_next_turn(conversation, draft=NEXT_QUESTION)
        typed_ttft.append(_time_to_first_token(pipeline, conversation, NEXT_QUESTION)[0])
        pipeline.end_conversation(conversation)

    hidden = engine.hidden_size
    high = min(1000, len(engine.tokenizer))  # ordinary token ids (the tiny test model has few)
    low = high // 10
    prefill, decode = [], []
    bandwidths = []
    loop = getattr(engine, "loop", None)  # llama.cpp's step loop: its llama_decode calls are timed
    step_ms, switches = [], []
    for _ in range(args.runs):
        # The bandwidth is sampled beside each decode run: on a shared virtual machine it drifts
        # (medians of separate probes ranged from 31 to 59 GB/s between runs here).
        bandwidths.append(measure_bandwidth_gbps(repeats=3))
        ids = rng.integers(low, high, args.prompt_tokens).tolist()  # fresh ids: nothing to reuse
        prefill.append(args.prompt_tokens / _time_prefill(engine, ids))
        first_at = None
        for _ in engine.stream(_text_request(ids), max_new_tokens=args.new_tokens + 1, ignore_eos=True):
            if first_at is None:
                first_at = time.perf_counter()
                switched = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                if loop is not None:
                    steps, decode_s = loop.steps, loop.decode_s
        decode.append(args.new_tokens / (time.perf_counter() - first_at))
        switches.append((resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switched) / args.new_tokens)
        if loop is not None:
            step_ms.append(1000 * (loop.decode_s - decode_s) / max(loop.steps - steps, 1))

    bandwidth = statistics.median(bandwidths)
    # llama.cpp's own time for one token in the same process and context, without the step loop: at
    # the engine's one-token thread count and at its batch count (all cores). The fastest is the
    # floor the engine's time per token is compared with.
    raw_step_ms = {}
    if hasattr(engine, "time_token_step"):
        ids = rng.integers(low, high, args.prompt_tokens + args.new_tokens // 2).tolist()  # mid-answer depth
        for threads in sorted({engine.token_threads, engine.batch_threads}):
            seconds = engine.time_token_step(_text_request(ids, f"bench-raw-{threads}"), 10 * args.runs, threads)
            raw_step_ms[threads] = round(1000 * statistics.median(seconds), 1)

    # What a next turn costs: its question and the template's end of turn, prefilled after a cached
    # conversation. Few tokens at a time run far below the long-prompt prefill rate.
    context = rng.integers(low, high, 100).tolist()
    prefill_ms_by_tokens = {}
    for count in (1, 4, 8, 13, 32, 96):
        times = [_time_prefill(engine, rng.integers(low, high, count).tolist(), context)
                 for _ in range(args.runs)]
        prefill_ms_by_tokens[count] = round(1000 * statistics.median(times), 1)
    gguf = getattr(engine, "gguf_path", None)
    if gguf:
        # llama.cpp reads the quantised tensors as stored: the GGUF's size is what a token reads.
        bytes_per_token = Path(gguf).stat().st_size
    else:
        bytes_per_token = weight_bytes_per_token(engine.language_model.model)
    result = {
        "profile": args.profile, "engine": args.engine,
        "cold_start_s": round(cold_start, 2),
        "vision_ms": round(statistics.median(vision_ms), 1),
        "retrieval_ms": round(statistics.median(retrieval_ms), 1) if retrieval_ms else None,
        "ttft_first_turn_s": round(statistics.median(first_ttft), 3),
        "ttft_next_turn_s": round(statistics.median(next_ttft), 3),
        "ttft_first_turn_warmed_s": round(statistics.median(warmed_ttft), 3),
        "ttft_next_turn_typed_s": round(statistics.median(typed_ttft), 3),
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "decode_tok_s": round(statistics.median(decode), 1),
        "tpot_ms": round(1000 / statistics.median(decode), 1),
        "voluntary_switches_per_token": round(statistics.median(switches), 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
        "bandwidth_gbps": round(bandwidth, 1),
        "decode_limit_tok_s": round(bandwidth * 1e9 / bytes_per_token, 1),
        "prefill_ms_after_100_by_tokens": prefill_ms_by_tokens,
    }
    if raw_step_ms:
        result["step_loop_decode_ms"] = round(statistics.median(step_ms), 1)  # llama_decode inside the loop
        result["raw_step_ms_by_threads"] = raw_step_ms
        result["raw_step_ms"] = min(raw_step_ms.values())
        result["tpot_vs_raw_step"] = round(result["tpot_ms"] / result["raw_step_ms"], 2)
    if gguf and Path(args.llama_bench).is_file():
        reference = run_llama_bench(args.llama_bench, gguf,
                                    args.prompt_tokens, args.new_tokens, torch.get_num_threads(), args.runs)
        result["llama_bench_prefill_tok_s"] = reference["prefill"]
        result["llama_bench_decode_tok_s"] = reference["decode"]
    print(f"profile {args.profile}, engine {args.engine}, {torch.get_num_threads()} threads, "
          f"decoder width {hidden}, {bytes_per_token / 1e6:.0f} MB of weights read per token")
    print(f"chat prompts: {min(prompt_lengths)}-{max(prompt_lengths)} tokens; synthetic prompt "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens; medians of {args.runs} runs")
    for key, value in result.items():
        print(f"  {key:>20}: {value}")
    print(f"  decode at {100 * result['decode_tok_s'] / result['decode_limit_tok_s']:.0f} % of the bandwidth limit; "
          f"next-turn TTFT = {result['ttft_next_turn_s'] / result['ttft_first_turn_s']:.2f} x first turn; "
          f"first turn after the app's warming = {result['ttft_first_turn_warmed_s'] / result['ttft_first_turn_s']:.2f} x; "
          f"next turn prefilled as typed = {result['ttft_next_turn_typed_s'] / result['ttft_first_turn_s']:.2f} x")
    if "tpot_vs_raw_step" in result:
        print(f"  time per output token {result['tpot_ms']} ms = {result['tpot_vs_raw_step']:.2f} x llama.cpp's own "
              f"one-token step in this process and context ({result['raw_step_ms']} ms; by threads "
              f"{result['raw_step_ms_by_threads']}); the step loop's llama_decode took {result['step_loop_decode_ms']} ms")
    if "llama_bench_decode_tok_s" in result:
        print(f"  against llama-bench on the same GGUF: decode {100 * result['decode_tok_s'] / result['llama_bench_decode_tok_s']:.0f} %, "
              f"prefill {100 * result['prefill_tok_s'] / result['llama_bench_prefill_tok_s']:.0f} %")
    if args.json:
        print(json.dumps(result))


def run_llama_bench(binary: str, gguf: str, prompt_tokens: int, new_tokens: int, threads: int, runs: int) -> dict:
    """llama.cpp's own benchmark on the same terms as ours: prefill of a prompt_tokens batch into an
    empty context, and decode of new_tokens after prompt_tokens of context (-d), in tokens/s."""
    import subprocess

    completed = subprocess.run([binary, "-m", gguf, "-p", str(prompt_tokens), "-n", str(new_tokens),
                                "-d", f"0,{prompt_tokens}", "-t", str(threads), "-r", str(runs), "-o", "json"],
                               capture_output=True, text=True, check=True, timeout=900)
    tests = json.loads(completed.stdout)
    prefill = next(test["avg_ts"] for test in tests
                   if test["n_prompt"] > 0 and test["n_gen"] == 0 and test.get("n_depth", 0) == 0)
    decode = next(test["avg_ts"] for test in tests
                  if test["n_gen"] > 0 and test["n_prompt"] == 0 and test.get("n_depth", 0) == prompt_tokens)
    return {"prefill": round(prefill, 1), "decode": round(decode, 1)}


def _time_to_first_token(pipeline: Pipeline, conversation: Conversation, question: str) -> tuple[float, Done]:
    """Seconds from asking to the first streamed piece (the whole answer's time if none came), and the
    final event. Iterating past Done warms the next turn, as the app does while the answer is read."""
    start, ttft, done = time.perf_counter(), None, None
    for event in pipeline.ask(conversation, question, constrained=False, max_new_tokens=8):
        if isinstance(event, Token) and ttft is None:
            ttft = time.perf_counter() - start
        elif isinstance(event, Done):
            done = event
    return (ttft if ttft is not None else done.timings["total_s"]), done


def _text_request(ids: list[int], conversation_id: str = "bench") -> EngineRequest:
    """A prompt of text token ids alone (no image positions) for the engine."""
    return EngineRequest(conversation_id, Prompt(list(ids), [False] * len(ids)), image=None, image_key=-1)


def _time_prefill(engine: Engine, ids: list[int], context: list[int] = ()) -> float:
    """Seconds to prefill `ids`, after `context` (cached beforehand through the engine's own prefix
    cache, not timed) when given; a fresh conversation each time, so nothing else is reused."""
    conversation_id = f"bench-{time.perf_counter_ns()}"
    context = list(context)
    if context:
        engine.prefill(_text_request(context, conversation_id))
    start = time.perf_counter()
    engine.prefill(_text_request(context + ids, conversation_id))
    elapsed = time.perf_counter() - start
    engine.forget(conversation_id)
    return elapsed


if __name__ == "__main__":
    main()
