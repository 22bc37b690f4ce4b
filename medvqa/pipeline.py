"""One object that owns the loaded parts and answers questions about scans.

    pipeline = Pipeline.load(load_settings("offline"))
    conversation = pipeline.new_conversation(scan)
    for event in pipeline.ask(conversation, "Is there a pleural effusion?"):
        ...  # Sources(passages), Token(text) pieces, Done(answer, ...): Sources comes first when the
             # decoder reads the passages, after the last Token when they are only shown beside it

The pipeline holds no per-user state of its own beyond bounded caches keyed by content (image
tokens) or by a random conversation id (the decoder's key/value cache): everything about a user's
scan and chat lives in their `Conversation` object.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from .answers import closed_candidates, surface_forms
from .config import Settings, resolve_path
from .decoder import Decoder, GenerationResult, hub_offline_env, resolve_decoder_folder
from .device import pick_device, pick_dtype
from .projector import Projector
from .prompt import PromptBuilder, Turn, merge_image_features
from .llama_engine import LlamaCppDecoder, llama_cpp_available, requantized_gguf
from .remote import RemoteDecoder
from .vision import VisionEncoder, build_vision

log = logging.getLogger(__name__)


@dataclass
class Sources:
    passages: list  # retrieval.Passage, numbered [1..n] in this order
    note: str = ""  # why there are none, when there are none
    in_prompt: bool = True  # whether the decoder reads them (see retrieval.prompt_gate)


@dataclass
class Token:
    text: str


@dataclass
class Done:
    answer: str
    passages: list
    window: str
    timings: dict = field(default_factory=dict)
    in_prompt: bool = True  # whether the passages were in the decoder's prompt


@dataclass
class Conversation:
    """One user's scan and chat. Never shared between users."""

    image: np.ndarray  # (H, W, 3) uint8, exactly what the model sees
    window: str = ""  # description of the window applied, for the prompt and the export
    history: list[Turn] = field(default_factory=list)
    id: str = field(default_factory=lambda: secrets.token_hex(8))

    def __setattr__(self, name, value) -> None:
        if name == "image":
            # Caches are keyed by the image's content: an image is replaced (a window or frame change
            # assigns a new array), never edited in place, so its hash is computed once per image.
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
            self.__dict__.pop("_digest", None)
        super().__setattr__(name, value)

    @property
    def digest(self) -> str:
        """image_digest(self.image), computed once per image assigned (not per turn or keystroke)."""
        if "_digest" not in self.__dict__:
            self.__dict__["_digest"] = image_digest(self.image)
        return self.__dict__["_digest"]

    @classmethod
    def from_scan(cls, scan) -> "Conversation":
        describe = getattr(scan, "describe_window", None)
        return cls(image=scan.pixels, window=describe() if callable(describe) else "")


class _LRU:
    """A small thread-safe least-recently-used map."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def pop(self, key) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        with self._lock:
            return list(self._items)


@dataclass
class _PrefixState:
    """The decoder cache of a conversation and the prompt ids it covers (image slots keyed by content)."""

    ids: list[int]
    cache: object


class Pipeline:
    def __init__(self, settings: Settings, vision: VisionEncoder | None, projector: Projector | None,
                 decoder: Decoder | RemoteDecoder, retriever=None, feature_cache_size: int = 64,
                 prefix_cache_size: int = 16):
        self.settings = settings
        self.vision = vision
        self.projector = projector
        self.decoder = decoder
        self.retriever = retriever
        # A remote decoder gets the image itself and renders its own template: no tokenizer here.
        self.prompts = PromptBuilder(getattr(decoder, "tokenizer", None), vision.num_tokens if vision else 0,
                                     settings.decoder.context_window,
                                     reserve_for_answer=settings.decoder.max_new_tokens,
                                     image_position=projector.image_position if projector
                                     else settings.projector.image_position)
        self.image_token_cache = _LRU(feature_cache_size)
        self.prefix_cache = _LRU(prefix_cache_size)
        self.encoder_calls = 0  # how often the vision encoder actually ran (cache misses)

    @classmethod
    def load(cls, settings: Settings, with_retrieval: bool | None = None, progress: bool = True) -> "Pipeline":
        hub_offline_env(settings.offline)
        torch.manual_seed(settings.seed)
        device = pick_device(settings.device)
        dtype = pick_dtype(device, settings.dtype)
        if settings.profile == "tiny":
            from .tiny import make_tiny_models
            from pathlib import Path

            make_tiny_models(Path(settings.decoder.name_or_path).parent, seed=settings.seed)
        retriever = None
        if settings.decoder.engine == "openai":
            # The server runs the whole vision-language model; we only retrieve and assemble the prompt.
            vision, projector, decoder = None, None, RemoteDecoder(settings.decoder)
        else:
            vision = build_vision(settings.vision, device, dtype, settings.offline)
            decoder = load_local_decoder(settings, device, dtype)
            projector = build_projector(settings, vision.hidden_size, decoder.hidden_size,
                                        vision.num_tokens).to(device, dtype)
        if with_retrieval if with_retrieval is not None else settings.retrieval.enabled:
            from .retrieval import Retriever, ensure_default_index

            ensure_default_index(settings.retrieval, progress=progress)
            retriever = Retriever.open(settings.retrieval)
        return cls(settings, vision, projector, decoder, retriever)

    # --- image -------------------------------------------------------------------------------

    def image_tokens(self, image: np.ndarray, digest: str | None = None) -> torch.Tensor:
        """Projected image tokens (1, N, d_l), cached by pixel content (the window is in the pixels);
        `digest` is image_digest(image) when the caller has it already."""
        key = digest or image_digest(image)
        tokens = self.image_token_cache.get(key)
        if tokens is None:
            self.encoder_calls += 1
            with torch.inference_mode():
                features = self.vision.encode(self.vision.preprocess([image]))  # (1, N, d_v)
                tokens = self.projector(features.to(self.projector.linear_1.weight.dtype))  # (1, N, d_l)
            self.image_token_cache.put(key, tokens)
        return tokens

    def new_conversation(self, scan) -> Conversation:
        return Conversation.from_scan(scan)

    def end_conversation(self, conversation: Conversation, *, keep_image: bool = False) -> None:
        """Drop the conversation's decoder cache and its scan's projected image tokens. With llama.cpp
        the cache lives in slots shared by content, and the scan's keys/values are dropped from them
        too. `keep_image` keeps the image tokens and the slots' keys/values (a caller asking one
        question at a time about the same image, as the evaluation does)."""
        self.prefix_cache.pop(conversation.id)
        if keep_image or conversation.image is None:
            return
        digest = conversation.digest
        self.image_token_cache.pop(digest)
        if isinstance(self.decoder, LlamaCppDecoder):
            self.decoder.forget(self._image_key(digest))

    # --- retrieval -----------------------------------------------------------------------------

    def retrieve(self, question: str, safe_meta: dict | None = None) -> list:
        if self.retriever is None:
            return []
        return self.retriever.search(question, self.settings.retrieval.top_k, safe_meta=safe_meta)

    # --- answering -------------------------------------------------------------------------------

    def ask(self, conversation: Conversation, question: str, *, use_retrieval: bool = True,
            safe_meta: dict | None = None, max_new_tokens: int | None = None,
            constrained: bool | None = None, warm: bool = True) -> Iterator[Sources | Token | Done]:
        """Answer `question` about the conversation's image, streaming; history is updated at the end.

        With `warm` (and `decoder.warm_next_turn`), iterating past Done prefills the start of the
        next turn (see warm_next_turn); a one-shot caller passes warm=False."""
        question = question.strip()
        if not question:
            raise ValueError("Please type a question about the image.")
        timings: dict[str, float] = {}
        start = time.perf_counter()
        in_prompt = self.passages_in_prompt(question)

        def sources() -> Sources:
            nonlocal passages
            began = time.perf_counter()
            passages = self.retrieve(question, safe_meta) if use_retrieval else []
            timings["retrieval_s"] = time.perf_counter() - began
            note = "" if passages else ("No literature passage was relevant enough to cite."
                                        if use_retrieval and self.retriever is not None else "Retrieval is off.")
            return Sources(passages, note, in_prompt)

        # Passages the decoder reads are found first; passages shown only as related literature are
        # found after the answer, so they do not delay its first word.
        passages: list = []
        if in_prompt:
            yield sources()

        prompt_passages = passages if in_prompt else []
        if constrained is None:
            constrained = self.settings.decoder.constrained_closed
        if isinstance(self.decoder, RemoteDecoder):
            messages = self.prompts.messages(question, conversation.history, prompt_passages,
                                             self._prompt_window(conversation))
            pieces = self.decoder.stream(messages, conversation.image, max_new_tokens)
        else:
            prompt = self.prompts.build(question, conversation.history, prompt_passages,
                                        self._prompt_window(conversation))
            if prompt_passages:
                passages = passages[:len(passages) - prompt.dropped_passages]
                prompt_passages = passages
            timings["prompt_tokens"] = len(prompt)
            candidates = closed_candidates(question) if constrained else None
            pieces = self._generate_local(conversation, prompt, candidates, max_new_tokens, timings)
        answer_parts = []
        for piece in pieces:
            if not answer_parts:
                timings["ttft_s"] = time.perf_counter() - start
            answer_parts.append(piece)
            yield Token(piece)
        answer = "".join(answer_parts).strip()
        timings.setdefault("ttft_s", time.perf_counter() - start)
        if not in_prompt:
            yield sources()
        timings["total_s"] = time.perf_counter() - start
        conversation.history.append(Turn(question, answer, prompt_passages))
        yield Done(answer, passages, conversation.window, timings, in_prompt)
        # Runs once the caller has taken Done (and shown the whole answer): while the clinician reads
        # and types, the decoder caches the start of the next turn, so the next question only has its
        # own words to prefill.
        if warm and self.settings.decoder.warm_next_turn and not isinstance(self.decoder, RemoteDecoder):
            self.warm_next_turn(conversation)

    def _prompt_window(self, conversation: Conversation) -> str:
        return conversation.window if self.settings.decoder.window_in_prompt else ""

    def _keyed_ids(self, digest: str, token_ids: list[int], image_mask: list[bool]) -> list[int]:
        """Prompt ids with each image slot replaced by a key of the image's pixels (`digest`), so a
        cache built on other pixels never matches."""
        image_key = self._image_key(digest)
        return [image_key if masked else token for token, masked in zip(token_ids, image_mask)]

    @staticmethod
    def _image_key(digest: str) -> int:
        return -2 - int(digest[:12], 16)  # negative: never a token id

    def warm_next_turn(self, conversation: Conversation, draft: str = "") -> int:
        """Extend the conversation's decoder cache with the part of the next prompt that does not
        depend on the next question (the last answer as the template renders it, end of turn, the
        next user header); returns how many prompt tokens are now cached (0 if nothing was done).

        Before the first question it caches the system prompt, the image tokens and the user header:
        the app calls it when a scan is shown, so the first question, too, has only its own words to
        prefill (the vision encoder has run by then as well).

        With `draft` (the question as typed so far) it caches the whole prompt for that question but
        its last token: asked as it stands, the question then has one token left to prefill; edited,
        the cache is cut back to where the prompts part and only the rest runs. Not when passages go
        into the prompt: they come before the question and are not known until it is asked."""
        if isinstance(self.decoder, RemoteDecoder):
            return 0  # the server keeps its own cache
        window = self._prompt_window(conversation)
        draft = draft.strip()
        if len(draft) > 8 * self.settings.decoder.context_window:
            return 0  # far too long to ask (the question will say so): not worth tokenising per keystroke
        if draft and not self.passages_in_prompt(draft):
            try:
                prompt = self.prompts.build(draft, conversation.history, (), window)
            except ValueError:
                return 0  # too long to ask: the question will say so
            if prompt.dropped_turns:
                return 0
            length = len(prompt) - 1  # the question's last token runs when it is asked, for the logits
            token_ids, image_mask = prompt.token_ids[:length], prompt.image_mask[:length]
        else:
            # Two prompts that differ only in the question share exactly the question-independent part.
            first = self.prompts.build("a", conversation.history, (), window)
            second = self.prompts.build("b", conversation.history, (), window)
            if first.dropped_turns:
                return 0  # the next prompt is cut differently anyway
            length = 0
            while (length < min(len(first), len(second))
                   and first.token_ids[length] == second.token_ids[length]):
                length += 1
            token_ids, image_mask = first.token_ids[:length], first.image_mask[:length]
        digest = conversation.digest
        keyed_ids = self._keyed_ids(digest, token_ids, image_mask)
        if isinstance(self.decoder, LlamaCppDecoder):
            image_tokens = self.image_tokens(conversation.image, digest)[0].float().cpu().numpy()
            self.decoder.extend(keyed_ids, token_ids, image_mask, image_tokens)
            return length
        cache, reused = self._reusable_prefix(conversation.id, keyed_ids)
        embeds = self._prompt_embeddings(conversation.image, token_ids, image_mask, digest)
        _, cache = self.decoder.prefill(embeds[:, reused:], cache, reused)
        self.prefix_cache.put(conversation.id, _PrefixState(keyed_ids, cache))
        return length

    def _generate_local(self, conversation: Conversation, prompt, candidates: list[str] | None,
                        max_new_tokens: int | None, timings: dict) -> Iterator[str]:
        digest = conversation.digest  # cache keys and prefix keys
        if candidates:
            # Closed question: the best of the options it names (structured output), no free text.
            yield self.choose_closed(conversation.image, prompt, candidates, digest)
            return
        keyed_ids = self._keyed_ids(digest, prompt.token_ids, prompt.image_mask)
        if isinstance(self.decoder, LlamaCppDecoder):
            # llama.cpp takes the image tokens as embeddings and keeps its own prefix cache.
            image_tokens = self.image_tokens(conversation.image, digest)[0].float().cpu().numpy()  # (N, d_l)
            yield from self.decoder.stream(keyed_ids, prompt.token_ids, prompt.image_mask, image_tokens,
                                           max_new_tokens=max_new_tokens, seed=self.settings.seed, timings=timings)
            return
        embeds = self._prompt_embeddings(conversation.image, prompt.token_ids, prompt.image_mask, digest)
        cache, reused = self._reusable_prefix(conversation.id, keyed_ids)
        timings["reused_tokens"] = reused
        result = GenerationResult()
        yield from self.decoder.stream(embeds[:, reused:], cache=cache, cache_length=reused,
                                       max_new_tokens=max_new_tokens, result=result, seed=self.settings.seed)
        if result.cache is not None:
            # The cache holds every generated token that was fed back: all of them when the answer
            # ended at its end-of-turn token, all but the last when it hit the length limit.
            fed = result.cache_length - len(keyed_ids)
            self.prefix_cache.put(conversation.id, _PrefixState(keyed_ids + result.token_ids[:fed], result.cache))

    def option_scores(self, image: np.ndarray, prompt, forms: list[str], digest: str | None = None) -> list[float]:
        """Mean token log-probability of each complete answer in `forms` after `prompt` with `image`."""
        digest = digest or image_digest(image)
        if isinstance(self.decoder, LlamaCppDecoder):
            keyed_ids = self._keyed_ids(digest, prompt.token_ids, prompt.image_mask)
            image_tokens = self.image_tokens(image, digest)[0].float().cpu().numpy()  # (N, d_l)
            return self.decoder.choose_answer(keyed_ids, prompt.token_ids, prompt.image_mask, image_tokens, forms)[1]
        embeds = self._prompt_embeddings(image, prompt.token_ids, prompt.image_mask, digest)
        return self.decoder.choose_answer(embeds, forms)[1]

    def choose_closed(self, image: np.ndarray, prompt, options: list[str], digest: str | None = None,
                      contrast: float | None = None, yes_bias: float | None = None) -> str:
        """The option with the best score, each option scored in its best spelling (surface_forms);
        "Yes" gets `decoder.yes_bias` added (see scripts/tune_closed.py).

        With `decoder.closed_contrast` = c > 0 an option's score is s(image) - c * s(blank image): the
        answer the decoder would give without looking (its prior for the question, as taught by the
        blank images of training's image drop) counts against itself, which makes the image decide
        more (the idea of visual contrastive decoding, Leng et al. 2024, applied to option scores)."""
        contrast = self.settings.decoder.closed_contrast if contrast is None else contrast
        yes_bias = self.settings.decoder.yes_bias if yes_bias is None else yes_bias
        forms = [form for option in options for form in surface_forms(option)]
        scores = np.asarray(self.option_scores(image, prompt, forms, digest))
        if contrast:
            scores = scores - contrast * np.asarray(self.option_scores(BLANK_IMAGE, prompt, forms, BLANK_DIGEST))
        scores = scores + yes_bias * np.asarray([form == "Yes" for form in forms])
        return forms[int(np.argmax(scores))]

    def passages_in_prompt(self, question: str) -> bool:
        """Whether retrieved passages go into the decoder's prompt (they are always shown to the user).

        `retrieval.prompt_gate`: "always"; "open" keeps them out of closed (yes/no, either/or) questions;
        "never" shows them as related literature only. The offline profile's 135M decoder, trained
        without passages, answers worse with them in its prompt (scripts/evaluate.py), so it uses "never".
        """
        gate = self.settings.retrieval.prompt_gate
        if gate not in ("always", "open", "never"):
            raise ValueError(f"retrieval.prompt_gate must be always, open or never, not {gate!r}")
        return gate == "always" or (gate == "open" and closed_candidates(question) is None)

    def answer(self, image: np.ndarray, question: str, *, use_retrieval: bool = True,
               constrained: bool | None = None, window: str = "",
               max_new_tokens: int | None = None) -> tuple[str, list]:
        """One-shot answer to a single question (evaluation); returns (answer, passages retrieved)."""
        conversation = Conversation(image=image, window=window)
        done = None
        for event in self.ask(conversation, question, use_retrieval=use_retrieval, constrained=constrained,
                              max_new_tokens=max_new_tokens, warm=False):
            if isinstance(event, Done):
                done = event
        # The next call is often about the same image (the evaluation goes image by image): llama.cpp's
        # slots keep its keys/values for it, bounded by the slot count.
        self.end_conversation(conversation, keep_image=True)
        return done.answer, done.passages

    def _prompt_embeddings(self, image: np.ndarray, token_ids: list[int], image_mask: list[bool],
                           digest: str | None = None) -> torch.Tensor:
        with torch.inference_mode():
            text = self.decoder.embed(token_ids)  # (1, T, d_l)
            mask = torch.tensor(image_mask, device=text.device).unsqueeze(0)  # (1, T)
            return merge_image_features(text, mask, self.image_tokens(image, digest).to(text.device))

    def _reusable_prefix(self, conversation_id: str, keyed_ids: list[int]):
        """The conversation's cache cropped to the prefix it shares with this prompt (at least one
        prompt token is always left to run, so there are logits to start from)."""
        state = self.prefix_cache.get(conversation_id)
        if state is None:
            return None, 0
        shared = 0
        limit = min(len(state.ids), len(keyed_ids) - 1)
        while shared < limit and state.ids[shared] == keyed_ids[shared]:
            shared += 1
        if shared == 0:
            return None, 0
        self.prefix_cache.pop(conversation_id)  # the cache is extended in place from here on
        state.cache.crop(shared - len(state.ids))  # a negative count removes that many tokens
        return state.cache, shared


def image_digest(image: np.ndarray) -> str:
    """Content key of an image's pixels (and shape): the image-token cache and prefix caches use it."""
    return hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest() + f":{image.shape}"


# The image training shows when it drops the image (scripts/train_projector.py --drop-image).
BLANK_IMAGE = np.zeros((64, 64, 3), dtype=np.uint8)
BLANK_IMAGE.setflags(write=False)
BLANK_DIGEST = image_digest(BLANK_IMAGE)


def choose_engine(settings: Settings) -> str:
    """"auto" means llama.cpp when it is installed and the decoder is a GGUF file, else transformers."""
    engine = settings.decoder.engine
    if engine == "auto":
        is_gguf = resolve_path(settings.decoder.name_or_path).endswith(".gguf")
        engine = "llama.cpp" if is_gguf and llama_cpp_available() else "transformers"
    return engine


def engine_label(settings: Settings) -> str:
    """The engine that answers, as results are named by it: "llama.cpp-Q8_0" when llama.cpp runs the
    GGUF re-encoded (decoder.llama_cpp_type), since its answers differ from the shipped file's."""
    engine = choose_engine(settings)
    if engine == "llama.cpp" and settings.decoder.llama_cpp_type:
        engine += f"-{settings.decoder.llama_cpp_type.upper()}"
    return engine


def load_local_decoder(settings: Settings, device: torch.device, dtype: torch.dtype):
    engine = choose_engine(settings)
    if engine == "llama.cpp":
        from transformers import AutoTokenizer

        gguf = resolve_path(settings.decoder.name_or_path)
        if not gguf.endswith(".gguf"):
            raise ValueError(f"The llama.cpp engine needs a GGUF decoder file, not {gguf!r}; convert the model "
                             f"with llama.cpp's convert_hf_to_gguf.py first.")
        # The tokenizer of the converted folder: the same ids the projector was trained with.
        tokenizer = AutoTokenizer.from_pretrained(resolve_decoder_folder(settings.decoder, settings.cache_dir))
        gguf = requantized_gguf(gguf, settings.decoder.llama_cpp_type, settings.cache_dir)
        return LlamaCppDecoder(gguf, tokenizer, settings.decoder, n_threads=torch.get_num_threads())
    if engine != "transformers":
        raise ValueError(f"Unknown decoder engine {engine!r}; use auto, transformers, llama.cpp or openai.")
    return Decoder.load(settings.decoder, device, dtype, settings.cache_dir, settings.offline, settings.profile)


def build_projector(settings: Settings, vision_size: int, text_size: int, image_tokens: int = 0) -> Projector:
    config = settings.projector
    projector = Projector(vision_size, config.hidden_size, text_size, config.normalize_input)
    projector.image_position = config.image_position
    weights = config.weights
    if weights and not weights.startswith("hub:"):
        from pathlib import Path

        if Path(weights).is_file():
            from .projector import read_metadata

            meta = read_metadata(weights)
            trained_tokens = meta.get("image_tokens")
            if image_tokens and trained_tokens and int(trained_tokens) != image_tokens:
                from .projector import ProjectorShapeError

                raise ProjectorShapeError(
                    f"{weights} was trained on {trained_tokens} image tokens but the {settings.profile!r} "
                    f"profile's encoder gives {image_tokens}; set vision.pooled_tokens to {trained_tokens}.")
            projector.normalize_input = bool(meta.get("normalize_input", config.normalize_input))
            projector.image_position = str(meta.get("image_position", config.image_position))
            projector.load(weights)
        else:
            log.warning("Projector weights %s not found: answering with an untrained projector. "
                        "Train one with scripts/train_projector.py.", weights)
    elif weights.startswith("hub:"):
        from .projector import convert_llava_med_projector
        from huggingface_hub import hf_hub_download, list_repo_files
        from pathlib import Path

        repo = weights[len("hub:"):]
        target = Path(settings.cache_dir) / "projectors" / (repo.replace("/", "--") + ".safetensors")
        if not target.is_file():
            shards = [hf_hub_download(repo, name, local_files_only=settings.offline)
                      for name in list_repo_files(repo) if name.endswith(".safetensors")]
            convert_llava_med_projector(shards, target)
        projector.load(target)
    projector.requires_grad_(True)
    return projector
