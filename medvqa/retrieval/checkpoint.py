"""A build's progress on disk, so that an interrupted build of millions of passages resumes.

    .<name>.building/               the staging folder (index.py), kept when a build is interrupted
        checkpoint.json             the build's key and how far it got (below)
        passages.sqlite             the corpus files read so far (committed one file at a time)
        trained.index               ivfpq: the trained, empty index
        vectors.npy                 every vector embedded so far, by row (float16 for ivfpq, which
                                    keeps the file for re-scoring; float32 otherwise)

The key holds everything that decides the index (models, chunking, FAISS type, shard size, each
corpus file's path, size and modification time, and for an append the index it extends). Running
the same command again finds the same key and goes on from the last finished file and the last
finished shard; anything else starts afresh. Vectors already embedded are added to FAISS again from
vectors.npy in the same shards, so a resumed build makes the same calls, and the same index, as an
uninterrupted one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

CHECKPOINT_FILE = "checkpoint.json"


class Checkpoint:
    """`state` is saved with `save()` (atomically); `resumed` says whether it came from disk."""

    def __init__(self, staging: Path, key: dict):
        self.path = staging / CHECKPOINT_FILE
        self.key = json.loads(json.dumps(key))  # as it will read back from disk
        saved = _load(self.path)
        self.resumed = saved is not None and saved.get("key") == self.key
        if not self.resumed:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            saved = {"key": self.key, "files": [], "row": None, "count": None, "plan": None, "embedded": None}
        self.state: dict = saved

    def save(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.state, indent=1))
        os.replace(partial, self.path)

    def describe(self) -> str:
        """Where a resumed build goes on from, in words."""
        state = self.state
        if state["embedded"] is not None:
            return f"{state['embedded']:,} of {state['count']:,} passages already embedded"
        return f"{len(state['files'])} corpus files already read"


def file_identity(path: str) -> list:
    """What tells a corpus file changed since the checkpoint, without reading it: path, size, mtime."""
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
