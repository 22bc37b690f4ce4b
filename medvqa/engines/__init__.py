"""Decoder engines behind one interface (base.Engine): which one runs is configuration.

- `transformers`: in process through `inputs_embeds` (training, CUDA, MPS, anywhere).
- `llama.cpp`: the decoder's GGUF through llama-cpp-python, image tokens fed as embeddings.
- `openai`: a remote OpenAI-compatible server (vLLM, SGLang) that runs the whole model.
"""

from __future__ import annotations

import torch

from ..config import Settings, resolve_path
from .base import Engine, EngineRequest

__all__ = ["Engine", "EngineRequest", "choose_engine", "engine_label", "llama_cpp_available", "load_engine"]


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


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


def load_engine(settings: Settings, device: torch.device, dtype: torch.dtype) -> Engine:
    """The profile's decoder, loaded by the engine the settings choose."""
    engine = choose_engine(settings)
    config = settings.decoder
    if engine == "openai":
        from ..vision import pad_fill_for
        from .openai import OpenAIEngine

        return OpenAIEngine(config, pad_fill=pad_fill_for(settings.vision))
    from ..language_model import LanguageModel, resolve_decoder_folder

    if engine == "llama.cpp":
        from transformers import AutoTokenizer

        from .llama_cpp import LlamaCppEngine, requantized_gguf

        gguf = resolve_path(config.name_or_path)
        if not gguf.endswith(".gguf"):
            raise ValueError(f"The llama.cpp engine needs a GGUF decoder file, not {gguf!r}; convert the model "
                             f"with llama.cpp's convert_hf_to_gguf.py first.")
        # The tokenizer of the converted folder: the same ids the projector was trained with.
        tokenizer = AutoTokenizer.from_pretrained(resolve_decoder_folder(config, settings.cache_dir))
        gguf = requantized_gguf(gguf, config.llama_cpp_type, settings.cache_dir)
        return LlamaCppEngine(gguf, tokenizer, config, n_threads=torch.get_num_threads(),
                              token_threads=config.llama_cpp_token_threads)
    from .transformers import TransformersEngine

    language_model = LanguageModel.load(config, device, dtype, settings.cache_dir, settings.offline, settings.profile)
    return TransformersEngine(language_model, config)
