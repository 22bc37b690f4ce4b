"""Projector training: encoder and decoder frozen, loss on the answer tokens only.

Two facts make this fast enough for a 2-core CPU:
- Image features are computed once per image and cached on disk (keyed by image content and
  encoder), so an epoch never runs the vision encoder.
- Every training prompt starts with the same system message, which does not depend on the image or
  the projector. Its key/value cache is computed once without gradients and shared by every batch,
  so each step runs the decoder only over image tokens, question and answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from .answers import normalise
from .datasets import VQAExample
from .decoder import Decoder
from .prompt import PromptBuilder
from .vision import VisionEncoder, pool_tokens


def read_image(path: str | Path) -> np.ndarray:
    """Benchmark images are plain 8-bit JPEGs; decode them as the app's imaging module does."""
    from .imaging import load_scan

    return load_scan(str(path)).pixels


def encoder_key(vision: VisionEncoder, settings_vision) -> str:
    return f"{settings_vision.kind}-{Path(str(settings_vision.name_or_path)).name}-{vision.image_size}"


class FeatureCache:
    """Unpooled encoder features per image, one safetensors file each under `folder/<encoder key>/`."""

    def __init__(self, folder: str | Path, vision: VisionEncoder, key: str):
        self.folder = Path(folder) / key
        self.folder.mkdir(parents=True, exist_ok=True)
        self.vision = vision

    def features(self, image: np.ndarray) -> torch.Tensor:
        """(N, d_v) float32 features of an RGB image, from disk when seen before."""
        digest = hashlib.sha256(np.ascontiguousarray(image).tobytes() + str(image.shape).encode()).hexdigest()
        path = self.folder / f"{digest[:32]}.safetensors"
        if path.is_file():
            return load_file(str(path))["features"].float()
        pooled, self.vision.pooled_tokens = self.vision.pooled_tokens, 0
        try:
            features = self.vision.encode(self.vision.preprocess([image]))[0]  # (N, d_v), unpooled
        finally:
            self.vision.pooled_tokens = pooled
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
    choices made after training (e.g. decoder.closed_contrast) are tuned on questions it never saw."""
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


def prefix_cache_tensors(decoder: Decoder, builder: PromptBuilder, prefix: int,
                         grad: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of the shared prompt prefix. A frozen decoder's never change (computed once,
    without gradients); with LoRA adapters (`grad=True`) they are recomputed every step."""
    ids = builder.build("x", answer="x").token_ids[:prefix]
    with torch.set_grad_enabled(grad):
        out = decoder.model(inputs_embeds=decoder.embed(ids), use_cache=True)
    return [(layer.keys, layer.values) for layer in out.cache.layers]


def forward_hidden(decoder: Decoder, projector, batch: list[TrainExample], prefix_kv, prefix: int,
                   n_tokens: int, blank_features: torch.Tensor | None = None, drop_image: float = 0.0,
                   rng: random.Random | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder hidden states (B, T, d_l) over image tokens, question and answer, and the labels (B, T)."""
    from transformers import DynamicCache

    size = len(batch)
    length = max(len(item.token_ids) for item in batch)
    pad = decoder.tokenizer.pad_token_id or 0
    ids = torch.full((size, length), pad, dtype=torch.long)
    labels = torch.full((size, length), -100, dtype=torch.long)
    image_mask = torch.zeros((size, length), dtype=torch.bool)
    attention = torch.zeros((size, prefix + length), dtype=torch.long)
    attention[:, :prefix] = 1
    features = []
    for row, item in enumerate(batch):
        n = len(item.token_ids)
        ids[row, :n] = torch.tensor(item.token_ids)
        labels[row, :n] = torch.tensor(item.labels)
        image_mask[row, :n] = torch.tensor(item.image_mask)
        attention[row, prefix:prefix + n] = 1
        use_blank = blank_features is not None and rng is not None and rng.random() < drop_image
        if use_blank:
            features.append(blank_features)
        elif item.views and rng is not None:
            features.append(rng.choice((item.features,) + item.views))
        else:
            features.append(item.features)
    stacked = pool_tokens(torch.stack(features), n_tokens)  # (B, n_tokens, d_v)
    image_tokens = projector(stacked)  # (B, n, d_l)
    embeds = decoder.model.get_input_embeddings()(ids).clone()  # (B, T, d_l)
    embeds[image_mask] = image_tokens.reshape(-1, image_tokens.shape[-1]).to(embeds.dtype)
    cache = DynamicCache(config=decoder.model.config)
    for layer_index, (keys, values) in enumerate(prefix_kv):
        cache.update(keys.expand(size, -1, -1, -1), values.expand(size, -1, -1, -1), layer_index)
    positions = torch.arange(prefix, prefix + length).unsqueeze(0).expand(size, -1)
    hidden = decoder.model.model(inputs_embeds=embeds, attention_mask=attention, cache=cache,
                                 position_ids=positions, use_cache=True).last_hidden_state  # (B, T, d_l)
    return hidden, labels


def batch_loss(decoder: Decoder, projector, batch: list[TrainExample], prefix_kv, prefix: int,
               n_tokens: int, blank_features: torch.Tensor | None = None, drop_image: float = 0.0,
               rng: random.Random | None = None, closed_weight: float = 0.0,
               choices: tuple[int, int] | None = None, contrast_weight: float = 0.0,
               contrast_margin: float = 0.5) -> torch.Tensor:
    """Cross-entropy on the answer tokens; with `closed_weight`, plus that weight times a two-way
    cross-entropy between the "Yes" and "No" tokens (`choices`) at the first answer position of
    every yes/no question in the batch: the decision constrained decoding makes at inference, which
    the token loss dilutes among the many tokens of open answers.

    With `contrast_weight`, plus that weight times an image-reliance hinge: each yes/no question is
    asked again with the image of the next example in the batch (a different image), and its right
    answer's two-way log-probability with its own image must beat the one with the other image by
    `contrast_margin`; see image_contrast_loss."""
    hidden, labels = forward_hidden(decoder, projector, batch, prefix_kv, prefix, n_tokens,
                                    blank_features, drop_image, rng)
    targets = labels[:, 1:]  # token t+1 is predicted from position t
    predicting = targets != -100
    # The vocabulary head only where a label is predicted: the head (49k x 576 for SmolLM2) over
    # every position would cost a fifth of the step for nothing.
    logits = decoder.model.lm_head(hidden[:, :-1][predicting]).float()  # (n_labels, V)
    loss = torch.nn.functional.cross_entropy(logits, targets[predicting])
    rows = [row for row, item in enumerate(batch) if item.yes_no >= 0]
    if not rows or choices is None or not (closed_weight or contrast_weight):
        return loss
    first = predicting.float().argmax(1)  # position predicting each row's first answer token
    wanted = torch.tensor([batch[row].yes_no for row in rows])
    own = _two_way_right(decoder, hidden[rows, first[rows]], choices, wanted)
    if closed_weight:
        loss = loss + closed_weight * -own.mean()  # the two-way cross-entropy
    if contrast_weight:
        loss = loss + contrast_weight * image_contrast_loss(decoder, projector, batch, rows, own, first,
                                                            prefix_kv, prefix, n_tokens, choices,
                                                            contrast_margin)
    return loss


def _two_way_right(decoder: Decoder, hidden_rows: torch.Tensor, choices: tuple[int, int],
                   wanted: torch.Tensor) -> torch.Tensor:
    """Log-probability of the right one of the two answer tokens, per row, from (n, d_l) states (the
    head has no bias in Llama-family models)."""
    head = decoder.model.lm_head.weight[list(choices)]  # (2, d_l)
    two_way = torch.log_softmax((hidden_rows @ head.T).float(), dim=-1)  # (n, 2)
    return two_way.gather(1, wanted.unsqueeze(1)).squeeze(1)


def image_contrast_loss(decoder: Decoder, projector, batch: list[TrainExample], rows: list[int],
                        own: torch.Tensor, first: torch.Tensor, prefix_kv, prefix: int, n_tokens: int,
                        choices: tuple[int, int], margin: float) -> torch.Tensor:
    """Mean hinge max(0, margin - (log p(right | own image) - log p(right | other image))) over the
    batch's yes/no questions, in two-way (Yes/No) log-probabilities at the first answer position.

    The other image is the next example's in the batch (cyclically), skipped where that is the same
    image: the shuffled-image test of the evaluation, turned into a training signal. The other image
    sometimes has the same right answer; the margin keeps that pull small (no gradient once the own
    image leads by `margin`). `rows` are the yes/no rows, `own` their right answers' two-way
    log-probabilities with their own image, `first` each row's first answer position."""
    pairs = []  # (index into rows, partner example)
    for k, row in enumerate(rows):
        item = batch[row]
        for step in range(1, len(batch)):
            partner = batch[(row + step) % len(batch)]
            if partner.features is not item.features and not torch.equal(partner.features, item.features):
                pairs.append((k, partner))
                break
    if not pairs:
        return own.new_zeros(())
    kept = [k for k, _ in pairs]
    paired_rows = [rows[k] for k in kept]
    swapped = [dataclasses.replace(batch[rows[k]], features=partner.features, views=()) for k, partner in pairs]
    other_hidden, _ = forward_hidden(decoder, projector, swapped, prefix_kv, prefix, n_tokens)
    # Same token ids as the original rows, so the first answer sits at the same position.
    wanted = torch.tensor([batch[row].yes_no for row in paired_rows])
    other = _two_way_right(decoder, other_hidden[torch.arange(len(kept)), first[paired_rows]], choices, wanted)
    return torch.relu(margin - (own[kept] - other)).mean()


@torch.no_grad()
def yes_no_accuracy(decoder: Decoder, projector, items: list[TrainExample], prefix_kv, prefix: int,
                    n_tokens: int, choices: tuple[int, int], batch_size: int = 16) -> tuple[float, float]:
    """(accuracy, share answered with choices[0]) on yes/no items: whether the right one of the two
    answer tokens scores higher at the first answer position, the constrained decoding the app uses
    for yes/no questions, batched, for watching training."""
    right = first_choice = 0
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        hidden, labels = forward_hidden(decoder, projector, batch, prefix_kv, prefix, n_tokens)
        for row in range(len(batch)):
            first = int((labels[row] != -100).nonzero()[0])  # position of the first answer token
            logits = decoder.model.lm_head(hidden[row, first - 1])
            picked = choices[0] if logits[choices[0]] >= logits[choices[1]] else choices[1]
            right += int(picked == int(labels[row, first]))
            first_choice += int(picked == choices[0])
    return right / max(1, len(items)), first_choice / max(1, len(items))


class Standardized(torch.nn.Module):
    """Training wrapper: per-channel standardisation of encoder features in front of the projector.

    Standardising is affine, so `folded()` merges it into the projector's first layer and the saved
    file is a plain projector (same keys and shapes; nothing changes for inference or export)."""

    def __init__(self, projector, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.projector = projector
        self.register_buffer("mean", mean.float())
        self.register_buffer("std", std.float())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.projector((features - self.mean) / self.std)

    def folded(self):
        import copy

        plain = copy.deepcopy(self.projector)
        with torch.no_grad():
            weight = plain.linear_1.weight / self.std  # (hidden, d_v): W x' = (W / std) x - (W / std) mean
            plain.linear_1.bias.sub_(weight @ self.mean)
            plain.linear_1.weight.copy_(weight)
        return plain


def channel_statistics(features: list[torch.Tensor], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation over the (pooled) image tokens the projector sees."""
    stacked = pool_tokens(torch.stack(features), n_tokens)
    flat = stacked.reshape(-1, stacked.shape[-1]).float()
    # A channel that hardly varies (ReLU-dead in training images) must not be blown up at test time.
    return flat.mean(0), flat.std(0).clamp_min(0.05)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trained low-rank update (Hu et al., 2021, "LoRA"):
    y = W x + b + (alpha / rank) B A x. B starts at zero, so training starts from the frozen model."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = torch.nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T * self.scale

    def merged(self) -> torch.nn.Linear:
        with torch.no_grad():
            self.base.weight.add_(self.scale * self.lora_b @ self.lora_a)
        return self.base


def add_lora(model: torch.nn.Module, rank: int, alpha: float,
             targets: tuple[str, ...] = LORA_TARGETS) -> list[torch.nn.Parameter]:
    """Wrap every linear layer named in `targets` with a LoRA adapter; returns the new parameters
    (the only ones that train in the decoder)."""
    wrapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, torch.nn.Linear):
                adapter = LoRALinear(child, rank, alpha)
                setattr(parent, name, adapter)
                wrapped += [adapter.lora_a, adapter.lora_b]
    if not wrapped:
        raise ValueError(f"no linear layer named {', '.join(targets)} to adapt")
    return wrapped


def merge_lora(model: torch.nn.Module) -> int:
    """Fold every adapter into its linear layer, leaving a plain model of the original architecture
    (what the inference engines load). Returns how many layers were merged."""
    merged = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merged())
                merged += 1
    return merged


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
