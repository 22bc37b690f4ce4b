"""The shipped recipe's loss: cross-entropy on the answer tokens, decoder frozen, image tokens from
the projector placed by the model's one merge (medvqa.model.merge_image_features); the feature
standardisation folded into the projector when saved; the learning-rate schedule.

Two facts make this fast enough for a 2-core CPU:
- Image features are computed once per image and cached on disk (data.FeatureCache), so an epoch
  never runs the vision encoder.
- Every training prompt starts with the same system message, which does not depend on the image or
  the projector. Its key/value cache is computed once without gradients and shared by every batch,
  so each step runs the decoder only over image tokens, question and answer.
"""

from __future__ import annotations

import math
import random

import torch

from medvqa.language_model import LanguageModel
from medvqa.model import merge_image_features
from medvqa.prompt import PromptBuilder
from medvqa.vision import pool_tokens

from .data import TrainExample
from .experimental import counterfactual_contrast_loss, image_contrast_loss, two_way_right


def prefix_cache_tensors(decoder: LanguageModel, builder: PromptBuilder, prefix: int,
                         grad: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of the shared prompt prefix. A frozen decoder's never change (computed once,
    without gradients); with LoRA adapters (`grad=True`) they are recomputed every step."""
    ids = builder.build("x", answer="x").token_ids[:prefix]
    with torch.set_grad_enabled(grad):
        out = decoder.model(inputs_embeds=decoder.embed(ids), use_cache=True)
    return [(layer.keys, layer.values) for layer in out.cache.layers]


def forward_hidden(decoder: LanguageModel, projector, batch: list[TrainExample], prefix_kv, prefix: int,
                   n_tokens: int, blank_features: torch.Tensor | None = None, drop_image: float = 0.0,
                   rng: random.Random | None = None, blanked: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LanguageModel hidden states (B, T, d_l) over image tokens, question and answer, and the labels (B, T).
    The rows shown the blank image (`drop_image`) are appended to `blanked` when it is given."""
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
            if blanked is not None:
                blanked.append(row)
        elif item.views and rng is not None:
            features.append(rng.choice((item.features,) + item.views))
        else:
            features.append(item.features)
    stacked = pool_tokens(torch.stack(features), n_tokens)  # (B, n_tokens, d_v)
    image_tokens = projector(stacked)  # (B, n, d_l)
    embeds = merge_image_features(decoder.model.get_input_embeddings()(ids), image_mask, image_tokens)  # (B, T, d_l)
    cache = DynamicCache(config=decoder.model.config)
    for layer_index, (keys, values) in enumerate(prefix_kv):
        cache.update(keys.expand(size, -1, -1, -1), values.expand(size, -1, -1, -1), layer_index)
    positions = torch.arange(prefix, prefix + length).unsqueeze(0).expand(size, -1)
    hidden = decoder.model.model(inputs_embeds=embeds, attention_mask=attention, cache=cache,
                                 position_ids=positions, use_cache=True).last_hidden_state  # (B, T, d_l)
    return hidden, labels


def batch_loss(decoder: LanguageModel, projector, batch: list[TrainExample], prefix_kv, prefix: int,
               n_tokens: int, blank_features: torch.Tensor | None = None, drop_image: float = 0.0,
               rng: random.Random | None = None, closed_weight: float = 0.0,
               choices: tuple[int, int] | None = None, contrast_weight: float = 0.0,
               contrast_margin: float = 0.5, counterfactual: bool = False) -> torch.Tensor:
    """Cross-entropy on the answer tokens; with `closed_weight`, plus that weight times a two-way
    cross-entropy between the "Yes" and "No" tokens (`choices`) at the first answer position of
    every yes/no question in the batch: the decision constrained decoding makes at inference, which
    the token loss dilutes among the many tokens of open answers.

    With `contrast_weight`, plus that weight times an image-reliance hinge: each yes/no question is
    asked again with the image of the next example in the batch (a different image), and its right
    answer's two-way log-probability with its own image must beat the one with the other image by
    `contrast_margin`; see image_contrast_loss. With `counterfactual`, the other image is one of the
    item's counterparts instead (counterfactual_contrast_loss), drawn with `rng`."""
    blanked: list[int] = []
    hidden, labels = forward_hidden(decoder, projector, batch, prefix_kv, prefix, n_tokens,
                                    blank_features, drop_image, rng, blanked)
    targets = labels[:, 1:]  # token t+1 is predicted from position t
    predicting = targets != -100
    # The vocabulary head only where a label is predicted: the head (49k x 576 for SmolLM2) over
    # every position would cost a fifth of the step for nothing.
    logits = decoder.model.lm_head(hidden[:, :-1][predicting]).float()  # (n_labels, V)
    loss = torch.nn.functional.cross_entropy(logits, targets[predicting])
    first = predicting.float().argmax(1)  # position predicting each row's first answer token
    if choices is None:
        return loss
    skip = set(blanked)  # a blank image's answer is no evidence of reading the image: out of both hinges
    if contrast_weight and counterfactual:
        loss = loss + contrast_weight * counterfactual_contrast_loss(decoder, projector, batch, hidden, labels, first,
                                                                     prefix_kv, prefix, n_tokens, choices,
                                                                     contrast_margin, rng or random.Random(0), skip)
    batch_contrast = 0.0 if counterfactual else contrast_weight
    rows = [row for row, item in enumerate(batch) if item.yes_no >= 0]
    if not rows or not (closed_weight or batch_contrast):
        return loss
    wanted = torch.tensor([batch[row].yes_no for row in rows])
    own = two_way_right(decoder, hidden[rows, first[rows]], choices, wanted)
    if closed_weight:
        loss = loss + closed_weight * -own.mean()  # the two-way cross-entropy
    if batch_contrast:
        loss = loss + batch_contrast * image_contrast_loss(decoder, projector, batch, rows, own, first,
                                                           prefix_kv, prefix, n_tokens, choices,
                                                           contrast_margin, skip)
    return loss


@torch.no_grad()
def yes_no_accuracy(decoder: LanguageModel, projector, items: list[TrainExample], prefix_kv, prefix: int,
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


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
