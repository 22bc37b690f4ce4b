"""The LLaVA composition: vision tower → projector → the decoder's input embeddings.

    model = VisionLanguageModel.load(settings, device, dtype, text_size=engine.hidden_size)
    tokens = model.image_tokens(image)                                    # (1, N, d_l), cached
    embeds = embed_prompt(language_model.embed, ids, image_mask, lambda: tokens)   # (1, T, d_l)

The pipeline, training and the LLaVA export all go through here, so "image → projected tokens →
merged prompt" is written once, with the token-count check in one place (`merge_image_features`).
The decoder itself is run by an engine (medvqa/engines/); an engine that takes token ids and image
embeddings separately (llama.cpp) gets the projected tokens from `image_tokens` too.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from .cache import LRU
from .config import Settings, resolve_path
from .projector import Projector, ProjectorShapeError, read_metadata
from .vision import VisionEncoder, build_vision, check_encoder_file, encoder_sha256

log = logging.getLogger(__name__)


def image_digest(image: np.ndarray) -> str:
    """Content key of an image's pixels (and shape): image-token, feature and prefix caches use it."""
    return hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest() + f":{image.shape}"


def image_key(digest: str) -> int:
    """The image as one negative id (never a token id): prefix caches key image positions by it."""
    return -2 - int(digest[:12], 16)


# The image training shows when it drops the image (scripts/train_projector.py --drop-image), and the
# evaluation's blank-image condition.
BLANK_IMAGE = np.zeros((64, 64, 3), dtype=np.uint8)
BLANK_IMAGE.setflags(write=False)
BLANK_DIGEST = image_digest(BLANK_IMAGE)


class VisionLanguageModel(nn.Module):
    """The frozen vision tower and the trained projector, with a bounded cache of projected image
    tokens keyed by pixel content (the window is in the pixels)."""

    def __init__(self, vision: VisionEncoder, projector: Projector, cache_size: int = 64):
        super().__init__()
        self.vision = vision
        self.projector = projector
        self.token_cache = LRU(cache_size)
        # The encoder's own tokens (before the projector), for the answer head (medvqa/answer_head.py);
        # with keep_features, image_tokens keeps them too, so an image is encoded once for both.
        self.feature_cache = LRU(cache_size)
        self.keep_features = False
        self.encoder_calls = 0  # how often the vision encoder actually ran (cache misses)

    @classmethod
    def load(cls, settings: Settings, device: torch.device, dtype: torch.dtype, text_size: int) -> "VisionLanguageModel":
        vision = build_vision(settings.vision, device, dtype, settings.offline)
        projector = build_projector(settings, vision.hidden_size, text_size, vision.num_tokens).to(device, dtype)
        return cls(vision, projector)

    @property
    def num_image_tokens(self) -> int:
        return self.vision.num_tokens

    def image_features(self, images: list[np.ndarray]) -> torch.Tensor:
        """Projected image tokens (B, N, d_l) of RGB uint8 images, uncached."""
        with torch.inference_mode():
            features = self.vision.encode(self.vision.preprocess(images))  # (B, N, d_v)
            return self.projector(features.to(self.projector.dtype))  # (B, N, d_l)

    def image_tokens(self, image: np.ndarray, digest: str | None = None) -> torch.Tensor:
        """Projected image tokens (1, N, d_l), cached by content; `digest` is image_digest(image)
        when the caller has it already."""
        key = digest or image_digest(image)
        tokens = self.token_cache.get(key)
        if tokens is None:
            features = self.feature_cache.get(key)  # encoded already for the answer head
            if features is None and not self.keep_features:
                self.encoder_calls += 1
                tokens = self.image_features([image])
            else:
                features = self.vision_tokens(image, key) if features is None else features
                with torch.inference_mode():
                    tokens = self.projector(features.to(self.projector.dtype))
            self.token_cache.put(key, tokens)
        return tokens

    def vision_tokens(self, image: np.ndarray, digest: str | None = None) -> torch.Tensor:
        """The encoder's tokens (1, N, d_v) before the projector, cached by content (an image whose
        projected tokens were cached without keep_features is encoded again, once, for these)."""
        key = digest or image_digest(image)
        features = self.feature_cache.get(key)
        if features is None:
            self.encoder_calls += 1
            with torch.inference_mode():
                features = self.vision.encode(self.vision.preprocess([image]))
            self.feature_cache.put(key, features)
        return features

    def forget_image(self, digest: str) -> None:
        self.token_cache.pop(digest)
        self.feature_cache.pop(digest)


def merge_image_features(text_embeds: torch.Tensor, image_mask: torch.Tensor,
                         image_features: torch.Tensor) -> torch.Tensor:
    """Place image features at the flagged positions.

    text_embeds (B, T, d), image_mask (B, T) bool, image_features (B, N, d): every row must flag
    exactly N positions, or the prompt and image disagree and we refuse rather than guess.
    """
    flagged = image_mask.sum(dim=1)
    expected = image_features.shape[1]
    if not bool((flagged == expected).all()):
        raise ValueError(f"The prompt has {flagged.tolist()} image positions but the image has "
                         f"{expected} tokens per row; they must match exactly.")
    merged = text_embeds.clone()
    merged[image_mask] = image_features.reshape(-1, image_features.shape[-1]).to(merged.dtype)
    return merged


def embed_prompt(embed_tokens: Callable[[list[int]], torch.Tensor], token_ids: list[int], image_mask: list[bool],
                 image_tokens: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    """Input embeddings (1, T, d_l) of a prompt: the decoder's embeddings of its token ids, with the
    projected image tokens (from `image_tokens()`, asked for only when the prompt has image
    positions) at the flagged positions."""
    text = embed_tokens(token_ids)  # (1, T, d_l)
    if not any(image_mask):
        return text
    mask = torch.tensor(image_mask, device=text.device).unsqueeze(0)  # (1, T)
    return merge_image_features(text, mask, image_tokens().to(text.device))


def build_projector(settings: Settings, vision_size: int, text_size: int, image_tokens: int = 0) -> Projector:
    """The profile's projector: the trained file (checked against the encoder and its token count),
    LLaVA-Med's weights mapped from the hub checkpoint, or untrained when none is named."""
    config = settings.projector
    projector = Projector(vision_size, config.hidden_size, text_size)
    weights = config.weights
    if weights.startswith("hub:"):
        projector.load(_hub_projector(weights[len("hub:"):], settings))
    elif weights:
        metadata = checked_projector_file(settings)
        trained_tokens = metadata.get("image_tokens")
        if image_tokens and trained_tokens and int(trained_tokens) != image_tokens:
            raise ProjectorShapeError(
                f"{weights} was trained on {trained_tokens} image tokens but the {settings.profile!r} "
                f"profile's encoder gives {image_tokens}; set vision.pooled_tokens to {trained_tokens}.")
        projector.load(weights)
    projector.requires_grad_(True)
    return projector


def checked_projector_file(settings: Settings) -> dict:
    """The metadata of the profile's trained projector file, after refusing one that is absent (answers
    from an untrained projector would be guesses), unreadable, or trained on another encoder's features."""
    from .language_model import ModelMissingError

    weights = settings.projector.weights
    if not Path(weights).is_file():
        raise ModelMissingError(f"The projector weights {weights} were not found (projector.weights); train them "
                                "with scripts/train_projector.py, or set projector.weights to \"\" to run an "
                                "untrained projector (for tests only).")
    metadata = read_metadata(weights)  # ModelFileError when cut short or damaged
    # A projector maps one encoder's features: another encoder of the same width would load and
    # answer from features it never saw. Files that record their encoder are checked against it.
    trained_encoder = metadata.get("encoder_sha256")
    if trained_encoder and (current := encoder_sha256(settings.vision)) != trained_encoder:
        raise ProjectorShapeError(
            f"{weights} was trained on the features of encoder {trained_encoder[:12]}… but the "
            f"{settings.profile!r} profile's encoder ({settings.vision.name_or_path}) is "
            f"{f'{current[:12]}…' if current else 'not a single weights file'}; set vision.name_or_path "
            f"to the encoder it was trained with, or retrain it with scripts/train_projector.py.")
    return metadata


def check_weight_files(settings: Settings) -> None:
    """Refuse, before the decoder's slow load (minutes on a first start), a profile whose EfficientNet
    encoder or trained projector file is absent, cut short, or (the projector) another encoder's."""
    vision = settings.vision
    if vision.kind == "efficientnet_lite0" and not vision.name_or_path.startswith("tiny:"):
        check_encoder_file(resolve_path(vision.name_or_path))
    weights = settings.projector.weights
    if weights and not weights.startswith("hub:"):
        checked_projector_file(settings)


def _hub_projector(repo: str, settings: Settings) -> Path:
    """LLaVA-Med's projector pulled out of its hub checkpoint once, into the cache folder."""
    from huggingface_hub import hf_hub_download, list_repo_files

    from .projector import convert_llava_med_projector

    target = Path(settings.cache_dir) / "projectors" / (repo.replace("/", "--") + ".safetensors")
    if not target.is_file():
        shards = [hf_hub_download(repo, name, local_files_only=settings.offline)
                  for name in list_repo_files(repo) if name.endswith(".safetensors")]
        convert_llava_med_projector(shards, target)
    return target
