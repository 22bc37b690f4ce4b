"""llama.cpp decoder engine: the decoder's GGUF run by llama-cpp-python, image tokens fed as embeddings.

On a CPU a 135M-parameter decoder is bound by per-token Python and dispatch overhead under
transformers (a quarter of what memory bandwidth allows); llama.cpp decodes the quantised GGUF at
close to the bandwidth limit. Text goes in as token ids; the projected image tokens go in through
llama.cpp's batch API as input embeddings (`llama_batch_init(n, n_embd, 1)`, `batch.embd`), after
which generation continues normally.

The engine keeps its own prefix cache: each of a few sequences in one context keeps the keys/values of
a conversation's last prompt and answer, and the next prompt that shares a prefix with one of them
(the next turn of that conversation) only runs the new tokens; a prefix that another slot holds
(the system prompt every conversation starts with) is copied from it. Image positions are keyed by
content, so a different image never matches. Concurrent requests are batched continuously (llama_steps.py).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

import numpy as np

from ..config import DecoderConfig
from ..language_model import derived_decoder_path
from .base import Detokenizer, Engine, EngineRequest, sample_next_token, shared_prefix, stop_token_ids
from .llama_steps import BATCH_CAPACITY, Generation, Job, Piece, Prefill, Scoring, StepLoop

MIN_BORROWED = 4  # prompt positions another slot must hold beyond a slot's own cache to copy them over
# Threads for a step of one position: one answer's next token. llama.cpp (an OpenMP build, sharing
# torch's libgomp) meets its threads at a barrier after each operation of the graph, and libgomp
# stops spinning at barriers (each waiter sleeps on a futex: 759 sleeps a token) as soon as the
# threads of all OpenMP teams in the process outnumber the cores, as torch's team and the step
# loop's do on 2 cores. In the issue-35 profile (docs/performance.md) those barriers were most of a
# token's time. One thread has no barrier, was within 2 % of two or faster for every step shape
# (scripts/bench_llama_batch.py --as-in-app --against-threads 2), and leaves the other core to the
# reader, the web server and the vision encoder.
TOKEN_THREADS = 1


def gguf_file_type(path: str | os.PathLike) -> str:
    """The GGUF's declared weight type name (e.g. "Q4_1"), read from its header."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return ""
    value = int(field.parts[field.data[0]][0])
    return LlamaFileType(value).name.removeprefix("MOSTLY_")


def requantized_gguf(source: str, weight_type: str, cache_dir: str | os.PathLike) -> str:
    """Path of `source` with its weights re-encoded as `weight_type`, made once under
    `cache_dir/decoders/` (a few seconds for a small decoder); `source` itself when `weight_type` is ""
    or already its type. Re-encoding dequantises each tensor and quantises it again: from 4 to 8 bits
    it changes next-token probabilities very little (scripts/bench_gguf_types.py measures it)."""
    from pathlib import Path

    if not weight_type:
        return source
    import llama_cpp

    weight_type = weight_type.upper()
    source_path = Path(source)
    if gguf_file_type(source_path) == weight_type:
        return source
    if not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{weight_type}"):
        raise ValueError(f"decoder.llama_cpp_type {weight_type!r} is not a llama.cpp weight type; use e.g. Q8_0, "
                         f"IQ4_NL or Q4_0, or \"\" for the file as given.")
    base = derived_decoder_path(source_path, cache_dir, f".{weight_type}")
    target = base.with_name(base.name + ".gguf")
    if target.is_file():
        return str(target)
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp logs a line per tensor
    print(f"Re-encoding {source_path.name} as {weight_type} for llama.cpp (once; later starts reuse it)...",
          flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{weight_type}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(str(source_path).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not re-encode {source_path} as {weight_type} (status {status}); "
                           f"set decoder.llama_cpp_type to \"\" to run the file as given.")
    partial.replace(target)
    return str(target)


@dataclass
class _Slot:
    """One llama.cpp sequence: the keys/values of one conversation's latest prompt and answer."""

    seq_id: int
    cached: list[int] = field(default_factory=list)  # keyed ids whose keys/values the sequence holds
    busy: bool = False
    last_used: float = 0.0
    forget: set[int] = field(default_factory=set)  # image keys to drop once the slot is given back


def _slot_cost(slot: _Slot, shared: dict[int, int], length: int) -> int:
    """Positions that taking `slot` costs a prompt of `length` positions, of which each slot's cache
    holds `shared[seq_id]` as its prefix: those left to run after the longest prefix the slot holds or
    can copy from another (_borrow_prefix), plus those of the slot's cache thrown away, plus one for a
    copy. A conversation's own slot costs least; then an empty one, which loses nothing (another
    conversation's slot would lose its scan and chat for the system prompt they share); when every
    slot holds someone's work, the one losing least."""
    own = shared[slot.seq_id]
    donated = max((count for seq_id, count in shared.items() if seq_id != slot.seq_id), default=0)
    copied = donated >= own + MIN_BORROWED
    return length - max(own, donated if copied else 0) + (len(slot.cached) - own) + int(copied)


class LlamaCppEngine(Engine):
    """The engine contract on llama.cpp (greedy or sampled, streamed), batched continuously.

    One context holds `slots` sequences, each with its own key/value stream. A request takes the free
    slot whose cache keeps the most of its prompt for the least of another's (its own conversation's
    previous turn, if still there; else an empty slot; else the least lost, oldest first) and hands
    what is left to run to the step loop (llama_steps.py), which runs every request's work together:
    one llama_decode a step carries the next token of each answer being generated and chunks of
    prompts. The caller waits for its results inside `request.waiting`, so a pipeline's turn-taking
    does not hold other requests back meanwhile.
    """

    name = "llama.cpp"

    def __init__(self, gguf_path: str, tokenizer, config: DecoderConfig, n_threads: int | None = None,
                 slots: int = 8, token_threads: int = TOKEN_THREADS):
        import llama_cpp

        self._lib = llama_cpp
        self.gguf_path = gguf_path  # the file llama.cpp runs (after any re-encoding)
        self.config = config
        self.tokenizer = tokenizer
        threads = n_threads or os.cpu_count() or 1
        if token_threads < 0:
            raise ValueError(f"decoder.llama_cpp_token_threads must be 0 (all cores) or more, not {token_threads}.")
        # llama-cpp-python routes llama.cpp's log through this logger; keep only errors.
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load the decoder GGUF at {gguf_path}.")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.context_window * slots
        params.n_batch = params.n_ubatch = BATCH_CAPACITY
        params.n_seq_max = slots
        # One key/value stream per slot: a token attends over its own conversation's cells only. In a
        # unified cache attention spans every slot's cells up to the highest in use, so cached
        # conversations slow each other down: decode after five chats measured 89-97 tok/s unified
        # against 104-109 per slot (llama-bench at the same depth: 103-117). The price: llama.cpp
        # runs a batch over separate streams in one pass only for consecutive sequence ids, so
        # answers in slots 0, 1, 2 share a pass and answers in slots 0 and 5 take one each.
        params.kv_unified = False
        # llama.cpp runs a step of one position (one answer's next token) on `n_threads` and larger
        # steps (prompts, several answers) on `n_threads_batch`. See TOKEN_THREADS for why one.
        self.token_threads, self.batch_threads = min(token_threads, threads) or threads, threads
        params.n_threads, params.n_threads_batch = self.token_threads, self.batch_threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context for the decoder.")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.hidden_size = int(llama_cpp.llama_model_n_embd(self.model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.stop_ids = stop_token_ids(tokenizer, [int(llama_cpp.llama_vocab_eos(vocab)),
                                                   int(llama_cpp.llama_vocab_eot(vocab))])
        self._slots = [_Slot(seq_id) for seq_id in range(slots)]
        self._slots_changed = threading.Condition()
        self.loop = StepLoop(llama_cpp, self.ctx, self.hidden_size, self.n_vocab)

    def close(self) -> None:
        """Stop the step loop (pending requests fail) and free the context and the weights."""
        loop, self.loop = getattr(self, "loop", None), None
        if loop is not None:
            loop.close()
            if loop.running:
                return  # its step still uses the context and the weights: leave them to the process
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        self.close()

    # --- slots -----------------------------------------------------------------------------------

    def _take_slot(self, keyed_ids: list[int], waiting: Callable[[], ContextManager] = contextlib.nullcontext) -> _Slot:
        """The free slot that suits the prompt best, marked busy. When every slot is in use it waits
        inside `waiting` (the caller's turn given up: the answers holding slots need turns to end).
        Whether to wait is decided in the same hold of the lock that takes the slot: a slot seen free,
        then taken by another thread, must not leave this caller waiting with its turn held."""
        with self._slots_changed:
            slot = self._pick_slot(keyed_ids)
        if slot is not None:
            return slot
        with waiting(), self._slots_changed:
            while (slot := self._pick_slot(keyed_ids)) is None:
                self._slots_changed.wait()
        return slot

    def _pick_slot(self, keyed_ids: list[int]) -> _Slot | None:
        """With _slots_changed held: the best free slot, marked busy, or None when all are in use."""
        free = [slot for slot in self._slots if not slot.busy]
        if not free:
            return None
        shared = {slot.seq_id: shared_prefix(slot.cached, keyed_ids) for slot in self._slots}
        slot = min(free, key=lambda s: (_slot_cost(s, shared, len(keyed_ids)), s.last_used))
        slot.busy = True
        return slot

    def _give_back(self, slot: _Slot) -> None:
        """Free the slot, first dropping the images forget_image asked to drop while it was in use.
        The keys are taken and the slot freed under _slots_changed, so a key added meanwhile is
        dropped too, never lost."""
        while True:
            with self._slots_changed:
                keys, slot.forget = slot.forget, set()
                if not keys:
                    slot.busy = False
                    slot.last_used = time.monotonic()
                    self._slots_changed.notify()
                    return
            with self.loop.context_lock:
                self._drop_keys(slot, keys)

    def forget(self, conversation_id: str, image_key: int | None = None) -> None:
        """Slots are shared by content, not owned by a conversation: only an image's keys/values are
        dropped (see forget_image)."""
        if image_key is not None:
            self.forget_image(image_key)

    def forget_image(self, key: int) -> int:
        """Drop the keys/values of every slot from the first position holding `key` (an image's key in
        the keyed ids) on, keeping what precedes it (the shared system prompt): a conversation that
        ends takes its scan out of the cache. A slot in use is cleared when it is given back. Returns
        how many slots held the key."""
        with self._slots_changed:
            holding = [slot for slot in self._slots if key in slot.cached]
            idle = [slot for slot in holding if not slot.busy]
            for slot in holding:
                if slot.busy:
                    slot.forget.add(key)
                else:
                    slot.busy = True
        try:
            with self.loop.context_lock:
                for slot in idle:
                    self._drop_keys(slot, {key})
        finally:
            with self._slots_changed:
                for slot in idle:
                    slot.busy = False
                self._slots_changed.notify_all()
        return len(holding)

    def _drop_keys(self, slot: _Slot, keys: set[int]) -> None:
        first = next((position for position, key in enumerate(slot.cached) if key in keys), None)
        if first is not None:
            self.loop.truncate(slot, first)

    # --- requests --------------------------------------------------------------------------------

    def _start(self, request: EngineRequest, job_type, last_logits: bool = True, **job_fields):
        """A slot for the request (the free one holding most of its prompt; waiting for one outside the
        caller's turn when all are in use) and the job that runs the rest of its prompt there. The
        image's projected tokens are asked for only when its positions are not cached."""
        if self.loop is None:
            raise RuntimeError("The llama.cpp engine is closed.")
        keyed_ids = request.cache_ids()
        slot = self._take_slot(keyed_ids, request.waiting)
        try:
            reused = min(shared_prefix(slot.cached, keyed_ids), len(keyed_ids) - 1)  # run >= 1 prompt token
            reused = self._borrow_prefix(slot, keyed_ids, reused, request.waiting)
            pieces = self._prompt_pieces(request, keyed_ids, reused, last_logits)
            job = job_type(slot=slot, pieces=pieces, keep=reused, background=request.background, **job_fields)
        except BaseException:
            self._give_back(slot)
            raise
        return job, reused

    def _borrow_prefix(self, slot: _Slot, keyed_ids: list[int], own: int,
                       waiting: Callable[[], ContextManager] = contextlib.nullcontext) -> int:
        """Where another slot holds a longer prefix of the prompt than `slot` does (the system prompt
        every conversation shares, in a slot this one never held it in; the neutral image of the
        image-reliance check), copy those keys/values into `slot` instead of computing them again.
        Returns how many of the prompt's positions the slot now holds. Copying a slot's stream
        (about 24 KB a position for this decoder) costs less than running a few positions."""
        def best_donor() -> tuple[_Slot | None, int]:
            limit = len(keyed_ids) - 1  # as for a slot's own cache: at least one prompt token runs
            return max(((other, min(shared_prefix(other.cached, keyed_ids), limit))
                        for other in self._slots if other is not slot), key=lambda entry: entry[1], default=(None, 0))

        if best_donor()[1] < own + MIN_BORROWED:
            return own  # (a first look, without the lock; confirmed under it)
        # The context lock waits for the step in progress: the caller's turn is given up meanwhile.
        with waiting(), self.loop.context_lock:  # no step runs now: every cache is as `cached` says
            donor, length = best_donor()
            if donor is None or length < own + MIN_BORROWED:
                return own
            self.loop.copy_prefix(donor, slot, length)
        return length

    def _prompt_pieces(self, request: EngineRequest, keyed_ids: list[int], start: int,
                       last_logits: bool) -> collections.deque:
        """The prompt from `start` on as pieces of text or image positions."""
        token_ids, image_mask = request.prompt.token_ids, request.prompt.image_mask
        pieces: collections.deque = collections.deque()
        position, image_row, image_tokens = start, sum(image_mask[:start]), None
        while position < len(token_ids):
            end, is_image = position, image_mask[position]
            while end < len(token_ids) and image_mask[end] == is_image:
                end += 1
            piece = Piece(keyed_ids[position:end])
            if is_image:
                if image_tokens is None:
                    image_tokens = request.image_tokens()[0].float().cpu().numpy()  # (N, d_l)
                piece.embeddings = image_tokens[image_row:image_row + end - position]
                image_row += end - position
            else:
                piece.tokens = list(token_ids[position:end])
            pieces.append(piece)
            position = end
        if pieces and last_logits:
            pieces[-1].logits = "last"
        return pieces

    def _finish(self, job: Job) -> None:
        """Take the job out of the loop (at its next step, if it is still running) and free its slot.
        After close the loop is gone and has failed the job: nothing is left to take out."""
        loop = self.loop
        if loop is None:
            return
        loop.cancel(job)
        self._give_back(job.slot)

    def time_token_step(self, request: EngineRequest, runs: int, threads: int | None = None) -> list[float]:
        """Seconds of each of `runs` bare llama_decode calls of one token after the request's prompt
        (cached first), in this context and process with no step in progress: llama.cpp's own time
        per token here, which benchmarks set the engine's against. `threads`: run them on this many
        threads instead of the engine's one-token count."""
        self.prefill(request)
        slot = self._take_slot(request.cache_ids())
        token = request.prompt.token_ids[-1]
        try:
            with self.loop.context_lock:
                before = (self._lib.llama_n_threads(self.ctx), self._lib.llama_n_threads_batch(self.ctx))
                self._lib.llama_set_n_threads(self.ctx, threads or before[0], before[1])
                try:
                    return self.loop.time_token_step(slot, token, runs)
                finally:
                    self._lib.llama_set_n_threads(self.ctx, *before)
        finally:
            self._give_back(slot)

    # --- the engine contract ---------------------------------------------------------------------

    def stream(self, request: EngineRequest, *, max_new_tokens: int | None = None, seed: int = 0,
               timings: dict | None = None, ignore_eos: bool = False) -> Iterator[str]:
        max_new_tokens = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        rng = np.random.default_rng(seed)
        config = self.config

        def sample(logits: np.ndarray) -> int:
            return sample_next_token(logits, config.temperature, config.top_p, rng)

        job, reused = self._start(request, Generation, sample=sample, max_new_tokens=max_new_tokens,
                                  stop_ids=frozenset() if ignore_eos else frozenset(self.stop_ids))
        try:
            if timings is not None:
                timings["reused_tokens"] = reused
            self.loop.submit(job)
            detokenizer = Detokenizer(self.tokenizer)
            while (token := job.next_token(request.waiting)) is not None:
                piece = detokenizer.push(token)
                if piece:
                    yield piece
            if timings is not None:
                timings["output_tokens"] = job.generated
        finally:
            if job.finished.is_set():
                self._finish(job)
            else:
                # Closed before its end (Stop, a closed tab), often by Gradio on the server's event
                # loop, which must not wait for the step in progress: a thread of its own takes the
                # job out of the loop and frees the slot (busy until then).
                threading.Thread(target=self._finish, args=(job,), name="llama.cpp stopped answer",
                                 daemon=True).start()

    def prefill(self, request: EngineRequest) -> int:
        """Cache the prompt without generating, in the slot holding the longest part of it; runs after
        the answers being generated (llama_steps.WARM_SHARE)."""
        keyed_ids = request.cache_ids()
        job, _ = self._start(request, Prefill, last_logits=False)
        try:
            self.loop.submit(job).wait(request.waiting)
        finally:
            self._finish(job)
        return len(keyed_ids)

    def score_options(self, request: EngineRequest, answers: list[list[int]]) -> list[float]:
        if not answers:
            raise ValueError("score_options needs at least one answer")
        longest = max(len(ids) for ids in answers)
        if longest - 1 > BATCH_CAPACITY:  # an option runs in one step (all but its last id), never split
            raise ValueError(f"An answer option of {longest} tokens is longer than one step takes "
                             f"({BATCH_CAPACITY + 1}).")
        job, _ = self._start(request, Scoring, answers=[list(ids) for ids in answers])
        try:
            self.loop.submit(job).wait(request.waiting)
        finally:
            self._finish(job)
        return job.scores
