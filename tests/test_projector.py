"""The projector file: exact round trip, clear shape errors, LLaVA-Med's layout, retired variants."""

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


def test_projector_save_load_round_trip_is_exact(tmp_path):
    projector = Projector(32, 24, 48)
    path = tmp_path / "projector.safetensors"
    projector.save(path)
    other = Projector(32, 24, 48).load(path)
    for name, tensor in projector.state_dict().items():
        assert torch.equal(tensor, other.state_dict()[name])


def test_wrong_shape_projector_file_fails_clearly(tmp_path):
    path = tmp_path / "projector.safetensors"
    Projector(32, 16, 48).save(path)
    with pytest.raises(ProjectorShapeError, match=r"linear_1\.(weight|bias) has shape \(16.*expected \(24"):
        Projector(32, 24, 48).load(path)


def test_llava_med_projector_keys_map_to_ours(tmp_path):
    """A tiny checkpoint in LLaVA-Med's layout (model.mm_projector.0/.2) loads into our projector."""
    from medvqa.projector import convert_llava_med_projector

    torch.manual_seed(0)
    theirs = {"model.mm_projector.0.weight": torch.randn(24, 32), "model.mm_projector.0.bias": torch.randn(24),
              "model.mm_projector.2.weight": torch.randn(48, 24), "model.mm_projector.2.bias": torch.randn(48),
              "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4)}
    shard = tmp_path / "model-00001-of-00001.safetensors"
    save_file(theirs, str(shard))
    ours = convert_llava_med_projector([shard], tmp_path / "projector.safetensors")
    projector = Projector(32, 24, 48).load(ours)
    assert torch.equal(projector.linear_1.weight, theirs["model.mm_projector.0.weight"])
    assert torch.equal(projector.linear_2.bias, theirs["model.mm_projector.2.bias"])
    assert set(map_llava_med_projector(theirs)) == {PREFIX + k for k in projector.state_dict()}


def test_a_projector_file_of_a_retired_variant_is_refused(tmp_path):
    """Input normalisation was measured worse and removed: a file trained that way would be read
    wrong, so it is refused with a message, not loaded; so is an image position this code does not
    know. The image after the question loads, and the projector says so (the prompt follows it)."""
    path = tmp_path / "projector.safetensors"
    Projector(32, 24, 48).save(path, metadata={"normalize_input": True})
    with pytest.raises(ProjectorShapeError, match="retired variant"):
        Projector(32, 24, 48).load(path)
    Projector(32, 24, 48).save(path, metadata={"image_position": "middle"})
    with pytest.raises(ProjectorShapeError, match="'middle'"):
        Projector(32, 24, 48).load(path)
    Projector(32, 24, 48).save(path, metadata={"image_position": "after"})
    assert Projector(32, 24, 48).load(path).image_position == "after"
    Projector(32, 24, 48).save(path)
    assert Projector(32, 24, 48).load(path).image_position == "before"
