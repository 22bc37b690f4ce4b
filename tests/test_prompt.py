"""Prompt assembly: the context budget."""

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


def test_context_budget_drops_old_turns_not_the_question(tiny_pipeline):
    from medvqa.prompt import Turn

    builder = tiny_pipeline.prompts
    history = [Turn("What is shown? " * 30, "An image. " * 30) for _ in range(10)]
    prompt = builder.build("Is there an effusion?", history)
    assert prompt.dropped_turns > 0
    assert len(prompt) <= builder.context_window - builder.reserve_for_answer
    assert sum(prompt.image_mask) == tiny_pipeline.model.vision.num_tokens  # the image survives
    assert "Is there an effusion?" in prompt.text
    with pytest.raises(ValueError, match="too long"):
        builder.build("why " * 5000)
