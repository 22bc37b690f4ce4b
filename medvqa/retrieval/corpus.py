"""Corpus JSONL → cleaned, chunked passages.

A corpus file holds one JSON object a line with at least `id`, `text` and `url` (an http(s) link a
clinician can open); `title`, `license` and `source` are optional and every other field is kept as
metadata. `read_passages` streams a file, so a corpus never has to fit in memory.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from medvqa.retrieval.errors import RetrievalError
from medvqa.retrieval.sanitize import sanitize_text
from medvqa.safe_text import safe_url

REQUIRED_FIELDS = ("id", "text", "url")
DISPLAY_FIELDS = ("title", "license", "source")
# Passage ids are shown on the page, in the exports and on the command line, and name chunks
# ("<id>#<n>"): letters, digits and . _ - / only, so an id is never markup or a link in any of them.
_PASSAGE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+|\n+")

TokenCounter = Callable[[list[str]], list[int]]


@dataclass
class Chunk:
    """One passage as stored: a whole corpus line, or one window of a long one."""
    id: str  # the line's id, or "<id>#<n>" for the n-th window of a chunked line
    doc_id: str  # the corpus line's id
    text: str
    url: str
    title: str = ""
    source: str = ""
    license: str = ""
    extra: dict = field(default_factory=dict)  # every other field of the line (pmid, mesh, ...)


@dataclass
class FileStats:
    path: str
    sha256: str = ""
    lines: int = 0  # non-blank lines read
    empty_after_cleaning: int = 0  # lines whose text was only markup or instructions


def read_passages(path: str | Path, count_tokens: TokenCounter, max_tokens: int, overlap: int,
                  stats: FileStats | None = None) -> Iterator[Chunk]:
    """Yield the chunks of every line of `path`; raise RetrievalError naming the file and line."""
    path = Path(path)
    stats = stats if stats is not None else FileStats(str(path))
    if not path.is_file():
        raise RetrievalError(f"Corpus file {path} does not exist.")
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            digest.update(raw)
            if not raw.strip():
                continue
            stats.lines += 1
            row = _parse_line(raw, path, line_number)
            text = sanitize_text(row["text"])
            if not text:
                stats.empty_after_cleaning += 1
                continue
            for n, piece in enumerate(chunk_text(text, count_tokens, max_tokens, overlap)):
                yield _make_chunk(row, piece, n)
            # Only a chunked line gets "#n" ids, so short passages keep the id their file gave them.
    stats.sha256 = digest.hexdigest()
    if stats.lines == 0:
        raise RetrievalError(f"Corpus file {path} is empty: it has no passages (one JSON object a line).")
    if stats.lines == stats.empty_after_cleaning:
        raise RetrievalError(f"Corpus file {path} has no usable passage: every text was empty after cleaning.")


def _parse_line(raw: bytes, path: Path, line_number: int) -> dict:
    where = f"{path}, line {line_number}"
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RetrievalError(f"{where}: not a valid JSON object ({error}).") from None
    if not isinstance(row, dict):
        raise RetrievalError(f"{where}: expected a JSON object with `id`, `text` and `url`, "
                             f"got {type(row).__name__}.")
    for name in REQUIRED_FIELDS:
        value = row.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise RetrievalError(f"{where}: missing required field `{name}`.")
    if not isinstance(row["text"], str):
        raise RetrievalError(f"{where}: field `text` must be a string.")
    row["id"] = str(row["id"]).strip()
    if "#" in row["id"]:
        raise RetrievalError(f"{where}: `id` {row['id']!r} must not contain '#' (reserved for chunk numbers).")
    if not _PASSAGE_ID.fullmatch(row["id"]):
        raise RetrievalError(f"{where}: `id` {row['id'][:80]!r} may only hold letters, digits and . _ - / "
                             f"(starting with a letter or digit, at most 128 characters).")
    url = str(row["url"]).strip()
    if not safe_url(url):  # the one rule for a link the app shows
        raise RetrievalError(f"{where}: `url` must be an http(s) link a clinician can open (a host, no user name "
                             f"before it, no backslash), got {url[:80]!r}.")
    row["url"] = url
    return row


def _make_chunk(row: dict, text: str, n: int) -> Chunk:
    extra = {key: value for key, value in row.items()
             if key not in REQUIRED_FIELDS and key not in DISPLAY_FIELDS}
    title = row.get("title") or row.get("question_title") or ""
    return Chunk(
        id=row["id"] if n == 0 else f"{row['id']}#{n}",
        doc_id=row["id"],
        text=text,
        url=row["url"],
        title=sanitize_text(str(title)).replace("\n", " "),
        source=sanitize_text(str(row.get("source") or "")).replace("\n", " "),
        license=sanitize_text(str(row.get("license") or "")).replace("\n", " "),
        extra=extra,
    )


def chunk_text(text: str, count_tokens: TokenCounter, max_tokens: int, overlap: int) -> list[str]:
    """Split `text` into windows of at most `max_tokens` tokens that share about `overlap` tokens.

    Windows end at sentence boundaries where they can; a sentence longer than a window is cut
    between words. Tokens are the embedder's own, so no window is truncated by the encoder.
    `max_tokens` 0 keeps the text whole.
    """
    if max_tokens <= 0 or len(text) <= max_tokens:  # a word-piece token covers at least one character
        return [text]
    if count_tokens([text])[0] <= max_tokens:
        return [text]
    sentences = [s for s in _SENTENCE_END.split(text) if s.strip()]
    pieces: list[tuple[str, int]] = []
    for sentence, length in zip(sentences, count_tokens(sentences)):
        if length <= max_tokens:
            pieces.append((sentence, length))
        else:
            words = sentence.split()
            pieces.extend(zip(words, count_tokens(words)))
    windows: list[str] = []
    current: list[tuple[str, int]] = []
    current_tokens = 0
    for piece, length in pieces:
        if current and current_tokens + length > max_tokens:
            windows.append(" ".join(p for p, _ in current))
            carried = _tail(current, overlap, count_tokens)
            carried_tokens = sum(n for _, n in carried)
            while carried and carried_tokens + length > max_tokens:
                carried_tokens -= carried.pop(0)[1]
            current, current_tokens = carried, carried_tokens
        current.append((piece, length))
        current_tokens += length
    if current:
        windows.append(" ".join(p for p, _ in current))
    return windows


def _tail(pieces: list[tuple[str, int]], budget: int, count_tokens: TokenCounter) -> list[tuple[str, int]]:
    """The trailing pieces worth at most `budget` tokens; a piece that does not fit gives its last words."""
    carried: list[tuple[str, int]] = []
    for piece, length in reversed(pieces):
        if length <= budget:
            carried.insert(0, (piece, length))
            budget -= length
            continue
        words = piece.split()
        for word, word_length in reversed(list(zip(words, count_tokens(words)))):
            if word_length > budget:
                break
            carried.insert(0, (word, word_length))
            budget -= word_length
        break
    return carried
