"""Building an index folder: passages → SQLite store, FAISS vectors, BM25, manifest.

    index/<name>/
        manifest.json     embedder, dimension, count, corpus checksum, FAISS type, created, ...
        passages.sqlite   texts and metadata by row (see store.py)
        faiss.index       normalised vectors, inner product; row n = passage row n
        vectors.f16.npy   ivfpq only: float16 vectors its candidates are re-scored against (rerank.py)
        bm25/             bm25s arrays and tokenizer vocabulary
        centroid.npy      sum of the passage vectors (the corpus topic, for the off-topic gate)

The FAISS type comes from the corpus size and the machine's memory (plan.py). A build is written to
a staging folder beside the target and moved into place at the end, so an interrupted build never
leaves a half index that looks complete; passages are embedded and added in shards with a
checkpoint, so running the same command again resumes it (checkpoint.py). A file lock keeps two
processes (two app workers on first run) from building the same index at once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import faiss
import numpy as np
from tqdm.auto import tqdm

from medvqa.config import RetrievalConfig
from medvqa.retrieval.bm25 import STEMMER, SparseIndex
from medvqa.retrieval.checkpoint import Checkpoint, file_identity
from medvqa.retrieval.corpus import FileStats, read_passages
from medvqa.retrieval.embed import load_embedder
from medvqa.retrieval.errors import IndexMissingError, RetrievalError, how_to_build
from medvqa.retrieval.plan import FAISS_TYPES, IndexPlan, plan_index
from medvqa.retrieval.rerank import VECTORS_FILE, tune_ivf
from medvqa.retrieval.store import PassageStore

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FAISS_FILE = "faiss.index"
STORE_FILE = "passages.sqlite"
BM25_DIR = "bm25"
CENTROID_FILE = "centroid.npy"  # float64 sum of all passage vectors: the corpus's topic, for the off-topic gate
TRAINED_FILE = "trained.index"  # staging only: the trained, empty IVF index
SHARD_FILE = "vectors.npy"  # staging only: the embedded vectors, the build's checkpoint
SHARD_SIZE = 50_000  # passages embedded between checkpoints


def build_index(corpus_files: list[str], index_dir: str | Path, embedder: str, *, append: bool = False,
                faiss_type: str = "auto", progress: bool = True, batch_size: int = 64,
                passage_embedder: str = "", pooling: str = "auto", device: str = "auto",
                chunk_tokens: int = 200, chunk_overlap: int = 40, overwrite: bool = False,
                normalize: bool = True, passage_title: bool = False, shard_size: int = SHARD_SIZE,
                memory_bytes: int | None = None) -> Path:
    """Build (or, with `append`, extend) the index at `index_dir` from JSONL corpus files.

    `embedder` encodes queries and is recorded in the manifest; `passage_embedder` encodes
    passages when it differs (MedCPT's article encoder), "" meaning the same model. `normalize`
    False keeps raw vectors (inner-product scoring); `passage_title` encodes [title, text] pairs.
    Passages are embedded `shard_size` at a time between checkpoints; `memory_bytes` is the index's
    memory budget for choosing its type (default: half of this machine's RAM).
    """
    index_dir = Path(index_dir)
    with _build_lock(index_dir):
        return _build(corpus_files, index_dir, embedder, append=append, faiss_type=faiss_type,
                      progress=progress, batch_size=batch_size, passage_embedder=passage_embedder,
                      pooling=pooling, device=device, chunk_tokens=chunk_tokens,
                      chunk_overlap=chunk_overlap, overwrite=overwrite, normalize=normalize,
                      passage_title=passage_title, shard_size=shard_size, memory_bytes=memory_bytes)


def default_index_ready(config: RetrievalConfig) -> bool:
    """Whether the configured index is built (its manifest is written last, once everything is in place)."""
    return (Path(config.index_dir) / config.index_name / MANIFEST).is_file()


def check_buildable(config: RetrievalConfig) -> None:
    """IndexMissingError, saying how to build one, when the configured index is missing and so is its corpus."""
    missing = [path for path in config.corpus if not Path(path).is_file()]
    if missing or not config.corpus:
        raise IndexMissingError(
            f"No retrieval index at {Path(config.index_dir) / config.index_name}, and its corpus files are missing "
            f"({', '.join(missing) or 'none configured'}). " + how_to_build(config.index_dir, config.index_name))


def ensure_default_index(config: RetrievalConfig, progress: bool = True, report=None) -> Path:
    """The configured index folder, built from `config.corpus` first if it is missing. `report`, if
    given, is called as the build goes: report(phase, done, total) with phase "reading", "embedding"
    or "keywords", `total` None while the count is not known (see retrieval.background)."""
    index_dir = Path(config.index_dir) / config.index_name
    if default_index_ready(config):
        return index_dir
    check_buildable(config)
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
                      passage_title=config.passage_title, report=report)


def read_manifest(index_dir: Path) -> dict:
    path = index_dir / MANIFEST
    if not path.is_file():
        raise IndexMissingError(f"No retrieval index at {index_dir}. "
                                + how_to_build(str(index_dir.parent), index_dir.name))
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as error:
        raise RetrievalError(f"The manifest {path} is damaged ({error}); rebuild the index.") from None
    if not isinstance(manifest, dict) or not all(key in manifest for key in ("count", "dimension", "format")):
        raise RetrievalError(f"The manifest {path} is damaged (not an object with `count`, `dimension` and "
                             "`format`); rebuild the index.")
    return manifest


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
           passage_title=False, shard_size=SHARD_SIZE, memory_bytes=None, report=None) -> Path:
    report = report or _silent
    if faiss_type not in FAISS_TYPES:
        raise RetrievalError(f"Unknown FAISS type {faiss_type!r}; choose one of {', '.join(FAISS_TYPES)}.")
    if not corpus_files:
        raise RetrievalError("No corpus file given.")
    missing = [path for path in corpus_files if not Path(path).is_file()]
    if missing:
        raise RetrievalError(f"Corpus file {missing[0]} does not exist.")
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
    # Room for [CLS] and [SEP]; 0 keeps every text whole (the encoder truncates as its reference does).
    max_tokens = min(chunk_tokens, model.max_tokens - 2) if chunk_tokens > 0 else 0
    staging = index_dir.parent / f".{index_dir.name}.building"
    key = {"embedder": embedder, "passage_embedder": passage_embedder or embedder, "pooling": pooling,
           "normalized": normalize, "passage_title": passage_title, "max_tokens": max_tokens,
           "overlap_tokens": chunk_overlap, "faiss_type": faiss_type, "shard_size": shard_size,
           "extends": manifest["updated"] if manifest else None,
           "files": [file_identity(path) for path in corpus_files]}
    checkpoint = Checkpoint(staging, key)
    if checkpoint.resumed and progress:
        print(f"Resuming the interrupted build in {staging}: {checkpoint.describe()}.", file=sys.stderr)
    try:
        if manifest is not None and not checkpoint.resumed:
            shutil.copy2(index_dir / STORE_FILE, staging / STORE_FILE)
        store = PassageStore(staging / STORE_FILE)
        start = manifest["count"] if manifest else 0
        if not checkpoint.resumed and len(store) != start:
            raise RetrievalError(f"The index at {index_dir} is inconsistent (store and manifest disagree); "
                                 f"rebuild it with --overwrite.")

        # Pass 1: clean, chunk and store; rows continue after the existing ones.
        count = _store_passages(corpus_files, store, model, max_tokens, chunk_overlap, start, checkpoint, progress,
                                report)
        if count == 0:
            raise RetrievalError("The corpus has no passages: " + ", ".join(corpus_files))

        # Pass 2: embed the new rows into FAISS, a shard at a time.
        plan = _plan(checkpoint, manifest, count, model.dimension, faiss_type, memory_bytes, progress)
        index = _starting_index(plan, manifest, index_dir, staging, store, model, count, batch_size, progress,
                                passage_title)
        vectors, offset = _shard_file(staging, plan.kind, manifest, index_dir, start, count, model.dimension,
                                      checkpoint.resumed)
        vector_sum = load_vector_sum(index_dir, index) if manifest is not None else np.zeros(model.dimension)
        vector_sum += _embed_in_shards(index, vectors, offset, store, model, start, count, checkpoint,
                                       shard_size, batch_size, passage_title, progress, report)
        if index.ntotal != count:
            raise RetrievalError(f"Internal error: {index.ntotal} vectors for {count} passages.")
        params = dict(plan.params)
        if plan.kind == "ivfpq":  # nprobe and the candidate width, from measured recall on the corpus
            params.update(tune_ivf(index, vectors, trained_on=training_rows(index, count)))
            del vectors
            (staging / SHARD_FILE).rename(staging / VECTORS_FILE)
        else:
            del vectors
            (staging / SHARD_FILE).unlink()
        faiss.write_index(index, str(staging / FAISS_FILE))
        np.save(staging / CENTROID_FILE, vector_sum)

        # BM25 has no incremental add: it is rebuilt over every stored passage.
        report("keywords", 0, None)
        sparse = SparseIndex.build(_all_texts(store), count, progress=progress)
        sparse.save(staging / BM25_DIR)
        store.close()

        all_files = (manifest["corpus_files"] if manifest else []) + checkpoint.state["files"]
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
            "faiss_type": plan.kind,
            "faiss_params": params,
            "faiss_choice": plan.reason,
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
        for name in (TRAINED_FILE, checkpoint.path.name):
            (staging / name).unlink(missing_ok=True)
        _swap_into_place(staging, index_dir)
    except RetrievalError:
        shutil.rmtree(staging, ignore_errors=True)  # bad input: nothing worth resuming
        raise
    except BaseException:
        if progress and checkpoint.path.is_file():
            print(f"\nThe build stopped; run the same command again to resume it ({checkpoint.describe()}).",
                  file=sys.stderr)
        raise
    return index_dir


def _store_passages(corpus_files, store: PassageStore, model, max_tokens: int, chunk_overlap: int, start: int,
                    checkpoint: Checkpoint, progress: bool, report=None) -> int:
    """Read the corpus files not yet stored into `store`, one committed file at a time; the row count."""
    state = checkpoint.state
    row = start if state["row"] is None else state["row"]
    store.truncate(row)  # drop what an interrupted read of the next file left
    for path in corpus_files[len(state["files"]):]:
        stats = FileStats(str(Path(path).resolve()))
        duplicates, first_row = 0, row
        bar = tqdm(desc=f"Reading {Path(path).name}", unit=" passages", disable=not progress)
        for chunk in read_passages(path, model.count_tokens, max_tokens, chunk_overlap, stats):
            if store.add(chunk, row):
                row += 1
                bar.update()
                if report is not None:
                    report("reading", row - start, None)
            else:
                duplicates += 1
        bar.close()
        if duplicates and progress:  # kept in the manifest too (files[].duplicates_skipped)
            print(f"{Path(path).name}: skipped {duplicates:,} passage(s) whose id is already in the index "
                  "(the first text given for an id is kept).", file=sys.stderr)
        store.commit()
        state["files"].append({"path": stats.path, "sha256": stats.sha256, "lines": stats.lines,
                               "passages": row - first_row, "duplicates_skipped": duplicates,
                               "empty_after_cleaning": stats.empty_after_cleaning, "added": _now()})
        state["row"] = row
        checkpoint.save()
    state["count"] = row
    return row


def _plan(checkpoint: Checkpoint, manifest: dict | None, count: int, dimension: int, faiss_type: str,
          memory_bytes: int | None, progress: bool) -> IndexPlan:
    """The index type and parameters: the extended index's, else chosen for `count` passages (once)."""
    if checkpoint.state["plan"] is None:
        if manifest is not None:
            plan = IndexPlan(manifest["faiss_type"], manifest["faiss_params"],
                             reason=manifest.get("faiss_choice", manifest["faiss_type"]))
        else:
            plan = plan_index(count, dimension, faiss_type, memory_bytes)
        checkpoint.state["plan"] = asdict(plan)
        checkpoint.save()
    plan = IndexPlan(**checkpoint.state["plan"])
    if progress:
        print(f"Index type: {plan.reason}", file=sys.stderr)
    return plan


def _starting_index(plan: IndexPlan, manifest, index_dir: Path, staging: Path, store, model, count: int,
                    batch_size: int, progress: bool, passage_title: bool) -> faiss.Index:
    """The index new rows are added to: the extended one, or a new one (trained once, for IVF)."""
    if manifest is not None:
        return faiss.read_index(str(index_dir / FAISS_FILE))
    index = _new_index(plan, model.dimension)
    if index.is_trained:
        return index
    trained = staging / TRAINED_FILE
    if not trained.is_file():
        _train(index, store, model, count, batch_size, progress, passage_title)
        faiss.write_index(index, str(trained))
    return faiss.read_index(str(trained))  # the same index, resumed or not


def _shard_file(staging: Path, kind: str, manifest, index_dir: Path, start: int, count: int, dimension: int,
                resumed: bool) -> tuple[np.ndarray, int]:
    """The memory-mapped vectors file of this build and the row its first line holds.

    ivfpq keeps every row (float16, for re-scoring), so an append copies the existing ones in first;
    the other types need only this build's rows, as a checkpoint (float32, exactly what was embedded).
    """
    path = staging / SHARD_FILE
    if resumed and path.is_file():
        vectors = np.load(path, mmap_mode="r+")
        return vectors, count - len(vectors)
    if kind != "ivfpq":
        return np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(count - start, dimension)), start
    vectors = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(count, dimension))
    if manifest is not None:
        if not (index_dir / VECTORS_FILE).is_file():
            raise RetrievalError(f"The ivfpq index at {index_dir} has no {VECTORS_FILE} (an older build); "
                                 f"rebuild it with --overwrite.")
        old = np.load(index_dir / VECTORS_FILE, mmap_mode="r")
        for first in range(0, start, SHARD_SIZE):
            last = min(first + SHARD_SIZE, start)
            vectors[first:last] = old[first:last]
    return vectors, 0


def _embed_in_shards(index: faiss.Index, vectors: np.ndarray, offset: int, store: PassageStore, model, start: int,
                     count: int, checkpoint: Checkpoint, shard_size: int, batch_size: int, passage_title: bool,
                     progress: bool, report=None) -> np.ndarray:
    """Embed rows start..count into `vectors` and add them to `index`, checkpointing after each shard;
    shards a previous run finished are only added, from the file. Returns the float64 vector sum."""
    state = checkpoint.state
    embedded = start if state["embedded"] is None else state["embedded"]
    vector_sum = np.zeros(index.d)
    bar = tqdm(total=count - start, desc="Embedding", unit=" passages", disable=not progress)
    seconds, fresh = 0.0, 0
    for first in range(start, count, shard_size):
        last = min(first + shard_size, count)
        if last > embedded:
            began = time.perf_counter()
            for batch in store.texts(first, batch=1024, titles=passage_title, end=last):
                rows = [row - offset for row, _ in batch]
                vectors[rows[0]:rows[-1] + 1] = model.encode([text for _, text in batch], batch_size=batch_size)
                bar.update(len(batch))
                if report is not None:
                    report("embedding", rows[-1] + offset + 1 - start, count - start)
            seconds, fresh = seconds + time.perf_counter() - began, fresh + last - first
            vectors.flush()
            state["embedded"] = embedded = last
            checkpoint.save()
        else:
            bar.update(last - first)  # embedded before the interruption
            if report is not None:
                report("embedding", last - start, count - start)
        shard = np.asarray(vectors[first - offset:last - offset], dtype=np.float32)  # (S, d) as stored
        index.add(shard)
        vector_sum += shard.sum(axis=0, dtype=np.float64)
    bar.close()
    if progress and fresh:
        print(f"Embedded {fresh:,} passages in {seconds:.1f} s: {fresh / seconds:,.1f} passages/s on "
              f"{model.model.device} (batch {batch_size}).", file=sys.stderr)
    return vector_sum


def _silent(phase: str, done: int, total: int | None) -> None:
    pass


def load_vector_sum(index_dir: Path, index: faiss.Index) -> np.ndarray:
    """The float64 sum of an index's vectors: saved at build time, else summed from FAISS (an older index)."""
    path = index_dir / CENTROID_FILE
    if path.is_file():
        return np.load(path)
    total = np.zeros(index.d)
    for start in range(0, index.ntotal, 65536):
        total += index.reconstruct_n(start, min(65536, index.ntotal - start)).sum(axis=0, dtype=np.float64)
    return total


def new_faiss_index(kind: str, dimension: int, count: int) -> tuple[faiss.Index, dict]:
    """An empty FAISS index of `kind` sized for about `count` vectors, and its parameters."""
    plan = plan_index(count, dimension, kind, memory_bytes=0)
    return _new_index(plan, dimension), plan.params


def _new_index(plan: IndexPlan, dimension: int) -> faiss.Index:
    params = plan.params
    if plan.kind == "flat":
        return faiss.IndexFlatIP(dimension)
    if plan.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dimension, params["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["ef_construction"]
        return index
    if plan.kind == "ivfpq":
        # "np": no polysemous training, which only serves Hamming-distance filtering (unused here) and
        # took most of the build time (1,364 s of training for 100k vectors on the busy 2-core machine).
        spec = f"IVF{params['nlist']},PQ{params['pq_m']}x{params['pq_bits']}np"
        return faiss.index_factory(dimension, spec, faiss.METRIC_INNER_PRODUCT)
    raise RetrievalError(f"Unknown FAISS type {plan.kind!r}; choose one of {', '.join(FAISS_TYPES)}.")


def training_size(index: faiss.Index, count: int) -> int:
    nlist = faiss.extract_index_ivf(index).nlist
    return int(min(count, max(40 * nlist, 50_000)))  # FAISS warns below 39 points a list


def training_rows(index: faiss.Index, count: int) -> np.ndarray:
    """The rows an IVF index is trained on: a fixed random sample, so a resumed build draws the same."""
    return np.sort(np.random.default_rng(0).choice(count, size=training_size(index, count), replace=False))


def _train(index: faiss.Index, store: PassageStore, model, count: int, batch_size: int, progress: bool,
           passage_title: bool = False) -> None:
    if count < faiss.extract_index_ivf(index).nlist * 4:
        raise RetrievalError(f"{count} passages are too few for IVF-PQ; use --faiss-type flat or hnsw.")
    rows = training_rows(index, count)
    size = len(rows)
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
