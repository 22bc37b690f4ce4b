"""Experiments that were measured and not shipped (docs/experiments.md): they stay runnable
through scripts/train_projector.py's experimental flags, off by default.

- A two-way Yes/No loss at the first answer position (--closed-weight).
- An image-reliance hinge: each yes/no question asked again with another image of the batch
  (--contrast-weight); the shuffled-image test as a training signal. With --contrast-partner
  counterfactual, every question (open ones too) is asked again with one of the most similar
  training images asked the same question with another answer.
- LoRA adapters on the decoder (--lora). The design keeps the decoder frozen; a LoRA run writes a
  whole merged decoder for the transformers engine, never used by a profile.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from medvqa.language_model import LanguageModel


def two_way_right(decoder: LanguageModel, hidden_rows: torch.Tensor, choices: tuple[int, int],
                   wanted: torch.Tensor) -> torch.Tensor:
    """Log-probability of the right one of the two answer tokens, per row, from (n, d_l) states (the
    head has no bias in Llama-family models)."""
    head = decoder.model.lm_head.weight[list(choices)]  # (2, d_l)
    two_way = torch.log_softmax((hidden_rows @ head.T).float(), dim=-1)  # (n, 2)
    return two_way.gather(1, wanted.unsqueeze(1)).squeeze(1)


def image_contrast_loss(decoder: LanguageModel, projector, batch: list, rows: list[int],
                        own: torch.Tensor, first: torch.Tensor, prefix_kv, prefix: int, n_tokens: int,
                        choices: tuple[int, int], margin: float, skip: set[int] = frozenset()) -> torch.Tensor:
    """Mean hinge max(0, margin - (log p(right | own image) - log p(right | other image))) over the
    batch's yes/no questions (but the rows in `skip`, shown the blank image), in two-way (Yes/No) log-probabilities at the first answer position.

    The other image is the next example's in the batch (cyclically), skipped where that is the same
    image: the shuffled-image test of the evaluation, turned into a training signal. The other image
    sometimes has the same right answer; the margin keeps that pull small (no gradient once the own
    image leads by `margin`). `rows` are the yes/no rows, `own` their right answers' two-way
    log-probabilities with their own image, `first` each row's first answer position."""
    pairs = []  # (index into rows, partner example)
    for k, row in enumerate(rows):
        item = batch[row]
        if row in skip:
            continue
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
    from .loss import forward_hidden  # the loss module imports this one

    other_hidden, _ = forward_hidden(decoder, projector, swapped, prefix_kv, prefix, n_tokens)
    # Same token ids as the original rows, so the first answer sits at the same position.
    wanted = torch.tensor([batch[row].yes_no for row in paired_rows])
    other = two_way_right(decoder, other_hidden[torch.arange(len(kept)), first[paired_rows]], choices, wanted)
    return torch.relu(margin - (own[kept] - other)).mean()


def attach_counterparts(items: list, questions: list[str], answers: list[str], keep: int = 3) -> list:
    """Give each training item the features of up to `keep` other training images asked the same
    question (normalised words) with another answer, the most similar first (cosine of the mean
    feature): the pairs where only reading the image tells the answers apart, hardest first, as the
    evaluation's neighbouring slice is. Items without such a partner are returned unchanged.
    `contrast_answer` is the item's Yes/No index for yes/no questions (scored two-way), else -1
    (scored by the answer's mean token log-probability)."""
    from medvqa.answers import normalise

    groups: dict[str, list[int]] = {}
    for index, question in enumerate(questions):
        groups.setdefault(normalise(question), []).append(index)
    said = [normalise(answer) for answer in answers]
    summary: dict[int, torch.Tensor] = {}

    def mean_feature(index: int) -> torch.Tensor:
        key = id(items[index].features)
        if key not in summary:
            summary[key] = torch.nn.functional.normalize(items[index].features.float().mean(0), dim=0)
        return summary[key]

    out = list(items)
    for members in groups.values():
        for index in members:
            own = items[index].features
            others, seen = [], set()
            for other in members:
                candidate = items[other].features
                if (said[other] == said[index] or id(candidate) in seen or candidate is own
                        or torch.equal(candidate, own)):
                    continue
                seen.add(id(candidate))
                others.append(other)
            if not others:
                continue
            target = mean_feature(index)
            others.sort(key=lambda other: -float(mean_feature(other) @ target))
            yes_no = ("yes", "no").index(said[index]) if said[index] in ("yes", "no") else -1
            out[index] = dataclasses.replace(items[index], contrast_answer=yes_no,
                                             counterparts=tuple(items[o].features for o in others[:keep]))
    return out


def _right_answer_score(decoder: LanguageModel, hidden: torch.Tensor, labels: torch.Tensor, first: torch.Tensor,
                        batch_rows: list, choices: tuple[int, int]) -> torch.Tensor:
    """Per row: the two-way log-probability of the right one of Yes/No for yes/no questions, else the
    mean log-probability of the answer's tokens."""
    scores = []
    for k, item in enumerate(batch_rows):
        if item.contrast_answer >= 0:
            wanted = torch.tensor([item.contrast_answer])
            scores.append(two_way_right(decoder, hidden[k, first[k]].unsqueeze(0), choices, wanted)[0])
        else:
            targets = labels[k, 1:]
            predicting = targets != -100
            logits = decoder.model.lm_head(hidden[k, :-1][predicting]).float()
            scores.append(torch.log_softmax(logits, -1).gather(1, targets[predicting].unsqueeze(1)).mean())
    return torch.stack(scores)


def counterfactual_contrast_loss(decoder: LanguageModel, projector, batch: list, hidden: torch.Tensor,
                                 labels: torch.Tensor, first: torch.Tensor, prefix_kv, prefix: int, n_tokens: int,
                                 choices: tuple[int, int], margin: float, rng, skip: set[int] = frozenset()) -> torch.Tensor:
    """Mean hinge max(0, margin - (score(right | own image) - score(right | counterpart))) over the
    batch's items that have counterparts (attach_counterparts), one counterpart drawn per item with
    `rng`; the score is _right_answer_score's. The counterpart's right answer is another one, so the
    own image must lead. Rows in `skip` (shown the blank image in `hidden`) are left out."""
    rows = [row for row, item in enumerate(batch) if item.counterparts and row not in skip]
    if not rows:
        return hidden.new_zeros(())
    items = [batch[row] for row in rows]
    own = _right_answer_score(decoder, hidden[rows], labels[rows], first[rows], items, choices)
    swapped = [dataclasses.replace(item, features=rng.choice(item.counterparts), views=()) for item in items]
    from .loss import forward_hidden  # the loss module imports this one

    other_hidden, other_labels = forward_hidden(decoder, projector, swapped, prefix_kv, prefix, n_tokens)
    other = _right_answer_score(decoder, other_hidden, other_labels, first[rows], items, choices)
    return torch.relu(margin - (own - other)).mean()


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


