"""The LLaVA checkpoint export: same logits as ours, and a clear refusal for a CNN encoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medvqa.model import embed_prompt


def _image(seed: int = 0, shape=(48, 40)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def test_export_matches_our_logits(tiny_pipeline, tmp_path):
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    from medvqa.hf_export import export_llava

    language_model = tiny_pipeline.engine.language_model
    folder = export_llava(tiny_pipeline.model, language_model, tmp_path / "llava", "tiny", dtype=torch.float32)
    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    processor = LlavaProcessor.from_pretrained(folder)
    image = _image(7, shape=(32, 32))
    prompt = tiny_pipeline.prompts.build("Is there an effusion?")
    ours_embeds = embed_prompt(language_model.embed, prompt.token_ids, prompt.image_mask,
                               lambda: tiny_pipeline.model.image_tokens(image))
    with torch.no_grad():
        ours = language_model(ours_embeds).logits
        ids = torch.tensor([[model.config.image_token_index if m else t
                             for t, m in zip(prompt.token_ids, prompt.image_mask)]])
        pixels = tiny_pipeline.model.vision.preprocess([image])
        theirs = model(input_ids=ids, pixel_values=pixels).logits
        # The exported processor turns the same square image into the same pixel values.
        processed = processor.image_processor(images=image, return_tensors="pt")["pixel_values"]
    vocab = ours.shape[-1]
    torch.testing.assert_close(theirs[..., :vocab], ours, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(processed, pixels, atol=2e-2, rtol=0)


def test_offline_profile_export_says_why_not():
    from medvqa.hf_export import ExportError, export_llava

    class CnnModel:  # only the encoder type matters for this refusal
        vision = object()
        projector = None

    with pytest.raises(ExportError, match="no Hugging Face LLaVA form"):
        export_llava(CnnModel(), None, "/nonexistent", "offline")


def test_export_refuses_a_projector_trained_with_the_image_after_the_question(tiny_pipeline, tmp_path, monkeypatch):
    from medvqa.hf_export import ExportError, export_llava

    monkeypatch.setattr(tiny_pipeline.model.projector, "image_position", "after")
    with pytest.raises(ExportError, match="image after the question"):
        export_llava(tiny_pipeline.model, tiny_pipeline.engine.language_model, tmp_path / "llava", "tiny")
    assert not (tmp_path / "llava").exists()  # refused before anything is written
