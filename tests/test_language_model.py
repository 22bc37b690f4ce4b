"""Loading the frozen decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from medvqa.config import load_settings
from medvqa.model import embed_prompt, merge_image_features
from medvqa.pipeline import Conversation, Done, Sources, Token
from medvqa.projector import PREFIX, Projector, ProjectorShapeError, map_llava_med_projector

from .conftest import prompt_gate, require_shared_data


def _image(seed: int = 0, shape=(48, 40)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def test_missing_model_gives_one_clear_message(tmp_path):
    from medvqa.language_model import LanguageModel, ModelMissingError

    settings = load_settings("llava-med", env={"MEDVQA_CACHE": str(tmp_path)})
    with pytest.raises(ModelMissingError, match="llava-med.*not available locally"):
        LanguageModel.load(settings.decoder, torch.device("cpu"), torch.float32, tmp_path, offline=True,
                     profile="llava-med")


def test_two_first_conversions_at_once_leave_one_whole_folder(tmp_path, monkeypatch):
    """A trainer and the app starting together both convert the GGUF; each writes its own partial
    folder, and whichever finishes second keeps the first one's whole copy."""
    import transformers

    from medvqa import language_model

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: "tokenizer")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: "model")
    target = language_model.derived_decoder_path(gguf, tmp_path / "cache")
    written = []

    def save(model, tokenizer, folder):
        folder.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (folder / name).write_text(str(len(written)))
        written.append(folder)
        if len(written) == 1:  # while this one wrote, another process finished its own conversion
            target.mkdir(parents=True)
            for name in ("config.json", "model.safetensors"):
                (target / name).write_text("other")

    monkeypatch.setattr(language_model, "save_plain_copy", save)
    assert language_model.convert_gguf(str(gguf), tmp_path / "cache") == target
    assert (target / "config.json").read_text() == "other"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no partial folder left
    assert written[0].name != target.name + ".partial"  # the partial folder is this process's own
