"""The one interface every decoder engine stands behind, and what the in-process engines share.

The pipeline hands an engine an `EngineRequest` (the assembled prompt, the image and a way to get
its projected tokens) and gets text pieces or option scores back; it never asks which engine it
has. Each engine owns its prefix cache: the transformers engine keeps a key/value cache per
conversation, llama.cpp keeps slots in its context, a remote server keeps its own.

Adding an engine (vLLM in process, MLX) is one new module with a subclass of `Engine`, and one line
in `engines/__init__.py`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import numpy as np

from ..prompt import IMAGE_PLACEHOLDER, Prompt


@dataclass
class EngineRequest:
    """One prompt for an engine: everything any engine needs, so none is special-cased by its caller."""

    conversation_id: str  # the conversation whose prefix cache this prompt extends
    prompt: Prompt  # token ids with image slots (in-process engines) and the messages (remote ones)
    image: np.ndarray  # (H, W, 3) uint8 pixels exactly as shown: a remote engine sends these
    image_key: int  # key of the image's content, negative (never a token id)
    # Projected image tokens (1, N, d_l), computed (and cached by the model) only when an engine
    # asks: a prefix cache that already holds the image needs no vision encoder run.
    image_tokens: Callable[[], "object"] | None = None
    # Entered while the engine waits for work it runs together with other requests (a batching
    # engine's step loop, a free slot): the pipeline's turn on the model is given up meanwhile
    # (TurnTaking.aside), so the other requests can reach the engine.
    waiting: Callable[[], ContextManager] = contextlib.nullcontext
    # Work nobody is waiting for (the image-reliance check of an answer already shown): a batching
    # engine runs it with warming, after the prompts of answers someone is waiting for.
    background: bool = False

    def cache_ids(self, length: int | None = None) -> list[int]:
        """The prompt's ids with every image slot replaced by the image's key, so a cache built on
        other pixels never matches a prefix; the first `length` of them when given."""
        ids, mask = self.prompt.token_ids, self.prompt.image_mask
        if length is not None:
            ids, mask = ids[:length], mask[:length]
        return [self.image_key if masked else token for token, masked in zip(ids, mask)]


class Engine:
    """A frozen decoder behind one interface."""

    name = "engine"
    tokenizer = None  # the tokenizer prompts are built with; None: the engine renders messages itself
    hidden_size: int | None = None  # width of the decoder's input embeddings (the projector's output)
    takes_image_tokens = True  # False: the engine is sent pixels and runs the vision side itself
    caches_prompts = True  # whether prefill() can cache a prompt ahead of the question
    scores_options = True  # whether score_options() works (constrained decoding of closed questions)

    def stream(self, request: EngineRequest, *, max_new_tokens: int | None = None, seed: int = 0,
               timings: dict | None = None, ignore_eos: bool = False) -> Iterator[str]:
        """Generate an answer to `request`, yielding text pieces as they become printable. Where the
        engine reused a cached prefix, `timings["reused_tokens"]` says how many prompt tokens.
        `ignore_eos` generates exactly `max_new_tokens` (benchmarks)."""
        raise NotImplementedError

    def score_options(self, request: EngineRequest, answers: list[list[int]]) -> list[float]:
        """Mean token log-probability of each answer's token ids (PromptBuilder.answer_ids: the end-of-
        turn token included where the format says so) after the prompt: constrained decoding."""
        raise NotImplementedError(f"The {self.name} engine cannot score a closed set of answers.")

    def prefill(self, request: EngineRequest) -> int:
        """Cache the request's prompt (a prefix of the next one) without generating; returns the
        number of prompt tokens now cached (0 where the engine keeps no cache of its own)."""
        return 0

    def forget(self, conversation_id: str, image_key: int | None = None) -> None:
        """Drop the conversation's cached prefix; with `image_key`, also every cached key/value
        computed on that image (the scan leaves the cache with its conversation)."""

    def close(self) -> None:
        """Release what the engine holds (connections, contexts)."""


def sample_next_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The next token from (V,) logits: greedy at temperature 0, else nucleus sampling over the
    smallest set of tokens whose probabilities sum to `top_p`."""
    if temperature <= 0:
        return int(np.argmax(logits))
    probs = np.exp(log_softmax(logits / temperature))
    if top_p < 1.0:
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above each
        kept = np.zeros_like(probs)
        kept[order[before < top_p]] = probs[order[before < top_p]]
        probs = kept
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def never_sampled_ids(tokenizer) -> list[int]:
    """Ids no answer may contain: the image placeholder's, where the vocabulary has one (generated, it
    would be an image slot in the next turn's prompt; LLaVA's reference keeps it outside the vocabulary,
    so its model never generates it)."""
    token_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER) if tokenizer is not None else None
    return [token_id] if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else []


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


class Detokenizer:
    """Token ids in, printable text pieces out: a multi-byte character split across tokens is held
    back until it is complete, and special tokens are never printed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.printed = ""

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly printable text ("" if none yet)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or len(text) <= len(self.printed):
            return ""
        piece, self.printed = text[len(self.printed):], text
        return piece


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists. Safe while another thread shortens one
    of them (the step loop cuts a slot's ids as a request reads them): it never indexes past an end."""
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    return shared


def stop_token_ids(tokenizer, declared=()) -> set[int]:
    """Ids that end an answer: those the model declares (`declared`: its generation config's or
    llama.cpp's end-of-sequence ids), the tokenizer's, and the end-of-turn markers of the common chat
    templates where the vocabulary has them."""
    ids: set[int] = set()
    for value in (*declared, tokenizer.eos_token_id):
        if isinstance(value, int) and value >= 0:
            ids.add(value)
        elif isinstance(value, (list, tuple, set)):
            ids.update(int(v) for v in value)
    for token in ("<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id is not None and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids
