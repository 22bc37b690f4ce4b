"""Which FAISS index a corpus gets: chosen by passage count and the machine's memory.

    plan = plan_index(count=15_000_000, dimension=384)      # budget: half of this machine's RAM
    plan.kind, plan.params, plan.reason                      # "ivfpq", {...}, "15,000,000 passages: ..."

Three kinds (their build time, latency and recall at 1M vectors, measured with `python
scripts/bench_retrieval.py scale --n 1000000 --data clustered`, are recorded in
docs/performance.md):

| kind  | bytes in RAM a vector | chosen                        |
|-------|-----------------------|-------------------------------|
| flat  | 4 d                   | below 200k passages (exact)   |
| hnsw  | 4 d + 8 M + 16        | below 2M, when it fits        |
| ivfpq | m + 8 (+ 2 d on disk) | above, or when HNSW won't fit |

`ivfpq` keeps only PQ codes in memory; its candidates are re-scored against float16 vectors in a
file beside the index (rerank.py), read by row through the page cache, so recall does not pay for
the compression. Its `nprobe` and candidate width are tuned at build time (rerank.tune_ivf).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from medvqa.retrieval.errors import RetrievalError

FAISS_TYPES = ("auto", "flat", "hnsw", "ivfpq")
FLAT_LIMIT = 200_000  # exact search below this many passages: a query scans all of them
HNSW_LIMIT = 2_000_000  # HNSW's recall at efSearch 128 is measured up to 1M; above this IVF-PQ
HNSW_M, HNSW_EF_CONSTRUCTION = 32, 80
PQ_SUB_DIMENSION = 8  # PQ with 8-dim sub-vectors of 8 bits: d / 8 bytes a vector
MEMORY_SHARE = 0.5  # the index may take this share of the machine's RAM; models and BM25 need the rest


@dataclass(frozen=True)
class IndexPlan:
    kind: str  # "flat" | "hnsw" | "ivfpq"
    params: dict = field(default_factory=dict)  # FAISS parameters (nlist, pq_m, M, ...), as in the manifest
    ram_bytes: int = 0  # the index in memory
    disk_bytes: int = 0  # beside it on disk (ivfpq's float16 vectors for re-scoring)
    reason: str = ""  # one sentence for the operator: what was chosen and why


def plan_index(count: int, dimension: int, requested: str = "auto", memory_bytes: int | None = None) -> IndexPlan:
    """The index for `count` passages of `dimension`: `requested` if not "auto", else the fastest kind
    whose memory fits `memory_bytes` (default: half of this machine's RAM)."""
    if requested not in FAISS_TYPES:
        raise RetrievalError(f"Unknown FAISS type {requested!r}; choose one of {', '.join(FAISS_TYPES)}.")
    budget = int(memory_bytes if memory_bytes is not None else MEMORY_SHARE * machine_memory())
    plans = {kind: _sized(kind, count, dimension) for kind in FAISS_TYPES[1:]}
    gib = f"{budget / 2**30:.1f} GiB budget"
    if requested != "auto":
        plan = plans[requested]
        return _with_reason(plan, f"{plan.kind} as requested ({_size(plan)}; {gib}).")
    flat, hnsw, ivf = plans["flat"], plans["hnsw"], plans["ivfpq"]
    if count < FLAT_LIMIT and flat.ram_bytes <= budget:
        return _with_reason(flat, f"flat (exact): {count:,} passages < {FLAT_LIMIT:,}, so a query scans them all "
                                  f"({_size(flat)}).")
    if count < HNSW_LIMIT and hnsw.ram_bytes <= budget:
        return _with_reason(hnsw, f"hnsw: {count:,} passages are too many to scan per query and fewer than "
                                  f"{HNSW_LIMIT:,}; the graph fits the {gib} ({_size(hnsw)}).")
    why = (f"HNSW would need {hnsw.ram_bytes / 2**30:.1f} GiB, over the {gib}" if hnsw.ram_bytes > budget
           else f"{count:,} passages >= {HNSW_LIMIT:,}, beyond HNSW's measured range")
    warning = "" if ivf.ram_bytes <= budget else " WARNING: even this is over the budget; use a bigger machine."
    return _with_reason(ivf, f"ivfpq with float16 re-scoring: {why}; IVF-PQ keeps {ivf.params['pq_m']} bytes a "
                             f"passage in memory ({_size(ivf)}).{warning}")


def ivf_lists(count: int) -> int:
    """~4 sqrt(n) inverted lists (the FAISS guideline), a power of two."""
    return int(2 ** round(np.log2(max(16.0, 4 * np.sqrt(count)))))


def pq_sub_vectors(dimension: int) -> int:
    """The number of PQ sub-quantizers: d / 8 when it divides, else the nearest divisor below."""
    return max(m for m in range(1, dimension // PQ_SUB_DIMENSION + 1) if dimension % m == 0)


def machine_memory() -> int:
    """Physical memory in bytes (8 GiB where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 8 * 2**30


def _sized(kind: str, count: int, dimension: int) -> IndexPlan:
    if kind == "flat":
        return IndexPlan("flat", {}, ram_bytes=4 * dimension * count)
    if kind == "hnsw":
        params = {"M": HNSW_M, "ef_construction": HNSW_EF_CONSTRUCTION}
        return IndexPlan("hnsw", params, ram_bytes=(4 * dimension + 8 * HNSW_M + 16) * count)
    nlist, pq_m = ivf_lists(count), pq_sub_vectors(dimension)
    params = {"nlist": nlist, "pq_m": pq_m, "pq_bits": 8, "rerank": "float16"}
    return IndexPlan("ivfpq", params, ram_bytes=(pq_m + 8) * count + 4 * dimension * nlist,
                     disk_bytes=2 * dimension * count)


def _size(plan: IndexPlan) -> str:
    text = f"{plan.ram_bytes / 2**20:,.0f} MiB in memory"
    return text + (f", {plan.disk_bytes / 2**20:,.0f} MiB of vectors on disk" if plan.disk_bytes else "")


def _with_reason(plan: IndexPlan, reason: str) -> IndexPlan:
    return IndexPlan(plan.kind, dict(plan.params), plan.ram_bytes, plan.disk_bytes, reason)
