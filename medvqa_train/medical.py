"""Training data for the offline encoder's medical stage (scripts/train_encoder.py).

Images from three public training sets, each keyed by the SHA-256 of its file's bytes (PathVQA's
rows repeat images under many file names; one copy is kept), with what each image can teach:

- SLAKE train: modality and body region from the question metadata; which organs are present, and
  in which cell of a 4 x 4 grid (the 16 tokens the decoder sees), from `detection.json` boxes;
- VQA-RAD train: body region (`image_organ`);
- PathVQA train: modality "pathology";
- every question of all three: its answer, for an answer head over frequent answers.

The hold-out is by image content: an image whose hash falls in the first `percent` of 100 buckets
is never trained on, by this script or by the projector scripts (`held_out_by_content`), so the
same images measure the encoder, the projector, `yes_bias` and the calibration.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from medvqa.answer_head import AnswerLayers
from medvqa.answers import normalise

MODALITIES = ("ct", "mri", "x-ray", "pathology")
REGIONS = ("head", "neck", "chest", "abdomen", "pelvis")
_SLAKE_REGION = {"Lung": "chest", "Abdomen": "abdomen", "Brain_Tissue": "head", "Brain": "head",
                 "Pelvic Cavity": "pelvis", "Chest_lung": "chest", "Brain_Face": "head", "Neck": "neck",
                 "Chest_heart": "chest", "Chest_mediastinal": "chest"}
_VQA_RAD_REGION = {"HEAD": "head", "CHEST": "chest", "ABD": "abdomen"}
GRID = 4  # organ cells: the 4 x 4 pooled token grid the offline decoder is given


def content_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def held_out_hash(digest: str, percent: float) -> bool:
    """Whether an image (by its content hash) belongs to the by-image hold-out of `percent` %."""
    return int(digest[:8], 16) % 10000 < percent * 100


@dataclass
class ImageRecord:
    key: str  # sha256 of the file
    path: Path
    source: str  # slake / vqa-rad / pathvqa
    modality: int = -1  # index in MODALITIES, -1 unknown
    region: int = -1  # index in REGIONS
    organs: dict[str, list[tuple[float, float, float, float]]] | None = None  # name -> boxes (x, y, w, h)
    questions: list[tuple[str, str, bool]] = field(default_factory=list)  # (question, answer, closed)


def _add(records: dict[str, ImageRecord], path: Path, source: str) -> ImageRecord:
    key = content_hash(path)
    if key not in records:
        records[key] = ImageRecord(key, path, source)
    return records[key]


def load_slake(folder: Path, annotations: Path | None, records: dict[str, ImageRecord]) -> None:
    """SLAKE train (English): `folder/train.json` and `folder/imgs/`; `annotations` is a folder laid
    out as SLAKE's own `imgs/` (xmlabN/detection.json), read only for the training images."""
    rows = [row for row in json.loads((folder / "train.json").read_text()) if row.get("q_lang", "en") == "en"]
    for row in rows:
        record = _add(records, folder / "imgs" / row["img_name"], "slake")
        modality = {"CT": "ct", "MRI": "mri", "X-Ray": "x-ray"}.get(row.get("modality", ""))
        if modality:
            record.modality = MODALITIES.index(modality)
        region = _SLAKE_REGION.get(row.get("location", ""))
        if region:
            record.region = REGIONS.index(region)
        record.questions.append((row["question"].strip(), row["answer"].strip(),
                                 row["answer_type"].strip().upper() == "CLOSED"))
        if annotations is not None and record.organs is None:
            detection = annotations / Path(row["img_name"]).parent / "detection.json"
            if detection.is_file():
                organs: dict[str, list] = {}
                for entry in json.loads(detection.read_text() or "[]"):
                    for name, box in entry.items():
                        organs.setdefault(name.strip().lower(), []).append(tuple(float(v) for v in box))
                record.organs = organs


def load_vqa_rad(folder: Path, records: dict[str, ImageRecord]) -> None:
    for row in json.loads((folder / "trainset.json").read_text()):
        record = _add(records, folder / "images" / row["image_name"], "vqa-rad")
        region = _VQA_RAD_REGION.get(str(row.get("image_organ", "")).strip().upper())
        if region:
            record.region = REGIONS.index(region)
        record.questions.append((str(row["question"]).strip(), str(row["answer"]).strip(),
                                 str(row["answer_type"]).strip().upper() == "CLOSED"))


def load_pathvqa(folder: Path, records: dict[str, ImageRecord]) -> None:
    """PathVQA train, in either layout medvqa.datasets reads (`pathvqa:DIR:train`); never the test split."""
    from medvqa.datasets import load_examples

    for example in load_examples("pathvqa", folder, "train"):
        record = _add(records, example.image, "pathvqa")
        record.modality = MODALITIES.index("pathology")
        closed = example.answer_type == "CLOSED" or normalise(example.answer) in ("yes", "no")
        record.questions.append((example.question, example.answer, closed))


def organ_cells(boxes: list[tuple[float, float, float, float]], width: int, height: int) -> list[int]:
    """Cells (row-major, GRID x GRID) of the padded square image that a box overlaps by at least a
    tenth of the cell, and the cell of its centre. The image is centred on a square canvas before resizing, as the encoder's
    preprocessing does (vision.pad_to_square)."""
    side = max(width, height)
    top, left = (side - height) // 2, (side - width) // 2
    cell = side / GRID
    hit = set()
    for x, y, w, h in boxes:
        x0, y0, x1, y1 = x + left, y + top, x + left + w, y + top + h
        for row in range(GRID):
            for col in range(GRID):
                overlap_w = min(x1, (col + 1) * cell) - max(x0, col * cell)
                overlap_h = min(y1, (row + 1) * cell) - max(y0, row * cell)
                if overlap_w > 0 and overlap_h > 0 and overlap_w * overlap_h >= 0.1 * cell * cell:
                    hit.add(row * GRID + col)
        # A small organ still marks the cell its centre lies in.
        centre_row = min(GRID - 1, max(0, int((y0 + y1) / 2 // cell)))
        centre_col = min(GRID - 1, max(0, int((x0 + x1) / 2 // cell)))
        hit.add(centre_row * GRID + centre_col)
    return sorted(hit)


class Heads(AnswerLayers):
    """What the medical stage teaches, read from the 16 pooled tokens (B, 16, 1280): the answer layers
    (medvqa/answer_head.py, which the app can load from the heads file) and the image-only heads."""

    def __init__(self, n_answers: int, n_organs: int, question_size: int = 384, width: int = 512):
        super().__init__(n_answers, question_size, width)  # created first, as always: same initial weights
        self.organs = nn.Linear(1280, max(1, n_organs))
        self.cells = nn.Linear(1280, max(1, n_organs))
        self.modality = nn.Linear(1280, len(MODALITIES))
        self.region = nn.Linear(1280, len(REGIONS))

    def image_heads(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        normed = self.norm(tokens)
        pooled = normed.mean(1)
        return {"normed": normed, "organs": self.organs(pooled), "cells": self.cells(normed),
                "modality": self.modality(pooled), "region": self.region(pooled)}


class Tail(nn.Module):
    """Blocks TRUNK.. and the 1280-channel head of an EfficientNet-Lite0 -> (B, 16, 1280) pooled tokens."""

    def __init__(self, net: nn.Module, trunk: int):
        super().__init__()
        self.blocks = nn.ModuleList(copy.deepcopy(net._blocks[trunk:]))
        self.conv_head, self.bn1, self.act = copy.deepcopy(net._conv_head), copy.deepcopy(net._bn1), net._swish
        self.first, self.total = trunk, len(net._blocks)
        self.drop_connect = net._global_params.drop_connect_rate or 0.0

    def forward(self, x: torch.Tensor, pool: bool = True) -> torch.Tensor:
        for offset, block in enumerate(self.blocks):
            # As the network's own extract_features scales drop-connect by depth.
            x = block(x, drop_connect_rate=self.drop_connect * (self.first + offset) / self.total)
        maps = self.act(self.bn1(self.conv_head(x)))  # (B, 1280, 7, 7)
        if not pool:
            return maps
        return F.adaptive_avg_pool2d(maps, GRID).flatten(2).transpose(1, 2)  # as vision.pool_tokens to 16


def trunk_forward(net: nn.Module, pixels: torch.Tensor, trunk: int) -> torch.Tensor:
    x = net._swish(net._bn0(net._conv_stem(pixels)))
    for block in net._blocks[:trunk]:
        x = block(x)
    return x
