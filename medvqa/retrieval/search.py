"""`Retriever.search(question) -> [Passage]`: dense + BM25, fused, cut for relevance, de-duplicated.

One search, top to bottom:
1. the question is cleaned and, when the scan's safe metadata names a modality or body part,
   enriched with them ("... [CT computed tomography, chest]");
2. FAISS (cosine on normalised vectors) and BM25 each rank `candidates` passages;
3. reciprocal rank fusion: score = sum over retrievers of weight / (rrf_k + rank);
4. relevance cut: a question far from the corpus centroid (`min_topic_score`) gets no sources at
   all unless some passage matches it strongly (`strong_match_score`); otherwise a passage is cited
   only when the *bare* question's cosine with it reaches
   `min_dense_score`, so an off-topic question gets no sources rather than bad ones (the metadata
   alone must not make a chest CT caption look relevant to "what's the weather?"), and lies within
   `relevance_margin` of the best candidate's, so one strong match is not padded with weak ones;
5. near-duplicates (same normalised text, or vectors closer than `duplicate_cosine`) collapse onto
   the better-ranked passage.

With a cross-encoder configured (`cross_encoder`, the llava-med profile's MedCPT-Cross-Encoder), the
first `rerank_candidates` fused passages are re-ordered by its score of (bare question, passage)
before steps 4 and 5 (retrieval/cross_encoder.py).
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
from bm25s.stopwords import STOPWORDS_EN_PLUS

from medvqa.config import RetrievalConfig
from medvqa.retrieval.bm25 import STEMMER, SparseIndex
from medvqa.retrieval.cross_encoder import CrossEncoder, article_text, load_cross_encoder
from medvqa.retrieval.embed import Embedder, load_embedder
from medvqa.retrieval.errors import RetrievalError
from medvqa.retrieval.index import (BM25_DIR, FAISS_FILE, FORMAT_VERSION, STORE_FILE, check_embedder,
                                    load_vector_sum, read_manifest)
from medvqa.retrieval.rerank import VECTORS_FILE, RerankedIndex
from medvqa.retrieval.sanitize import sanitize_query
from medvqa.retrieval.store import PassageStore


@dataclass(frozen=True)
class Passage:
    id: str
    text: str  # sanitised at ingest: data, never instructions
    url: str  # from the corpus line; the UI links to this, never to model output
    title: str
    source: str
    license: str
    score: float  # fused reciprocal-rank score (higher is better)
    # 1-based rank in each retriever, e.g. {"dense": 1, "bm25": 4}, and in the cross-encoder's order
    # ("cross_encoder") when one re-ranked it
    ranks: dict[str, int] = field(default_factory=dict)


@dataclass
class Ranking:
    """Every retriever's candidates for one query (rows are FAISS rows / store rows)."""
    question_vector: np.ndarray | None  # (d,) the bare question's embedding
    dense: list[int] = field(default_factory=list)
    dense_scores: list[float] = field(default_factory=list)
    bm25: list[int] = field(default_factory=list)
    bm25_scores: list[float] = field(default_factory=list)
    fused: list[tuple[int, float, dict[str, int]]] = field(default_factory=list)  # (row, score, ranks)


_OPEN_DAMAGE = (OSError, RuntimeError, sqlite3.Error, ValueError, KeyError, TypeError, EOFError)
_SEARCH_DAMAGE = (OSError, sqlite3.Error)  # a file changed under a running app (FAISS's index is in memory)


@contextlib.contextmanager
def _damage_said(index_dir: Path, kinds: tuple[type[BaseException], ...] = _OPEN_DAMAGE):
    """Reading an index's files: what FAISS, SQLite, NumPy or the BM25 files raise for a file that is cut
    short, emptied or not what it should be becomes a RetrievalError that says to rebuild the index (the app
    then answers without literature, and says why)."""
    try:
        yield
    except RetrievalError:
        raise
    except kinds as error:
        raise RetrievalError(f"The index at {index_dir} is damaged ({type(error).__name__}: "
                             f"{str(error).splitlines()[0][:160] if str(error) else 'unreadable'}); rebuild it with "
                             "scripts/build_index.py --overwrite.") from error  # the library's own words kept


class Retriever:
    """An opened index. Safe to share between threads: every stateful part sits behind a lock."""

    def __init__(self, config: RetrievalConfig, index_dir: Path, manifest: dict, index: faiss.Index | RerankedIndex,
                 sparse: SparseIndex, store: PassageStore, embedder: Embedder,
                 cross_encoder: CrossEncoder | None = None):
        self.config = config
        self.cross_encoder = cross_encoder
        self.index_dir = index_dir
        self.manifest = manifest
        self.index = index
        self.sparse = sparse
        self.store = store
        self.embedder = embedder
        self._faiss_lock = threading.Lock()
        # Relevance cut-offs in this embedder's units: calibrated ones from the manifest win.
        self.thresholds = {name: getattr(config, name) for name in THRESHOLDS}
        self.thresholds.update({name: float(value) for name, value in (manifest.get("thresholds") or {}).items()
                                if name in THRESHOLDS})
        with _damage_said(index_dir):
            centroid = load_vector_sum(index_dir, index)
        self.centroid = (centroid / max(np.linalg.norm(centroid), 1e-12)).astype(np.float32)  # (d,)

    @classmethod
    def open(cls, config: RetrievalConfig) -> "Retriever":
        index_dir = Path(config.index_dir) / config.index_name
        manifest = read_manifest(index_dir)
        if manifest.get("format") != FORMAT_VERSION:
            raise RetrievalError(f"The index at {index_dir} has format {manifest.get('format')!r}; this app reads "
                                 f"format {FORMAT_VERSION}. Rebuild it with scripts/build_index.py --overwrite.")
        check_embedder(manifest, config.embedder, config.passage_embedder, config.pooling, index_dir,
                       config.normalize, config.passage_title)
        whole = manifest.get("chunking", {}).get("max_tokens", 1) == 0
        if whole != (config.chunk_tokens <= 0):
            raise RetrievalError(f"The index at {index_dir} holds {'whole texts' if whole else 'chunks'}, but "
                                 f"retrieval.chunk_tokens is {config.chunk_tokens}; rebuild it with "
                                 f"scripts/build_index.py --overwrite.")
        if manifest.get("bm25", {}).get("stemmer") != STEMMER:
            raise RetrievalError(f"The BM25 index at {index_dir} was tokenised differently; rebuild it.")
        for name in (FAISS_FILE, STORE_FILE, BM25_DIR):
            if not (index_dir / name).exists():
                raise RetrievalError(f"The index at {index_dir} is incomplete ({name} is missing); rebuild it "
                                     f"with scripts/build_index.py --overwrite.")
        embedder = load_embedder(config.embedder, device=config.device, pooling=config.pooling,
                                 normalize=config.normalize, max_tokens=config.query_max_tokens)
        if embedder.dimension != manifest["dimension"]:
            raise RetrievalError(f"The embedder {config.embedder!r} gives {embedder.dimension}-dim vectors but the "
                                 f"index at {index_dir} holds {manifest['dimension']}-dim ones.")
        with _damage_said(index_dir):  # a file cut short or overwritten: one message, not a library's traceback
            index = _open_faiss(index_dir, manifest, config)
            store = PassageStore(index_dir / STORE_FILE, read_only=True)
            sparse = SparseIndex.load(index_dir / BM25_DIR)
            counts = {"manifest": manifest["count"], "faiss": index.ntotal, "bm25": sparse.num_docs,
                      "store": len(store)}
        if len(set(counts.values())) != 1:
            raise RetrievalError(f"The index at {index_dir} is inconsistent ({counts}); rebuild it with "
                                 f"scripts/build_index.py --overwrite.")
        cross_encoder = load_cross_encoder(config.cross_encoder, config.device) if config.cross_encoder else None
        return cls(config, index_dir, manifest, index, sparse, store, embedder, cross_encoder)

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def search(self, query: str, k: int | None = None, safe_meta: dict[str, str] | None = None) -> list[Passage]:
        """The `k` (default `top_k`) passages that best ground an answer to `query`; may be fewer, or none."""
        with _damage_said(self.index_dir, _SEARCH_DAMAGE):
            return self._search(query, k, safe_meta)

    def _search(self, query: str, k: int | None, safe_meta: dict[str, str] | None) -> list[Passage]:
        k = self.config.top_k if k is None else int(k)
        if k <= 0:
            return []
        ranking = self.rank(query, safe_meta, depth=max(self.config.candidates, 4 * k))
        if not ranking.fused:
            return []
        if self.cross_encoder is not None:
            ranking.fused = self.rerank(sanitize_query(query), ranking.fused)
        # A passage that says nothing ("CT image.") is no candidate at all: left out before the cut-offs,
        # which a close but empty caption would otherwise set for the rest.
        records = self.store.get([row for row, _, _ in ranking.fused])
        ranking.fused = [entry for entry in ranking.fused if entry[0] in records
                         and content_words(records[entry[0]]["text"]) >= self.config.min_passage_words]
        if not ranking.fused:
            return []
        rows = [row for row, _, _ in ranking.fused]
        vectors = self._vectors(rows)  # (C, d)
        relevance = vectors @ ranking.question_vector  # (C,) score with the bare question (cosine or inner product)
        cut = self.thresholds
        if (self.topic_score(ranking.question_vector) < cut["min_topic_score"]
                and float(relevance.max()) < cut["strong_match_score"]):
            return []  # off-topic: no sources rather than bad ones
        floor = max(cut["min_dense_score"], float(relevance.max()) - cut["relevance_margin"])
        directions = _unit(vectors)  # near-duplicates are judged by cosine whatever the scoring
        relevant = [i for i in range(len(rows)) if relevance[i] >= floor]
        kept: list[Passage] = []
        kept_texts: set[str] = set()
        kept_vectors: list[np.ndarray] = []
        for i in relevant:
            row, score, ranks = ranking.fused[i]
            record = records[row]
            text_key = _normalise(record["text"])
            if text_key in kept_texts or any(float(v @ directions[i]) >= self.config.duplicate_cosine
                                             for v in kept_vectors):
                continue
            kept_texts.add(text_key)
            kept_vectors.append(directions[i])
            kept.append(Passage(id=record["id"], text=record["text"], url=record["url"], title=record["title"],
                                source=record["source"], license=record["license"], score=float(score),
                                ranks=dict(ranks)))
            if len(kept) == k:
                break
        return kept

    def rerank(self, question: str, fused: list[tuple[int, float, dict[str, int]]]) -> list[tuple[int, float, dict]]:
        """The first `rerank_candidates` of `fused` in the cross-encoder's order (best first, ties in
        fused order), each with its rank there; the rest after them as they were."""
        head, tail = fused[:self.config.rerank_candidates], fused[self.config.rerank_candidates:]
        records = self.store.get([row for row, _, _ in head])
        found = [item for item in head if item[0] in records]
        scores = self.cross_encoder.score(question, [article_text(records[row]["title"], records[row]["text"])
                                                     for row, _, _ in found])  # (C,)
        order = np.argsort(-scores, kind="stable")
        reranked = [(row, score, {**ranks, "cross_encoder": rank})
                    for rank, (row, score, ranks) in enumerate((found[i] for i in order), start=1)]
        return reranked + [item for item in head if item[0] not in records] + tail

    def topic_score(self, question_vector: np.ndarray) -> float:
        """Cosine between a question and the corpus centroid: how much it is about what the corpus covers."""
        return float(_unit(question_vector[None])[0] @ self.centroid)

    def rank(self, query: str, safe_meta: dict[str, str] | None = None, depth: int | None = None) -> Ranking:
        """Dense, BM25 and fused candidate lists, before the relevance cut and de-duplication."""
        depth = depth or self.config.candidates
        question = sanitize_query(query)
        if not question:
            return Ranking(question_vector=None)
        enriched = enrich_query(question, safe_meta) if self.config.enrich_query else question
        texts = [enriched] if enriched == question else [enriched, question]
        with query_threads(self.config.query_threads):
            vectors = self.embedder.encode(texts)  # (1 or 2, d)
            with self._faiss_lock:
                scores, rows = self.index.search(vectors[:1], min(depth, self.index.ntotal))  # (1, depth)
        found = rows[0] >= 0
        dense_rows, dense_scores = rows[0][found].tolist(), scores[0][found].tolist()
        bm25_rows, bm25_scores = self.sparse.search(enriched, depth)
        fused = reciprocal_rank_fusion({"dense": dense_rows, "bm25": bm25_rows.tolist()},
                                       {"dense": self.config.dense_weight, "bm25": self.config.bm25_weight},
                                       self.config.rrf_k)
        return Ranking(question_vector=vectors[-1], dense=dense_rows, dense_scores=dense_scores,
                       bm25=bm25_rows.tolist(), bm25_scores=bm25_scores.tolist(), fused=fused)

    def close(self) -> None:
        self.store.close()

    def _vectors(self, rows: list[int]) -> np.ndarray:
        with self._faiss_lock:
            return self.index.reconstruct_batch(np.asarray(rows, dtype=np.int64))  # (C, d)


@contextlib.contextmanager
def query_threads(count: int):
    """Run one query's torch and FAISS work on `count` threads, in the calling thread only.

    Both use OpenMP, whose thread count is per calling thread, so other requests (and the decoder)
    keep theirs. One short query gains nothing from a thread team, and on a busy CPU the team's
    barriers cost far more than they save: measured on the 2-core reference machine under load, a
    MiniLM query encode took 490 ms on 2 threads and 13 ms on 1; a 100k Flat search 44 ms and 7.5 ms.
    """
    if count <= 0:
        yield
        return
    import torch
    torch_before, faiss_before = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(count)
    faiss.omp_set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(torch_before)
        faiss.omp_set_num_threads(faiss_before)


def reciprocal_rank_fusion(rankings: dict[str, list[int]], weights: dict[str, float],
                           k: float) -> list[tuple[int, float, dict[str, int]]]:
    """Cormack et al. (2009): score(d) = sum_r weight_r / (k + rank_r(d)), ranks from 1."""
    scores: dict[int, float] = {}
    ranks: dict[int, dict[str, int]] = {}
    for name, rows in rankings.items():
        weight = weights.get(name, 1.0)
        for rank, row in enumerate(rows, start=1):
            scores[row] = scores.get(row, 0.0) + weight / (k + rank)
            ranks.setdefault(row, {})[name] = rank
    order = sorted(scores, key=lambda row: (-scores[row], min(ranks[row].values()), row))
    return [(row, scores[row], ranks[row]) for row in order]


_MODALITY_WORDS = {
    "CT": "CT computed tomography", "MR": "MRI magnetic resonance", "MRI": "MRI magnetic resonance",
    "CR": "radiograph X-ray", "DX": "radiograph X-ray", "DR": "radiograph X-ray", "XR": "radiograph X-ray",
    "US": "ultrasound", "PT": "PET", "NM": "nuclear medicine scintigraphy", "MG": "mammography",
    "XA": "angiography", "RF": "fluoroscopy", "OT": "",
}
_META_KEYS = {"modality": "modality", "bodypart": "body", "bodypartexamined": "body", "organ": "body",
              "imageorgan": "body", "anatomy": "body", "location": "body"}
_SAFE_WORD = re.compile(r"[^A-Za-z0-9 \-]")


def enrich_query(question: str, safe_meta: dict[str, str] | None) -> str:
    """Append the scan's modality and body part (from its safe metadata) to the question."""
    if not safe_meta:
        return question
    found = {"modality": "", "body": ""}
    for key, value in safe_meta.items():
        slot = _META_KEYS.get(re.sub(r"[^a-z]", "", str(key).lower()))
        if slot and not found[slot] and value:
            word = _SAFE_WORD.sub(" ", str(value)).strip()[:40]
            if slot == "modality":
                word = _MODALITY_WORDS.get(word.upper(), word)
            found[slot] = word.lower() if slot == "body" else word
    extra = ", ".join(value for value in (found["modality"], found["body"]) if value)
    return f"{question} [{extra}]" if extra else question


IVF_NPROBE_UNTUNED = 32  # an ivfpq index built before tuning recorded its nprobe


def _open_faiss(index_dir: Path, manifest: dict, config: RetrievalConfig) -> faiss.Index | RerankedIndex:
    """The FAISS index with its search parameters; ivfpq with its float16 vectors for re-scoring."""
    index = faiss.read_index(str(index_dir / FAISS_FILE))
    kind, params = manifest["faiss_type"], manifest.get("faiss_params", {})
    if kind == "hnsw":
        index.hnsw.efSearch = max(config.hnsw_ef_search, config.candidates)
    elif kind == "ivfpq":
        # nprobe as tuned at build time for the recall target (the setting overrides it when > 0)
        faiss.extract_index_ivf(index).nprobe = config.ivf_nprobe or params.get("nprobe", IVF_NPROBE_UNTUNED)
        if (index_dir / VECTORS_FILE).is_file():
            return RerankedIndex.open(index, index_dir, params.get("k_factor", 1))
        faiss.extract_index_ivf(index).make_direct_map()  # an older index: reconstruct() from the PQ codes
    return index


THRESHOLDS = ("min_dense_score", "min_topic_score", "strong_match_score", "relevance_margin")


def _unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (unchanged for an embedder that normalises already)."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


# Words that name an image's kind, view or labels rather than anything in it: a caption made of these and
# stop words only ("CT (coronal view).", "Anteroposterior view") cites nothing.
_IMAGE_WORDS = frozenset("""
    image images imaging scan scans scanned view views plane planes section sections slice slices figure figures
    fig photo photograph photographs picture pictures film radiograph radiographs radiography radiographic xray ray
    rays ct cta mri mr mra pet spect ultrasound ultrasonography ultrasonographic sonography sonographic
    echocardiography computed tomography tomographic magnetic resonance angiography angiogram contrast enhanced
    non weighted axial coronal sagittal transverse oblique longitudinal lateral frontal anteroposterior
    posteroanterior showing shows shown show showed demonstrating demonstrates demonstrated reveals revealed
    revealing seen see arrow arrows arrowhead arrowheads white black asterisk patient case left right""".split())
_NOT_CONTENT = frozenset(STOPWORDS_EN_PLUS) | _IMAGE_WORDS
_WORD = re.compile(r"[^\W\d_]\w+")  # a word starting with a letter, in any script


def content_words(text: str) -> int:
    """How many words of `text` say something: three letters or more, not English stop words (bm25s's list)
    and not `_IMAGE_WORDS`."""
    return sum(1 for word in _WORD.findall(text.lower()) if len(word) > 2 and word not in _NOT_CONTENT)


def _normalise(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))
