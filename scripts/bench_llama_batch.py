"""What one llama_decode costs by batch shape on the offline decoder: the ceiling continuous batching
works under on this machine.

    python scripts/bench_llama_batch.py [--type Q8_0] [--threads 2] [--runs 15] [--as-in-app]
                                        [--against-threads 1] [--json]

One context as the llama.cpp engine makes it (8 slots of the profile's context window, one key/value
stream each); every slot first holds an 80-token prompt. Then, median over --runs calls each: one
token in one slot, a 7-, 64- and 512-token prompt chunk in one slot, one token in each of 4 consecutive
slots, of 4 slots apart (0, 2, 4, 6) and of all 8, and 8 tokens in each of the 8 slots; each call after
the 80 tokens (the slots are cut back to them first). Printed per shape: milliseconds per call and
positions per second, with the voluntary context switches per call (threads that slept, which
is how llama.cpp's threads meet at a barrier when libgomp does not spin); then the 8-slot step
against one slot's.

`--as-in-app` times the calls as the app makes them: torch (sharing llama.cpp's libgomp) first runs
an operation on all cores in the main thread, as the vision encoder does, and the calls run
in a thread of their own, as the engine's step loop does. Two OpenMP teams then hold more threads
than the machine has cores, and libgomp stops spinning at barriers. `--against-threads N` also times
each call on N threads, alternating call by call with --threads, so that both see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SHAPES = [("1 token, 1 slot", [0], 1), ("7 tokens, 1 slot", [0], 7), ("64 tokens, 1 slot", [0], 64),
          ("512 tokens, 1 slot", [0], 512),
          ("1 token each, slots 0-3", [0, 1, 2, 3], 1), ("1 token each, slots 0,2,4,6", [0, 2, 4, 6], 1),
          ("1 token each, slots 0-7", list(range(8)), 1), ("8 tokens each, slots 0-7", list(range(8)), 8)]
SLOTS, HELD = 8, 80


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="", help='weights re-encoded as this type (e.g. Q8_0); "" as shipped')
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--as-in-app", action="store_true",
                        help="a torch operation in the main thread first, the calls in a thread of their own")
    parser.add_argument("--against-threads", type=int, default=0,
                        help="also time each call on this many threads, alternating with --threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.as_in_app:
        import threading

        import torch

        torch.ones(1 << 22).exp_()  # torch's OpenMP team (all cores, as the vision encoder's), in the main thread
        result: list[int] = []
        worker = threading.Thread(target=lambda: result.append(_measure(args)), name="as the step loop")
        worker.start()
        worker.join()
        return result[0]
    return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    import resource

    import llama_cpp
    from llama_cpp._logger import set_verbose

    from medvqa.config import load_settings, resolve_path
    from medvqa.engines.llama_cpp import gguf_file_type, requantized_gguf

    settings = load_settings("offline")
    gguf = requantized_gguf(resolve_path(settings.decoder.name_or_path), args.type, settings.cache_dir)
    set_verbose(False)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = settings.decoder.context_window * SLOTS
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max, params.kv_unified = SLOTS, False
    params.n_threads = params.n_threads_batch = max(args.threads, args.against_threads)
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(512, 0, 1)
    positions = [0] * SLOTS

    def decode(slots: list[int], per_slot: int) -> float:
        index = 0
        for slot in slots:
            for offset in range(per_slot):
                batch.token[index] = 100 + offset
                batch.pos[index] = positions[slot] + offset
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = slot
                batch.logits[index] = int(offset == per_slot - 1)
                index += 1
            positions[slot] += per_slot
        batch.n_tokens = index
        start = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return 1000 * (time.perf_counter() - start)

    memory = llama_cpp.llama_get_memory(ctx)

    def timed(slots: list[int], per_slot: int, threads: int) -> tuple[float, int]:
        """One call on `threads` threads at the same depth each time (the slots are cut back to the
        held prompt first): milliseconds, and the voluntary context switches of the process meanwhile."""
        llama_cpp.llama_set_n_threads(ctx, threads, threads)
        for slot in slots:
            llama_cpp.llama_memory_seq_rm(memory, slot, HELD, -1)
            positions[slot] = HELD
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        ms = decode(slots, per_slot)
        return ms, resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches

    for slot in range(SLOTS):
        decode([slot], HELD)
    rows = []
    for name, slots, per_slot in SHAPES:
        calls, against = [], []
        for _ in range(args.runs):
            calls.append(timed(slots, per_slot, args.threads))
            if args.against_threads:
                against.append(timed(slots, per_slot, args.against_threads))
        ms = statistics.median(call[0] for call in calls)
        rows.append({"shape": name, "positions": len(slots) * per_slot, "ms": round(ms, 1),
                     "positions_per_s": round(1000 * len(slots) * per_slot / ms, 1),
                     "switches_per_call": statistics.median(call[1] for call in calls)})
        if against:
            rows[-1]["against_ms"] = round(statistics.median(call[0] for call in against), 1)
            rows[-1]["against_switches_per_call"] = statistics.median(call[1] for call in against)
    by_shape = {row["shape"]: row["ms"] for row in rows}
    one, eight = by_shape["1 token, 1 slot"], by_shape["1 token each, slots 0-7"]
    summary = {"weights": gguf_file_type(gguf), "threads": args.threads, "runs": args.runs,
               "against_threads": args.against_threads, "as_in_app": args.as_in_app, "shapes": rows,
               "eight_slot_step_vs_one": round(eight / one, 2)}
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"weights {summary['weights']}, {args.threads} threads{', as in the app' if args.as_in_app else ''}, "
              f"medians of {args.runs} calls")
        for row in rows:
            print(f"  {row['shape']:<30} {row['ms']:7.1f} ms  {row['positions_per_s']:7.1f} positions/s  "
                  f"{row['switches_per_call']:5.0f} context switches"
                  + (f"  | {args.against_threads} threads: {row['against_ms']:7.1f} ms, "
                     f"{row['against_switches_per_call']:5.0f} switches" if "against_ms" in row else ""))
        print(f"  a step carrying 8 answers' tokens costs {summary['eight_slot_step_vs_one']}x one answer's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
