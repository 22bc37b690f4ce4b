"""A cross-encoder that re-ranks retrieved passages: query and passage read together, one logit each.

The second stage MedCPT's retriever is built to end with (ncbi/MedCPT-Cross-Encoder), used exactly as
its README does: `[query, article]` pairs tokenised together with `truncation=True, padding=True,
max_length=512` (longest first: a long article loses its tail, the question stays whole), a
`BertForSequenceClassification` with one label, `logits.squeeze(1)` as the score, higher = more
relevant. An article is its title and text joined as the README writes them ("Title. Abstract").

Plain transformers rather than sentence-transformers' CrossEncoder: the latter applies an activation
and its own tokenizer arguments, and the point here is the reference's exact inputs.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from medvqa.config import resolve_path
from medvqa.retrieval.errors import RetrievalError

MAX_LENGTH = 512  # the reference's max_length for a query-article pair

_cache: dict[tuple[str, str], "CrossEncoder"] = {}
_cache_lock = threading.Lock()


def article_text(title: str, text: str) -> str:
    """A passage as MedCPT's cross-encoder reads an article: "Title. Abstract" (the text alone when
    it has no title)."""
    title = title.strip()
    if not title:
        return text
    return f"{title} {text}" if title.endswith((".", "?", "!")) else f"{title}. {text}"


class CrossEncoder:
    """Scores (query, article) pairs. Safe to share between threads: one call at a time."""

    def __init__(self, model, tokenizer, name: str, device: str):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = device
        self._lock = threading.Lock()

    def encode_pairs(self, query: str, articles: list[str]) -> dict:
        """The model's inputs for `[query, article]` pairs, as the reference tokenises them."""
        return self.tokenizer([[query, article] for article in articles], truncation=True, padding=True,
                              return_tensors="pt", max_length=MAX_LENGTH)

    def score(self, query: str, articles: list[str]) -> np.ndarray:
        """(A,) relevance logits of each article to `query`."""
        import torch

        if not articles:
            return np.zeros(0, dtype=np.float32)
        with self._lock, torch.inference_mode():
            encoded = self.encode_pairs(query, articles).to(self.device)
            logits = self.model(**encoded).logits.squeeze(dim=1)  # (A,)
        return logits.float().cpu().numpy()


def load_cross_encoder(spec: str, device: str = "auto") -> CrossEncoder:
    """The cross-encoder named by `spec` (folder, `pkg:` path or hub id), cached per process."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from medvqa.device import pick_device

    try:
        path = resolve_path(spec)
    except FileNotFoundError as error:
        raise RetrievalError(str(error)) from None
    device = str(pick_device(device))
    with _cache_lock:
        if (path, device) in _cache:
            return _cache[(path, device)]
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
        if not Path(path).exists() and offline:
            raise RetrievalError(f"The cross-encoder {spec!r} is not a local folder and offline mode is on "
                                 f"(HF_HUB_OFFLINE=1); download it once on a machine with hub access, or set "
                                 f"retrieval.cross_encoder to \"\" to keep the fused order.")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(path).to(device)
        except (OSError, ValueError) as error:
            raise RetrievalError(f"Could not load the cross-encoder {spec!r}: {error}") from None
        if model.config.num_labels != 1:
            raise RetrievalError(f"The cross-encoder {spec!r} has {model.config.num_labels} labels; a re-ranker "
                                 f"gives one relevance logit per pair.")
        _cache[(path, device)] = CrossEncoder(model, tokenizer, spec, device)
        return _cache[(path, device)]
