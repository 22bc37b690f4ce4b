"""The LLaVA composition on the tiny profile: frozen vision tower, trained projector, image tokens
merged at the prompt's image positions."""

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


def test_only_projector_is_trainable(tiny_pipeline):
    language_model = tiny_pipeline.engine.language_model
    trainable = {name for name, p in tiny_pipeline.model.vision.named_parameters() if p.requires_grad}
    trainable |= {name for name, p in language_model.named_parameters() if p.requires_grad}
    assert trainable == set()
    assert all(p.requires_grad for p in tiny_pipeline.model.projector.parameters())
    tiny_pipeline.model.vision.train()
    language_model.train()
    assert not tiny_pipeline.model.vision.training and not language_model.model.training


def test_vision_drops_cls_and_uses_penultimate_layer(tiny_pipeline):
    vision = tiny_pipeline.model.vision
    pixels = vision.preprocess([_image()])
    features = vision.encode(pixels)
    assert features.shape == (1, 16, 32)  # 32x32 input, 8x8 patches, CLS dropped
    with torch.no_grad():
        hidden = vision.tower(pixel_values=pixels, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, hidden[-2][:, 1:])


def test_image_tokens_land_at_placeholder(tiny_pipeline):
    prompt = tiny_pipeline.prompts.build("Is there an effusion?")
    n = tiny_pipeline.model.vision.num_tokens
    assert sum(prompt.image_mask) == n
    start = prompt.image_mask.index(True)
    assert prompt.image_mask[start:start + n] == [True] * n  # contiguous
    language_model = tiny_pipeline.engine.language_model
    image_tokens = tiny_pipeline.model.image_tokens(_image())
    embeds = embed_prompt(language_model.embed, prompt.token_ids, prompt.image_mask, lambda: image_tokens)
    torch.testing.assert_close(embeds[0, start:start + n], image_tokens[0])
    text = language_model.embed(prompt.token_ids)
    torch.testing.assert_close(embeds[0, :start], text[0, :start])
    torch.testing.assert_close(embeds[0, start + n:], text[0, start + n:])


def test_image_token_count_mismatch_is_refused():
    text = torch.zeros(1, 10, 4)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 2:5] = True
    with pytest.raises(ValueError, match="3.*image positions.*4 tokens"):
        merge_image_features(text, mask, torch.ones(1, 4, 4))


def test_changing_the_window_reencodes(tiny_pipeline):
    calls = tiny_pipeline.model.encoder_calls
    image = _image(5)
    tiny_pipeline.model.image_tokens(image)
    tiny_pipeline.model.image_tokens(image)
    tiny_pipeline.model.image_tokens(np.clip(image.astype(int) + 10, 0, 255).astype(np.uint8))
    assert tiny_pipeline.model.encoder_calls == calls + 2


def test_projector_trained_on_other_token_count_is_refused(tiny_settings, tmp_path):
    import copy

    from medvqa.model import build_projector

    path = tmp_path / "projector.safetensors"
    Projector(32, 24, 48).save(path, metadata={"image_tokens": 49})
    settings = copy.deepcopy(tiny_settings)
    settings.projector.weights = str(path)
    with pytest.raises(ProjectorShapeError, match="trained on 49 image tokens.*gives 16"):
        build_projector(settings, 32, 48, image_tokens=16)
    assert build_projector(settings, 32, 48, image_tokens=49) is not None


def test_projector_trained_on_another_encoder_is_refused(tiny_settings, tmp_path):
    """A projector file records the encoder weights it was trained on; another encoder of the same width
    (the ImageNet EfficientNet-Lite0 under the medical projector, say) is refused, not silently used."""
    import copy
    import hashlib

    from medvqa.config import VisionConfig, resolve_path
    from medvqa.model import build_projector
    from medvqa.vision import encoder_sha256

    settings = copy.deepcopy(tiny_settings)
    settings.vision = VisionConfig()  # the ImageNet EfficientNet-Lite0 from its package: one weights file
    imagenet = hashlib.sha256(open(resolve_path(settings.vision.name_or_path), "rb").read()).hexdigest()
    assert encoder_sha256(settings.vision) == imagenet
    assert encoder_sha256(tiny_settings.vision) is None  # the tiny CLIP is a folder: nothing recorded
    path = tmp_path / "projector.safetensors"
    settings.projector.weights = str(path)
    Projector(32, 24, 48).save(path, metadata={"image_tokens": 16, "encoder_sha256": "0" * 64})
    with pytest.raises(ProjectorShapeError, match=r"trained on the features of encoder 000000000000… but the "
                                                   r".* profile's encoder \(pkg:.*\) is " + imagenet[:12]):
        build_projector(settings, 32, 48, image_tokens=16)
    Projector(32, 24, 48).save(path, metadata={"image_tokens": 16, "encoder_sha256": imagenet})
    assert build_projector(settings, 32, 48, image_tokens=16).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    Projector(32, 24, 48).save(path, metadata={"image_tokens": 16})  # files from before the field: not checked
    assert build_projector(settings, 32, 48, image_tokens=16) is not None
