"""BM25 over the stored passages with the `bm25s` package, saved beside the FAISS index."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer

STEMMER = "s-stemmer"  # recorded in the manifest: query and corpus must be tokenised alike


def s_stem(word: str) -> str:
    """Harman's (1991) S-stemmer: folds English plurals ("effusions" → "effusion").

    Hand-written because the full Snowball stemmer needs PyStemmer, which is not a project
    dependency; plural folding is most of the gain on short clinical queries, and unlike Snowball it
    leaves "pleural" and "pleura" apart.
    """
    if len(word) > 3 and word.endswith("ies") and not word.endswith(("eies", "aies")):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("es") and not word.endswith(("aes", "ees", "oes")):
        return word[:-1]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("us", "ss", "is")):
        return word[:-1]
    return word


def new_tokenizer() -> Tokenizer:
    return Tokenizer(lower=True, stopwords="en", stemmer=s_stem)


class SparseIndex:
    """A saved bm25s index and the tokenizer vocabulary that goes with it."""

    def __init__(self, retriever: bm25s.BM25, tokenizer: Tokenizer):
        self.retriever = retriever
        self.tokenizer = tokenizer
        self.num_docs = int(retriever.scores["num_docs"])
        self._lock = threading.Lock()  # the tokenizer caches stems in plain dicts

    @classmethod
    def build(cls, texts: Iterable[str], count: int, progress: bool = True) -> "SparseIndex":
        tokenizer = new_tokenizer()
        tokens = tokenizer.tokenize(texts, update_vocab=True, return_as="tuple", length=count,
                                    show_progress=progress)
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=progress)
        return cls(retriever, tokenizer)

    def save(self, folder: Path) -> None:
        self.retriever.save(str(folder), show_progress=False)
        self.tokenizer.save_vocab(str(folder))
        self.tokenizer.save_stopwords(str(folder))

    @classmethod
    def load(cls, folder: Path) -> "SparseIndex":
        # Memory-mapped score arrays: a large index costs page cache, not resident memory.
        retriever = bm25s.BM25.load(str(folder), mmap=True, show_progress=False, verbosity=0)
        tokenizer = new_tokenizer()
        tokenizer.load_vocab(str(folder))
        tokenizer.load_stopwords(str(folder))
        return cls(retriever, tokenizer)

    def search(self, query: str, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, scores) of the best `depth` passages; empty when no query word is indexed."""
        with self._lock:
            ids = self.tokenizer.tokenize([query], update_vocab=False, return_as="ids",
                                          show_progress=False, allow_empty=False)
        ids = [[token for token in ids[0] if token in self.retriever.unique_token_ids_set]]
        if not ids[0]:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
        depth = min(depth, self.num_docs)
        rows, scores = self.retriever.retrieve(ids, k=depth, show_progress=False, n_threads=0)
        rows, scores = rows[0], scores[0]
        keep = scores > 0  # passages sharing no query word all score 0: not a match
        return rows[keep].astype(np.int64), scores[keep].astype(np.float32)
