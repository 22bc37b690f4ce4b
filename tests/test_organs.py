"""Organ-presence questions from SLAKE's training annotations (medvqa_train/organs.py)."""

import json
import subprocess
import sys
from pathlib import Path

from medvqa.datasets import load_specs
from medvqa_train.organs import organ_labels, organ_questions, organs_named

ROOT = Path(__file__).resolve().parents[1]


def _row(image, question, answer, location, kind="CLOSED"):
    return {"img_name": f"{image}/source.jpg", "question": question, "answer": answer, "answer_type": kind,
            "location": location, "q_lang": "en", "qid": 0}


def _slake(tmp_path: Path) -> tuple[Path, Path]:
    slake, boxes = tmp_path / "slake", tmp_path / "boxes"
    rows = [
        _row("xmlab1", "Does the picture contain liver?", "Yes", "Abdomen"),
        _row("xmlab1", "What is the largest organ in the picture?", "Liver", "Abdomen", "OPEN"),
        _row("xmlab2", "Does the picture contain spleen?", "No", "Abdomen"),
        _row("xmlab3", "Which organs appear in pairs?", "Left Lung, Right Lung", "Lung", "OPEN"),
        _row("xmlab4", "Is this a CT?", "Yes", "Brain"),
        _row("xmlab4", "您好", "是", "Brain") | {"q_lang": "zh"},
    ]
    slake.mkdir()
    (slake / "train.json").write_text(json.dumps(rows))
    for image in ("xmlab1", "xmlab2", "xmlab3", "xmlab4"):
        (slake / "imgs" / image).mkdir(parents=True)
        (slake / "imgs" / image / "source.jpg").write_bytes(image.encode())  # distinct content, distinct hash
    (boxes / "xmlab2").mkdir(parents=True)
    (boxes / "xmlab2" / "detection.json").write_text(json.dumps([{"Spleen": [1, 2, 3, 4]}, {"Left Kidney": [1, 2, 3, 4]}]))
    (boxes / "xmlab4").mkdir(parents=True)
    (boxes / "xmlab4" / "detection.json").write_text(json.dumps([{"Brain Edema": [1, 2, 3, 4]}]))
    return slake, boxes


def test_organs_named_reads_box_labels_and_answers():
    assert organs_named("Right Lung") == {"Lung"}
    assert organs_named("Liver, Kidney") == {"Liver", "Kidney"}
    assert organs_named("Left Femoral Head") == {"Femoral Head"}
    assert organs_named("Brain Edema") == {"Brain"}
    assert organs_named("Brain Stem") == {"Brain Stem"}
    assert organs_named("Kidneys") == {"Kidney"}
    assert organs_named("Left Eye") == {"Eyes"} and organs_named("Right Ear") == {"Ears"}
    assert organs_named("Left Humerus Head") == {"Humerus Head"} and organs_named("Esophagus") == {"Esophagus"}
    assert organs_named("Cardiomegaly") == set()


def test_labels_come_from_answers_boxes_and_locations(tmp_path):
    slake, boxes = _slake(tmp_path)
    labels = organ_labels(slake, boxes)
    assert set(labels) == {"xmlab1/source.jpg", "xmlab2/source.jpg", "xmlab3/source.jpg", "xmlab4/source.jpg"}
    one, two = labels["xmlab1/source.jpg"], labels["xmlab2/source.jpg"]
    assert one["present"] == {"Liver"}
    assert two["present"] == {"Kidney"}, "an explicit No outweighs the box"
    assert "Spleen" in two["absent"]
    assert labels["xmlab3/source.jpg"]["present"] == {"Lung"}
    assert labels["xmlab4/source.jpg"]["present"] == {"Brain"}
    # no abdomen image shows the lung, so it is absent from both; the liver is seen in the abdomen,
    # so an abdomen image without a label for it is unknown, neither present nor absent
    assert "Lung" in one["absent"] and "Lung" in two["absent"]
    assert "Liver" not in two["absent"] and "Liver" not in two["present"]
    assert "Liver" in labels["xmlab4/source.jpg"]["absent"]


def test_questions_are_balanced_readable_and_deterministic(tmp_path):
    slake, boxes = _slake(tmp_path)
    rows = organ_questions(slake, boxes, per_image=2, seed=0)
    assert rows == organ_questions(slake, boxes, per_image=2, seed=0)
    assert sum(row["answer"] == "Yes" for row in rows) == sum(row["answer"] == "No" for row in rows) == 4
    assert all(row["question"].startswith(("Does the picture contain ", "Does this image contain ")) for row in rows)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_organ_questions.py"), "--slake", str(slake),
                             "--slake-annotations", str(boxes), "--per-image", "2", "--holdout-percent", "0",
                             "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, check=True)
    assert "8 questions on 4 images" in result.stdout
    examples = load_specs([f"jsonl:{out}:slake-organs"])
    assert len(examples) == 8 and all(example.image.is_file() for example in examples)
    assert {example.answer for example in examples} == {"Yes", "No"}


def test_held_out_images_are_skipped_altogether(tmp_path):
    from medvqa_train.medical import content_hash, held_out_hash

    slake, boxes = _slake(tmp_path)
    names = ("xmlab1", "xmlab2", "xmlab3", "xmlab4")
    assert organ_labels(slake, boxes, holdout_percent=100.0) == {}
    assert organ_questions(slake, boxes, holdout_percent=100.0) == []
    # the image in the lowest bucket alone held out: it is skipped, the others are labelled
    first = {name: next(p for p in range(1, 101) if held_out_hash(content_hash(slake / "imgs" / name / "source.jpg"), p))
             for name in names}
    lowest = min(first, key=first.get)
    assert sorted(first.values())[0] < sorted(first.values())[1]  # the images' contents are fixed: no tie
    labels = organ_labels(slake, boxes, holdout_percent=first[lowest])
    assert set(labels) == {f"{name}/source.jpg" for name in names if name != lowest}
