"""Retrieval benchmarks.

    python scripts/bench_retrieval.py quality [--json]
        On pubmed_abstracts.jsonl each article's `question_title` is a query and that article's
        passages (same `pmid`) are the gold. Prints recall@1/5/10 (share of queries with a gold
        passage in the top k) and MRR (first gold within the top 100) for BM25, dense and fused
        rankings (before the relevance cut and de-duplication, which only shorten the list).
        With --json the last line is one JSON object.

    python scripts/bench_retrieval.py scale --n 1000000
        Random unit vectors of the embedder's dimension: build time, index bytes, resident memory,
        p50/p99 single-query latency for Flat, HNSW and IVF-PQ, and recall@10 of HNSW and IVF-PQ
        against Flat (exact). Each is built as build_index.py builds it (IVF-PQ with float16
        vectors on disk, nprobe and candidate width tuned for the recall target). Uniform random
        vectors have no cluster structure, the hardest case for approximate indexes; `--data
        clustered` draws them around 1,000 centres instead. Then what the index chooser picks at
        this size and at 15M and 36M passages, and a projection of memory, build time, latency and
        embedding hours there (on this machine's CPU; per GPU with --gpu-rate).

    python scripts/bench_retrieval.py costs [--n 200000]
        The two per-query costs rerank.tune_ivf weighs (SCAN_NS, RESCORE_NS): on an IVF-PQ index of
        n clustered vectors built as build_index.py builds it (float16 vectors in the page cache),
        one query thread, the nanoseconds a PQ code scanned (from the time at nprobe 8 and 64) and a
        candidate re-scored (from k_factor 1 and 64, k = 10), each the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


import numpy as np

from medvqa.config import load_settings

KS = (1, 5, 10)
DEPTH = 100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    quality = commands.add_parser("quality", help="recall@k and MRR of BM25, dense and fused")
    quality.add_argument("--corpus", default=None, help="default: ../shared/data/corpus/pubmed_abstracts.jsonl")
    quality.add_argument("--index-dir", default=None, help="where the benchmark index is cached (default index/)")
    quality.add_argument("--rebuild", action="store_true")
    quality.add_argument("--json", action="store_true", help="end with one JSON line")
    scale = commands.add_parser("scale", help="FAISS index types on random vectors")
    scale.add_argument("--n", type=int, default=1_000_000)
    scale.add_argument("--dim", type=int, default=None, help="default: the embedder's dimension")
    scale.add_argument("--queries", type=int, default=200)
    scale.add_argument("--types", default="flat,hnsw,ivfpq")
    scale.add_argument("--data", choices=("uniform", "clustered"), default="uniform")
    scale.add_argument("--seed", type=int, default=0)
    scale.add_argument("--embed-sample", type=int, default=256,
                       help="corpus passages to time the embedder on, for the projection (0: skip)")
    scale.add_argument("--gpu-rate", type=float, default=None,
                       help="passages/s of a GPU embedding run (build_index.py --device cuda prints it)")
    scale.add_argument("--json", action="store_true")
    costs = commands.add_parser("costs", help="ns a PQ code scanned and a candidate re-scored")
    costs.add_argument("--n", type=int, default=200_000)
    costs.add_argument("--queries", type=int, default=200)
    costs.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    return {"quality": run_quality, "scale": run_scale, "costs": run_costs}[args.command](args)


# --- costs ----------------------------------------------------------------------------------------

def run_costs(args) -> int:
    import faiss

    from medvqa.retrieval.index import new_faiss_index, training_size
    from medvqa.retrieval.rerank import RerankedIndex

    faiss.omp_set_num_threads(1)
    dim = _embedder_dimension(load_settings("offline").retrieval.embedder)
    blocks = _Blocks(args.n, dim, 0, "clustered")
    index, params = new_faiss_index("ivfpq", dim, args.n)
    index.train(blocks.sample(training_size(index, args.n)))
    vectors = np.concatenate(list(blocks)).astype(np.float16)  # (n, d), in memory like a cached file
    index.add(vectors.astype(np.float32))
    ivf, queries, k = faiss.extract_index_ivf(index), blocks.queries(args.queries), 10

    def seconds_a_query(nprobe: int, k_factor: int) -> float:
        ivf.nprobe = nprobe
        searchable = RerankedIndex(index, vectors, k_factor)
        runs = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            for query in queries:
                searchable.search(query[None], k)
            runs.append((time.perf_counter() - started) / len(queries))
        return float(np.median(runs))

    list_size = args.n / ivf.nlist
    scan_ns = (seconds_a_query(64, 1) - seconds_a_query(8, 1)) / ((64 - 8) * list_size) * 1e9
    rescore_ns = (seconds_a_query(8, 64) - seconds_a_query(8, 1)) / ((64 - 1) * k) * 1e9
    print(json.dumps({"n": args.n, "dim": dim, "nlist": ivf.nlist, "pq_m": params["pq_m"],
                      "scan_ns": round(scan_ns, 1), "rescore_ns": round(rescore_ns, 1),
                      "faiss": faiss.__version__}))
    return 0


# --- quality --------------------------------------------------------------------------------------

def run_quality(args) -> int:
    from medvqa.retrieval import Retriever, build_index
    from medvqa.retrieval.index import MANIFEST

    config = load_settings().retrieval
    corpus = Path(args.corpus or Path(config.corpus[0]).parent / "pubmed_abstracts.jsonl")
    if not corpus.is_file():
        print(f"error: {corpus} not found (run scripts/fetch_corpus.py)", file=sys.stderr)
        return 2
    index_root = Path(args.index_dir or config.index_dir)
    name = "bench-" + corpus.stem
    index_dir = index_root / name
    if args.rebuild or not _built_from(index_dir / MANIFEST, corpus, config.embedder):
        started = time.perf_counter()
        build_index([str(corpus)], index_dir, config.embedder, overwrite=True, progress=True,
                    passage_embedder=config.passage_embedder, pooling=config.pooling, device=config.device,
                    chunk_tokens=config.chunk_tokens, chunk_overlap=config.chunk_overlap,
                    normalize=config.normalize, passage_title=config.passage_title)
        print(f"built {index_dir} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    retriever = Retriever.open(replace(config, index_dir=str(index_root), index_name=name))

    row_pmid, queries = {}, {}
    for start in range(0, len(retriever), 4096):
        for row, record in retriever.store.get(list(range(start, min(start + 4096, len(retriever))))).items():
            row_pmid[row] = str(record["extra"].get("pmid", ""))
            queries.setdefault(row_pmid[row], record["extra"].get("question_title", ""))
    queries = {pmid: q for pmid, q in queries.items() if pmid and q}

    first_gold = {"bm25": [], "dense": [], "fused": []}
    started = time.perf_counter()
    for pmid, question in queries.items():
        ranking = retriever.rank(question, depth=DEPTH)
        lists = {"bm25": ranking.bm25, "dense": ranking.dense, "fused": [row for row, _, _ in ranking.fused]}
        for method, rows in lists.items():
            rank = next((i for i, row in enumerate(rows[:DEPTH], start=1) if row_pmid[row] == pmid), None)
            first_gold[method].append(rank)
    elapsed = time.perf_counter() - started

    results = {method: _metrics(ranks) for method, ranks in first_gold.items()}
    print(f"{len(queries)} queries over {len(retriever)} passages from {corpus.name} "
          f"({elapsed / len(queries) * 1000:.1f} ms a query, embedder {config.embedder})")
    print(f"{'method':<8}{'MRR':>8}" + "".join(f"{'R@' + str(k):>8}" for k in KS))
    for method, values in results.items():
        print(f"{method:<8}{values['mrr']:>8.4f}" + "".join(f"{values[f'recall@{k}']:>8.4f}" for k in KS))
    if args.json:
        print(json.dumps(results))
    return 0


def _metrics(first_ranks: list[int | None]) -> dict[str, float]:
    n = len(first_ranks)
    values = {"mrr": round(sum(1 / r for r in first_ranks if r) / n, 4)}
    for k in KS:
        values[f"recall@{k}"] = round(sum(1 for r in first_ranks if r and r <= k) / n, 4)
    return values


def _built_from(manifest_path: Path, corpus: Path, embedder: str) -> bool:
    if not manifest_path.is_file():
        return False
    manifest = json.loads(manifest_path.read_text())
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
    return manifest.get("embedder") == embedder and [f["sha256"] for f in manifest["corpus_files"]] == [digest]


# --- scale ----------------------------------------------------------------------------------------

def run_scale(args) -> int:
    import faiss

    from medvqa.retrieval.plan import MEMORY_SHARE, machine_memory, plan_index
    from medvqa.retrieval.search import query_threads

    config = load_settings().retrieval
    dim = args.dim or _embedder_dimension(config.embedder)
    kinds = [kind.strip() for kind in args.types.split(",") if kind.strip()]
    blocks = _Blocks(args.n, dim, args.seed, args.data)
    queries = blocks.queries(args.queries)  # (Q, d)
    print(f"{args.n:,} {args.data} random unit vectors of dimension {dim}; {args.queries} single-vector queries; "
          f"faiss {faiss.__version__}, built on {faiss.omp_get_max_threads()} threads, queried on "
          f"{config.query_threads or faiss.omp_get_max_threads()}", flush=True)
    sizes = {_label(args.n): args.n} | {_label(n): n for n in PROJECTED_SIZES}
    budget = int(MEMORY_SHARE * machine_memory())
    chosen = {label: plan_index(n, dim, memory_bytes=budget) for label, n in sizes.items()}
    for label, plan in chosen.items():
        print(f"chooser at {label} passages ({budget / 2**30:.1f} GiB budget): {plan.reason}", flush=True)

    truth = None
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for kind in ["flat"] + [k for k in kinds if k != "flat"]:
            gc.collect()
            rss_before = _rss_bytes()
            started = time.perf_counter()
            index, params, disk_bytes, phases = _bench_index(kind, dim, args.n, blocks, config, Path(scratch))
            build_s = time.perf_counter() - started
            rss = _rss_bytes() - rss_before
            size = _index_bytes(index.index if hasattr(index, "k_factor") else index)
            latencies, found = [], []
            with query_threads(config.query_threads):  # as Retriever.search runs them
                for query in queries:
                    start = time.perf_counter()
                    _, ids = index.search(query[None, :], 10)  # (1, 10)
                    latencies.append(time.perf_counter() - start)
                    found.append(ids[0])
            if kind == "flat":
                truth = found
            recall = float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth)]))
            row = {"type": kind, "params": params, "build_s": round(build_s, 1),
                   "index_mib": round(size / 2**20, 1), "rss_mib": round(rss / 2**20, 1),
                   "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 2),
                   "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 2), "recall@10": round(recall, 4),
                   "disk_mib": round(disk_bytes / 2**20, 1),
                   "build_phases_s": {phase: round(seconds, 1) for phase, seconds in phases.items()},
                   "chosen_for": [label for label, plan in chosen.items() if plan.kind == kind]}
            rows.append(row)
            print(f"{kind}: {row}", file=sys.stderr, flush=True)
            del index
            if kind == "flat" and "flat" not in kinds:
                rows.pop()

    embed_rate = _embedding_rate(config, args.embed_sample) if args.embed_sample else None
    for row in rows:
        row["projection"] = _project(row, args.n, dim, budget, embed_rate, args.gpu_rate)

    print(f"{'type':<7}{'build s':>9}{'index MiB':>11}{'disk MiB':>10}{'RSS MiB':>9}{'p50 ms':>8}{'p99 ms':>8}"
          f"{'R@10':>7}  params")
    for row in rows:
        print(f"{row['type']:<7}{row['build_s']:>9.1f}{row['index_mib']:>11.1f}{row['disk_mib']:>10.1f}"
              f"{row['rss_mib']:>9.1f}{row['p50_ms']:>8.2f}{row['p99_ms']:>8.2f}{row['recall@10']:>7.3f}"
              f"  {row['params']}")
    _print_projection(rows, args.n, embed_rate, args.gpu_rate)
    if args.json:
        print(json.dumps(rows))
    return 0


PROJECTED_SIZES = (15_000_000, 36_000_000)  # PMC-15M figure-caption pairs; PubMed's ~36M abstracts


def _bench_index(kind: str, dim: int, count: int, blocks: "_Blocks", config, scratch: Path):
    """Build `kind` over the dataset as build_index does: (searchable index, params, bytes on disk,
    seconds of each build phase: train, add, tune). ivfpq keeps float16 vectors in a file and is
    tuned for the recall target on them, as in a build."""
    import faiss

    from medvqa.retrieval.index import new_faiss_index, training_size
    from medvqa.retrieval.rerank import RerankedIndex, tune_ivf

    phases = {"train": 0.0, "add": 0.0, "tune": 0.0}
    started = time.perf_counter()
    index, params = new_faiss_index(kind, dim, count)
    if kind == "hnsw":
        index.hnsw.efSearch = config.hnsw_ef_search
    if not index.is_trained:
        index.train(blocks.sample(training_size(index, count)))
    phases["train"], started = time.perf_counter() - started, time.perf_counter()
    if kind != "ivfpq":
        for block in blocks:
            index.add(block)  # (B, d)
        phases["add"] = time.perf_counter() - started
        return index, params, 0, phases
    vectors = np.lib.format.open_memmap(scratch / "vectors.npy", mode="w+", dtype=np.float16, shape=(count, dim))
    start = 0
    for block in blocks:
        vectors[start:start + len(block)] = block
        index.add(np.asarray(vectors[start:start + len(block)], dtype=np.float32))  # (B, d) as stored
        start += len(block)
    vectors.flush()
    phases["add"], started = time.perf_counter() - started, time.perf_counter()
    params.update(tune_ivf(index, vectors, trained_on=np.arange(training_size(index, count))))
    phases["tune"] = time.perf_counter() - started
    if config.ivf_nprobe:
        faiss.extract_index_ivf(index).nprobe = config.ivf_nprobe
    searchable = RerankedIndex(index, np.load(scratch / "vectors.npy", mmap_mode="r"), params["k_factor"])
    return searchable, params, vectors.nbytes, phases


def _project(row: dict, n: int, dim: int, budget: int, embed_rate: float | None, gpu_rate: float | None) -> dict:
    """Memory, build time and latency at PROJECTED_SIZES from the measurement at `n` (meaningful from
    about 1M, where the fixed costs no longer dominate).

    Memory: the chooser's per-vector model (plan.py), scaled by measured / modelled at `n`. Build
    time, phase by phase: adding x N for flat, x N log N for HNSW (each insertion searches the
    graph), x N nlist for IVF (each vector meets every list centre; nlist grows as sqrt N); IVF
    training x nlist^2 (its sample grows with nlist); tuning x N (an exact scan). Latency: flat x N
    (a full scan), HNSW x log N, IVF x sqrt N (the lists visited grow as N / nlist). Recall is not
    projected: a build tunes nprobe and the candidate width for the target on its own corpus.
    """
    from medvqa.retrieval.plan import ivf_lists, machine_memory, plan_index

    at_n = plan_index(n, dim, row["type"], memory_bytes=0)
    ram_scale = row["index_mib"] * 2**20 / at_n.ram_bytes if at_n.ram_bytes else 1.0
    phases = row["build_phases_s"]
    projected = {}
    for big in PROJECTED_SIZES:
        plan = plan_index(big, dim, row["type"], memory_bytes=0)
        ram, disk = plan.ram_bytes * ram_scale, plan.disk_bytes
        lists = ivf_lists(big) / ivf_lists(n)
        add = {"flat": big / n, "hnsw": big * np.log(big) / (n * np.log(n)), "ivfpq": big / n * lists}[row["type"]]
        build_s = phases["train"] * lists**2 + phases["add"] * add + phases["tune"] * big / n
        latency = {"flat": big / n, "hnsw": np.log(big) / np.log(n), "ivfpq": np.sqrt(big / n)}[row["type"]]
        projected[_label(big)] = {
            "ram_gib": round(ram / 2**30, 1), "disk_gib": round(disk / 2**30, 1),
            "fits_budget": bool(ram <= budget),
            "disk_fits_page_cache": bool(disk <= machine_memory() - ram),  # else re-scoring reads the disk
            "build_h": round(build_s / 3600, 1),
            "p50_ms": round(row["p50_ms"] * latency, 2), "p99_ms": round(row["p99_ms"] * latency, 2),
            "embed_cpu_h": round(big / embed_rate / 3600, 1) if embed_rate else None,
            "embed_gpu_h": round(big / gpu_rate / 3600, 2) if gpu_rate else None}
    return projected


def _print_projection(rows: list[dict], n: int, embed_rate: float | None, gpu_rate: float | None) -> None:
    rate = f"embedding at {embed_rate:,.1f} passages/s here" if embed_rate else "embedding not measured"
    gpu = f", {gpu_rate:,.0f}/s on the GPU given" if gpu_rate else ""
    print(f"projection from {_label(n)} ({rate}{gpu}; recall is tuned per build, not projected):")
    print(f"{'type':<7}{'size':>6}{'RAM GiB':>9}{'fits':>6}{'disk GiB':>10}{'cached':>8}{'build h':>10}"
          f"{'p50 ms':>10}{'p99 ms':>10}{'embed h':>10}{'GPU h':>8}  chooser")
    for row in rows:
        for label, p in row["projection"].items():
            print(f"{row['type']:<7}{label:>6}{p['ram_gib']:>9,.1f}{_yes(p['fits_budget']):>6}{p['disk_gib']:>10,.1f}"
                  f"{_yes(p['disk_fits_page_cache']) if p['disk_gib'] else '':>8}{p['build_h']:>10,.1f}"
                  f"{p['p50_ms']:>10,.2f}{p['p99_ms']:>10,.2f}{_hours(p['embed_cpu_h']):>10}"
                  f"{_hours(p['embed_gpu_h']):>8}"
                  f"  {'picks' if label in row['chosen_for'] else ''}")


def _embedding_rate(config, sample: int) -> float:
    """Passages a second the configured embedder encodes on this machine, on corpus passages."""
    from medvqa.retrieval.embed import load_embedder

    texts = []
    corpus = Path(config.corpus[0]) if config.corpus else None
    if corpus and corpus.is_file():
        with open(corpus) as lines:
            texts = [json.loads(line)["text"] for line, _ in zip(lines, range(sample))]
    texts = texts or [f"Passage {i} about a chest radiograph with a pleural effusion." for i in range(sample)]
    model = load_embedder(config.embedder, device=config.device, pooling=config.pooling, normalize=config.normalize)
    model.encode(texts[:8])  # warm-up
    started = time.perf_counter()
    model.encode(texts, batch_size=64)
    return len(texts) / (time.perf_counter() - started)


def _label(count: int) -> str:
    return f"{count / 1e6:g}M" if count >= 1_000_000 else f"{count / 1e3:g}k"


def _hours(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _yes(value: bool) -> str:
    return "yes" if value else "no"


class _Blocks:
    """The dataset, regenerated block by block from seeds, so it is never held twice in memory."""

    def __init__(self, n: int, dim: int, seed: int, kind: str, block: int = 100_000):
        self.n, self.dim, self.seed, self.kind, self.block = n, dim, seed, kind, block
        self.centres = _unit(np.random.default_rng(seed + 10**6).standard_normal((1000, dim), dtype=np.float32))

    def _make(self, rng: np.random.Generator, count: int) -> np.ndarray:
        points = rng.standard_normal((count, self.dim), dtype=np.float32)
        if self.kind == "clustered":
            points = self.centres[rng.integers(0, len(self.centres), count)] + 0.06 * points
        return _unit(points)

    def __iter__(self):
        for i, start in enumerate(range(0, self.n, self.block)):
            yield self._make(np.random.default_rng(self.seed + i), min(self.block, self.n - start))

    def sample(self, count: int) -> np.ndarray:
        # Training sample: the first blocks are already a uniform sample of the data.
        taken, parts = 0, []
        for block in self:
            parts.append(block[:count - taken])
            taken += len(parts[-1])
            if taken >= count:
                break
        return np.concatenate(parts)

    def queries(self, count: int) -> np.ndarray:
        return self._make(np.random.default_rng(self.seed + 10**7), count)


def _unit(points: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(points / np.linalg.norm(points, axis=1, keepdims=True), dtype=np.float32)


def _embedder_dimension(spec: str) -> int:
    from medvqa.retrieval.embed import load_embedder
    return load_embedder(spec, device="cpu").dimension


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _index_bytes(index) -> int:
    import faiss
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "index")
        faiss.write_index(index, path)
        return os.path.getsize(path)


if __name__ == "__main__":
    sys.exit(main())
