"""Building an index folder: passages → SQLite store, FAISS vectors, BM25, manifest.

    index/<name>/
        manifest.json     embedder, dimension, count, corpus checksum, FAISS type, created, ...
        passages.sqlite   texts and metadata by row (see store.py)
        faiss.index       normalised vectors, inner product; row n = passage row n
        bm25/             bm25s arrays and tokenizer vocabulary
        centroid.npy      sum of the passage vectors (the corpus topic, for the off-topic gate)

A build is written to a staging folder beside the target and moved into place at the end, so an
interrupted build never leaves a half index that looks complete; a file lock keeps two processes
(two app workers on first run) from building the same index at once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import faiss
import numpy as np
from tqdm.auto import tqdm

from medvqa.config import RetrievalConfig
from medvqa.retrieval.bm25 import STEMMER, SparseIndex
from medvqa.retrieval.corpus import FileStats, read_passages
from medvqa.retrieval.embed import load_embedder
from medvqa.retrieval.errors import IndexMissingError, RetrievalError, how_to_build
from medvqa.retrieval.store import PassageStore

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FAISS_FILE = "faiss.index"
STORE_FILE = "passages.sqlite"
BM25_DIR = "bm25"
CENTROID_FILE = "centroid.npy"  # float64 sum of all passage vectors: the corpus's topic, for the off-topic gate
FAISS_TYPES = ("auto", "flat", "hnsw", "ivfpq")
FLAT_LIMIT = 200_000  # exact search below this many passages (a few ms a query on one core)
HNSW_LIMIT = 2_000_000  # above this, full vectors (d x 4 bytes each) no longer fit comfortably in RAM


def build_index(corpus_files: list[str], index_dir: str | Path, embedder: str, *, append: bool = False,
                faiss_type: str = "auto", progress: bool = True, batch_size: int = 64,
                passage_embedder: str = "", pooling: str = "auto", device: str = "auto",
                chunk_tokens: int = 200, chunk_overlap: int = 40, overwrite: bool = False,
                normalize: bool = True, passage_title: bool = False) -> Path:
    """Build (or, with `append`, extend) the index at `index_dir` from JSONL corpus files.

    `embedder` encodes queries and is recorded in the manifest; `passage_embedder` encodes
    passages when it differs (MedCPT's article encoder), "" meaning the same model. `normalize`
    False keeps raw vectors (inner-product scoring); `passage_title` encodes [title, text] pairs.
    """
    index_dir = Path(index_dir)
    with _build_lock(index_dir):
        return _build(corpus_files, index_dir, embedder, append=append, faiss_type=faiss_type,
                      progress=progress, batch_size=batch_size, passage_embedder=passage_embedder,
                      pooling=pooling, device=device, chunk_tokens=chunk_tokens,
                      chunk_overlap=chunk_overlap, overwrite=overwrite, normalize=normalize,
                      passage_title=passage_title)


def ensure_default_index(config: RetrievalConfig, progress: bool = True) -> Path:
    """The configured index folder, built from `config.corpus` first if it is missing."""
    index_dir = Path(config.index_dir) / config.index_name
    if (index_dir / MANIFEST).is_file():
        return index_dir
    missing = [path for path in config.corpus if not Path(path).is_file()]
    if missing or not config.corpus:
        raise IndexMissingError(
            f"No retrieval index at {index_dir}, and its corpus files are missing "
            f"({', '.join(missing) or 'none configured'}). " + how_to_build(config.index_dir, config.index_name))
    with _build_lock(index_dir):
        if (index_dir / MANIFEST).is_file():  # another process built it while we waited
            return index_dir
        if progress:
            print(f"Building the retrieval index {index_dir} from {len(config.corpus)} corpus files "
                  f"(first run only).", file=sys.stderr)
        return _build(config.corpus, index_dir, config.embedder, append=False, faiss_type=config.faiss_type,
                      progress=progress, batch_size=64, passage_embedder=config.passage_embedder,
                      pooling=config.pooling, device=config.device, chunk_tokens=config.chunk_tokens,
                      chunk_overlap=config.chunk_overlap, overwrite=False, normalize=config.normalize,
                      passage_title=config.passage_title)


def read_manifest(index_dir: Path) -> dict:
    path = index_dir / MANIFEST
    if not path.is_file():
        raise IndexMissingError(f"No retrieval index at {index_dir}. "
                                + how_to_build(str(index_dir.parent), index_dir.name))
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RetrievalError(f"The manifest {path} is damaged ({error}); rebuild the index.") from None


def check_embedder(manifest: dict, embedder: str, passage_embedder: str, pooling: str, where: Path,
                   normalize: bool = True, passage_title: bool = False) -> None:
    """Refuse an index whose vectors came from another model (or were made another way) than the one
    configured."""
    wanted = {"embedder": embedder, "passage_embedder": passage_embedder or embedder, "pooling": pooling,
              "normalized": normalize, "passage_title": passage_title}
    for key, value in wanted.items():
        stored = manifest.get(key, False if key == "passage_title" else None)
        if stored != value and _resolved(stored) != _resolved(value):
            raise RetrievalError(
                f"The index at {where} was built with {key} {stored!r}, but {value!r} is configured; "
                f"its vectors are not comparable. Set the retrieval {key} back to {stored!r}, or rebuild "
                f"the index with the configured model (scripts/build_index.py --overwrite).")


def _build(corpus_files, index_dir: Path, embedder: str, *, append, faiss_type, progress, batch_size,
           passage_embedder, pooling, device, chunk_tokens, chunk_overlap, overwrite, normalize=True,
           passage_title=False) -> Path:
    if faiss_type not in FAISS_TYPES:
        raise RetrievalError(f"Unknown FAISS type {faiss_type!r}; choose one of {', '.join(FAISS_TYPES)}.")
    if not corpus_files:
        raise RetrievalError("No corpus file given.")
    manifest = None
    if (index_dir / MANIFEST).is_file():
        if append:
            manifest = read_manifest(index_dir)
            check_embedder(manifest, embedder, passage_embedder, pooling, index_dir, normalize, passage_title)
            if faiss_type not in ("auto", manifest["faiss_type"]):
                raise RetrievalError(f"The index at {index_dir} is {manifest['faiss_type']}; an append cannot "
                                     f"change it to {faiss_type}. Rebuild with --overwrite instead.")
        elif not overwrite:
            raise RetrievalError(f"An index already exists at {index_dir}; add --append to extend it or "
                                 f"--overwrite to replace it.")
    elif append and index_dir.exists() and any(index_dir.iterdir()):
        raise RetrievalError(f"{index_dir} has no {MANIFEST}; it is not an index this app built.")

    model = load_embedder(passage_embedder or embedder, device=device, pooling=pooling, normalize=normalize)
    max_tokens = min(chunk_tokens, model.max_tokens - 2)  # room for [CLS] and [SEP]
    staging = index_dir.parent / f".{index_dir.name}.building"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if manifest is not None:
            shutil.copy2(index_dir / STORE_FILE, staging / STORE_FILE)
        store = PassageStore(staging / STORE_FILE)
        start = manifest["count"] if manifest else 0
        if len(store) != start:
            raise RetrievalError(f"The index at {index_dir} is inconsistent (store and manifest disagree); "
                                 f"rebuild it with --overwrite.")

        # Pass 1: clean, chunk and store; rows continue after the existing ones.
        row, files = start, []
        for path in corpus_files:
            stats = FileStats(str(Path(path).resolve()))
            duplicates, first_row = 0, row
            bar = tqdm(desc=f"Reading {Path(path).name}", unit=" passages", disable=not progress)
            for chunk in read_passages(path, model.count_tokens, max_tokens, chunk_overlap, stats):
                if store.add(chunk, row):
                    row += 1
                    bar.update()
                else:
                    duplicates += 1
            bar.close()
            store.commit()
            files.append({"path": stats.path, "sha256": stats.sha256, "lines": stats.lines,
                          "passages": row - first_row, "duplicates_skipped": duplicates,
                          "empty_after_cleaning": stats.empty_after_cleaning, "added": _now()})
        count = row
        if count == 0:
            raise RetrievalError("The corpus has no passages: " + ", ".join(corpus_files))

        # Pass 2: embed the new rows into FAISS.
        if manifest is not None:
            index = faiss.read_index(str(index_dir / FAISS_FILE))
            kind, params = manifest["faiss_type"], manifest["faiss_params"]
        else:
            kind = _choose_faiss_type(count, faiss_type)
            index, params = new_faiss_index(kind, model.dimension, count)
            if not index.is_trained:
                _train(index, store, model, count, batch_size, progress, passage_title)
        vector_sum = load_vector_sum(index_dir, index) if manifest is not None else np.zeros(model.dimension)
        bar = tqdm(total=count - start, desc="Embedding", unit=" passages", disable=not progress)
        for batch in store.texts(start, batch=1024, titles=passage_title):
            vectors = model.encode([text for _, text in batch], batch_size=batch_size)  # (B, d)
            index.add(vectors)
            vector_sum += vectors.sum(axis=0, dtype=np.float64)
            bar.update(len(batch))
        bar.close()
        if index.ntotal != count:
            raise RetrievalError(f"Internal error: {index.ntotal} vectors for {count} passages.")
        faiss.write_index(index, str(staging / FAISS_FILE))
        np.save(staging / CENTROID_FILE, vector_sum)

        # BM25 has no incremental add: it is rebuilt over every stored passage.
        sparse = SparseIndex.build(_all_texts(store), count, progress=progress)
        sparse.save(staging / BM25_DIR)
        store.close()

        all_files = (manifest["corpus_files"] if manifest else []) + files
        now = _now()
        new_manifest = {
            "format": FORMAT_VERSION,
            "name": index_dir.name,
            "embedder": embedder,
            "passage_embedder": passage_embedder or embedder,
            "pooling": pooling,
            "dimension": model.dimension,
            "count": count,
            "metric": "inner_product",
            "normalized": normalize,
            "passage_title": passage_title,
            "faiss_type": kind,
            "faiss_params": params,
            "corpus_checksum": _corpus_checksum(all_files),
            "corpus_files": all_files,
            "chunking": {"max_tokens": max_tokens, "overlap_tokens": chunk_overlap},
            "bm25": {"package": "bm25s", "stemmer": STEMMER, "stopwords": "en"},
            "created": manifest["created"] if manifest else now,
            "updated": now,
        }
        if manifest and "thresholds" in manifest:  # calibrated cut-offs stay with the embedder's vectors
            new_manifest["thresholds"] = manifest["thresholds"]
        (staging / MANIFEST).write_text(json.dumps(new_manifest, indent=2))
        _swap_into_place(staging, index_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return index_dir


def load_vector_sum(index_dir: Path, index: faiss.Index) -> np.ndarray:
    """The float64 sum of an index's vectors: saved at build time, else summed from FAISS (an older index)."""
    path = index_dir / CENTROID_FILE
    if path.is_file():
        return np.load(path)
    total = np.zeros(index.d)
    for start in range(0, index.ntotal, 65536):
        total += index.reconstruct_n(start, min(65536, index.ntotal - start)).sum(axis=0, dtype=np.float64)
    return total


def _choose_faiss_type(count: int, requested: str) -> str:
    if requested != "auto":
        return requested
    if count < FLAT_LIMIT:
        return "flat"
    return "hnsw" if count < HNSW_LIMIT else "ivfpq"


def new_faiss_index(kind: str, dimension: int, count: int) -> tuple[faiss.Index, dict]:
    """An empty FAISS index of `kind` sized for about `count` vectors, and its parameters."""
    if kind == "flat":
        return faiss.IndexFlatIP(dimension), {}
    if kind == "hnsw":
        params = {"M": 32, "ef_construction": 80}
        index = faiss.IndexHNSWFlat(dimension, params["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["ef_construction"]
        return index, params
    if kind == "ivfpq":
        # ~4 sqrt(n) lists (FAISS guideline), PQ with 8-dim sub-vectors of 8 bits: d/8 bytes a vector.
        nlist = int(2 ** round(np.log2(max(16.0, 4 * np.sqrt(count)))))
        sub_vectors = max(d for d in range(1, dimension // 8 + 1) if dimension % d == 0)
        params = {"nlist": nlist, "pq_m": sub_vectors, "pq_bits": 8}
        index = faiss.index_factory(dimension, f"IVF{nlist},PQ{sub_vectors}x8", faiss.METRIC_INNER_PRODUCT)
        return index, params
    raise RetrievalError(f"Unknown FAISS type {kind!r}; choose one of {', '.join(FAISS_TYPES)}.")


def training_size(index: faiss.Index, count: int) -> int:
    nlist = faiss.extract_index_ivf(index).nlist
    return int(min(count, max(40 * nlist, 50_000)))  # FAISS warns below 39 points a list


def _train(index: faiss.Index, store: PassageStore, model, count: int, batch_size: int, progress: bool,
           passage_title: bool = False) -> None:
    size = training_size(index, count)
    if count < faiss.extract_index_ivf(index).nlist * 4:
        raise RetrievalError(f"{count} passages are too few for IVF-PQ; use --faiss-type flat or hnsw.")
    rows = np.sort(np.random.default_rng(0).choice(count, size=size, replace=False))
    vectors = []
    for start in tqdm(range(0, size, 1024), desc="Training IVF-PQ sample", disable=not progress):
        found = store.get(rows[start:start + 1024].tolist())
        chosen = [found[int(r)] for r in rows[start:start + 1024]]
        vectors.append(model.encode([(p["title"] or "", p["text"]) if passage_title else p["text"] for p in chosen],
                                    batch_size))
    index.train(np.concatenate(vectors))  # (size, d)


def _all_texts(store: PassageStore) -> Iterator[str]:
    for batch in store.texts(0, batch=4096):
        for _, text in batch:
            yield text


def _corpus_checksum(files: list[dict]) -> str:
    digest = hashlib.sha256()
    for entry in files:
        digest.update(entry["sha256"].encode())
    return digest.hexdigest()


def _swap_into_place(staging: Path, index_dir: Path) -> None:
    old = index_dir.parent / f".{index_dir.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if index_dir.exists():
        index_dir.rename(old)  # readers holding the old files keep them until they close
    staging.rename(index_dir)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(index_dir: Path):
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; concurrent first-run builds are not guarded
        yield
        return
    with open(index_dir.parent / f".{index_dir.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _resolved(spec):
    from medvqa.config import resolve_path
    if not isinstance(spec, str):
        return spec
    try:
        path = Path(resolve_path(spec))
    except (FileNotFoundError, TypeError):
        return spec
    return str(path.resolve()) if path.exists() else spec


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
