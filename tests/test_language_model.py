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
