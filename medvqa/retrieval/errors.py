"""Errors whose messages a clinician or an operator can act on."""

from __future__ import annotations


class RetrievalError(Exception):
    """Retrieval cannot go on; the message says why in plain words."""


class IndexMissingError(RetrievalError):
    """No index at the configured place; the message says how to build one."""


def how_to_build(index_dir: str, name: str) -> str:
    return (f"Build it with `python scripts/build_index.py --corpus FILE.jsonl [FILE ...] --name {name} "
            f"--index-dir {index_dir}` (one JSON passage a line with at least `id`, `text` and `url`), "
            f"or start the app, which builds the default index from ../shared/data/corpus on its first run "
            f"(`python scripts/fetch_corpus.py` downloads those files where ../shared is absent).")
