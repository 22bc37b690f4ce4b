"""Continuous batching for the llama.cpp engine: one loop runs every request's work in shared steps.

Each request (an answer, a closed question's options, a warming) holds one slot of the context (a
sequence with its own key/value stream) and hands the loop the positions it still has to run as
`Piece`s. Each step packs into one `llama_decode` the next token of every answer being generated,
then as much prompt as a budget allows (answers' prompts and option scoring first, warming last), so
eight conversations make one pass over the weights where they made eight, and a long prompt is
prefilled in chunks between the steps that keep running answers flowing. Requests join and leave at
every step. Sampling happens in the loop, so an answer never waits for its reader to come back for
the next token; the reader takes token ids from a queue.

Image embeddings cannot share a `llama_batch` with token ids: a step whose work includes image
positions makes a second `llama_decode` for them.
"""

from __future__ import annotations

import collections
import ctypes
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Literal

import numpy as np

from .base import log_softmax

PREFILL_BUDGET = 64  # prompt positions one step runs besides the answers' next tokens
WARM_SHARE = 8  # of which background work (warming) may take this many, in all, while answers are generated
BATCH_CAPACITY = 512  # positions one llama_decode call may carry (the context's n_batch)


@dataclass
class Piece:
    """Positions to run in a slot: token ids, or image embeddings, with the keyed ids its cache holds
    for them afterwards; and which of them the caller wants logits for."""

    keyed: list[int]
    tokens: list[int] | None = None
    embeddings: np.ndarray | None = None  # (n, d) float32
    logits: Literal["none", "last", "all"] = "none"
    done: int = 0  # positions already run

    @property
    def left(self) -> int:
        return len(self.keyed) - self.done


@dataclass(eq=False)
class Job:
    """One request's work in the loop: its slot, the pieces still to run, and (in subclasses) what to
    do with the logits of the last piece. `keep` is how much of the slot's cache the request reuses:
    the loop cuts the rest away before the first piece runs."""

    slot: "object"  # llama_cpp._Slot: seq_id and cached (the keyed ids its stream holds)
    pieces: collections.deque
    keep: int
    finished: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    error: BaseException | None = None
    started: bool = False
    arrival: float = field(default_factory=time.monotonic)
    rows: list = field(default_factory=list)  # logits collected for the piece being run
    # Nobody waits for it (warming; EngineRequest.background, such as the image-reliance check).
    background: bool = False

    def urgency(self) -> int:
        """0: the next token of an answer being read; 1: an answer's prompt or options; 2: background
        work."""
        return 2 if self.background else 1

    def on_logits(self, rows: list[np.ndarray], loop: "StepLoop") -> None:
        """Called in the loop once every piece has run; `rows` are the logits the last piece asked for.
        Append more pieces, or finish."""
        self.finish()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = self.error or error
        self.finished.set()

    def wait(self, waiting: Callable[[], ContextManager]) -> None:
        """Block until the job is finished (inside `waiting`: the caller's turn is given up), then raise
        its error, if any."""
        if not self.finished.is_set():
            with waiting():
                self.finished.wait()
        if self.error is not None:
            raise self.error


class Prefill(Job):
    """Run a prompt into the slot (warming while the clinician types); no logits. Background work."""

    def urgency(self) -> int:
        return 2


@dataclass(eq=False)
class Generation(Job):
    """An answer: after the prompt, sample a token from each step's logits and run it in the next
    step, until an end-of-answer token or `max_new_tokens`. Token ids go to `tokens`, then None."""

    sample: Callable[[np.ndarray], int] = None
    stop_ids: frozenset = frozenset()
    max_new_tokens: int = 0
    tokens: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    generated: int = 0

    def urgency(self) -> int:
        return 0 if self.generated else 1

    def on_logits(self, rows, loop) -> None:
        if self.max_new_tokens <= 0:
            return self.finish()
        token = self.sample(rows[-1])
        if token in self.stop_ids:
            return self.finish()
        self.tokens.put(token)
        self.generated += 1
        if self.generated >= self.max_new_tokens:
            return self.finish()  # the last token is not run: as in a cache built token by token
        self.pieces.append(Piece([token], tokens=[token], logits="last"))

    def finish(self, error=None) -> None:
        super().finish(error)
        self.tokens.put(None)

    def next_token(self, waiting: Callable[[], ContextManager]) -> int | None:
        """The next generated token id, or None at the end (raising the job's error, if any)."""
        try:
            token = self.tokens.get_nowait()
        except queue.Empty:
            with waiting():
                token = self.tokens.get()
        if token is None and self.error is not None:
            raise self.error
        return token


@dataclass(eq=False)
class Scoring(Job):
    """A closed question's options: the mean log-probability of each answer's ids after the prompt.
    Each answer runs (all but its last id) in one step, and the slot is cut back to the prompt after."""

    answers: list = field(default_factory=list)
    scores: list = field(default_factory=list)
    first: np.ndarray | None = None  # log-probabilities after the prompt
    prompt_length: int = 0

    def on_logits(self, rows, loop) -> None:
        if self.first is None:
            self.first, self.prompt_length = log_softmax(rows[-1]), len(self.slot.cached)
        else:
            ids = self.answers[len(self.scores)]
            log_probs = [self.first[ids[0]]] + [log_softmax(row)[ids[i + 1]] for i, row in enumerate(rows)]
            self.scores.append(float(np.mean(log_probs)))
            loop.truncate(self.slot, self.prompt_length)
        while len(self.scores) < len(self.answers):
            ids = self.answers[len(self.scores)]
            if len(ids) > 1:
                self.pieces.append(Piece(list(ids[:-1]), tokens=list(ids[:-1]), logits="all"))
                return
            self.scores.append(float(self.first[ids[0]]))
        self.finish()


class StepLoop:
    """The thread that owns a llama.cpp context's decoding and runs the jobs submitted to it."""

    def __init__(self, lib, ctx, n_embd: int, n_vocab: int, budget: int = PREFILL_BUDGET,
                 warm_share: int = WARM_SHARE):
        self._lib, self._ctx = lib, ctx
        self._memory = lib.llama_get_memory(ctx)
        self.n_vocab = n_vocab
        self.budget, self.warm_share = budget, warm_share
        self._tokens = lib.llama_batch_init(BATCH_CAPACITY, 0, 1)
        self._embeds = lib.llama_batch_init(BATCH_CAPACITY, n_embd, 1)
        self.context_lock = threading.Lock()  # held for each step; others touching the cache take it too
        self._jobs: list[Job] = []
        self._changed = threading.Condition()
        self._closing = False
        self.steps = 0  # llama_decode calls made (tests and benchmarks read it)
        self.decode_s = 0.0  # seconds spent inside those calls (benchmarks: a token's time in the model)
        self.copies = 0  # prefixes copied between slots (copy_prefix)
        self._thread = threading.Thread(target=self._run, name="llama.cpp steps", daemon=True)
        self._thread.start()

    # --- callers -------------------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        with self._changed:
            if self._closing:
                job.finish(RuntimeError("The llama.cpp engine is closed."))
                return job
            if not job.pieces:  # nothing left to run: e.g. a prompt whose cache holds all of it
                job.finish()
                return job
            self._jobs.append(job)
            self._changed.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Take the job out at the next step (its slot keeps what ran) and wait until it is out."""
        with self._changed:
            job.cancelled = True
            self._changed.notify()
        job.finished.wait()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(timeout=60)
        with self._changed:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.finish(RuntimeError("The llama.cpp engine was closed."))
        if self.running:
            return  # a step still running (after a minute) uses the batches: leave them to the process
        for batch in (self._tokens, self._embeds):
            self._lib.llama_batch_free(batch)
        self._tokens = self._embeds = None

    @property
    def running(self) -> bool:
        """Whether the loop's thread is still alive (after close: a step ran past close's minute)."""
        return self._thread.is_alive()

    def copy_prefix(self, source, target, length: int) -> None:
        """Make `target`'s cache the first `length` positions of `source`'s (with the context lock held).
        Between slots of their own key/value streams llama.cpp copies the whole stream, at the start of
        the next llama_decode, before that step writes anything; the rest is cut away here."""
        self._lib.llama_memory_seq_cp(self._memory, source.seq_id, target.seq_id, -1, -1)
        self._lib.llama_memory_seq_rm(self._memory, target.seq_id, length, -1)
        target.cached[:] = source.cached[:length]
        self.copies += 1

    def truncate(self, slot, length: int) -> None:
        """Cut the slot's cache to its first `length` positions (with the context lock held)."""
        self._lib.llama_memory_seq_rm(self._memory, slot.seq_id, length, -1)
        del slot.cached[length:]

    def time_token_step(self, slot, token: int, runs: int) -> list[float]:
        """(With the context lock held) seconds of each of `runs` bare llama_decode calls of one token
        after the slot's cache, cut back after each: the model's own time per token, without the
        loop around it (benchmarks compare the engine's time per token with it)."""
        batch, position, seconds = self._tokens, len(slot.cached), []
        for _ in range(runs):
            batch.token[0], batch.pos[0], batch.n_seq_id[0] = token, position, 1
            batch.seq_id[0][0], batch.logits[0], batch.n_tokens = slot.seq_id, 1, 1
            started = time.perf_counter()
            status = self._lib.llama_decode(self._ctx, batch)
            seconds.append(time.perf_counter() - started)
            self._lib.llama_memory_seq_rm(self._memory, slot.seq_id, position, -1)
            if status != 0:
                raise RuntimeError(f"llama.cpp could not decode one token (status {status}).")
        return seconds

    # --- the loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closing and not self._jobs:
                    self._changed.wait()
                if self._closing:
                    return
                for job in [job for job in self._jobs if job.cancelled or job.finished.is_set()]:
                    self._jobs.remove(job)
                    job.finish()
                plan = self._plan()
            if not plan:  # only work too large for one batch: should not happen; do not spin
                with self._changed:
                    self._changed.wait(0.05)
                continue
            with self.context_lock:
                try:
                    self._step(plan)
                except Exception as error:  # noqa: BLE001 - the loop must outlive any one step
                    for job, _, _ in plan:
                        job.finish(error)
            with self._changed:
                self._jobs = [job for job in self._jobs if not job.finished.is_set()]

    def _plan(self) -> list[tuple[Job, Piece, int]]:
        """(job, piece, positions) to run this step: every answer's next token, then prompts within
        the budget, most urgent and oldest first. Background work (warming) gets `warm_share`
        positions of it in all while answers are being generated, the whole budget otherwise. While
        no answer is being generated, waited-for prompts may fill the whole batch."""
        plan, prompt_used, background_used, total = [], 0, 0, 0
        generating = any(job.urgency() == 0 for job in self._jobs)
        for job in sorted(self._jobs, key=lambda job: (job.urgency(), job.arrival)):
            piece = job.pieces[0]
            if job.urgency() == 0 or piece.logits == "all":
                count = piece.left  # one answer token, or one option's ids: never split
            elif job.urgency() == 1 and not generating:
                # Nobody is reading an answer, so no step needs to stay short: a waited-for prompt
                # runs in chunks as large as a call takes (one session's first turn as fast as before
                # the loop; larger chunks also suit the batched kernels of Q8_0 and IQ4_NL weights).
                count = min(piece.left, BATCH_CAPACITY - prompt_used)
                prompt_used += max(count, 0)
            else:
                allowance = self.budget - prompt_used
                if job.urgency() == 2 and generating:
                    allowance = min(allowance, self.warm_share - background_used)
                count = min(piece.left, allowance)
                prompt_used += max(count, 0)
                if job.urgency() == 2:
                    background_used += max(count, 0)
            if count <= 0 or total + count > BATCH_CAPACITY:
                continue
            plan.append((job, piece, count))
            total += count
        return plan

    def _step(self, plan: list[tuple[Job, Piece, int]]) -> None:
        for job, _, _ in plan:
            if not job.started:
                job.started = True
                self.truncate(job.slot, job.keep)
        # Sequences in increasing id order: llama.cpp puts consecutive ids into one pass over the
        # weights when each slot has its own key/value stream.
        plan = sorted(plan, key=lambda entry: entry[0].slot.seq_id)
        for is_image in (False, True):
            entries = [entry for entry in plan if (entry[1].embeddings is not None) == is_image]
            if entries:
                self._decode(entries, self._embeds if is_image else self._tokens, is_image)
        for job, piece, _ in plan:
            if piece.left == 0 and not job.finished.is_set():
                job.pieces.popleft()
                if not job.pieces:
                    rows, job.rows = job.rows, []
                    try:
                        job.on_logits(rows, self)
                    except Exception as error:  # noqa: BLE001 - the job's caller gets it
                        job.finish(error)

    def _decode(self, entries: list[tuple[Job, Piece, int]], batch, is_image: bool) -> None:
        """One llama_decode over the entries; then their caches, progress and wanted logits."""
        index, wanted = 0, []
        for job, piece, count in entries:
            start = len(job.slot.cached)
            if is_image:
                chunk = np.ascontiguousarray(piece.embeddings[piece.done:piece.done + count], dtype=np.float32)
                row_bytes = chunk.shape[1] * chunk.itemsize
                ctypes.memmove(ctypes.cast(batch.embd, ctypes.c_void_p).value + index * row_bytes,
                               chunk.ctypes.data, chunk.nbytes)
            for offset in range(count):
                position = piece.done + offset
                if not is_image:
                    batch.token[index] = piece.tokens[position]
                batch.pos[index] = start + offset
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = job.slot.seq_id
                last = position == len(piece.keyed) - 1
                want = piece.logits == "all" or (piece.logits == "last" and last)
                batch.logits[index] = int(want)
                if want:
                    wanted.append((job, index))
                index += 1
        batch.n_tokens = index
        started = time.perf_counter()
        status = self._lib.llama_decode(self._ctx, batch)
        self.decode_s += time.perf_counter() - started
        self.steps += 1
        if status != 0:
            for job, piece, _ in entries:
                self._lib.llama_memory_seq_rm(self._memory, job.slot.seq_id, len(job.slot.cached), -1)
                job.finish(RuntimeError(f"llama.cpp could not decode the batch (status {status}); the prompt "
                                        f"may exceed the context window."))
            return
        for job, index in wanted:
            # A plain copy out of llama.cpp's buffer (np.ctypeslib.as_array took 0.4 % of the loop's
            # profile, more than the rest of its Python between calls).
            row = np.empty(self.n_vocab, dtype=np.float32)
            ctypes.memmove(row.ctypes.data, self._lib.llama_get_logits_ith(self._ctx, index), row.nbytes)
            job.rows.append(row)
        for job, piece, count in entries:
            job.slot.cached += piece.keyed[piece.done:piece.done + count]
            piece.done += count
