"""llama.cpp decoder engine: the decoder's GGUF run by llama-cpp-python, image tokens fed as embeddings.

On a CPU a 135M-parameter decoder is bound by per-token Python and dispatch overhead under
transformers (a quarter of what memory bandwidth allows); llama.cpp decodes the quantised GGUF at
close to the bandwidth limit. Text goes in as token ids; the projected image tokens go in through
llama.cpp's batch API as input embeddings (`llama_batch_init(n, n_embd, 1)`, `batch.embd`), after
which generation continues normally.

The engine keeps its own prefix cache: each of a few sequences in one context keeps the keys/values of
a conversation's last prompt and answer, and the next prompt that shares a prefix with one of them
(the next turn of that conversation) only runs the new tokens. Image positions are keyed by content,
so a different image never matches.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..config import DecoderConfig
from ..language_model import derived_decoder_path
from .base import Detokenizer, Engine, EngineRequest, log_softmax, sample_next_token, shared_prefix, \
    stop_token_ids


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


class LlamaCppEngine(Engine):
    """The engine contract on llama.cpp (greedy or sampled, streamed).

    One context holds `slots` sequences, each with its own key/value stream. A generation takes the free
    slot whose cache shares the longest prefix with its prompt (its own conversation's previous turn,
    if still there) and holds the context lock for one decode call at a time, never across a yield,
    so concurrent answers interleave token by token.
    """

    name = "llama.cpp"

    def __init__(self, gguf_path: str, tokenizer, config: DecoderConfig, n_threads: int | None = None,
                 slots: int = 8):
        import llama_cpp

        self._lib = llama_cpp
        self.gguf_path = gguf_path  # the file llama.cpp runs (after any re-encoding)
        self.config = config
        self.tokenizer = tokenizer
        threads = n_threads or os.cpu_count() or 1
        # llama-cpp-python routes llama.cpp's log through this logger; keep only errors.
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load the decoder GGUF at {gguf_path}.")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.context_window * slots
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = slots
        # One key/value stream per slot: a token attends over its own conversation's cells only. In a
        # unified cache attention spans every slot's cells up to the highest in use, so cached
        # conversations slow each other down: decode after five chats measured 89-97 tok/s unified
        # against 104-109 per slot (llama-bench at the same depth: 103-117).
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context for the decoder.")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.hidden_size = int(llama_cpp.llama_model_n_embd(self.model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.stop_ids = stop_token_ids(tokenizer, [int(llama_cpp.llama_vocab_eos(vocab)),
                                                   int(llama_cpp.llama_vocab_eot(vocab))])
        self._tokens = llama_cpp.llama_batch_init(512, 0, 1)
        self._embeds = llama_cpp.llama_batch_init(512, self.hidden_size, 1)
        self._memory = llama_cpp.llama_get_memory(self.ctx)
        self._slots = [_Slot(seq_id) for seq_id in range(slots)]
        self._slots_changed = threading.Condition()
        self._lock = threading.Lock()  # the context: one decode call at a time

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        for name in ("_tokens", "_embeds"):
            if hasattr(self, name):
                lib.llama_batch_free(getattr(self, name))
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)

    # --- slots -----------------------------------------------------------------------------------

    def _take_slot(self, keyed_ids: list[int]) -> _Slot:
        with self._slots_changed:
            while all(slot.busy for slot in self._slots):
                self._slots_changed.wait()
            free = [slot for slot in self._slots if not slot.busy]
            slot = max(free, key=lambda s: (shared_prefix(s.cached, keyed_ids), -s.last_used))
            if shared_prefix(slot.cached, keyed_ids) == 0:
                slot = min(free, key=lambda s: s.last_used)  # nothing to reuse: evict the oldest
            slot.busy = True
            return slot

    def _give_back(self, slot: _Slot) -> None:
        if slot.forget:
            with self._lock:
                self._drop_keys(slot, slot.forget)
            slot.forget = set()
        with self._slots_changed:
            slot.busy = False
            slot.last_used = time.monotonic()
            self._slots_changed.notify()

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
            with self._lock:
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
            self._truncate(slot, first)

    # --- feeding (call with the lock held) ----------------------------------------------------------

    def _decode(self, batch, count: int, start: int, seq_id: int, want_logits: bool) -> None:
        batch.n_tokens = count
        for i in range(count):
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = int(want_logits and i == count - 1)
        status = self._lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama.cpp could not decode the batch (status {status}); "
                               f"the prompt may exceed the context window of {self.config.context_window}.")

    def _feed_tokens(self, slot: _Slot, token_ids: list[int], want_logits: bool) -> None:
        for offset in range(0, len(token_ids), 512):
            chunk = token_ids[offset:offset + 512]
            for i, token in enumerate(chunk):
                self._tokens.token[i] = token
            last = offset + len(chunk) == len(token_ids)
            self._decode(self._tokens, len(chunk), len(slot.cached) + offset, slot.seq_id, want_logits and last)

    def _feed_embeddings(self, slot: _Slot, embeddings: np.ndarray, want_logits: bool) -> None:
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)  # (n, d)
        for offset in range(0, len(embeddings), 512):
            chunk = embeddings[offset:offset + 512]
            ctypes.memmove(self._embeds.embd, chunk.ctypes.data, chunk.nbytes)
            last = offset + len(chunk) == len(embeddings)
            self._decode(self._embeds, len(chunk), len(slot.cached) + offset, slot.seq_id, want_logits and last)

    def _logits(self) -> np.ndarray:
        pointer = self._lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def _truncate(self, slot: _Slot, length: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, slot.seq_id, length, -1)
        del slot.cached[length:]

    def _prefill(self, slot: _Slot, request: EngineRequest, keyed_ids: list[int]) -> tuple[np.ndarray, int]:
        """Bring the slot to this prompt, keeping the longest cached prefix; return (logits, reused).
        The image's projected tokens are asked for only when its positions are not cached."""
        token_ids, image_mask = request.prompt.token_ids, request.prompt.image_mask
        reused = min(shared_prefix(slot.cached, keyed_ids), len(keyed_ids) - 1)  # run >= 1 prompt token
        self._truncate(slot, reused)
        position, image_row = reused, sum(image_mask[:reused])
        image_tokens = None
        while position < len(token_ids):
            end, is_image = position, image_mask[position]
            while end < len(token_ids) and image_mask[end] == is_image:
                end += 1
            last = end == len(token_ids)
            if is_image:
                if image_tokens is None:
                    image_tokens = request.image_tokens()[0].float().cpu().numpy()  # (N, d_l)
                self._feed_embeddings(slot, image_tokens[image_row:image_row + end - position], last)
                image_row += end - position
            else:
                self._feed_tokens(slot, token_ids[position:end], last)
            slot.cached += keyed_ids[position:end]
            position = end
        return self._logits(), reused

    # --- the engine contract ---------------------------------------------------------------------

    def stream(self, request: EngineRequest, *, max_new_tokens: int | None = None, seed: int = 0,
               timings: dict | None = None, ignore_eos: bool = False) -> Iterator[str]:
        max_new_tokens = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        rng = np.random.default_rng(seed)
        keyed_ids = request.cache_ids()
        slot = self._take_slot(keyed_ids)
        try:
            with self._lock:
                logits, reused = self._prefill(slot, request, keyed_ids)
            if timings is not None:
                timings["reused_tokens"] = reused
            detokenizer = Detokenizer(self.tokenizer)
            for step in range(max_new_tokens):
                token = sample_next_token(logits, self.config.temperature, self.config.top_p, rng)
                if token in self.stop_ids and not ignore_eos:
                    break
                piece = detokenizer.push(token)
                if piece:
                    yield piece
                if step == max_new_tokens - 1:
                    break
                with self._lock:
                    self._feed_tokens(slot, [token], True)
                    slot.cached.append(token)
                    logits = self._logits()
        finally:
            self._give_back(slot)

    def prefill(self, request: EngineRequest) -> int:
        """Cache the prompt without generating, in the slot holding the longest part of it."""
        keyed_ids = request.cache_ids()
        slot = self._take_slot(keyed_ids)
        try:
            with self._lock:
                self._prefill(slot, request, keyed_ids)
        finally:
            self._give_back(slot)
        return len(keyed_ids)

    def score_options(self, request: EngineRequest, answers: list[list[int]]) -> list[float]:
        keyed_ids = request.cache_ids()
        slot = self._take_slot(keyed_ids)
        try:
            with self._lock:
                logits, _ = self._prefill(slot, request, keyed_ids)
                first = log_softmax(logits)
                prompt_length = len(slot.cached)
                scores = []
                for ids in answers:
                    log_probs = [first[ids[0]]]
                    for index, token in enumerate(ids[:-1]):
                        self._feed_tokens(slot, [token], True)
                        slot.cached.append(token)
                        log_probs.append(log_softmax(self._logits())[ids[index + 1]])
                    self._truncate(slot, prompt_length)
                    scores.append(float(np.mean(log_probs)))
        finally:
            self._give_back(slot)
        return scores
