"""Retrieval: corpus JSONL → chunks → embeddings → FAISS + BM25 on disk → fused, cited passages.

    retriever = Retriever.open(settings.retrieval)      # after ensure_default_index(settings.retrieval)
    retriever.search("Is there a pleural effusion?", k=3, safe_meta={"modality": "CT"})

Modules, top-down: search (Retriever, fusion), index (building, manifest), bm25, store (SQLite),
embed (sentence-transformers), corpus (JSONL, chunking), sanitize (passages are data, never
instructions).
"""

from medvqa.retrieval.errors import IndexMissingError, RetrievalError
from medvqa.retrieval.index import build_index, ensure_default_index
from medvqa.retrieval.search import Passage, Retriever

__all__ = ["Passage", "Retriever", "RetrievalError", "IndexMissingError", "build_index", "ensure_default_index"]
