"""The trained two-layer GELU projector: image features (d_v) -> decoder embeddings (d_l).

The only module of the VQA model with trainable parameters. Its weights are stored as safetensors
under the Hugging Face LLaVA key names `multi_modal_projector.linear_1.*` / `linear_2.*`, so an
exported checkpoint needs no renaming.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .prompt import IMAGE_POSITIONS

PREFIX = "multi_modal_projector."


class ProjectorShapeError(ValueError):
    """A projector file does not fit the configured encoder/decoder widths."""


class Projector(nn.Module):
    def __init__(self, vision_size: int, hidden_size: int, text_size: int):
        super().__init__()
        self.linear_1 = nn.Linear(vision_size, hidden_size)
        self.act = nn.GELU()  # exact (erf) GELU, as Hugging Face's "gelu"
        self.linear_2 = nn.Linear(hidden_size, text_size)
        # Where the prompt puts the image it was trained with (prompt.IMAGE_POSITIONS); a loaded file
        # says which, so the pipeline builds its prompts the same way.
        self.image_position = "before"
        # The SHA-256 of the file loaded (None until one is): a closed-answer calibration names the
        # projector it was fitted with, and the pipeline uses it only for that projector.
        self.sha256: str | None = None

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (B, N, d_v) -> (B, N, d_l)
        return self.linear_2(self.act(self.linear_1(features)))

    @property
    def dtype(self) -> torch.dtype:
        return self.linear_1.weight.dtype

    def save(self, path: str | Path, metadata: dict | None = None) -> None:
        tensors = {PREFIX + name: tensor.detach().to("cpu", torch.float32).contiguous()
                   for name, tensor in self.state_dict().items()}
        meta = {key: json.dumps(value) for key, value in (metadata or {}).items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    def load(self, path: str | Path) -> "Projector":
        """Load weights saved by `save` (or mapped from LLaVA-Med); shapes must match exactly."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Projector weights not found at {path}.")
        meta = _checked_metadata(path)
        with safe_open(str(path), framework="pt") as handle:
            state = {key[len(PREFIX):]: handle.get_tensor(key) for key in handle.keys() if key.startswith(PREFIX)}
        expected = self.state_dict()
        if set(state) != set(expected):
            raise ProjectorShapeError(
                f"{path} holds projector keys {sorted(state)}; expected {sorted(expected)} "
                f"(prefixed with {PREFIX!r}).")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ProjectorShapeError(
                    f"{path}: {PREFIX}{name} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(expected[name].shape)} (vision {self.linear_1.in_features} -> hidden "
                    f"{self.linear_1.out_features} -> text {self.linear_2.out_features}).")
        self.load_state_dict(state)
        self.image_position = meta.get("image_position", "before")
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        return self


def _checked_metadata(path: Path) -> dict:
    """The file's metadata, after refusing files trained with input normalisation (measured worse and
    removed, docs/experiments.md; such a file would be read wrong) or with an image position this
    code does not know."""
    meta = read_metadata(path)
    if meta.get("normalize_input") is True:
        raise ProjectorShapeError(
            f"{path} was trained with a retired variant (input normalisation); retrain it with "
            f"scripts/train_projector.py.")
    if meta.get("image_position", "before") not in IMAGE_POSITIONS:
        raise ProjectorShapeError(
            f"{path} was trained with the image at {meta['image_position']!r}; this version knows "
            f"{', '.join(IMAGE_POSITIONS)}.")
    return meta


def read_metadata(path: str | Path) -> dict:
    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
    except (OSError, SafetensorError) as error:  # cut short, damaged, or not safetensors at all
        from .language_model import ModelFileError

        raise ModelFileError(f"The projector weights {path} could not be read ({error}); retrain them with "
                             f"scripts/train_projector.py, or check out the shipped file again.") from error
    try:
        return {key: json.loads(value) for key, value in raw.items()}
    except ValueError:  # a safetensors file written by something else (its metadata is not this project's JSON)
        raise ProjectorShapeError(f"{path} is not a projector file of this project (its metadata is not JSON); "
                                  "train one with scripts/train_projector.py.") from None


def map_llava_med_projector(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LLaVA-Med v1.5 stores its projector as `model.mm_projector.{0,2}` (nn.Sequential with GELU at
    index 1); return the same tensors under our `multi_modal_projector.linear_{1,2}` names."""
    names = {"model.mm_projector.0.weight": "linear_1.weight", "model.mm_projector.0.bias": "linear_1.bias",
             "model.mm_projector.2.weight": "linear_2.weight", "model.mm_projector.2.bias": "linear_2.bias"}
    missing = [key for key in names if key not in state]
    if missing:
        raise ProjectorShapeError(f"LLaVA-Med checkpoint lacks projector tensors {missing}.")
    return {PREFIX + ours: state[theirs] for theirs, ours in names.items()}


def convert_llava_med_projector(checkpoint_files: list[str | Path], out_path: str | Path) -> Path:
    """Pull the projector out of LLaVA-Med's safetensors shards into our file layout."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith("model.mm_projector."):
                    state[key] = handle.get_tensor(key).to(torch.float32)
    mapped = map_llava_med_projector(state)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in mapped.items()}, str(out_path),
              metadata={"source": json.dumps("llava-med")})
    return Path(out_path)
