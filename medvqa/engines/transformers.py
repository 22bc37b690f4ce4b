"""The transformers engine: the decoder in process, fed through `inputs_embeds`.

Generation is a small explicit loop over a key/value cache rather than `model.generate`, because the
pipeline needs three things `generate` does not give together: streamed text pieces without a helper
thread, the cache kept for the conversation's next turn, and scoring of a closed set of answers.

The engine owns its prefix cache: per conversation, the keys/values of its last prompt and answer
(bounded, least recently used first out). The next prompt of that conversation runs only what
differs; image positions are keyed by content, so other pixels never match. On CPU, Llama-family
decoders take the fused decode step of cpu_fast.py.

With `decoder.batch_decode` on, one thread runs the decoder for every conversation and batches their
decode steps (torch_steps.py): N answers being generated take one pass over the weights a token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import numpy as np
import torch

from ..cache import LRU
from ..config import DecoderConfig
from ..language_model import LanguageModel
from ..model import embed_prompt
from .base import Detokenizer, Engine, EngineRequest, log_softmax, never_sampled_ids, sample_next_token, \
    shared_prefix, stop_token_ids
from .cpu_fast import LlamaDecodeStep
from .torch_steps import PREFILL_CHUNK, StepBatcher


@dataclass
class _Prefix:
    """A conversation's cache and the keyed prompt ids it covers."""

    ids: list[int]
    cache: object  # transformers DynamicCache


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, language_model: LanguageModel, config: DecoderConfig, prefix_cache_size: int = 16):
        self.language_model = language_model
        self.config = config
        self.tokenizer = language_model.tokenizer
        self.hidden_size = language_model.hidden_size
        model = language_model.model
        self.stop_ids = stop_token_ids(self.tokenizer, [getattr(model.generation_config, "eos_token_id", None)])
        self.never_ids = never_sampled_ids(self.tokenizer)  # <image>: never generated
        # Prefill and decoded tokens on CPU skip the transformers forward's overhead (cpu_fast.py).
        self.fast_step = LlamaDecodeStep.build(model) if config.cpu_fast_decode else None
        self.prefixes = LRU(prefix_cache_size)
        self.batcher = None
        batched = self.fast_step or LlamaDecodeStep.build(model, any_device=True)
        if batched is not None and batch_decode_on(config.batch_decode, language_model.device):
            self.batcher = StepBatcher(self._step, batched.batch)

    def close(self) -> None:
        batcher, self.batcher = self.batcher, None
        if batcher is not None:
            batcher.close()

    # --- the engine contract ------------------------------------------------------------------------

    def stream(self, request: EngineRequest, *, max_new_tokens: int | None = None, seed: int = 0,
               timings: dict | None = None, ignore_eos: bool = False) -> Iterator[str]:
        keyed = request.cache_ids()
        cache, reused = self._reusable_prefix(request.conversation_id, keyed)
        if timings is not None:
            timings["reused_tokens"] = reused
        embeds = self._embeds(request)[:, reused:]
        generated: list[int] = []
        end = yield from self.generate(embeds, cache, reused, max_new_tokens=max_new_tokens, seed=seed,
                                       ignore_eos=ignore_eos, generated=generated, waiting=request.waiting)
        cache, cache_length = end
        if timings is not None:
            timings["output_tokens"] = len(generated)
        # The cache holds every generated token that was fed back: all of them when the answer ended at
        # its end-of-turn token, all but the last when it hit the length limit.
        fed = cache_length - len(keyed)
        self.prefixes.put(request.conversation_id, _Prefix(keyed + generated[:fed], cache))

    def score_options(self, request: EngineRequest, answers: list[list[int]]) -> list[float]:
        if not answers:
            raise ValueError("score_options needs at least one answer")
        keyed = request.cache_ids()
        # A conversation's cached prefix (the prompt warmed as the question was typed) is reused and
        # kept; a request of no conversation is scored from scratch.
        cache, reused = self._reusable_prefix(request.conversation_id, keyed) if request.conversation_id else (None, 0)
        embeds = self._embeds(request)[:, reused:]
        urgency = 2 if request.background else 1  # background work waits for the prompts of waited-for answers
        logits, cache = self.run_prompt(embeds, cache, reused, request.waiting, urgency=urgency)
        first = log_softmax(logits[0].cpu().numpy())
        scores = self._run(lambda: self._score(first, cache, len(keyed), answers), request.waiting, urgency)
        if request.conversation_id:
            self.prefixes.put(request.conversation_id, _Prefix(keyed, cache))
        return scores

    @torch.inference_mode()
    def _score(self, first: np.ndarray, cache, prompt_length: int, answers: list[list[int]]) -> list[float]:
        scores = []
        for ids in answers:
            log_probs = [first[ids[0]]]
            if len(ids) > 1:
                positions = torch.arange(prompt_length, prompt_length + len(ids) - 1,
                                         device=self.language_model.device).unsqueeze(0)
                out = self.language_model.model(inputs_embeds=self.language_model.embed(ids[:-1]), cache=cache,
                                                position_ids=positions, use_cache=True)
                cache.crop(1 - len(ids))  # back to the prompt for the next answer
                step_log_probs = torch.log_softmax(out.logits[0].float(), -1)  # (len-1, V)
                log_probs += [step_log_probs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
            scores.append(float(sum(log_probs) / len(log_probs)))
        return scores

    def prefill(self, request: EngineRequest) -> int:
        keyed = request.cache_ids()
        cache, reused = self._reusable_prefix(request.conversation_id, keyed)
        _, cache = self.run_prompt(self._embeds(request)[:, reused:], cache, reused, request.waiting, urgency=2)
        self.prefixes.put(request.conversation_id, _Prefix(keyed, cache))
        return len(keyed)

    def forget(self, conversation_id: str, image_key: int | None = None) -> None:
        self.prefixes.pop(conversation_id)  # a conversation's cache is its own: the image goes with it

    # --- generation -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_embeds(self, inputs_embeds: torch.Tensor, cache=None, cache_length: int = 0):
        """Run `inputs_embeds` (1, T, d) after `cache_length` cached tokens; return (last logits (1, V)
        float, the cache extended by them)."""
        from transformers import DynamicCache

        model = self.language_model.model
        cache = cache if cache is not None else DynamicCache(config=model.config)
        if self.fast_step is not None and inputs_embeds.shape[0] == 1:
            return self.fast_step(inputs_embeds, cache, cache_length), cache
        length = inputs_embeds.shape[1]
        positions = torch.arange(cache_length, cache_length + length, device=inputs_embeds.device).unsqueeze(0)
        out = model(inputs_embeds=inputs_embeds, cache=cache, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
        return out.logits[:, -1].float(), out.cache

    def run_prompt(self, inputs_embeds: torch.Tensor, cache=None, cache_length: int = 0,
                   waiting: Callable[[], ContextManager] = contextlib.nullcontext, urgency: int = 1):
        """forward_embeds for a prompt; with batching, on the batcher's thread in chunks of
        PREFILL_CHUNK positions, between the steps of the answers being generated."""
        if self.batcher is None:
            return self.forward_embeds(inputs_embeds, cache, cache_length)
        logits = None
        for start in range(0, inputs_embeds.shape[1], PREFILL_CHUNK):
            chunk = inputs_embeds[:, start:start + PREFILL_CHUNK]
            logits, cache = self.batcher.call(lambda: self.forward_embeds(chunk, cache, cache_length + start),
                                              waiting, urgency)
        return logits, cache

    def _run(self, run: Callable[[], object], waiting: Callable[[], ContextManager], urgency: int = 1):
        return run() if self.batcher is None else self.batcher.call(run, waiting, urgency)

    def _step(self, embedding: torch.Tensor, cache, position: int) -> torch.Tensor:
        """Logits (1, V) after one more token (the cache is extended by it)."""
        return self.forward_embeds(embedding, cache, position)[0]

    def generate(self, inputs_embeds: torch.Tensor, cache=None, cache_length: int = 0, *,
                 max_new_tokens: int | None = None, seed: int = 0, ignore_eos: bool = False,
                 generated: list[int] | None = None, waiting: Callable[[], ContextManager] = contextlib.nullcontext):
        """Generate after the prompt `inputs_embeds`, yielding printable text pieces; the generated ids
        are appended to `generated`. Returns (as the generator's value) the cache and the number of
        tokens it covers: the prompt and every generated token but the last. With batching, each
        decode step joins the other answers' (waiting inside `waiting`)."""
        config = self.config
        max_new_tokens = config.max_new_tokens if max_new_tokens is None else max_new_tokens
        rng = np.random.default_rng(seed)
        generated = generated if generated is not None else []
        detokenizer = Detokenizer(self.tokenizer)
        logits, cache = self.run_prompt(inputs_embeds, cache, cache_length, waiting)
        cache_length += inputs_embeds.shape[1]
        with self.batcher.generating() if self.batcher is not None else contextlib.nullcontext():
            for step in range(max_new_tokens):
                scores = np.array(logits[0].float().cpu().numpy())  # (V,) a copy: masked below
                scores[self.never_ids] = -np.inf
                token = sample_next_token(scores, config.temperature, config.top_p, rng)
                if token in self.stop_ids and not ignore_eos:
                    break
                generated.append(token)
                piece = detokenizer.push(token)
                if piece:
                    yield piece
                if step == max_new_tokens - 1:
                    break
                embedding = self.language_model.embed([token])
                if self.batcher is None:
                    logits = self._step(embedding, cache, cache_length)
                else:
                    logits = self.batcher.step(embedding, cache, cache_length, waiting)
                cache_length += 1
        return cache, cache_length

    # --- prompts and caches -------------------------------------------------------------------------

    def _embeds(self, request: EngineRequest) -> torch.Tensor:
        prompt = request.prompt
        with torch.inference_mode():
            return embed_prompt(self.language_model.embed, prompt.token_ids, prompt.image_mask, request.image_tokens)

    def _reusable_prefix(self, conversation_id: str, keyed_ids: list[int]):
        """The conversation's cache cropped to the prefix it shares with this prompt (at least one
        prompt token is always left to run, so there are logits to start from)."""
        state = self.prefixes.get(conversation_id)
        if state is None:
            return None, 0
        shared = min(shared_prefix(state.ids, keyed_ids), len(keyed_ids) - 1)
        if shared <= 0:
            return None, 0
        self.prefixes.pop(conversation_id)  # the cache is extended in place from here on
        state.cache.crop(shared - len(state.ids))  # a negative count removes that many tokens
        return state.cache, shared


def batch_decode_on(setting: str, device) -> bool:
    """decoder.batch_decode: "on", "off", or "auto" (on for CUDA and MPS; on CPU, CPU_BATCH_DECODE)."""
    if setting in ("on", "off"):
        return setting == "on"
    return torch.device(device).type != "cpu" or CPU_BATCH_DECODE


# "auto" on CPU: on. Measured with scripts/bench_app.py --clients 1 8 --questions 4, off / on twice each
# (2-core AMD EPYC, 2026-12-01; docs/performance.md#the-transformers-engine): at 8 sessions batching
# halves the time per token (p50 1086-1155 ms against 579-617) and the median first token (1.7 s
# against 1.35), at the same aggregate output (3.9-4.3 tokens/s); the slowest first tokens wait longer
# (p95 4.6-4.8 s against 6.6-7.6); one session is unchanged.
CPU_BATCH_DECODE = True
