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
    assert tune_open_head.main([str(slake), str(pathvqa), "--json", str(tmp_path / "out.json")]) == 0
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
