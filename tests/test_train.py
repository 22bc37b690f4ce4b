"""Projector training: input standardisation folds exactly into the saved projector, and the training
script runs end to end (tiny random models) to a projector the pipeline loads."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from medvqa.datasets import VQAExample
from medvqa.projector import Projector, read_metadata
from medvqa.prompt import PromptBuilder
from medvqa.config import resolve_path
from medvqa_train.data import augmented, make_example, shared_prefix_length, training_answer
from medvqa_train.experimental import LoRALinear, _right_answer_score, add_lora, attach_counterparts, merge_lora
from medvqa_train.resume import check_resume
from medvqa_train.loss import Standardized, batch_loss, channel_statistics, forward_hidden, prefix_cache_tensors

from .conftest import REPO


def test_standardisation_folds_into_the_first_layer(tmp_path):
    torch.manual_seed(0)
    features = [torch.rand(9, 20) * torch.linspace(0.01, 8, 20) for _ in range(6)]  # channels of very different scale
    mean, std = channel_statistics(features, 0)
    assert mean.shape == std.shape == (20,) and bool((std >= 0.05).all())
    wrapped = Standardized(Projector(20, 12, 16), mean, std)
    batch = torch.stack(features[:3]) * 1.3
    folded = wrapped.folded()
    assert torch.allclose(folded(batch), wrapped(batch), atol=1e-5)
    folded.save(tmp_path / "p.safetensors")  # a plain projector: same keys and shapes as any other
    reloaded = Projector(20, 12, 16).load(tmp_path / "p.safetensors")
    assert torch.allclose(reloaded(batch), wrapped(batch), atol=1e-5)


def test_lora_adapters_start_as_the_frozen_model_and_merge_exactly(tiny_pipeline, tiny_settings):
    from transformers import AutoModelForCausalLM

    # A fresh copy of the tiny decoder (the shared pipeline's one must stay unadapted).
    model = AutoModelForCausalLM.from_pretrained(resolve_path(tiny_settings.decoder.name_or_path), dtype=torch.float32)
    model.requires_grad_(False)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    names = {name for name, _ in model.named_parameters()}
    adapters = add_lora(model, rank=2, alpha=4.0)
    assert adapters and all(p.requires_grad for p in adapters)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == len(adapters) // 2
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before)  # B starts at zero
        for adapter in adapters[1::2]:
            adapter.normal_(std=0.5)
        adapted = model(input_ids=ids).logits
    assert not torch.allclose(adapted, before, atol=1e-4)
    # Gradients reach the adapters only.
    model(input_ids=ids).logits.sum().backward()
    assert all(p.grad is not None for p in adapters)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert merge_lora(model) == len(adapters) // 2
    assert {name for name, _ in model.named_parameters()} == names  # the original architecture again
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, adapted, atol=1e-4)
    with pytest.raises(ValueError, match="no linear layer"):
        add_lora(torch.nn.Sequential(torch.nn.ReLU()), rank=2, alpha=4.0)


def test_augmented_copies_are_fixed_per_index_and_keep_the_image_shape():
    image = np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)
    first, again, second = augmented(image, 0), augmented(image, 0), augmented(image, 1)
    assert first.shape == image.shape and first.dtype == np.uint8
    assert np.array_equal(first, again) and not np.array_equal(first, second)
    assert not np.array_equal(first, image)


def test_answers_are_taught_in_one_spelling():
    assert [training_answer(a) for a in ("yes", "Yes", "YES", " no ")] == ["Yes", "Yes", "Yes", "No"]
    assert [training_answer(a) for a in ("CT", "left lung", "T2")] == ["CT", "Left lung", "T2"]


def test_a_held_out_set_of_whole_images_leaves_all_their_questions_out(tmp_path):
    from medvqa_train.data import held_out_images

    examples = [VQAExample(str(i), tmp_path / f"{i // 3}.png", f"Question {i}?", ("yes", "no", "Liver")[i % 3],
                           "OPEN" if i % 3 == 2 else "CLOSED") for i in range(60)]  # 20 images, 3 questions each
    watched, left_out = held_out_images(examples, 5, seed=0)
    assert (watched, left_out) == held_out_images(examples, 5, seed=0)  # fixed by the seed
    assert len(watched) == 6 and set(watched) <= set(left_out) and len(left_out) == 9  # 3 whole images
    assert all(examples[i].answer in ("yes", "no") for i in watched)
    held_images = {examples[i].image for i in left_out}
    assert not any(example.image in held_images for i, example in enumerate(examples) if i not in left_out)


def _loss_setup(tiny_pipeline, tmp_path, rows):
    """Training examples for (question, answer, kind, features) rows on the tiny models, with what
    batch_loss needs: (decoder, projector, examples, prefix_kv, prefix, Yes/No token ids)."""
    decoder = tiny_pipeline.engine.language_model
    builder = PromptBuilder(decoder.tokenizer, 4, 512, reserve_for_answer=16)
    prefix = shared_prefix_length(builder)
    made = [make_example(builder, VQAExample(str(i), tmp_path, question, answer, kind), features, prefix)
            for i, (question, answer, kind, features) in enumerate(rows)]
    choices = tuple(decoder.tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in ("Yes", "No"))
    return decoder, tiny_pipeline.model.projector, made, prefix_cache_tensors(decoder, builder, prefix), prefix, choices


def test_image_after_the_question_changes_the_prompt_not_the_supervision(tiny_pipeline, tmp_path):
    tokenizer = tiny_pipeline.engine.language_model.tokenizer
    before = PromptBuilder(tokenizer, 4, 512, reserve_for_answer=16)
    after = PromptBuilder(tokenizer, 4, 512, reserve_for_answer=16, image_position="after")
    text = after.build("Is it normal?").text
    assert text.index("Question: Is it normal?") < text.index("<image>")
    # Every example shares the tokens before the question; the image is not among them.
    prefix = shared_prefix_length(after)
    assert not any(after.build("Is it normal?").image_mask[:prefix])
    assert after.build("x").token_ids[:prefix] == after.build("Why?").token_ids[:prefix]
    assert after.build("x").token_ids[prefix] != after.build("Why?").token_ids[prefix]
    example = VQAExample("0", tmp_path, "Is it normal?", "yes", "CLOSED")
    features = torch.zeros(16, tiny_pipeline.model.vision.hidden_size)
    taught = [make_example(builder, example, features, shared_prefix_length(builder)) for builder in (before, after)]
    answers = [[label for label in item.labels if label != -100] for item in taught]
    assert answers[0] == answers[1] and answers[0]  # the same answer tokens are taught
    assert sum(taught[1].image_mask) == 4
    with pytest.raises(ValueError, match="image_position"):
        PromptBuilder(tokenizer, 4, 512, image_position="middle")


def test_closed_weight_adds_a_yes_no_loss_on_yes_no_questions_only(tiny_pipeline, tmp_path):
    torch.manual_seed(0)
    features = torch.randn(16, tiny_pipeline.model.vision.hidden_size)
    decoder, projector, made, prefix_kv, prefix, choices = _loss_setup(
        tiny_pipeline, tmp_path, [("Is it normal?", "YES", "CLOSED", features),
                                  ("Is there a mass?", "no", "CLOSED", features),
                                  ("What organ?", "Liver", "OPEN", features)])
    assert [item.yes_no for item in made] == [0, 1, -1]

    def loss(items, weight):
        with torch.no_grad():
            return float(batch_loss(decoder, projector, items, prefix_kv, prefix, 4, closed_weight=weight,
                                    choices=choices))

    assert loss(made[2:], 1.0) == loss(made[2:], 0.0)  # no yes/no question: nothing added
    added = loss(made, 2.0) - loss(made, 0.0)
    assert added > 0 and abs(added - 2 * (loss(made, 1.0) - loss(made, 0.0))) < 1e-4


def test_counterparts_are_other_images_asked_the_same_question_with_another_answer(tiny_pipeline, tmp_path):
    torch.manual_seed(0)
    width = tiny_pipeline.model.vision.hidden_size
    base = torch.randn(16, width)
    near, far, same = base + 0.1 * torch.randn(16, width), torch.randn(16, width), base.clone()
    decoder, projector, made, prefix_kv, prefix, choices = _loss_setup(
        tiny_pipeline, tmp_path, [("Is there a mass?", "yes", "CLOSED", base),
                                  ("is there a mass", "No", "CLOSED", far),
                                  ("Is there a mass?", "no", "CLOSED", near),
                                  ("Is there a mass?", "no", "CLOSED", same),  # the same scan: never a partner
                                  ("Is there a mass?", "yes", "CLOSED", far),
                                  ("Is it normal?", "no", "CLOSED", far),
                                  ("What organ?", "Liver", "OPEN", near),
                                  ("What organ?", "liver", "OPEN", far),  # the same answer: no partner
                                  ("What organ?", "Lung", "OPEN", base)])
    rows = [("Is there a mass?", "yes"), ("is there a mass", "No"), ("Is there a mass?", "no"),
            ("Is there a mass?", "no"), ("Is there a mass?", "yes"), ("Is it normal?", "no"),
            ("What organ?", "Liver"), ("What organ?", "liver"), ("What organ?", "Lung")]
    questions, answers = [q for q, _ in rows], [a for _, a in rows]
    paired = attach_counterparts(made, questions, answers, keep=3)
    # The yes on `base` is paired with the two other "no" scans, the most similar first.
    assert paired[0].contrast_answer == 0 and len(paired[0].counterparts) == 2
    assert paired[0].counterparts[0] is made[2].features and paired[0].counterparts[1] is made[1].features
    assert len(paired[1].counterparts) == 1  # `far` answered no there; its other-answer scan is `base` only
    assert paired[1].counterparts[0] is made[0].features
    assert not paired[5].counterparts  # asked once
    # Open questions pair by answer too, scored by the answer's tokens (contrast_answer -1).
    assert paired[6].counterparts == (made[8].features,) and paired[6].contrast_answer == -1
    assert paired[8].counterparts[0] is made[6].features and len(paired[8].counterparts) == 2
    assert len(attach_counterparts(made, questions, answers, keep=1)[0].counterparts) == 1

    def loss(items, weight, margin=0.5):
        return batch_loss(decoder, projector, items, prefix_kv, prefix, 4, choices=choices, contrast_weight=weight,
                          contrast_margin=margin, counterfactual=True, rng=random.Random(0))

    with torch.no_grad():
        plain = float(loss(paired, 0.0))
        added = float(loss(paired, 1.0)) - plain
        assert 0.3 < added < 0.7  # an untrained projector: own and other image about level, the margin is added
        assert float(loss(paired, 1.0, margin=-5.0)) == pytest.approx(plain)
        assert float(loss(paired[5:6], 1.0)) == pytest.approx(float(loss(paired[5:6], 0.0)))  # no partner
        open_added = float(loss(paired[6:], 1.0)) - float(loss(paired[6:], 0.0))
        assert 0.3 < open_added < 0.7
        # The open score is the answer's mean token log-probability: minus the row's token loss.
        hidden, labels = forward_hidden(decoder, projector, paired[6:7], prefix_kv, prefix, 4)
        first = (labels[:, 1:] != -100).float().argmax(1)
        own = _right_answer_score(decoder, hidden, labels, first, paired[6:7], choices)
        assert float(own[0]) == pytest.approx(-float(loss(paired[6:7], 0.0)), abs=1e-5)
        # The hinge is margin - (own - other), with the other image's score from the same positions.
        swapped, other_labels = forward_hidden(decoder, projector, [dataclasses.replace(paired[6], features=made[8].features)],
                                               prefix_kv, prefix, 4)
        other = _right_answer_score(decoder, swapped, other_labels, first, paired[6:7], choices)
        assert float(loss(paired[6:7], 1.0, margin=9.0)) == pytest.approx(
            float(loss(paired[6:7], 0.0)) + 9.0 - float(own[0] - other[0]), abs=1e-5)
        # A row shown the blank image (--drop-image) is left out of the hinge.
        blank = torch.zeros_like(made[0].features)
        dropped = batch_loss(decoder, projector, paired[6:7], prefix_kv, prefix, 4, blank, 1.0, random.Random(0),
                             choices=choices, contrast_weight=1.0, counterfactual=True)
        kept_blank = batch_loss(decoder, projector, paired[6:7], prefix_kv, prefix, 4, blank, 1.0, random.Random(0),
                                choices=choices)
        assert float(dropped) == pytest.approx(float(kept_blank))
    projector.zero_grad()
    (loss(paired, 1.0) - loss(paired, 0.0)).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in projector.parameters())


def test_image_contrast_loss_compares_each_yes_no_answer_with_another_image(tiny_pipeline, tmp_path):
    torch.manual_seed(0)
    bright, dark = torch.randn(16, tiny_pipeline.model.vision.hidden_size), torch.randn(16, tiny_pipeline.model.vision.hidden_size)
    decoder, projector, made, prefix_kv, prefix, choices = _loss_setup(
        tiny_pipeline, tmp_path, [("Is it normal?", "yes", "CLOSED", bright),
                                  ("Is there a mass?", "no", "CLOSED", dark),
                                  ("What organ?", "Liver", "OPEN", bright)])

    def loss(items, weight, margin=0.5):
        return batch_loss(decoder, projector, items, prefix_kv, prefix, 4, choices=choices,
                          contrast_weight=weight, contrast_margin=margin)

    with torch.no_grad():
        base = float(loss(made, 0.0))
        # Own and other image give nearly the same answer in an untrained model: about the margin is added.
        added = float(loss(made, 1.0)) - base
        assert 0.3 < added < 0.7
        assert abs((float(loss(made, 2.0)) - base) - 2 * added) < 1e-4
        assert float(loss(made, 1.0, margin=-5.0)) == pytest.approx(base)  # the own image leads by more
        one_image = [made[0], made[2]]  # the only other example shares the image: nothing to contrast
        assert float(loss(one_image, 1.0)) == pytest.approx(float(loss(one_image, 0.0)))
        assert float(loss(made[2:], 1.0)) == pytest.approx(float(loss(made[2:], 0.0)))  # no yes/no question
        # Rows shown the blank image (--drop-image) are left out of the hinge.
        blank = torch.zeros_like(bright)
        blanked = [batch_loss(decoder, projector, made, prefix_kv, prefix, 4, blank, 1.0, random.Random(0),
                              choices=choices, contrast_weight=weight) for weight in (1.0, 0.0)]
        assert float(blanked[0]) == pytest.approx(float(blanked[1]))
    projector.zero_grad()
    (loss(made, 1.0) - loss(made, 0.0)).backward()  # the added term alone reaches the projector
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in projector.parameters())
    projector.zero_grad()


def test_training_script_runs_end_to_end_on_tiny_models(tiny_pipeline, tiny_settings, tmp_path):
    data = tmp_path / "bench"
    (data / "images").mkdir(parents=True)
    rows = []
    rng = np.random.default_rng(0)
    for index in range(12):
        bright = index % 2 == 0
        pixels = rng.integers(150, 255, (40, 40, 3)) if bright else rng.integers(0, 100, (40, 40, 3))
        Image.fromarray(pixels.astype(np.uint8)).save(data / "images" / f"{index}.png")
        rows.append({"image": f"{index}.png", "question": "Is the image bright?", "answer": "yes" if bright else "no",
                     "answer_type": "CLOSED"})
        rows.append({"image": f"{index}.png", "question": "What is shown?", "answer": "a test pattern",
                     "answer_type": "OPEN"})
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "weights"
    env = dict(os.environ, MEDVQA_CACHE=str(tiny_settings.cache_dir))
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_projector.py"), "--profile", "tiny",
         "--data", f"jsonl:{data}:train", "--batch-size", "4", "--max-steps", "4", "--val", "4",
         "--eval-every", "2", "--standardize", "--match-text-scale", "--drop-image", "0.2",
         "--image-position", "after", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    card = json.loads((out / "card.json").read_text())
    assert card["steps"] == 4 and card["held_out"] == 4 and card["standardize"] is True
    assert card["examples"] == len(rows) - 4  # the held-out questions are not trained on
    watched = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith('{"step"')]
    assert [entry["step"] for entry in watched] == [0, 2, 4]
    assert all(0.0 <= entry["yes_no_real"] <= 1.0 for entry in watched)
    assert int(read_metadata(out / "projector.safetensors")["steps"]) == 4
    assert card["image_position"] == "after"
    # The encoder it was trained on is recorded (the tiny CLIP is a folder, so by name only).
    assert card["encoder"] == tiny_settings.vision.name_or_path and card["encoder_sha256"] is None
    assert "encoder_sha256" in read_metadata(out / "projector.safetensors")
    projector = Projector(tiny_pipeline.model.vision.hidden_size, tiny_settings.projector.hidden_size,
                          tiny_pipeline.engine.hidden_size)
    projector.load(out / "projector.safetensors")  # the folded file loads as a plain projector
    assert projector.image_position == "after"  # and the prompt will put the image where it trained

    # Fine-tuning from those weights with the two-way yes/no loss.
    tuned = tmp_path / "tuned"
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_projector.py"), "--profile", "tiny",
         "--data", f"jsonl:{data}:train", "--batch-size", "4", "--max-steps", "2", "--init",
         str(out / "projector.safetensors"), "--closed-weight", "1.0", "--closed-data", "1", "--contrast-weight",
         "0.5", "--repeat", "2", "--augment", "2", "--val", "2", "--val-by-image", "--out", str(tuned)],
        capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    card = json.loads((tuned / "card.json").read_text())
    assert card["init"] == str(out / "projector.safetensors") and card["closed_weight"] == 1.0
    assert card["closed_data"] == [1]
    assert card["contrast_weight"] == 0.5 and card["contrast_margin"] == 0.5
    left_out = int(re.search(r"held out (\d+) questions on", completed.stdout).group(1))
    assert left_out == 4  # both questions on each of the 2 held-out images
    assert card["repeat"] == [2] and card["examples"] == 2 * (len(rows) - left_out)  # each shown twice
    assert card["steps"] == 2 and card["augment"] == 2
    assert card["held_out_by_image"] is True and card["held_out"] == 2
    assert card["image_position"] == "after"  # kept from the --init file

    # Resuming that run from its checkpoint continues to the new step count (--closed-data 1 left out:
    # with one --data spec that is its default, the same run).
    resume = [sys.executable, str(REPO / "scripts" / "train_projector.py"), "--profile", "tiny",
              "--data", f"jsonl:{data}:train", "--batch-size", "4", "--max-steps", "3", "--init",
              str(out / "projector.safetensors"), "--closed-weight", "1.0", "--contrast-weight", "0.5", "--repeat", "2",
              "--augment", "2", "--val", "2", "--val-by-image", "--out", str(tuned), "--resume"]
    # Any option that changes the run is refused, each difference named, before a step is taken.
    changed = [*resume, "--image-position", "before", "--seed", "1"]
    refused = subprocess.run(changed, capture_output=True, text=True, env=env, timeout=600)
    assert refused.returncode != 0 and "belongs to a run with other options" in refused.stderr
    assert "--image-position: the interrupted run had 'after', this command has 'before'" in refused.stderr
    assert "--seed: the interrupted run had 0, this command has 1" in refused.stderr
    assert "The interrupted run's command: python " in refused.stderr and "resumed at" not in refused.stdout
    assert json.loads((tuned / "card.json").read_text())["steps"] == 2  # nothing written
    completed = subprocess.run(resume, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "resumed at step 2/3" in completed.stdout
    assert json.loads((tuned / "card.json").read_text())["steps"] == 3

    # With LoRA adapters on the decoder (experimental), the merged decoder is written beside the projector.
    adapted = tmp_path / "lora"
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_projector.py"), "--profile", "tiny",
         "--data", f"jsonl:{data}:train", "--batch-size", "4", "--max-steps", "2", "--lora", "2",
         "--lora-lr", "0.05", "--val", "2", "--out", str(adapted)],
        capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    card = json.loads((adapted / "card.json").read_text())
    assert card["lora"] == 2 and card["steps"] == 2
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_path(tiny_settings.decoder.name_or_path), dtype=torch.float32)
    tuned_decoder = AutoModelForCausalLM.from_pretrained(adapted / "decoder", dtype=torch.float32)
    base_weights, tuned_weights = base.state_dict(), tuned_decoder.state_dict()
    assert base_weights.keys() == tuned_weights.keys()  # a plain model: the adapters are merged
    changed = [name for name in base_weights if not torch.equal(base_weights[name], tuned_weights[name])]
    assert changed and all(re.search(r"(q|k|v|o|gate|up|down)_proj", name) for name in changed)

    # Resuming a run without adapters as a LoRA run is refused, not silently started from zero adapters.
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_projector.py"), "--profile", "tiny",
         "--data", f"jsonl:{data}:train", "--batch-size", "4", "--max-steps", "3", "--lora", "2",
         "--out", str(tuned), "--resume"],
        capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode != 0 and "--lora: the interrupted run had 0, this command has 2" in completed.stderr


def test_resume_accepts_an_option_added_after_the_checkpoint_only_at_its_default(tmp_path, capsys):
    """A checkpoint written before an option existed does not record it: left at the parser's default
    (the older run's behaviour) the run resumes, saying so; set otherwise, or without the defaults, it is
    refused like any other difference."""
    checkpoint = tmp_path / "checkpoint.pt"
    saved = {"seed": 0, "lr": 3e-4}
    defaults = {"seed": 0, "lr": 1e-3, "contrast_partner": "batch"}
    check_resume(saved, {**saved, "contrast_partner": "batch"}, checkpoint, defaults=defaults)
    assert "written before --contrast-partner existed; resuming with its default" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--contrast-partner: the interrupted run had \\(not recorded\\), "
                                         "this command has 'counterfactual'"):
        check_resume(saved, {**saved, "contrast_partner": "counterfactual"}, checkpoint, defaults=defaults)
    with pytest.raises(SystemExit, match="--contrast-partner"):
        check_resume(saved, {**saved, "contrast_partner": "batch"}, checkpoint)
    # A recorded option is compared with the checkpoint, never with the default.
    with pytest.raises(SystemExit, match="--lr: the interrupted run had 0.0003, this command has 0.001"):
        check_resume(saved, {"seed": 0, "lr": 1e-3}, checkpoint, defaults=defaults)
