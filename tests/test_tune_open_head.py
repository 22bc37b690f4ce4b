"""scripts/tune_open_head.py: the threshold above which the answer head answers open questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import load_script

tune_open_head = load_script("tune_open_head")


def _row(qid, reference, decoder, head, probability, answer_type="OPEN"):
    return {"qid": qid, "question": "q", "reference": reference, "answer_type": answer_type, "no_retrieval": decoder,
            **({"head_open": {"answer": head, "probability": probability, "answered": False}} if head else {})}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_threshold_gives_the_head_the_questions_it_gets_right(tmp_path, capsys):
    # The head is right when confident (0.9), wrong when not (0.3); the decoder is right on the latter.
    slake = _write(tmp_path / "eval-x-heldout-slake-y.jsonl", [
        _row("a", "Liver", "lung", "Liver", 0.9), _row("b", "CT", "CT", "MRI", 0.3),
        _row("c", "Yes", "Yes", None, None, "CLOSED"),  # closed rows are not read
        dict(_row("f", "kidney", "Kidney", None, None), question="Which is denser, the cyst or the kidney?")])
    pathvqa = _write(tmp_path / "eval-x-heldout-pathvqa-y.jsonl", [
        _row("d", "a long answer", "a long answer", "Liver", 0.2), _row("e", "liver", "no", "Liver", 0.95)])
    # The question naming its options is the decoder's at every threshold.
    assert tune_open_head.recall_at(tune_open_head.load_rows(slake), 0.0) == (2 / 3, 2 / 3)
    assert tune_open_head.recall_at(tune_open_head.load_rows(slake), 1.0) == (2 / 3, 0.0)
    assert tune_open_head.main([str(slake), str(pathvqa), "--no-similarity", "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    # Every threshold from 0.3 to 0.85 gives both files full recall; the highest is chosen.
    assert out["chosen"] == 0.85 and out["questions"] == {"heldout-slake": 3, "heldout-pathvqa": 2}
    best = next(line for line in out["thresholds"] if line["threshold"] == 0.85)
    assert best["mean_recall"] == 1.0 and best["by_file"]["heldout-slake"]["head_share"] == 1 / 3
    assert "chosen decoder.head_open_min_probability = 0.85" in capsys.readouterr().out


def test_runs_without_the_heads_reading_or_with_its_answers_are_refused(tmp_path):
    missing = _write(tmp_path / "a.jsonl", [_row("a", "Liver", "lung", None, None)])
    with pytest.raises(SystemExit, match="lack the head's reading"):
        tune_open_head.load_rows(missing)
    answered = _row("a", "Liver", "Liver", "Liver", 0.9)
    answered["head_open"]["answered"] = True
    with pytest.raises(SystemExit, match="threshold at 1"):
        tune_open_head.load_rows(_write(tmp_path / "b.jsonl", [answered]))


def _like(row, similarity):
    row["head_open"]["similarity"] = similarity
    return row


def test_the_similarity_threshold_keeps_the_head_to_questions_like_its_training_ones(tmp_path, capsys, monkeypatch):
    # The head is right on the questions like its training ones (0.97, 0.9), wrong on the unlike one
    # (0.6), where the decoder is right; on PathVQA a question at 0.8 the head gets right.
    slake = _write(tmp_path / "eval-x-heldout-slake-y.jsonl", [
        _like(_row("a", "Liver", "lung", "Liver", 0.9), 0.97), _like(_row("b", "CT", "CT", "MRI", 0.9), 0.6),
        _like(_row("c", "Lung", "lung", "Lung", 0.9), 0.9)])
    pathvqa = _write(tmp_path / "eval-x-heldout-pathvqa-y.jsonl", [
        _like(_row("d", "liver", "no", "Liver", 0.95), 0.8), _like(_row("e", "a b c d", "a", "x", 0.9), 0.99)])
    questions = tmp_path / "other.txt"
    questions.write_text("Describe the findings.\nWhy?\n")
    tables = {"slake": tune_open_head.load_rows(slake), "pathvqa": tune_open_head.load_rows(pathvqa)}
    assert tune_open_head.recall_at(tables["slake"], 0.05, min_similarity=0.65) == (1.0, 2 / 3)
    chosen, lines = tune_open_head.choose_similarity(tables, 0.05, tolerance=0.0, free_form=[0.3, 0.85])
    # Best mean 0.75 from 0.65 to 0.80; from 0.85 PathVQA's right head answer goes to the wrong decoder.
    assert chosen == 0.8
    assert [line["free_form_to_head"] for line in lines if line["min_similarity"] in (0.0, 0.8, 0.9)] == [1.0, 0.5, 0.0]
    # A tolerance of 25 points lets it go to 0.97 (a mean of 0.5 from 0.85); at 0.98 SLAKE's "a" goes too.
    assert tune_open_head.choose_similarity(tables, 0.05, tolerance=25.0)[0] == 0.97
    # What the decoder and the head do on the questions handed over: PathVQA's "d" at 0.85.
    assert tune_open_head.handed_over(tables["pathvqa"], 0.05, 0.85) == (1, 0.0, 1.0)
    # The runs recorded the similarities, so main needs no head (the free-form questions it does embed:
    # here with a stand-in for the head's embedder).
    monkeypatch.setattr(tune_open_head, "head_similarities",
                        lambda path: (lambda qs: [0.3 if q == "Why?" else 0.85 for q in qs]))
    assert tune_open_head.main([str(slake), str(pathvqa), "--tolerance", "0", "--free-form", str(questions),
                                "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["chosen_similarity"] == 0.8 and out["free_form_questions"] == 2 and out["tolerance"] == 0
    assert "chosen decoder.head_open_min_similarity = 0.8" in capsys.readouterr().out


def test_other_questions_are_read_from_text_or_llava_med_jsonl(tmp_path):
    text = tmp_path / "q.txt"
    text.write_text("What is shown?\n\nWhy?\n")
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text(json.dumps({"question_id": 0, "text": "What is the organ in the image?\n<image>"}) + "\n")
    assert tune_open_head.read_questions(text) == ["What is shown?", "Why?"]
    assert tune_open_head.read_questions(jsonl) == ["What is the organ in the image?"]


def test_two_runs_of_one_data_set_are_refused(tmp_path):
    rows = [_like(_row("a", "Liver", "lung", "Liver", 0.9), 0.97)]
    first = _write(tmp_path / "eval-a-heldout-slake-1.jsonl", rows)
    second = _write(tmp_path / "eval-b-heldout-slake-2.jsonl", rows)
    with pytest.raises(SystemExit):
        tune_open_head.main([str(first), str(second)])
