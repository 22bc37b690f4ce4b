"""One browser tab's state, kept in a `gr.State` and nowhere else, and the answer it is streaming.

A session is never shared between tabs. Gradio drops it when the tab goes away and then calls
`_close_session`, so the pipeline can forget the conversation's cached prompt.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..imaging import Scan, ScanSource
from ..pipeline import Conversation, Pipeline
from .transcript import _citation


@dataclass
class _Session:
    """One browser tab: never shared, dropped by Gradio when the tab goes away."""

    pipeline: Pipeline
    source: ScanSource
    scan: Scan
    conversation: Conversation
    messages: list[dict] = field(default_factory=list)  # what the chat shows
    turns: list[dict] = field(default_factory=list)  # answered (or stopped) turns, for the transcript
    generation: int = 0  # bumped by Stop / New conversation / a new scan: a running answer then ends
    current: _Answer | None = None  # the answer being streamed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def look_at(self, scan: Scan) -> None:
        """Show `scan` and let the model see exactly it from the next question on. The conversation
        keeps its history but gets a new id, so no decoder cache built on the old pixels is reused."""
        self.scan = scan
        old = self.conversation
        self.conversation = Conversation(image=scan.pixels, window=scan.describe_window(), history=old.history)
        self.pipeline.end_conversation(old)

    def close(self) -> None:
        """Let the pipeline drop what it cached for this session's conversation."""
        self.pipeline.end_conversation(self.conversation)


def _close_session(session: _Session | None) -> None:
    """Gradio's delete callback for a session whose tab is gone."""
    if session is not None:
        session.close()


@dataclass
class _Answer:
    """The answer being streamed: what the chat shows of it so far, and what the transcript keeps."""

    question: str
    scan: Scan
    text: str = ""
    passages: list = field(default_factory=list)
    note: str = ""
    window: str = ""
    started: bool = False
    in_prompt: bool = True  # the model read the passages (else they are related literature only)

    def record(self, stopped: bool = False) -> dict:
        """This turn as the transcript keeps it (`stopped`: the user pressed Stop before the end)."""
        return {"question": self.question, "answer": self.text.strip(), "stopped": stopped,
                "window": self.window or self.scan.describe_window(), "frame": self.scan.frame_index + 1,
                "citations": [_citation(n, p) for n, p in enumerate(self.passages, start=1)],
                "citations_read_by_model": self.in_prompt,
                **({"note": self.note} if not self.passages and self.note else {})}
