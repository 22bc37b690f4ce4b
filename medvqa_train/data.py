"""Training data: cached encoder features, held-out splits (by question or by image), and the
examples the projector is taught with (prompt, image slots, labels on the answer only)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from medvqa.answers import normalise
from medvqa.datasets import VQAExample
from medvqa.model import image_digest
from medvqa.prompt import PromptBuilder
from medvqa.vision import VisionEncoder


def encoder_key(vision: VisionEncoder, settings_vision) -> str:
    """The feature cache's folder name: encoder kind, weights file (and the start of its SHA-256, so a
    retrained encoder of the same file name never reads an older one's features) and input size."""
    from medvqa.config import resolve_path

    name = str(settings_vision.name_or_path)
    key = f"{settings_vision.kind}-{Path(name).name}-{vision.image_size}"
    try:
        path = Path(resolve_path(name))
    except Exception:  # a hub id or a tiny: path: no local file to hash
        return key
    if path.is_file():
        key += "-" + hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return key


class FeatureCache:
    """Unpooled encoder features per image, one safetensors file each under `folder/<encoder key>/`."""

    def __init__(self, folder: str | Path, vision: VisionEncoder, key: str):
        self.folder = Path(folder) / key
        self.folder.mkdir(parents=True, exist_ok=True)
        self.vision = vision

    def features(self, image: np.ndarray) -> torch.Tensor:
        """(N, d_v) float32 features of an RGB image, from disk when seen before."""
        name = hashlib.sha256(image_digest(image).encode()).hexdigest()[:32]
        path = self.folder / f"{name}.safetensors"
        if path.is_file():
            return load_file(str(path))["features"].float()
        features = self.vision.encode(self.vision.preprocess([image]), pool=False)[0]  # (N, d_v), unpooled
        save_file({"features": features.to(torch.float16).contiguous()}, str(path))
        return features.float()


@dataclass
class TrainExample:
    features: torch.Tensor  # (N, d_v) unpooled
    token_ids: list[int]  # after the shared prefix
    image_mask: list[bool]
    labels: list[int]  # -100 except the answer tokens
    yes_no: int = -1  # 0 for a "yes" reference, 1 for "no", -1 otherwise (see batch_loss's closed_weight)
    views: tuple[torch.Tensor, ...] = ()  # features of augmented copies of the image (--augment)
    # --contrast-partner counterfactual: features of other training images asked the same question
    # with another answer, and this question's Yes/No index (0 yes, 1 no; -1 for other answers)
    counterparts: tuple[torch.Tensor, ...] = ()
    contrast_answer: int = -1


def augmented(image: np.ndarray, index: int) -> np.ndarray:
    """A fixed random variation of a scan (the `index`-th): a crop of 80-100 % of each side, resized
    back, a rotation within 7 degrees, brightness and contrast within 15 %. Never a mirror image:
    left and right are answers."""
    from PIL import ImageEnhance

    rng = random.Random(index)
    picture = Image.fromarray(image)
    width, height = picture.size
    scale = rng.uniform(0.8, 1.0)
    crop_w, crop_h = max(1, int(width * scale)), max(1, int(height * scale))
    left, top = rng.randint(0, width - crop_w), rng.randint(0, height - crop_h)
    picture = picture.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), Image.BILINEAR)
    picture = picture.rotate(rng.uniform(-7, 7), resample=Image.BILINEAR)
    picture = ImageEnhance.Brightness(picture).enhance(rng.uniform(0.85, 1.15))
    picture = ImageEnhance.Contrast(picture).enhance(rng.uniform(0.85, 1.15))
    return np.asarray(picture.convert("RGB"))


def shared_prefix_length(builder: PromptBuilder) -> int:
    """Number of leading prompt tokens every example shares: up to the image or the question,
    whichever comes first (training computes them once)."""
    first, second = builder.build("x", answer="x"), builder.build("y", answer="y")
    length = 0
    while (length < min(len(first), len(second)) and first.token_ids[length] == second.token_ids[length]
           and not first.image_mask[length]):
        length += 1
    return length


def training_answer(answer: str) -> str:
    """The answer as the model is taught to say it: first letter capitalised.

    The benchmarks mix "yes", "Yes" and "YES" for the same answer (VQA-RAD train: 513 "Yes", 315
    "yes"); taught as given, the decoder spends its yes/no decision partly on guessing the casing.
    Evaluation compares case-insensitively, and constrained decoding scores the capitalised options."""
    answer = answer.strip()
    if answer.isupper() and len(answer) > 1 and answer.lower() in ("yes", "no"):
        answer = answer.lower()
    return answer[:1].upper() + answer[1:]


def held_out_yes_no(examples: list[VQAExample], count: int, seed: int) -> list[int]:
    """Indices of a fixed sample of closed yes/no questions that training leaves out (--val), so that
    choices made after training (e.g. decoder.yes_bias) are tuned on questions it never saw."""
    yes_no = [i for i, example in enumerate(examples) if _is_yes_no(example)]
    return sorted(random.Random(seed + 2).sample(yes_no, min(count, len(yes_no))))


def held_out_images(examples: list[VQAExample], count: int, seed: int) -> tuple[list[int], list[int]]:
    """A held-out set of whole images (--val-by-image): images are drawn at random until their closed
    yes/no questions number at least `count`. Returns (those yes/no questions, every question on the
    drawn images); training leaves out all of the second, so the first asks about images it never saw,
    as a test split of new images does (SLAKE's validation images are not in its training split)."""
    by_image: dict = {}
    for index, example in enumerate(examples):
        by_image.setdefault(example.image, []).append(index)
    images = sorted(by_image, key=str)
    random.Random(seed + 3).shuffle(images)
    watched: list[int] = []
    left_out: list[int] = []
    for image in images:
        if len(watched) >= count:
            break
        left_out += by_image[image]
        watched += [index for index in by_image[image] if _is_yes_no(examples[index])]
    return sorted(watched), sorted(left_out)


def _is_yes_no(example: VQAExample) -> bool:
    return example.answer_type == "CLOSED" and normalise(example.answer) in ("yes", "no")


def make_example(builder: PromptBuilder, example: VQAExample, features: torch.Tensor, prefix: int) -> TrainExample:
    prompt_only = builder.build(example.question)
    full = builder.build(example.question, answer=training_answer(example.answer))
    # The template renders the answer followed by its end marker; both are supervised, nothing else.
    answer_start = len(prompt_only)
    labels = [-100] * answer_start + full.token_ids[answer_start:]
    # Drop the template's trailing newline after the end-of-turn marker from supervision.
    end_tokens = builder.tokenizer("\n", add_special_tokens=False)["input_ids"]
    if end_tokens and full.token_ids[-len(end_tokens):] == end_tokens:
        labels[-len(end_tokens):] = [-100] * len(end_tokens)
    yes_no = ("yes", "no").index(normalise(example.answer)) if _is_yes_no(example) else -1
    return TrainExample(features, full.token_ids[prefix:], full.image_mask[prefix:], labels[prefix:], yes_no)




def held_out_by_content(examples: list[VQAExample], percent: float) -> tuple[list[int], list[int]]:
    """The encoder's hold-out (--holdout-percent, scripts/train_encoder.py): every question on an image
    whose content hash falls in the first `percent` of 100 buckets. Returns (its yes/no questions, all
    its questions), as held_out_images does. The same images are held out of the encoder's medical
    stage, of the projector, and of yes_bias and the calibration, whatever the dataset mix."""
    from .medical import content_hash, held_out_hash

    held: dict[Path, bool] = {}
    left_out = []
    for index, example in enumerate(examples):
        if example.image not in held:
            held[example.image] = held_out_hash(content_hash(example.image), percent)
        if held[example.image]:
            left_out.append(index)
    return [i for i in left_out if _is_yes_no(examples[i])], left_out


def load_named_specs(specs: list[str]) -> tuple[list[VQAExample], list[str]]:
    """The examples of several --data specs, in order, and each one's spec name: the dataset
    ("slake"), or for `jsonl:DIR:SPLIT` the folder's name and the split ("holdout:heldout-slake")."""
    from medvqa.datasets import load_specs

    examples, names = [], []
    for spec in specs:
        from_spec = load_specs([spec])
        parts = spec.split(":")
        name = f"{Path(parts[1]).name}:{parts[-1]}" if parts[0] == "jsonl" and len(parts) == 3 else parts[0]
        examples += from_spec
        names += [name] * len(from_spec)
    return examples, names


def held_out_split(examples: list[VQAExample], val: int, by_image: bool, seed: int,
                   percent: float = 0.0) -> tuple[list[int], list[int]]:
    """(watched yes/no questions, every question training leaves out), as the projector scripts'
    --holdout-percent, --val-by-image or --val choose."""
    if percent:
        return held_out_by_content(examples, percent)
    if by_image:
        return held_out_images(examples, val, seed)
    picked = held_out_yes_no(examples, val, seed)
    return picked, picked
