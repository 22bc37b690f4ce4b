"""scripts/tune_closed.py's grid, from saved scores, overall and by data spec (no model is run)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def _spec(folder: Path, name: str, answers: list[str], shade: int) -> str:
    (folder / "images").mkdir(parents=True)
    rows = []
    for k, answer in enumerate(answers):
        Image.new("L", (8, 8), shade + k).save(folder / "images" / f"{k}.png")
        rows.append({"qid": f"{name}-{k}", "image": f"{k}.png", "question": "Is the heart enlarged?",
                     "answer": answer, "answer_type": "CLOSED"})
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"jsonl:{folder}:train"


def test_grid_overall_and_by_source(tmp_path):
    first = _spec(tmp_path / "a", "a", ["Yes", "No", "Yes"], 10)
    second = _spec(tmp_path / "b", "b", ["No", "No"], 100)
    # Forms: Yes, No; the model leans No on every question by 0.15.
    real = np.tile([-1.15, -1.0], (5, 1))
    np.savez(tmp_path / "scores.npz", real=real, shuffled=real, answers=np.asarray(["yes", "no", "yes", "no", "no"]),
             presupposed=np.asarray([False, False, True, False, False]), engine=np.asarray("test"))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune_closed.py"), "--reuse", "--by-source",
                             "--data", first, second, "--holdout-percent", "100", "--scores", str(tmp_path / "scores.npz"),
                             "--yes-bias", "0", "0.2"], capture_output=True, text=True, cwd=ROOT, check=True)
    out = result.stdout
    # The third question is scored through the open question it presupposes (offline profile): left out.
    assert "4 held-out yes/no questions" in out
    assert "| 0 | 75.0 | 75.0 | 0.0 |" in out and "| 0.2 | 25.0 | 25.0 | 100.0 |" in out
    assert "a:train: 2 questions (50.0 % yes)" in out and "b:train: 2 questions (0.0 % yes)" in out
    by_source = out.split("a:train: 2 questions")[1]
    assert "| 0 | 50.0 | 50.0 | 0.0 |" in by_source and "| 0 | 100.0 | 100.0 | 0.0 |" in by_source
    assert json.loads(out.strip().splitlines()[-1])["best"] == {"yes_bias": 0.0}
