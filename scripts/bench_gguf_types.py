"""What each llama.cpp weight type costs and buys for the decoder: speed and closeness to the shipped file.

    python scripts/bench_gguf_types.py [--profile offline] [--types Q8_0 IQ4_NL Q4_0] [--texts 40]

For the profile's decoder GGUF as shipped and each re-encoding of it (made once under the cache
folder, as the app does for `decoder.llama_cpp_type`), prints
- llama-bench's prefill speed on 13 tokens (a typical follow-up question with its end-of-turn
  marker) and 512 tokens, and its decode speed on 64 tokens, when the binary is built
  (scripts/build_llama_bench.sh);
- against the shipped file, over the first tokens of literature passages from the corpus: the mean
  KL divergence of next-token distributions (nats) and the share of positions whose most likely
  next token is the same.
Ends with one JSON line: {"source_type", "types": {TYPE: {"file_mb", "pp13_tok_s", "pp512_tok_s",
"tg64_tok_s", "kl_nats", "top1_agreement"}}}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path


import numpy as np

from medvqa.config import PROFILES, load_settings, resolve_path
from medvqa.engines.llama_cpp import gguf_file_type, requantized_gguf

LLAMA_BENCH = Path(__file__).resolve().parent.parent / ".cache" / "llama-bench" / "llama-bench"


def corpus_texts(paths: list[str], count: int) -> list[str]:
    texts = []
    for path in paths:
        if not Path(path).is_file():
            continue
        with open(path) as lines:
            for line in itertools.islice(lines, count):
                text = json.loads(line).get("text", "")
                if text:
                    texts.append(text)
    return texts[:count]


def log_probs(gguf: str, texts: list[str], tokens: int, threads: int) -> list[np.ndarray]:
    """(positions, vocabulary) log-probabilities of each text's first `tokens` tokens."""
    from llama_cpp import Llama

    model = Llama(gguf, n_ctx=tokens + 8, logits_all=True, verbose=False, n_threads=threads)
    out = []
    for text in texts:
        ids = model.tokenize(text.encode())[:tokens]
        model.reset()
        model.eval(ids)
        scores = np.asarray(model.scores[:len(ids)], dtype=np.float64)
        scores -= scores.max(1, keepdims=True)
        out.append(scores - np.log(np.exp(scores).sum(1, keepdims=True)))
    return out


def llama_bench(binary: str, gguf: str, threads: int, runs: int) -> dict:
    completed = subprocess.run([binary, "-m", gguf, "-p", "13,512", "-n", "64", "-t", str(threads),
                                "-r", str(runs), "-o", "json"], capture_output=True, text=True, check=True)
    speeds = {}
    for row in json.loads(completed.stdout):
        name = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        speeds[f"{name}_tok_s"] = round(row["avg_ts"], 1)
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="offline")
    parser.add_argument("--types", nargs="+", default=["Q8_0", "IQ4_NL", "Q4_0"])
    parser.add_argument("--texts", type=int, default=40, help="corpus passages compared")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of each passage compared")
    parser.add_argument("--runs", type=int, default=3, help="llama-bench repetitions")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--llama-bench", default=str(LLAMA_BENCH))
    args = parser.parse_args()

    settings = load_settings(args.profile)
    source = resolve_path(settings.decoder.name_or_path)
    if not source.endswith(".gguf"):
        raise SystemExit(f"The {args.profile!r} profile's decoder is not a GGUF file: {source}")
    texts = corpus_texts(settings.retrieval.corpus, args.texts)
    source_type = gguf_file_type(source)
    print(f"decoder {Path(source).name} ({source_type}); {len(texts)} corpus passages, "
          f"first {args.tokens} tokens each; {args.threads} threads")
    reference = log_probs(source, texts, args.tokens, args.threads)
    results = {}
    for weight_type in [source_type] + [t for t in args.types if t.upper() != source_type]:
        path = source if weight_type == source_type else requantized_gguf(source, weight_type, settings.cache_dir)
        row = {"file_mb": round(Path(path).stat().st_size / 1e6, 1)}
        if Path(args.llama_bench).is_file():
            row.update(llama_bench(args.llama_bench, path, args.threads, args.runs))
        if weight_type != source_type:
            other = log_probs(path, texts, args.tokens, args.threads)
            kl = np.concatenate([(np.exp(p) * (p - q)).sum(1) for p, q in zip(reference, other)])
            agree = np.concatenate([p.argmax(1) == q.argmax(1) for p, q in zip(reference, other)])
            row.update(kl_nats=round(float(kl.mean()), 4), top1_agreement=round(float(agree.mean()), 4))
        results[weight_type] = row
        print(f"{weight_type:>7}: " + ", ".join(f"{key} {value}" for key, value in row.items()), flush=True)
    print(json.dumps({"source_type": source_type, "types": results}))


if __name__ == "__main__":
    main()
