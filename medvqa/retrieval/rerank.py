"""IVF-PQ candidates re-scored against float16 vectors on disk, and the build-time choice of how
many lists to visit (`nprobe`) and how many candidates to re-score (`k_factor` x k).

PQ keeps d/8 bytes a vector in memory, which is what lets tens of millions of passages fit, but its
approximate scores alone miss most true neighbours (recall@10 0.27 at 1M clustered 384-d vectors).
Re-scoring a wider candidate list exactly restores the order; the float16 vectors (2 d bytes each)
stay in a file that is memory-mapped, so the operating system keeps what fits in its page cache and
reads the rest by row.

`tune_ivf` measures recall@10 on a sample of the corpus's own vectors as queries (each one's exact
neighbours, itself excluded, found by a full scan) and picks the cheapest (nprobe, k_factor) that
reaches the target, so the setting is measured, not guessed, and is written to the manifest.
"""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

VECTORS_FILE = "vectors.f16.npy"  # (count, d) float16, row n = FAISS row n
RECALL_TARGET = 0.95  # recall@10 the tuning aims at on the corpus sample (the app needs >= 0.9)
TUNING_QUERIES = 500  # 200 left a 0.02-0.03 gap between tuned and fresh-query recall
TUNING_K = 10
NPROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
K_FACTORS = (1, 2, 4, 8, 16, 32, 64)
# Cost of one query, to choose between settings that reach the target (fixed numbers, so a rebuild
# chooses the same; only their ratio matters). Measured by `python scripts/bench_retrieval.py costs`
# (200k clustered 384-d vectors, IVF2048,PQ48, one thread, float16 vectors in memory): 59.5 ns a PQ
# code scanned and 2,568 ns a candidate re-scored (a second run on the loaded machine: 111 and 4,450,
# the same ratio within 10 %); more when a candidate must be read from disk.
SCAN_NS, RESCORE_NS = 60, 2_570


class RerankedIndex:
    """A FAISS IVF index whose top `k x k_factor` candidates are re-scored exactly.

    Offers what the retriever uses of a FAISS index: `search`, `reconstruct_batch`, `ntotal`, `d`.
    """

    def __init__(self, index: faiss.Index, vectors: np.ndarray, k_factor: int):
        if len(vectors) != index.ntotal:
            raise ValueError(f"{len(vectors)} stored vectors for {index.ntotal} indexed ones")
        self.index = index
        self.vectors = vectors  # (n, d) float16, usually a read-only memory map
        self.k_factor = int(k_factor)
        self.d = index.d

    @classmethod
    def open(cls, index: faiss.Index, folder: Path, k_factor: int) -> "RerankedIndex":
        return cls(index, np.load(folder / VECTORS_FILE, mmap_mode="r"), k_factor)

    @property
    def ntotal(self) -> int:
        return self.index.ntotal

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (Q, k), best first; rows -1 where fewer than k were found."""
        _, candidates = self.index.search(queries, min(k * self.k_factor, self.ntotal))  # (Q, k x k_factor)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        for i, (query, found) in enumerate(zip(queries, candidates)):
            found_scores, found_rows = rescore(self.vectors, query, found)
            scores[i, :len(found_rows[:k])] = found_scores[:k]
            rows[i, :len(found_rows[:k])] = found_rows[:k]
        return scores, rows

    def reconstruct_batch(self, rows) -> np.ndarray:
        return np.asarray(self.vectors[np.asarray(rows, dtype=np.int64)], dtype=np.float32)  # (C, d)

    def reconstruct_n(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self.vectors[start:start + count], dtype=np.float32)  # (count, d)


def rescore(vectors: np.ndarray, query: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact scores of `candidates` (FAISS rows, -1 = none), best first; ties go to the lower row."""
    rows = np.unique(candidates[candidates >= 0])  # sorted: the reads go through the file in order
    exact = np.asarray(vectors[rows], dtype=np.float32) @ query  # (C,)
    order = np.argsort(-exact, kind="stable")
    return exact[order], rows[order]


def tune_ivf(index: faiss.Index, vectors: np.ndarray, target: float = RECALL_TARGET,
             queries: int = TUNING_QUERIES, seed: int = 0, trained_on: np.ndarray | None = None) -> dict:
    """The cheapest nprobe and k_factor reaching recall@10 `target` on `queries` corpus vectors.

    Queries are drawn from rows not in `trained_on` (the IVF training sample) where the corpus has
    enough of them: list centres and codebooks fit their training vectors, and on 20k clustered
    vectors, all of them in the training sample, recall tuned on the corpus came out 0.03 above
    recall on new queries. Returns the manifest's tuning fields; where nothing reaches the target,
    the best recall found.
    """
    count, k = index.ntotal, TUNING_K
    excluded = np.asarray([] if trained_on is None else trained_on, dtype=np.int64)
    drawn = np.random.default_rng(seed).choice(count, size=min(count, queries + len(excluded)), replace=False)
    unseen = drawn[~np.isin(drawn, excluded)]
    rows = np.sort(unseen[:queries] if len(unseen) >= min(queries, count) // 2 else drawn[:queries])
    sample = np.asarray(vectors[rows], dtype=np.float32)  # (Q, d)
    truth = [_without(found, row, k) for found, row in zip(exact_neighbours(sample, vectors, k + 1), rows)]
    ivf = faiss.extract_index_ivf(index)
    list_size = count / ivf.nlist
    widest = min(k * max(K_FACTORS) + 1, count)
    measured = []  # (cost, -recall, nprobe, k_factor, recall)
    for nprobe in [p for p in NPROBES if p <= ivf.nlist]:
        ivf.nprobe = nprobe
        _, candidates = index.search(sample, widest)  # (Q, widest), in PQ order
        hits = np.zeros(len(K_FACTORS))
        for query, found, row, gold in zip(sample, candidates, rows, truth):
            found = found[found >= 0]
            exact = np.asarray(vectors[found], dtype=np.float32) @ query  # (C,) one read serves every width
            for i, k_factor in enumerate(K_FACTORS):
                width = k * k_factor + 1  # + 1: the query itself is among its candidates
                best = found[:width][np.lexsort((found[:width], -exact[:width]))]
                hits[i] += len(set(_without(best, row, k)) & set(gold))
        for k_factor, found_hits in zip(K_FACTORS, hits):
            recall = float(found_hits) / (k * len(rows))
            cost = nprobe * list_size * SCAN_NS + k * k_factor * RESCORE_NS
            measured.append((cost, -recall, nprobe, k_factor, recall))
    reached = [m for m in measured if m[4] >= target]
    _, _, nprobe, k_factor, recall = min(reached) if reached else min(measured, key=lambda m: (m[1], m[0]))
    ivf.nprobe = nprobe
    return {"nprobe": nprobe, "k_factor": k_factor, "recall_target": target, "tuned_recall@10": round(recall, 4),
            "tuning_queries": len(rows)}


def exact_neighbours(queries: np.ndarray, vectors: np.ndarray, k: int, block: int = 262_144) -> np.ndarray:
    """(Q, k) rows of the exact top-k inner products, scanning `vectors` a block at a time."""
    best_scores = np.zeros((len(queries), 0), dtype=np.float32)
    best_rows = np.zeros((len(queries), 0), dtype=np.int64)
    for start in range(0, len(vectors), block):
        scores = queries @ np.asarray(vectors[start:start + block], dtype=np.float32).T  # (Q, B)
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k] if scores.shape[1] > k else \
            np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
        scores = np.concatenate([best_scores, np.take_along_axis(scores, top, axis=1)], axis=1)
        rows = np.concatenate([best_rows, top + start], axis=1)
        keep = np.lexsort((rows, -scores), axis=-1)[:, :k]  # best first, ties to the lower row
        best_scores = np.take_along_axis(scores, keep, axis=1)
        best_rows = np.take_along_axis(rows, keep, axis=1)
    return best_rows


def _without(found: np.ndarray, row: int, k: int) -> list[int]:
    return [int(r) for r in found if r != row][:k]
