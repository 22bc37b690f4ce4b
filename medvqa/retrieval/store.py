"""Passage texts and metadata on disk, looked up by FAISS row.

SQLite keeps the corpus out of Python memory: row n of the FAISS index is the passage with
`row = n` (the table's integer primary key, a B-tree lookup), so 10M passages cost only the page
cache they touch. One connection is shared between threads behind a lock.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from medvqa.retrieval.corpus import Chunk

_SCHEMA = """
CREATE TABLE IF NOT EXISTS passages (
    row INTEGER PRIMARY KEY,   -- FAISS row and BM25 document number
    id TEXT NOT NULL UNIQUE,
    doc_id TEXT NOT NULL,
    text TEXT NOT NULL,
    url TEXT NOT NULL,
    title TEXT NOT NULL,
    source TEXT NOT NULL,
    license TEXT NOT NULL,
    extra TEXT NOT NULL        -- JSON of the corpus line's other fields
);
"""
COLUMNS = ("row", "id", "doc_id", "text", "url", "title", "source", "license", "extra")


class PassageStore:
    def __init__(self, path: str | Path, read_only: bool = False):
        self.path = Path(path)
        if read_only:
            uri = f"file:{self.path}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        else:
            self._db = sqlite3.connect(self.path, check_same_thread=False)
            self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM passages").fetchone()[0]

    def add(self, chunk: Chunk, row: int) -> bool:
        """Insert `chunk` at `row`; False (nothing inserted) when its id is already stored."""
        with self._lock:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO passages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (row, chunk.id, chunk.doc_id, chunk.text, chunk.url, chunk.title, chunk.source,
                 chunk.license, json.dumps(chunk.extra, ensure_ascii=False)))
            return cursor.rowcount == 1

    def commit(self) -> None:
        with self._lock:
            self._db.commit()

    def get(self, rows: list[int]) -> dict[int, dict]:
        """Rows → passage dicts (missing rows are left out)."""
        if not rows:
            return {}
        placeholders = ",".join("?" * len(rows))
        with self._lock:
            found = self._db.execute(f"SELECT * FROM passages WHERE row IN ({placeholders})",
                                     [int(r) for r in rows]).fetchall()
        return {record[0]: _as_dict(record) for record in found}

    def truncate(self, row: int) -> None:
        """Delete every passage from `row` on (what an interrupted build had not finished)."""
        with self._lock:
            self._db.execute("DELETE FROM passages WHERE row >= ?", (row,))
            self._db.commit()

    def texts(self, start: int = 0, batch: int = 4096, titles: bool = False,
              end: int | None = None) -> Iterator[list[tuple]]:
        """(row, text) in row order from `start` (up to `end`), `batch` at a time (for embedding and
        BM25); with `titles`, (row, (title, text)) for an embedder that reads [title, text] pairs."""
        columns = "row, title, text" if titles else "row, text"
        end = 2**62 if end is None else end
        while True:
            with self._lock:
                found = self._db.execute(
                    f"SELECT {columns} FROM passages WHERE row >= ? AND row < ? ORDER BY row LIMIT ?",
                    (start, end, batch)).fetchall()
            if titles:
                found = [(row, (title or "", text)) for row, title, text in found]
            if not found:
                return
            yield found
            start = found[-1][0] + 1

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _as_dict(record: tuple) -> dict:
    passage = dict(zip(COLUMNS, record))
    passage["extra"] = json.loads(passage["extra"])
    return passage
