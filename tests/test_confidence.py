"""Closed-answer confidence: the fit, the verdict, abstention in the pipeline, and the calibration script."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from medvqa.confidence import (CHOICE, PRESUPPOSED, YES_NO, Calibration, fit_platt, leaning_text, load_calibration,
                               question_kind, reliability)
from .conftest import load_script, prompt_gate
from medvqa.pipeline import Conversation, Done, Token


def test_the_fit_recovers_a_known_logistic_and_finds_no_slope_in_noise():
    rng = np.random.default_rng(0)
    margin = rng.uniform(0, 2, 4000)
    right = rng.random(4000) < 1 / (1 + np.exp(-(2.0 * margin - 1.0)))
    a, b = fit_platt(margin, right)
    assert abs(a - 2.0) < 0.25 and abs(b + 1.0) < 0.2
    # A margin that says nothing about being right: a flat fit at the base rate.
    a, b = fit_platt(margin, rng.random(4000) < 0.55)
    assert abs(a) < 0.1 and abs(1 / (1 + np.exp(-(a + b))) - 0.55) < 0.03
    with pytest.raises(ValueError):
        fit_platt([], [])


def test_kinds_verdicts_and_abstention():
    assert question_kind({"yes": 0, "no": 0}) == YES_NO and question_kind({"left": 0, "right": 0}) == CHOICE
    calibration = Calibration({YES_NO: (1.0, 0.0), CHOICE: (4.0, 0.0)})
    low = calibration.judge({"yes": -0.5, "no": -0.6}, min_confidence=0.7)
    assert low.choice == "yes" and abs(low.margin - 0.1) < 1e-9 and low.kind == YES_NO
    assert 0.5 < low.confidence < 0.7 and low.abstained
    assert not calibration.judge({"yes": -0.5, "no": -0.6}, min_confidence=0.7, abstain=False).abstained
    high = calibration.judge({"left lung": -0.1, "right lung": -0.5}, min_confidence=0.7)
    assert high.kind == CHOICE and high.confidence > 0.8 and not high.abstained
    text = leaning_text(low)
    assert text.startswith("Uncertain — the model cannot tell from this image") and "Yes" in text
    # Options are scored lower-cased; the leaning is shown as the question spells it ("CT", not "Ct").
    options = calibration.judge({"ct": -0.5, "mri": -0.6}, min_confidence=0.99)
    assert "leans to CT;" in leaning_text(options, spelling="CT") or "leans to CT," in leaning_text(options, spelling="CT")
    assert "leans to Ct" in leaning_text(options, spelling="MRI")  # another option's spelling is not used
    # No calibration: nothing measured, so no confidence and never an abstention.
    bare = Calibration().judge({"yes": -0.5, "no": -0.6}, min_confidence=0.99)
    assert bare.confidence is None and not bare.abstained


def test_calibration_files_round_trip_and_bad_ones_are_refused(tmp_path):
    path = tmp_path / "calibration.json"
    Calibration({YES_NO: (1.5, -0.2)}, {"fitted_on": {"questions": 3}}).save(path)
    loaded = load_calibration(str(path))
    assert loaded.fits == {YES_NO: (1.5, -0.2)} and loaded.meta["fitted_on"]["questions"] == 3
    assert load_calibration("").fits == {} and load_calibration(str(tmp_path / "missing.json")).fits == {}
    path.write_text(json.dumps({"fits": {YES_NO: {"slope": 1}}}))
    with pytest.raises(ValueError, match="not a closed-answer calibration"):
        load_calibration(str(path))


def test_reliability_bins_count_every_answer():
    rows = reliability([0.55, 0.65, 0.95, 1.0], [True, False, True, True])
    assert sum(row["n"] for row in rows) == 4 and rows[-1]["accuracy"] == 1.0


def _ask(pipeline, question, use_retrieval=False):
    image = np.random.default_rng(3).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    return list(pipeline.ask(Conversation(image=image), question, use_retrieval=use_retrieval, warm=False))


class _Literature:
    """The retriever's interface, with a passage that describes the finding the test asks about."""

    def search(self, query, k=None, safe_meta=None):
        from medvqa.retrieval import Passage

        return [Passage("p1", "Chest radiograph showing an enlarged cardiac silhouette.",
                        "https://pubmed.ncbi.nlm.nih.gov/1/", "", "test", "CC0", 1.0, {"dense": 1}),
                Passage("p2", "The lungs are clear.", "https://pubmed.ncbi.nlm.nih.gov/2/", "", "test", "CC0", 0.5,
                        {"dense": 2})]


def test_the_pipeline_says_uncertain_below_the_threshold_and_answers_above(tiny_pipeline):
    saved = tiny_pipeline.calibration, tiny_pipeline.settings.decoder.abstain, tiny_pipeline.retriever
    try:
        # A calibration under which every yes/no answer is a coin flip.
        tiny_pipeline.calibration = Calibration({YES_NO: (0.0, 0.0), CHOICE: (0.0, 0.0)})
        tiny_pipeline.retriever = _Literature()
        with prompt_gate(tiny_pipeline, "never"):  # passages cited after the answer, for its claim
            events = _ask(tiny_pipeline, "Is the heart enlarged?", use_retrieval=True)
        done = events[-1]
        assert isinstance(done, Done) and done.closed["abstained"] and done.closed["confidence"] == 0.5
        assert done.answer.startswith("Uncertain — the model cannot tell from this image")
        assert done.closed["choice"].capitalize() in done.answer  # the leaning is shown
        assert "".join(e.text for e in events if isinstance(e, Token)).strip() == done.answer
        # "Uncertain" claims nothing: a passage that describes the finding is only related, where a
        # Yes would be supported by it (the same passages, below).
        assert len(done.passages) == 2 and [mark for mark, _ in done.support] == ["related", "related"]
        tiny_pipeline.calibration = Calibration({YES_NO: (0.0, 5.0), CHOICE: (0.0, 5.0)})
        tiny_pipeline.settings.decoder.yes_bias, saved_bias = 50.0, tiny_pipeline.settings.decoder.yes_bias
        try:
            with prompt_gate(tiny_pipeline, "never"):
                sure_yes = _ask(tiny_pipeline, "Is the heart enlarged?", use_retrieval=True)[-1]
        finally:
            tiny_pipeline.settings.decoder.yes_bias = saved_bias
        assert sure_yes.answer == "Yes" and [mark for mark, _ in sure_yes.support] == ["supports", "related"]
        tiny_pipeline.retriever = saved[2]
        tiny_pipeline.calibration = Calibration({YES_NO: (0.0, 0.0), CHOICE: (0.0, 0.0)})
        # The setting that turns abstention off: the same choice, given as the answer.
        tiny_pipeline.settings.decoder.abstain = False
        plain = _ask(tiny_pipeline, "Is the heart enlarged?")[-1]
        assert not plain.closed["abstained"] and plain.answer.lower() == done.closed["choice"]
        assert plain.closed["confidence"] == 0.5  # still shown
        # Confident: answered as before.
        tiny_pipeline.settings.decoder.abstain = True
        tiny_pipeline.calibration = Calibration({YES_NO: (0.0, 5.0), CHOICE: (0.0, 5.0)})
        sure = _ask(tiny_pipeline, "Is the heart enlarged?")[-1]
        assert not sure.closed["abstained"] and sure.answer in ("Yes", "No") and sure.closed["confidence"] > 0.99
    finally:
        tiny_pipeline.calibration, tiny_pipeline.settings.decoder.abstain, tiny_pipeline.retriever = saved


def test_calibrate_closed_fits_on_held_out_training_images(tmp_path, tiny_settings, monkeypatch, capsys):
    """The script end to end on a tiny training split laid out like the public ones (tiny profile)."""
    from PIL import Image

    data = tmp_path / "bench"
    (data / "images").mkdir(parents=True)
    rows = []
    for n in range(4):
        Image.fromarray(np.full((32, 32, 3), 40 * n, np.uint8)).save(data / "images" / f"{n}.png")
        rows += [{"image": f"{n}.png", "question": "Is the liver enlarged?", "answer": "yes" if n % 2 else "no",
                  "answer_type": "CLOSED"},
                 {"image": f"{n}.png", "question": "Is this a CT or an MRI?", "answer": "CT", "answer_type": "CLOSED"},
                 {"image": f"{n}.png", "question": "What organ is shown?", "answer": "liver", "answer_type": "OPEN"}]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    script = load_script("calibrate_closed")
    monkeypatch.setattr(script, "load_settings", lambda profile: copy.deepcopy(tiny_settings))
    monkeypatch.setattr(script, "MIN_PER_KIND", 1)
    out = tmp_path / "calibration.json"
    assert script.main(["--profile", "tiny", "--data", f"jsonl:{data}:train", "--val", "2", "--val-by-image",
                        "--out", str(out), "--scores", str(tmp_path / "scores.npz")]) == 0
    saved = json.loads(out.read_text())
    # Every kind gets a fit; a kind with fewer than MIN_PER_KIND questions (none here) gets the pooled one.
    assert set(saved["fits"]) == {YES_NO, CHOICE, PRESUPPOSED}
    kept = np.load(tmp_path / "scores.npz")
    pooled = fit_platt(kept["margin"].astype(float), kept["correct"].astype(bool))
    assert saved["fits"][PRESUPPOSED] == pytest.approx({"a": pooled[0], "b": pooled[1]})
    fitted = saved["fitted_on"]
    # The engine that scored the answers is kept with the scores and recorded; so are the folds' draws.
    assert saved["engine"] == str(kept["engine"]) == "transformers" and fitted["out_of_fold_draws"] > 1
    assert fitted["val_by_image"] and fitted["images"] >= 2 and fitted["by_kind"] == {YES_NO: fitted["images"],
                                                                                      CHOICE: fitted["images"],
                                                                                      PRESUPPOSED: 0}
    assert saved["out_of_fold"]["min_confidence"] == tiny_settings.decoder.min_confidence
    assert saved["threshold"]["target_accuracy"] == 0.8 and isinstance(saved["threshold"]["met"], bool)
    # The app's accuracy by kind is printed with the fit, matching the saved scores.
    by_kind = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy_by_kind"]
    kept = np.load(tmp_path / "scores.npz")
    assert by_kind[YES_NO]["n"] == int((kept["kind"] == YES_NO).sum()) == fitted["images"]
    assert by_kind[YES_NO]["accuracy"] == round(float(kept["correct"][kept["kind"] == YES_NO].mean()), 4)
    assert PRESUPPOSED not in by_kind  # the tiny profile scores Yes against No
    # ... and by data spec: every held-out question belongs to the one spec given
    [spec] = [name for name in by_kind if name.startswith("all, ")]
    assert by_kind[spec] == {"n": len(kept["correct"]), "accuracy": round(float(kept["correct"].mean()), 4)}
    assert saved["out_of_fold"]["risk_coverage"]["coverage"][-1] == 1.0
    assert load_calibration(str(out)).fits  # the app reads what the script wrote
    # Each question's image group is kept with its score; groups this small get no fit of their own.
    assert set(kept["group"].tolist()) == {"grey"} and saved["group_sizes"] == {"grey": len(kept["group"])}
    assert "groups" not in saved and saved["app_out_of_fold"]["thresholds"] == {}
    (spec, counts), = saved["groups_by_data"].items()
    assert counts == {"grey": len(kept["group"])} and set(saved["app_out_of_fold"]["by_data"]) == {spec}
    assert saved["app_out_of_fold"]["by_data"][spec]["questions"] == len(kept["group"])
    # With a lower bar the grey images get their own fit, which the app then uses for them.
    monkeypatch.setattr(script, "MIN_PER_GROUP", 2)
    # --reuse refits from the saved scores without the model (scores kept before the groups: from the images).
    older = tmp_path / "older.npz"
    np.savez(older, **{key: kept[key] for key in kept.files if key != "group"})
    assert script.main(["--reuse", "--out", str(out), "--scores", str(older), "--val-by-image"]) == 0
    regrouped = load_calibration(str(out))
    assert set(regrouped.groups) == {"grey"} and regrouped.groups["grey"].group == "grey"
    assert regrouped.for_image(np.zeros((8, 8, 3), np.uint8)) is regrouped.groups["grey"]
    assert regrouped.groups["grey"].meta["questions"] == len(kept["group"])


def _bins_of_ten(right_per_bin=(5, 6, 9, 10), confidences=(0.55, 0.65, 0.75, 0.85)):
    """Ten questions at each out-of-fold confidence, `right_per_bin` of them right."""
    confidence = np.repeat(confidences, 10)
    correct = np.concatenate([np.arange(10) < right for right in right_per_bin])
    return confidence, correct


def test_the_threshold_is_the_lowest_that_reaches_the_target_out_of_fold():
    script = load_script("calibrate_closed")
    confidence, correct = _bins_of_ten()
    # Answering all: 30/40 right; from above 0.55: 25/30, the target reached with the most answered.
    chosen = script.choose_threshold(confidence, correct, target=0.8)
    assert chosen == {"target_accuracy": 0.8, "min_answered": script.MIN_ANSWERED, "min_confidence": 0.56,
                      "met": True, "answered_share_out_of_fold": 0.75, "accuracy_answered_out_of_fold": 0.8333}
    # 19/20 above 0.65, 10/10 above 0.75: too few answered to count as measured.
    assert not script.choose_threshold(confidence, correct, target=0.96)["met"]
    curve = script.risk_coverage(confidence, correct)  # one point per distinct confidence, highest first
    assert curve == {"min_confidence": [0.85, 0.75, 0.65, 0.55], "coverage": [0.25, 0.5, 0.75, 1.0],
                     "accuracy_answered": [1.0, 0.95, 0.8333, 0.75]}
    # A margin that says nothing about being right: no out-of-fold threshold reaches the target.
    rng = np.random.default_rng(0)
    scores = {"margin": rng.uniform(0, 2, 400), "kind": np.full(400, YES_NO), "correct": rng.random(400) < 0.6,
              "image": np.asarray([f"{n % 80}.png" for n in range(400)])}
    held = script.out_of_fold(scores)
    assert script.choose_threshold(held, scores["correct"], target=0.8) == {
        "target_accuracy": 0.8, "min_answered": script.MIN_ANSWERED, "min_confidence": None, "met": False,
        "answered_share_out_of_fold": None, "accuracy_answered_out_of_fold": None}


def test_out_of_fold_confidences_are_the_mean_over_several_draws_of_the_folds():
    """Each draw of the folds gives each question a confidence from fits that never saw it; the scripts use the mean
    over FOLD_DRAWS draws, so the chosen threshold does not hang on one draw."""
    script = load_script("calibrate_closed")
    rng = np.random.default_rng(1)
    margin = rng.uniform(0, 2, 300)
    scores = {"margin": margin, "kind": np.full(300, YES_NO), "correct": rng.random(300) < 0.3 + 0.3 * margin,
              "image": np.asarray([f"{n % 60}.png" for n in range(300)])}
    draws = [script.out_of_fold(scores, seed=k) for k in range(3)]
    assert not np.allclose(draws[0], draws[1])  # another draw of the folds, other fits
    assert np.allclose(script.out_of_fold(scores, draws=3), np.mean(draws, axis=0))
    assert np.array_equal(script.out_of_fold(scores, draws=1), draws[0])
    assert script.FOLD_DRAWS > 1
    # the folds are drawn by content: two names of one image share a fold, in every draw
    content = np.asarray(["a", "b", "a", "c", "d", "e"])
    for seed in range(5):
        which = script.folds_by_content(content, 5, seed)
        assert which[0] == which[2] and len(set(which[[0, 1, 3, 4, 5]].tolist())) == 5
    opened = load_script("calibrate_open")
    mask = np.ones(300, bool)
    both = {"margin": margin, "share": np.full(300, 0.5), "correct": scores["correct"], "content": scores["image"]}
    assert np.allclose(opened.out_of_fold(both, mask, False, draws=2),
                       (opened.out_of_fold(both, mask, False) + opened.out_of_fold(both, mask, False, seed=1)) / 2)


def _out_of_fold_meta(threshold: dict | None = None) -> dict:
    confidence, correct = _bins_of_ten()
    return {"out_of_fold": {"min_confidence": 0.7, "answered": 0.5, "accuracy_answered": 0.95,
                            "reliability": reliability(confidence, correct)},
            **({"threshold": threshold} if threshold else {})}


def test_a_chosen_threshold_replaces_min_confidence_and_older_files_still_load(tmp_path):
    older = tmp_path / "older.json"  # written before the out-of-fold table and the threshold
    older.write_text(json.dumps({"fits": {YES_NO: {"a": 1.0, "b": 0.0}}, "fitted_on": {"questions": 3}}))
    calibration = load_calibration(str(older))
    assert calibration.min_confidence(0.7) == 0.7 and calibration.held_out(0.65) is None
    verdict = calibration.judge({"yes": -0.5, "no": -0.6}, min_confidence=0.7)
    assert verdict.held_out is None and verdict.record()["held_out"] is None
    assert "estimated 52% likely to be right" in leaning_text(verdict)  # as before

    chosen = {"target_accuracy": 0.8, "min_confidence": 0.56, "met": True}
    calibration = Calibration({YES_NO: (1.0, 0.0)}, _out_of_fold_meta(chosen))
    assert calibration.min_confidence(0.7) == 0.56
    assert calibration.min_confidence(0.7, from_calibration=False) == 0.7
    missed = Calibration({YES_NO: (1.0, 0.0)}, _out_of_fold_meta(dict(chosen, min_confidence=None, met=False)))
    assert missed.min_confidence(0.7) == 0.7  # no threshold met the target: the configured one


def test_the_reliability_table_is_split_at_the_threshold_so_given_and_withheld_answers_differ():
    """With the threshold inside a bin, an answer given and one withheld would show the same figure; the
    table gets the threshold as an edge, and each answer the figure of its side."""
    confidence = np.array([0.61, 0.62, 0.63, 0.64, 0.67, 0.68, 0.69, 0.75])
    correct = np.array([0, 1, 0, 0, 1, 1, 0, 1], bool)
    plain = reliability(confidence, correct)
    assert [row["bin"] for row in plain] == ["0.6-0.7", "0.7-0.8"]
    split = reliability(confidence, correct, split_at=0.66)
    assert [(row["bin"], row["n"]) for row in split] == [("0.6-0.66", 4), ("0.66-0.7", 3), ("0.7-0.8", 1)]
    assert reliability(confidence, correct, split_at=0.7) == plain  # already an edge
    calibration = Calibration({YES_NO: (1.0, 0.0)}, {"out_of_fold": {"reliability": split},
                                                     "threshold": {"min_confidence": 0.66, "met": True}})
    withheld, given = calibration.held_out(0.65), calibration.held_out(0.66)
    assert (withheld["bin"], withheld["accuracy"]) == ("0.6-0.66", 0.25)
    assert (given["bin"], given["n"]) == ("0.66-0.7", 3) and abs(given["accuracy"] - 2 / 3) < 1e-3
    # Bins of fewer answers than min_count join their neighbour on the same side, away from the threshold;
    # a side with fewer in all is one bin.
    joined = reliability(confidence, correct, split_at=0.66, min_count=4)
    assert [(row["bin"], row["n"]) for row in joined] == [("0.6-0.66", 4), ("0.66-0.8", 4)]
    assert [(row["bin"], row["n"]) for row in reliability(confidence, correct, split_at=0.66, min_count=5)] == \
        [("0.0-0.66", 4), ("0.66-1.0", 4)]


def test_the_confidence_shown_is_the_out_of_fold_bins(tiny_pipeline, monkeypatch):
    from medvqa.ui.render import _confidence_html
    from medvqa.ui.transcript import export_markdown

    calibration = Calibration({YES_NO: (0.0, 0.4), CHOICE: (0.0, 0.4)}, _out_of_fold_meta())  # all 0.599
    assert calibration.held_out(0.599) == {"bin": "0.5-0.6", "accuracy": 0.5, "n": 10}
    assert calibration.held_out(0.85)["bin"] == "0.8-0.9" and calibration.held_out(0.95) is None  # no such answer
    top = Calibration(meta={"out_of_fold": {"reliability": reliability([0.95, 1.0], [True, False])}})
    assert top.held_out(1.0) == {"bin": "0.9-1.0", "accuracy": 0.5, "n": 2}  # the last bin holds 1.0
    monkeypatch.setattr(tiny_pipeline, "calibration", calibration)
    shown = "answers like this were right 50 % of the time on held-out training images (n = 10)"
    done = _ask(tiny_pipeline, "Is the heart enlarged?")[-1]
    assert done.closed["abstained"] and done.closed["held_out"]["n"] == 10
    assert shown in done.answer and "leans to" in done.answer
    assert _confidence_html(done.closed) == f'<div class="medvqa-confidence medvqa-uncertain">Not answered: {shown}.</div>'
    # With a threshold chosen for a target, the line under a withheld answer says why instead of repeating
    # the leaning's figure; a part where no threshold met the target says that.
    monkeypatch.setattr(calibration, "meta", _out_of_fold_meta({"target_accuracy": 0.8, "min_confidence": 0.66,
                                                                "met": True}))
    withheld = _ask(tiny_pipeline, "Is the heart enlarged?")[-1].closed
    assert withheld["abstained"] and withheld["withheld_below"] == {"target_accuracy": 0.8, "never_met": False}
    assert "answers where held-out answers at that confidence or above were right at least 80 %" in \
        _confidence_html(withheld) and shown not in _confidence_html(withheld)
    monkeypatch.setattr(calibration, "meta", _out_of_fold_meta({"target_accuracy": 0.8, "min_confidence": None,
                                                                "met": False, "abstain": True}))
    never = _ask(tiny_pipeline, "Is the heart enlarged?")[-1].closed
    assert "no confidence of answers like this was right 80 % of the time" in _confidence_html(never)
    monkeypatch.setattr(calibration, "meta", _out_of_fold_meta())
    assert _confidence_html(dict(done.closed, abstained=False)) == f'<div class="medvqa-confidence">Confidence: {shown}.</div>'
    record = {"notice": "n", "exported_at": "t", "profile": "tiny", "scan": {"format": "png", "modality": "", "frames": 1},
              "turns": [{"question": "Is the heart enlarged?", "answer": done.answer, "window": "w", "frame": 1,
                         "stopped": False, "citations": [], "closed": {"choice": "yes", "abstained": True,
                                                                       "confidence": 0.599,
                                                                       "held_out": done.closed["held_out"]}}]}
    assert f"- Confidence: {shown}; not answered (uncertain)" in export_markdown(record)
    # A threshold chosen out of fold below that confidence: answered, unless the setting says otherwise.
    monkeypatch.setattr(calibration, "meta", _out_of_fold_meta({"min_confidence": 0.56, "met": True}))
    assert not _ask(tiny_pipeline, "Is the heart enlarged?")[-1].closed["abstained"]
    monkeypatch.setattr(tiny_pipeline.settings.decoder, "threshold_from_calibration", False)
    assert _ask(tiny_pipeline, "Is the heart enlarged?")[-1].closed["abstained"]


def test_the_command_line_shows_a_closed_answers_confidence(tiny_pipeline, monkeypatch, tmp_path, capsys):
    from PIL import Image

    from medvqa.__main__ import main
    from medvqa.pipeline import Pipeline

    image = tmp_path / "scan.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(image)
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline))
    shown = "answers like this were right 50 % of the time on held-out training images (n = 10)"
    monkeypatch.setattr(tiny_pipeline, "calibration", Calibration({YES_NO: (0.0, 0.4)}, _out_of_fold_meta()))
    assert main(["ask", str(image), "Is the heart enlarged?", "--no-retrieval"]) == 0
    printed = capsys.readouterr().out
    assert "Uncertain — the model cannot tell from this image (it leans to" in printed and shown in printed
    assert "(Confidence:" not in printed  # said once, in the answer
    monkeypatch.setattr(tiny_pipeline, "calibration", Calibration({YES_NO: (0.0, 0.4)},
                                                                  _out_of_fold_meta({"min_confidence": 0.56, "met": True})))
    assert main(["ask", str(image), "Is the heart enlarged?", "--no-retrieval"]) == 0
    printed = capsys.readouterr().out
    assert "Uncertain" not in printed and f"(Confidence: {shown})" in printed
    monkeypatch.setattr(tiny_pipeline, "calibration", Calibration(unused="fitted with projector 000000000000… and so on"))
    assert main(["ask", str(image), "Is the heart enlarged?", "--no-retrieval"]) == 0
    assert ("(Confidence: not measured (the calibration file was fitted with projector 000000000000… and so on))"
            in capsys.readouterr().out)


def test_the_command_line_ends_the_answers_line_before_a_note(tiny_pipeline, monkeypatch, tmp_path, capsys):
    import contextlib
    import sys

    from PIL import Image

    from medvqa.__main__ import main
    from medvqa.pipeline import Pipeline

    image = tmp_path / "scan.png"
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(image)
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline))
    # Passages shown beside the answer are looked for after it: the note comes after the answer's words.
    with contextlib.redirect_stderr(sys.stdout), prompt_gate(tiny_pipeline, "never"):  # as a terminal shows both
        assert main(["ask", str(image), "Is the heart enlarged?", "--no-retrieval"]) == 0
    lines = capsys.readouterr().out.splitlines()
    note = lines.index("(Retrieval is off.)")  # a line of its own, after the answer's
    assert note >= 1 and lines[note - 1].strip() and "\n\n" not in "\n".join(lines[:note + 2])


def test_plot_calibration_writes_an_svg_of_both_panels(tmp_path):
    import xml.etree.ElementTree as ElementTree

    script = load_script("calibrate_closed")
    confidence, correct = _bins_of_ten()
    meta = _out_of_fold_meta(script.choose_threshold(confidence, correct, target=0.8))
    meta["out_of_fold"]["risk_coverage"] = script.risk_coverage(confidence, correct)
    path = tmp_path / "calibration.json"
    Calibration({YES_NO: (1.0, 0.0)}, meta).save(path)
    plot = load_script("plot_calibration")
    assert plot.main([str(path), "-o", str(tmp_path / "calibration.svg")]) == 0
    root = ElementTree.parse(tmp_path / "calibration.svg").getroot()
    svg = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{svg}svg" and len(root.findall(f"{svg}polyline")) == 2  # reliability, risk-coverage
    texts = [text.text for text in root.iter(f"{svg}text")]
    assert "n = 10" in texts and "chosen min_confidence 0.56" in texts
    # One image group's fit, on request; a group the file does not fit is refused with the ones it has.
    grey = Calibration({YES_NO: (1.0, 0.0)}, {**meta, "questions": 40, "images": 9})
    Calibration({YES_NO: (1.0, 0.0)}, meta, groups={"grey": grey}).save(path)
    assert plot.main([str(path), "--group", "grey", "-o", str(tmp_path / "grey.svg")]) == 0
    texts = [text.text for text in ElementTree.parse(tmp_path / "grey.svg").getroot().iter(f"{svg}text")]
    assert any("40 held-out closed questions on 9 grey training images" in (text or "") for text in texts)
    with pytest.raises(SystemExit, match="no fit for image group 'colour' \\(it has: grey\\)"):
        plot.main([str(path), "--group", "colour", "-o", str(tmp_path / "colour.svg")])
    # An older file (no curve, no threshold): the reliability panel alone.
    del meta["out_of_fold"]["risk_coverage"], meta["threshold"]
    Calibration({YES_NO: (1.0, 0.0)}, meta).save(path)
    assert plot.main([str(path), "-o", str(tmp_path / "older.svg")]) == 0
    assert len(ElementTree.parse(tmp_path / "older.svg").getroot().findall(f"{svg}polyline")) == 1


def test_a_calibration_fitted_for_another_projector_or_bias_is_not_used(tmp_path, tiny_pipeline, monkeypatch):
    """The file names the projector (SHA-256) and yes_bias it was fitted with: any other model's
    margins are not what it measured, so its answers are shown as not measured, saying why."""
    import hashlib

    from medvqa.pipeline import Pipeline
    from medvqa.projector import Projector
    from medvqa.ui.render import _confidence_html
    from medvqa.ui.transcript import export_markdown

    weights = tmp_path / "projector.safetensors"
    tiny_pipeline.model.projector.save(weights)
    own = tiny_pipeline.model.projector
    loaded = Projector(own.linear_1.in_features, own.linear_1.out_features, own.linear_2.out_features).load(weights)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert loaded.sha256 == digest and Projector(4, 4, 4).sha256 is None
    monkeypatch.setattr(own, "sha256", digest)
    bias = tiny_pipeline.settings.decoder.yes_bias

    def pipeline_with(meta: dict, model=tiny_pipeline.model) -> Pipeline:
        path = tmp_path / "calibration.json"
        Calibration({YES_NO: (0.0, 0.0), CHOICE: (0.0, 0.0)}, meta).save(path)
        settings = copy.deepcopy(tiny_pipeline.settings)
        settings.decoder.calibration = str(path)
        return Pipeline(settings, tiny_pipeline.engine, model)

    fitted_here = pipeline_with({"projector_sha256": digest, "yes_bias": bias})
    assert fitted_here.calibration.fits and not fitted_here.calibration.unused
    assert pipeline_with({"fitted_on": {"questions": 3}}).calibration.fits  # older files say neither: used

    other = pipeline_with({"projector_sha256": "0" * 64, "yes_bias": bias})
    assert not other.calibration.fits
    assert other.calibration.unused.startswith(f"fitted with projector 000000000000… and this model has "
                                               f"projector {digest[:12]}…")
    done = _ask(other, "Is the heart enlarged?")[-1]
    assert done.closed["confidence"] is None and not done.closed["abstained"] and done.answer in ("Yes", "No")
    assert done.closed["uncalibrated"] == other.calibration.unused
    assert "not measured for this model (the calibration file was fitted with projector 000000000000…" \
        in _confidence_html(done.closed)
    record = {"notice": "n", "exported_at": "t", "profile": "tiny", "scan": {"format": "png", "modality": "", "frames": 1},
              "turns": [{"question": "Is the heart enlarged?", "answer": done.answer, "window": "w", "frame": 1,
                         "stopped": False, "citations": [],
                         "closed": {"choice": done.closed["choice"], "abstained": False, "confidence": None,
                                    "uncalibrated": done.closed["uncalibrated"]}}]}
    assert "- Confidence: not measured (the calibration file was fitted with projector 000000000000…" \
        in export_markdown(record)

    moved = pipeline_with({"projector_sha256": digest, "yes_bias": bias + 0.1})
    assert not moved.calibration.fits and "decoder.yes_bias" in moved.calibration.unused
    # A model whose vision side is not a file of ours (a remote engine) is not what the file measured.
    assert "this model has no projector file" in pipeline_with({"projector_sha256": digest}, model=None).calibration.unused


def test_the_shipped_calibrations_name_their_own_projector_and_bias():
    """Each shipped calibration is in force with its profile's projector file and yes_bias."""
    import hashlib

    from medvqa.config import REPO_ROOT, load_settings
    from medvqa.projector import read_metadata
    from medvqa.vision import encoder_sha256

    for env in ({}, {"MEDVQA_CONFIG": str(REPO_ROOT / "weights" / "offline-imagenet" / "config.json")}):
        settings = load_settings("offline", env=env)
        calibration = load_calibration(settings.decoder.calibration)
        projector = (REPO_ROOT / settings.projector.weights).read_bytes()
        assert calibration.fits and calibration.meta["projector_sha256"]
        assert calibration.unusable_for(hashlib.sha256(projector).hexdigest(), settings.decoder.yes_bias) == ""
        # The medical projector names the encoder it was trained on (the ImageNet one predates the field).
        recorded = read_metadata(REPO_ROOT / settings.projector.weights).get("encoder_sha256")
        assert recorded == (encoder_sha256(settings.vision) if not env else None)


def test_image_groups_and_a_calibration_per_group(tiny_pipeline, tmp_path, monkeypatch):
    """A grey radiograph and a stained slide are told apart by their pixels, and a file fitted per group
    judges each image's answers by its group's fit, threshold and out-of-fold table."""
    from medvqa.confidence import COLOUR, GREY, image_group

    grey = np.repeat(np.random.default_rng(0).integers(0, 256, (20, 20, 1), dtype=np.uint8), 3, axis=2)
    slide = np.stack([np.full((20, 20), 200), np.full((20, 20), 120), np.full((20, 20), 180)], -1).astype(np.uint8)
    assert image_group(grey) == GREY and image_group(grey[..., 0]) == GREY and image_group(slide) == COLOUR
    assert image_group(np.clip(grey.astype(int) + [0, 1, 0], 0, 255).astype(np.uint8)) == GREY  # JPEG-like noise

    pooled = Calibration({YES_NO: (0.0, 0.0)}, _out_of_fold_meta({"min_confidence": 0.7, "met": True}))
    pooled.groups = {COLOUR: Calibration({YES_NO: (0.0, 5.0)}, {"group": COLOUR,
                                                                 "threshold": {"min_confidence": 0.9, "met": True}}),
                     GREY: Calibration({YES_NO: (0.0, -5.0)}, {"group": GREY})}
    path = tmp_path / "calibration.json"
    pooled.save(path)
    loaded = load_calibration(str(path))
    assert set(loaded.groups) == {COLOUR, GREY} and loaded.group is None
    assert loaded.for_image(slide).fits == {YES_NO: (0.0, 5.0)} and loaded.for_image(slide).min_confidence(0.7) == 0.9
    assert loaded.for_image(grey).group == GREY and loaded.for_image(grey).min_confidence(0.7) == 0.7
    assert "group" not in json.loads(path.read_text())["groups"][GREY]  # the key names it
    assert Calibration({YES_NO: (0.0, 0.0)}).for_image(slide).group is None  # no groups: the pooled fit
    # A conversation works its image's group out once per image assigned (closed answers read it).
    conversation = Conversation(image=slide)
    assert conversation.image_group == COLOUR and conversation.__dict__["_image_group"] == COLOUR
    conversation.image = grey
    assert conversation.image_group == GREY

    monkeypatch.setattr(tiny_pipeline, "calibration", loaded)
    done = _ask(tiny_pipeline, "Is the heart enlarged?")[-1]  # _ask's image is coloured noise
    assert done.closed["calibration_group"] == COLOUR and done.closed["confidence"] > 0.99
    assert not done.closed["abstained"]
    grey_done = list(tiny_pipeline.ask(Conversation(image=grey), "Is the heart enlarged?", use_retrieval=False,
                                       warm=False))[-1]
    assert grey_done.closed["calibration_group"] == GREY and grey_done.closed["abstained"]
    # The out-of-fold share shown is the group's, and says so.
    monkeypatch.setattr(loaded.groups[GREY], "meta", {**_out_of_fold_meta(), "group": GREY})
    monkeypatch.setattr(loaded.groups[GREY], "fits", {YES_NO: (0.0, 0.4)})  # 0.599: the 0.5-0.6 bin
    grey_done = list(tiny_pipeline.ask(Conversation(image=grey), "Is the heart enlarged?", use_retrieval=False,
                                       warm=False))[-1]
    assert grey_done.closed["held_out"]["group"] == GREY
    assert "right 50 % of the time on held-out grey training images (n = 10)" in grey_done.answer


def test_evaluate_grounding_reports_the_threshold_of_each_image_group(tiny_settings):
    thresholds = load_script("evaluate_grounding")._thresholds
    decoder = tiny_settings.decoder
    assert thresholds(Calibration(), decoder) is None  # no calibration, no threshold
    pooled = Calibration({YES_NO: (1.0, 0.0)}, {"threshold": {"min_confidence": 0.66, "met": True}})
    assert thresholds(pooled, decoder) == 0.66
    pooled.groups = {"grey": Calibration({YES_NO: (1.0, 0.0)}, {"threshold": {"min_confidence": 0.72, "met": True}}),
                     "colour": Calibration({YES_NO: (1.0, 0.0)}, {"threshold": {"met": False}})}
    assert thresholds(pooled, decoder) == {"colour": decoder.min_confidence, "grey": 0.72, "other images": 0.66}


def test_calibration_groups_split_by_wording_fall_back_to_the_image_group():
    script = load_script("calibrate_closed")
    probe = load_script("probe_calibration_wording")
    rng = np.random.default_rng(5)
    # 500 grey questions worded like training (right more often as the margin grows), 150 worded
    # otherwise (a coin flip at any margin): too few to fit apart, they keep the image group's fit.
    margin = np.concatenate([rng.uniform(0, 4, 500), rng.uniform(0, 4, 150)])
    correct = np.concatenate([rng.uniform(0, 1, 500) < 0.45 + 0.12 * margin[:500], rng.uniform(0, 1, 150) < 0.5])
    similarity = np.concatenate([np.full(500, 0.99), np.full(150, 0.5)])
    scores = {"margin": margin, "correct": correct, "kind": np.full(650, "head"),
              "image": np.asarray([f"img{i % 130}" for i in range(650)]), "group": np.full(650, "grey"),
              "data": np.asarray(["slake"] * 500 + ["vqa-rad"] * 150)}
    worded = script.worded_groups(scores["group"], similarity, 0.9)
    assert set(worded.tolist()) == {"grey, worded like training", "grey, worded otherwise"}
    assert (script.worded_groups(scores["group"], similarity, None) == scores["group"]).all()
    assert list(script.fit_worded(scores, worded, 0.7, 0.8)) == ["grey, worded like training"]  # 150 < 200
    split = probe.app_answers(scores, similarity, 0.9, target=0.8, configured=0.7)
    plain = probe.app_answers(scores, similarity, None, target=0.8, configured=0.7)
    assert set(split["thresholds"]) == {"grey", "grey, worded like training"} and set(plain["thresholds"]) == {"grey"}
    # The questions worded otherwise are judged exactly as with the image groups alone.
    assert split["by_data"]["vqa-rad"] == plain["by_data"]["vqa-rad"]
    # The split value answering the most at the target is chosen; one short of the target never is.
    many_wrong = {"like": 0.8, "answered": 1.0, "accuracy_answered": 0.5}
    few_right = {"like": 0.95, "answered": 0.3, "accuracy_answered": 0.9}
    assert probe.choose([dict(plain, like=None), many_wrong, few_right], 0.8) == 0.95
    assert probe.choose([dict(plain, like=None), many_wrong], 0.8) is None


def test_a_part_whose_threshold_reaches_no_target_gets_the_configured_one_as_in_the_app():
    script = load_script("calibrate_closed")
    rng = np.random.default_rng(6)
    # 300 questions worded otherwise, right half of the time at any margin: their part is fitted (300 >= 200)
    # but no threshold reaches 80 %; out of fold they are judged at decoder.min_confidence, as the app does.
    margin = np.concatenate([rng.uniform(0, 4, 400), rng.uniform(0, 4, 300)])
    correct = np.concatenate([rng.uniform(0, 1, 400) < 0.45 + 0.12 * margin[:400], rng.uniform(0, 1, 300) < 0.5])
    scores = {"margin": margin, "correct": correct, "kind": np.full(700, "head"),
              "image": np.asarray([f"img{i % 140}" for i in range(700)]), "group": np.full(700, "grey"),
              "data": np.asarray(["slake"] * 400 + ["vqa-rad"] * 300)}
    worded = script.worded_groups(scores["group"], np.concatenate([np.full(400, 0.99), np.full(300, 0.5)]), 0.9)
    parts = script.fit_worded(scores, worded, 0.7, 0.8)
    assert not parts["grey, worded otherwise"][0].meta["threshold"]["met"]
    held = script.out_of_fold(scores)
    result = script.app_out_of_fold(scores, held, 0.6, script.fit_groups(scores, 0.7, 0.8), worded, parts, 0.77)
    assert result["thresholds"]["grey, worded otherwise"] == 0.77


def test_a_calibration_fitted_by_wording_judges_worded_questions_by_their_fit():
    from medvqa.confidence import WORDED, WORDED_OTHERWISE, held_out_text

    grey, worded = Calibration({YES_NO: (1.0, 0.0)}), Calibration({YES_NO: (2.0, 0.0)})
    calibration = Calibration({YES_NO: (0.5, 0.0)}, {"wording": {"min_similarity": 0.9}},
                              groups={"grey": grey, "grey" + WORDED: worded})
    assert calibration.wording == 0.9
    assert calibration.for_group("grey", 0.95) is worded and calibration.for_group("grey", 0.5) is grey
    otherwise = Calibration({YES_NO: (0.2, 0.0)})
    calibration.groups["grey" + WORDED_OTHERWISE] = otherwise
    assert calibration.for_group("grey", 0.5) is otherwise and calibration.for_group("grey") is grey
    assert calibration.for_group("grey") is grey and calibration.for_group("colour", 0.95) is calibration
    assert Calibration({YES_NO: (1.0, 0.0)}, groups={"grey": grey}).for_group("grey", 0.99) is grey
    text = held_out_text({"group": "grey" + WORDED, "accuracy": 0.83, "n": 40})
    assert text.endswith("held-out grey training images, of questions worded like the training questions (n = 40)")
    assert "worded unlike the training questions (n = 9)" in held_out_text(
        {"group": "grey" + WORDED_OTHERWISE, "accuracy": 0.5, "n": 9})


def test_a_calibration_fitted_by_wording_is_written_for_the_answerer_it_was_fitted_with(tmp_path):
    from types import SimpleNamespace

    script = load_script("calibrate_closed")
    data = ["vqa-rad:train"]
    questions = script.held_out_closed(SimpleNamespace(data=data, val=400, val_by_image=False, seed=0,
                                                       holdout_percent=15.0))
    rng = np.random.default_rng(7)
    n = len(questions)
    margin = rng.uniform(0, 4, n)
    scores = tmp_path / "scores.npz"
    np.savez(scores, margin=margin, kind=np.full(n, YES_NO), correct=rng.uniform(0, 1, n) < 0.45 + 0.12 * margin,
             image=np.asarray([str(example.image) for _, example in questions]), group=np.full(n, "grey"))
    out = tmp_path / "calibration.json"
    assert script.main(["--data", *data, "--holdout-percent", "15", "--scores", str(scores), "--reuse",
                        "--out", str(out), "--wording-similarity", "0.9"]) == 0
    written = json.loads(out.read_text())
    # The decoder's fit stays the decoder's: loading the questions' head does not make it the head's.
    assert "closed_answerer" not in written and not written["command"].startswith("MEDVQA_")
    assert written["wording"]["min_similarity"] == 0.9 and written["wording"]["yes_no_questions_sha256"]
    assert sum(written["wording"]["questions"].values()) == n


def test_a_calibration_split_by_the_heads_agreement_judges_each_part_by_its_fit():
    from medvqa.confidence import AGREES, DISAGREES, held_out_text

    grey, agreeing = Calibration({YES_NO: (1.0, 0.0)}), Calibration({YES_NO: (3.0, 0.0)})
    calibration = Calibration({YES_NO: (0.5, 0.0)}, {"agreement": {"answer_head_digest": "ab" * 32}},
                              groups={"grey": grey, "grey" + AGREES: agreeing})
    assert calibration.agreement == "ab" * 32 and Calibration().agreement is None
    assert calibration.for_group("grey", agrees=True) is agreeing
    assert calibration.for_group("grey", agrees=False) is grey  # no part fitted: the image group's
    assert calibration.for_group("grey") is grey and calibration.for_group("colour", agrees=True) is calibration
    disagreeing = Calibration({YES_NO: (0.1, 0.0)})
    calibration.groups["grey" + DISAGREES] = disagreeing
    assert calibration.for_group("grey", agrees=False) is disagreeing
    # A file without `agreement` ignores the reading.
    assert Calibration({YES_NO: (1.0, 0.0)}, groups={"grey": grey}).for_group("grey", agrees=True) is grey
    assert held_out_text({"group": "grey" + AGREES, "accuracy": 0.84, "n": 120}).endswith(
        "held-out grey training images, where the image encoder's own reading gave the same answer (n = 120)")
    assert "where the image encoder's own reading gave the other answer (n = 30)" in held_out_text(
        {"group": "colour" + DISAGREES, "accuracy": 0.5, "n": 30})


def test_a_fit_may_weigh_the_heads_strength(tmp_path):
    """fit_platt with a strength column recovers its slope; a part's (a, b, c) fit is saved and loaded, and
    gives no confidence without the strength it was fitted on."""
    rng = np.random.default_rng(5)
    margin, strength = rng.uniform(-1, 3, 6000), rng.uniform(0, 5, 6000)
    right = rng.uniform(0, 1, 6000) < 1 / (1 + np.exp(-(0.8 * margin - 1.0 + 0.6 * strength)))
    a, b, c = fit_platt(margin, right, strength)
    assert abs(a - 0.8) < 0.15 and abs(b + 1.0) < 0.2 and abs(c - 0.6) < 0.1
    assert len(fit_platt(margin, right)) == 2
    part = Calibration({YES_NO: (a, b, c)}, {"group": "grey, image encoder agrees"})
    whole = Calibration({YES_NO: (1.0, 0.0)}, {"agreement": {"answer_head_digest": "ab" * 32,
                                                             "strength": {"min_similarity": 0.0}}},
                        groups={"grey, image encoder agrees": part})
    whole.save(tmp_path / "c.json")
    loaded = Calibration.load(tmp_path / "c.json")
    assert loaded.groups["grey, image encoder agrees"].fits[YES_NO] == pytest.approx((a, b, c))
    assert loaded.strength_wording == (0.0, "") and Calibration().strength_wording is None
    assert loaded.weighs_strength is False and loaded.groups["grey, image encoder agrees"].weighs_strength
    assert part.confidence(1.0, YES_NO) is None  # not what the fit describes
    assert part.confidence(1.0, YES_NO, 2.0) == pytest.approx(1 / (1 + np.exp(-(a + b + 2 * c))))
    verdict = part.judge({"yes": -0.2, "no": -1.2}, min_confidence=0.5, strength=4.0)
    assert verdict.choice == "yes" and verdict.confidence > part.confidence(1.0, YES_NO, 0.0)


def test_a_disagreeing_part_no_threshold_reaches_says_uncertain_to_all(monkeypatch):
    """fit_agreement marks a part whose answers reach the target at no threshold out of fold `abstain`: the app
    then says "Uncertain" to every answer of it, where decoder.min_confidence would answer some below it."""
    from medvqa.confidence import DISAGREES, NEVER

    script = load_script("calibrate_closed")
    rng = np.random.default_rng(4)
    n = 600
    labels = np.asarray(["grey" + DISAGREES] * n)
    strength = rng.uniform(0, 4, n)
    scores = {"margin": rng.uniform(0, 3, n), "kind": np.full(n, YES_NO), "group": np.full(n, "grey"),
              "image": np.asarray([f"i{i % 150}" for i in range(n)])}
    scores["correct"] = rng.uniform(0, 1, n) < 0.75 - 0.1 * strength  # never 80 % right at any confidence
    fitted = script.fit_agreement(scores, labels, 0.7, 0.8, strength)
    part, held = fitted["grey" + DISAGREES]
    assert part.meta["threshold"]["met"] is False and part.meta["threshold"]["abstain"] is True
    assert (held >= 0.7).any()  # decoder.min_confidence would have answered some
    assert part.min_confidence(0.7) == NEVER and part.min_confidence(0.7, from_calibration=False) == 0.7
    assert part.judge({"yes": 0.0, "no": -9.0}, part.min_confidence(0.7), strength=0.0).abstained
    result = script.app_out_of_fold({**scores, "group": labels}, held, 0.7, {}, labels, fitted, 0.7)
    assert result["answered"] == 0 and result["thresholds"] == {"grey" + DISAGREES: None}
    # An image group (not a part) reaching no target keeps decoder.min_confidence, as before.
    assert Calibration({YES_NO: (1.0, 0.0)}, {"threshold": {"met": False, "min_confidence": None}}).min_confidence(0.7) == 0.7


def test_agreement_labels_only_the_decoders_yes_no_answers():
    script = load_script("calibrate_closed")
    groups = np.asarray(["grey", "grey", "grey", "colour", "grey"])
    kinds = np.asarray([YES_NO, PRESUPPOSED, CHOICE, YES_NO, "head"])
    choices = np.asarray(["yes", "no", "left", "no", "yes"])
    margins = np.asarray([1.5, 0.4, 2.0, -0.3, 3.0])
    assert script.agreement_groups(groups, kinds, choices, margins).tolist() == [
        "grey, image encoder agrees", "grey, image encoder disagrees", "grey", "colour, image encoder agrees", "grey"]
    assert script.decoder_choices({"choice": np.asarray(["Yes", "No", "Left"])}, "s.npz").tolist() == ["yes", "no", "left"]
    with pytest.raises(SystemExit, match="score again"):  # scores kept before the decoder's answers were
        script.decoder_choices({"correct": np.asarray([False, True, True])}, "s.npz")


def test_a_calibration_fitted_by_agreement_names_the_head_and_fits_its_parts(tmp_path, monkeypatch):
    from types import SimpleNamespace

    script = load_script("calibrate_closed")
    data = ["vqa-rad:train"]
    questions = script.held_out_closed(SimpleNamespace(data=data, val=400, val_by_image=False, seed=0,
                                                       holdout_percent=15.0))
    n = len(questions)
    rng = np.random.default_rng(8)
    margin = rng.uniform(0, 4, n)
    choice = np.asarray(["Yes" if i % 2 else "No" for i in range(n)])
    # The head reads 80 % of them as the decoder answered (a part of 200 or more), and those are right more often.
    agrees = rng.uniform(0, 1, n) < 0.8
    monkeypatch.setattr(script, "head_margins", lambda settings, asked: np.where(
        agrees == (choice == "Yes"), 1.0, -1.0))
    correct = np.where(agrees, rng.uniform(0, 1, n) < 0.55 + 0.1 * margin, rng.uniform(0, 1, n) < 0.4)
    kind = np.asarray([YES_NO] * (n - 10) + [CHOICE] * 10)  # the last 10 name their options: not read
    scores = tmp_path / "scores.npz"
    np.savez(scores, margin=margin, kind=kind, correct=correct, choice=choice, group=np.full(n, "grey"),
             image=np.asarray([str(example.image) for _, example in questions]))
    out = tmp_path / "calibration.json"
    arguments = ["--data", *data, "--holdout-percent", "15", "--scores", str(scores), "--reuse", "--out", str(out)]
    with pytest.raises(SystemExit):
        script.main([*arguments, "--head-agreement", "--wording-similarity", "0.9"])
    assert script.main([*arguments, "--head-agreement", "--no-head-strength"]) == 0
    plain = json.loads(out.read_text())
    assert plain["agreement"]["strength"] is None
    assert all("c" not in fit for part in plain["groups"].values() for fit in part["fits"].values())
    assert script.main([*arguments, "--head-agreement"]) == 0
    written = json.loads(out.read_text())
    # By default each part also weighs the head's strength on questions worded like its training yes/no ones.
    assert written["agreement"]["strength"]["min_similarity"] == 0.9
    assert written["agreement"]["strength"]["yes_no_questions_sha256"]
    assert all("c" in fit for fit in written["groups"]["grey, image encoder agrees"]["fits"].values())
    assert all("c" not in fit for fit in written["groups"]["grey"]["fits"].values())
    from medvqa.answer_head import AnswerHead
    from medvqa.config import load_settings, resolve_path
    assert written["agreement"]["answer_head_digest"] == AnswerHead.digest_of(
        resolve_path(load_settings("offline").decoder.answer_head))
    counts = written["agreement"]["questions"]
    assert counts == {"grey": 10, "grey, image encoder agrees": int(agrees[:-10].sum()),
                      "grey, image encoder disagrees": int((~agrees[:-10]).sum())}
    assert counts["grey, image encoder agrees"] >= script.MIN_PER_GROUP
    assert {"grey, image encoder agrees"} <= set(written["groups"])
    by_data = written["agreement"]["accuracy_by_data"]["vqa-rad"]
    assert by_data["agrees"]["n"] == counts["grey, image encoder agrees"] and by_data["not read"]["n"] == 10
    # The questions left with their image group keep its threshold, out of fold as in the app.
    thresholds = written["app_out_of_fold"]["thresholds"]
    grey = written["groups"]["grey"]["threshold"]
    assert thresholds["grey"] == (grey["min_confidence"] if grey["met"] else load_settings("offline").decoder.min_confidence)
    assert "grey, image encoder agrees" in thresholds


def test_the_heads_readings_come_from_the_shipped_encoder_and_head():
    """head_margins: the head's Yes-minus-No logit, as the app's reading computes it."""
    import torch

    from medvqa.answer_head import AnswerHead
    from medvqa.config import load_settings, resolve_path
    from medvqa.datasets import read_image
    from medvqa.vision import build_vision
    from types import SimpleNamespace

    script = load_script("calibrate_closed")
    questions = script.held_out_closed(SimpleNamespace(data=["vqa-rad:train"], val=400, val_by_image=False, seed=0,
                                                       holdout_percent=15.0))[:3]
    settings = load_settings("offline")
    margins = script.head_margins(settings, questions)
    head = AnswerHead.load(resolve_path(settings.decoder.answer_head))
    vision = build_vision(settings.vision, torch.device("cpu"), torch.float32)
    for (_, example), margin in zip(questions, margins.tolist()):
        with torch.inference_mode():
            tokens = vision.encode(vision.preprocess([read_image(example.image)]))
        scores = head.scores(tokens, example.question)
        assert margin == pytest.approx(scores["yes"] - scores["no"], abs=1e-5)
