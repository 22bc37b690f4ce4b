"""One browser tab's state, kept in a `gr.State` and nowhere else, and the answer it is streaming.

A session is never shared between tabs. When the tab goes away `_forget_closed_tabs` drops it from
Gradio's state at once (Gradio would keep it an hour) and `_close_session` lets the pipeline forget
the conversation's cached prompt.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import gradio as gr

from ..imaging import Scan, ScanSource, Series, Study
from ..injection import InjectionFinding
from ..answer_head import open_note
from ..open_choices import choice_note
from ..pipeline import FREE_TEXT_NOTE, Conversation, Pipeline
from ..presuppose import reading_text
from ..safe_text import visible
from .transcript import _citation

log = logging.getLogger(__name__)

SETTLE_S = 1.0  # how long Stop, New conversation or a new scan wait for a stopped answer's last update to leave


@dataclass
class _Session:
    """One browser tab: never shared, dropped by Gradio when the tab goes away."""

    pipeline: Pipeline
    source: ScanSource | Series  # what the viewer scrolls: one file's frames, or one series' slices
    scan: Scan
    conversation: Conversation
    study: Study | None = None  # several files (a .zip, a folder, a multi-file upload): their series
    messages: list[dict] = field(default_factory=list)  # what the chat shows
    turns: list[dict] = field(default_factory=list)  # answered (or stopped) turns, for the transcript
    generation: int = 0  # bumped by Stop / New conversation / a new scan: a running answer then ends
    current: _Answer | None = None  # the answer being streamed
    waiting: list = field(default_factory=list)  # questions asked meanwhile (_Answer), answered in this order
    # What the last New conversation (or the chat's bin) cleared: (messages, turns, history), which
    # the Restore button brings back until a turn of the new conversation is answered or stopped
    # (handlers.restore_conversation).
    cleared: tuple | None = None
    # The last question asked, when (time.monotonic) and its _Answer: a double click asks it once (handlers.ask).
    last_asked: tuple = ("", float("-inf"), None)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Random, for the page's question box to say which session and generation a question was asked in
    # (handlers.ask drops a question asked before a Stop, New conversation or new scan it reaches after).
    token: str = field(default_factory=lambda: secrets.token_hex(6))
    # Chat snapshots an answer has made and not yet seen sent, by generation (`sending` / `sent`).
    in_flight: Counter = field(default_factory=Counter, repr=False)
    _settled: threading.Condition = field(init=False, repr=False)  # on `lock`: `sent` notifies, `settle` waits

    def __post_init__(self) -> None:
        self._settled = threading.Condition(self.lock)
    budget: Any = field(default=None, repr=False)  # the app's DecodedBudget (budget.py), which may drop the pixels

    def sending(self, generation: int) -> None:
        """Under the lock: an answer of `generation` made a chat snapshot it is about to yield."""
        self.in_flight[generation] += 1

    def sent(self, generation: int) -> None:
        """The answer's generator resumed after yielding that snapshot (Gradio resumes it only once it has
        queued the snapshot for the page), or was closed."""
        with self.lock:
            self.in_flight[generation] -= 1
            if self.in_flight[generation] <= 0:
                del self.in_flight[generation]
            self._settled.notify_all()

    def settle(self, timeout_s: float = SETTLE_S) -> bool:
        """Under the lock, after the generation moved on (Stop, New conversation, a new scan): wait until no
        snapshot of an earlier generation is still on its way to the page, so that what the caller returns
        reaches the page after it rather than being painted over by it. At most `timeout_s` (a generator
        Gradio cancelled between queueing a snapshot and resuming it is only closed later); False then."""
        settled = self._settled.wait_for(lambda: not any(count > 0 for generation, count in self.in_flight.items()
                                                     if generation != self.generation), timeout=timeout_s)
        if not settled:
            log.info("a stopped answer's last chat update was not seen sent within %.1f s", timeout_s)
        return settled

    def look_at(self, scan: Scan) -> Conversation:
        """Show `scan` and let the model see exactly it from the next question on. The conversation
        keeps its history but gets a new id, so no decoder cache built on the old pixels is reused.
        Returns the old conversation, for the caller to end (Pipeline.end_conversation) once it has
        let go of the session's lock: ending may wait for the decoder's step in progress."""
        self.scan = scan
        old = self.conversation
        self.conversation = Conversation(image=scan.pixels, window=scan.describe_window(), history=old.history)
        return old

    def close(self) -> None:
        """Let the pipeline drop what it cached for this session's conversation."""
        if self.budget is not None:
            self.budget.forget(self)
        self.pipeline.end_conversation(self.conversation)

    def _sources(self) -> list:
        return list(self.study.series) if self.study is not None else [self.source]

    def decoded_bytes(self) -> int:
        """Bytes of decoded pixels the session holds: the rendered image and the frames kept."""
        pixels = self.scan.pixels
        return (pixels.nbytes if pixels is not None else 0) + sum(source.decoded_bytes for source in self._sources())

    def drop_decoded(self) -> None:
        """The budget's call (budget.py), never while a handler uses the session: let go of the decoded
        pixels. The conversation keeps its id and image digest, so the model's caches stay valid for
        the identical pixels `restore_decoded` renders again."""
        with self.lock:
            for source in self._sources():
                source.forget_decoded()
            self.scan.pixels = None
            if self.conversation.image is not None:
                self.conversation.digest  # noqa: B018 - computed now, kept while the image is away
                self.conversation.__dict__["image"] = None  # not through __setattr__: that drops the digest

    def restore_decoded(self) -> None:
        """Render the scan again, exactly as it was shown (window and frame), if its pixels were dropped."""
        with self.lock:
            scan, source = self.scan, self.source
        if scan.pixels is not None:
            return
        again = source.render(window=scan.window, frame=scan.frame_index)  # decoding: outside the lock
        again.pixels.setflags(write=False)
        with self.lock:
            if self.scan is scan and scan.pixels is None:
                scan.pixels = again.pixels
                if self.conversation.image is None:
                    self.conversation.__dict__["image"] = again.pixels


def _copy(messages: list[dict]) -> list[dict]:
    """A snapshot of the chat for Gradio, so later edits to the session's messages do not leak into it."""
    return [dict(message) for message in messages]


def _close_session(session: _Session | None) -> None:
    """Gradio's delete callback for a session whose tab is gone."""
    if session is not None:
        session.close()


def _forget_closed_tabs(demo: Any) -> Callable[[gr.Request], Awaitable[None]]:
    """The app's unload handler: a tab's session is dropped when the tab goes away.

    Left to itself, Gradio keeps a closed tab's gr.State for an hour (for a reconnect), and keeps
    every output it sent the tab — the viewer's inline scan, the chat, the export — in that session's
    config until 10,000 newer sessions push it out. So on unload the session's whole record is taken
    out of Gradio's state holder (on the event loop, where Gradio's own expiry runs, so the two never
    interleave) and its states' delete callbacks (`_close_session`) run in a worker thread. Reads
    Gradio's `state_holder.session_data`; if that is not there, Gradio's own expiry stands."""
    async def forget(request: gr.Request) -> None:
        holder = getattr(demo, "state_holder", None)
        session_hash = getattr(request, "session_hash", None)
        sessions = getattr(holder, "session_data", None)
        if not session_hash or not isinstance(sessions, dict) or session_hash not in sessions:
            return
        state = sessions.pop(session_hash)
        getattr(holder, "time_last_used", {}).pop(session_hash, None)
        try:
            callbacks = [(component.delete_callback, value) for component, value, _ in state.state_components]
        except Exception:  # noqa: BLE001 - a Gradio without these internals: the record is gone regardless
            log.exception("could not read a closed tab's state")
            return
        await anyio.to_thread.run_sync(lambda: [callback(value) for callback, value in callbacks])

    return forget


def _place(scan: Scan) -> dict:
    """Which image a question was asked on: the frame of a file, or the series, slice and position."""
    if scan.series is None:
        return {"frame": scan.frame_index + 1}
    return {"series": scan.series, "slice": scan.frame_index + 1, "slices": scan.frame_count,
            "position_mm": scan.position_mm}


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
    injection: InjectionFinding | None = None  # the answer repeats an instruction or link from a passage
    support: list = field(default_factory=list)  # per passage: trust.mark_support's (mark, evidence)
    closed: dict | None = None  # a closed answer's option scores and image reliance (Done.closed)
    confidence_note: str = ""  # an answer written in free text: why it has no confidence (Done.confidence_note)
    refused: bool = False  # the pipeline refused the question (too long): it goes back to the question box
    head_open: dict | None = None  # an open question's answer head reading (Done.head_open)
    open_choice: dict | None = None  # an open answer the decoder chose among training answers (Done.open_choice)
    dropped_turns: int = 0  # the oldest earlier turns the prompt left out, not fitting the context (Done.dropped_turns)
    reply: dict | None = field(default=None, repr=False, compare=False)  # the chat message that shows it

    def _marks(self) -> list:
        """One support mark per passage (a passage without one is related literature)."""
        return list(self.support) + [None] * (len(self.passages) - len(self.support))

    def record(self, stopped: bool = False) -> dict:
        """This turn as the transcript keeps it (`stopped`: the user pressed Stop before the end)."""
        return {"question": visible(self.question), "answer": visible(self.text).strip(), "stopped": stopped,
                "window": self.window or self.scan.describe_window(), **_place(self.scan),
                "citations": [dict(_citation(n, p), support=mark[0] if mark else "related")
                              for n, (p, mark) in enumerate(zip(self.passages, self._marks()), start=1)],
                **({"closed": {"choice": str(self.closed["choice"]), "abstained": bool(self.closed["abstained"]),
                               "confidence": self.closed["confidence"],
                               **({"held_out": self.closed["held_out"]} if self.closed.get("held_out") else {}),
                               **({"uncalibrated": str(self.closed["uncalibrated"])}
                                  if self.closed.get("uncalibrated") else {}),
                               **({"reading": reading} if (reading := reading_text(self.closed)) else {})}}
                   if self.closed and "kind" in self.closed else
                   {"closed": {"choice": self.text.strip(), "abstained": False, "confidence": None, "scored": False}}
                   if self.confidence_note and self.confidence_note != FREE_TEXT_NOTE else {}),
                **({"answered_by": {"answerer": "decoder_free_text", "note": self.confidence_note}}
                   if self.confidence_note == FREE_TEXT_NOTE else {}),
                **({"answered_by": {"answerer": "encoder_head", "note": head_note,
                                    "probability": round(float(self.head_open["probability"]), 4),
                                    **({"similarity": round(float(self.head_open["similarity"]), 4)}
                                       if "similarity" in self.head_open else {})}}
                   if (head_note := open_note(self.head_open)) else {}),
                **({"answered_by": {"answerer": "decoder_choice", "note": chosen,
                                    "nearest_training_question": str(self.open_choice["nearest"]),
                                    "similarity": round(float(self.open_choice["similarity"]), 4),
                                    "choices": int(self.open_choice["choices"]),
                                    "chosen": str(self.open_choice["answer"]),
                                    "abstained": bool(self.open_choice.get("abstained")),
                                    "confidence": self.open_choice.get("confidence"),
                                    **({"held_out": self.open_choice["held_out"]}
                                       if self.open_choice.get("held_out") else {})}}
                   if (chosen := choice_note(self.open_choice)) else {}),
                **({"image_reliance": {"flagged": bool(self.closed["flagged"]),
                                       "answer_without_image": str(self.closed["without_image"])}}
                   if self.closed and "flagged" in self.closed else {}),
                **({"earlier_turns_not_read": self.dropped_turns} if self.dropped_turns else {}),
                "citations_read_by_model": self.in_prompt,
                **({"note": self.note} if not self.passages and self.note else {}),
                **({"injection": self.injection.record()} if self.injection is not None else {})}
