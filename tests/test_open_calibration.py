"""How likely an open answer chosen among training answers is to be right, and when the app says "Uncertain"
instead (decoder.open_calibration, scripts/calibrate_open.py, open_choices.judged), with the tiny decoder."""

from __future__ import annotations

import copy
import json
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from medvqa.confidence import (COLOUR, GREY, OPEN_CHOICE, Calibration, Verdict, leaning_text,
                               open_calibration_for)
from medvqa.config import REPO_ROOT, load_settings
from medvqa.open_choices import OpenAnswers, choice_note, fitted_settings, judged, leaning
from medvqa.pipeline import Pipeline

from .test_open_choices import _write

sys.path.insert(0, str(REPO_ROOT / "scripts"))

RECORD = {"answer": "CT", "nearest": "What modality is used to take this image?", "similarity": 1.0,
          "min_similarity": 1.0, "choices": 3, "images": 80, "prior": 0.0, "runner_up": "MRI", "margin": 1.0,
          "share": 0.5}


def _decoder(**changes):
    decoder = SimpleNamespace(abstain=True, min_confidence=0.7, threshold_from_calibration=True,
                              open_choices_min_similarity=1.0, open_choices_max=4, open_choices_min_images=2,
                              open_choices_prior=0.0, open_answerer="decoder")
    return SimpleNamespace(**{**vars(decoder), **changes})


def _part(group: str, fit, threshold: dict, reliability=(), withheld=None) -> dict:
    return {"fits": {OPEN_CHOICE: dict(zip("abc", fit))}, "group": group,
            "threshold": {"target_accuracy": 0.8, **threshold}, "out_of_fold": {"reliability": list(reliability)},
            **({"withheld_out_of_fold": withheld} if withheld else {})}


def _calibration(projector="p" * 64, digest="d" * 64, **settings) -> dict:
    """An open-answer calibration: grey answers at 0.75 and above (a + b + c log share), colour answers never."""
    return {"fits": {OPEN_CHOICE: {"a": 1.0, "b": 0.0}}, "kind": OPEN_CHOICE, "projector_sha256": projector,
            "open_choices": {"open_answers_sha256": digest, "min_similarity": 1.0, "max": 4, "min_images": 2,
                             "prior": 0.0, "answerer": "decoder", **settings},
            "threshold": {"met": True, "min_confidence": 0.6},
            "groups": {GREY: _part(GREY, (2.0, 0.0, 1.0), {"met": True, "min_confidence": 0.75},
                                   [{"bin": "0.0-0.5", "n": 30, "accuracy": 0.3, "mean_confidence": 0.4},
                                    {"bin": "0.5-0.8", "n": 40, "accuracy": 0.55, "mean_confidence": 0.6},
                                    {"bin": "0.8-1.0", "n": 60, "accuracy": 0.85, "mean_confidence": 0.9}],
                                   {"n": 150, "accuracy": 0.45}),
                       COLOUR: _part(COLOUR, (0.5, -2.0, 1.0), {"met": False, "min_confidence": None, "abstain": True},
                                     [{"bin": "0.9-1.0", "n": 2, "accuracy": 1.0, "mean_confidence": 0.95}],
                                     {"n": 994, "accuracy": 0.126})}}


def test_a_chosen_answer_gets_its_image_groups_confidence_and_is_withheld_below_its_threshold(tmp_path):
    path = tmp_path / "open.json"
    path.write_text(json.dumps(_calibration()))
    calibration = Calibration.load(path)
    sigmoid = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    # Grey: sigmoid(2 x margin + log share); 0.5 share, margin 1 -> 0.79, given, with its out-of-fold bin.
    given = judged(RECORD, calibration, GREY, _decoder())
    assert given["confidence"] == pytest.approx(sigmoid(2.0 + math.log(0.5)))
    assert not given["abstained"] and given["held_out"] == {"bin": "0.5-0.8", "accuracy": 0.55, "n": 40, "group": GREY}
    assert given["answer"] == "CT" and given["margin"] == 1.0  # the record is kept
    # A smaller margin falls below the group's 0.75; an answer usual for the question (share 1) rises above it.
    low = judged(dict(RECORD, margin=0.3), calibration, GREY, _decoder())
    assert low["abstained"] and low["confidence"] == pytest.approx(sigmoid(0.6 + math.log(0.5)))
    assert not judged(dict(RECORD, margin=0.6, share=1.0), calibration, GREY, _decoder())["abstained"]
    # Colour images: the file found no threshold reaching its target, so every chosen answer is withheld.
    assert judged(dict(RECORD, margin=30.0), calibration, COLOUR, _decoder())["abstained"]
    # decoder.abstain off gives it, confidence and all; without the file's threshold, decoder.min_confidence.
    assert not judged(dict(RECORD, margin=0.3), calibration, GREY, _decoder(abstain=False))["abstained"]
    assert not judged(dict(RECORD, margin=0.5, share=1.0), calibration, GREY,
                      _decoder(threshold_from_calibration=False, min_confidence=0.7))["abstained"]
    # No file: no confidence, nothing withheld, and the note says it is not measured.
    bare = judged(RECORD, Calibration(), GREY, _decoder())
    assert bare["confidence"] is None and not bare["abstained"] and bare["held_out"] is None
    assert choice_note(bare).endswith("How often such answers are right is not measured for this model.")


def test_the_answer_the_note_and_the_transcript_say_what_was_measured(tmp_path):
    from medvqa.imaging import Scan
    from medvqa.ui.render import _render_answer
    from medvqa.ui.session import _Answer

    path = tmp_path / "open.json"
    path.write_text(json.dumps(_calibration()))
    calibration = Calibration.load(path)
    given = judged(RECORD, calibration, GREY, _decoder())
    assert choice_note(given).endswith("not written freely. Confidence: answers like this were right 55 % of the time "
                                       "on held-out grey training images (n = 40).")
    withheld = judged(dict(RECORD, margin=0.3), calibration, GREY, _decoder())
    # The leaning keeps the answer's spelling ("CT", not "Ct") and says how often the answers withheld below the
    # threshold were right out of fold (not its bin's figure: a bin may straddle the threshold).
    assert leaning(withheld) == ("Uncertain — the model cannot tell from this image (it leans to CT; chosen answers "
                                 "with a confidence below the threshold were right 45 % of the time on held-out grey "
                                 "training images (n = 150)).")
    assert choice_note(withheld).endswith("It is not given as the answer: its confidence is below the threshold at "
                                          "which such answers were right 80 % of the time on held-out training images.")
    # A group no threshold answers: what all its chosen answers were worth, even for a confident one whose bin
    # held a few right answers, and the note does not say a confident answer was right too rarely.
    slide = judged(dict(RECORD, margin=30.0), calibration, COLOUR, _decoder())
    assert slide["abstained"] and slide["held_out"]["accuracy"] == 1.0
    assert leaning(slide) == ("Uncertain — the model cannot tell from this image (it leans to CT; chosen answers about "
                              "such images were right 13 % of the time on held-out training images with colour "
                              "(n = 994)).")
    assert "no confidence picked out enough chosen answers that were right 80 % of the time" in choice_note(slide)
    # Another threshold than the file's (decoder.min_confidence): the bin's figure, as for closed answers.
    other = judged(dict(RECORD, margin=0.3), calibration, GREY, _decoder(threshold_from_calibration=False))
    assert "withheld" not in other and "answers like this were right 30 % of the time" in leaning(other)
    assert choice_note(other).endswith("its confidence is below the app's threshold (decoder.min_confidence).")
    # A file whose withheld table is empty (no out-of-fold answer fell below the threshold): the bin's figure.
    empty = _calibration()
    empty["groups"][GREY]["withheld_out_of_fold"] = {"n": 0, "accuracy": None}
    path.write_text(json.dumps(empty))
    bare = judged(dict(RECORD, margin=0.3), Calibration.load(path), GREY, _decoder())
    assert bare["abstained"] and "withheld" not in bare and "right 30 % of the time" in leaning(bare)
    scan = Scan(np.zeros((2, 2, 3), np.uint8), None, 0, 1, {}, "png")
    answer = _Answer("What modality is used to take this image?", scan=scan, passages=[], text=leaning(withheld),
                     open_choice=withheld)
    turn = answer.record()
    assert turn["answer"].startswith("Uncertain — ") and turn["answered_by"]["chosen"] == "CT"
    assert turn["answered_by"]["abstained"] is True and turn["answered_by"]["held_out"]["n"] == 30
    from medvqa.ui.transcript import export_markdown

    kept = export_markdown({"notice": "n", "exported_at": "t", "profile": "offline",
                            "scan": {"format": "png", "modality": "", "frames": 1}, "turns": [turn]})
    assert kept.count("Uncertain — the model cannot tell from this image") == 1 and "leans to CT;" in kept
    assert "It is not given as the answer" in kept
    assert "It is not given as the answer" in _render_answer(answer, final=True)
    # Closed leanings keep their spelling too; a lower-case option still starts with a capital.
    assert "leans to Yes," in leaning_text(Verdict("yes", 0.1, "yes/no", 0.55, True))


def test_a_file_fitted_for_another_model_or_other_choices_is_not_used(tmp_path, caplog):
    path = tmp_path / "open.json"
    settings = {"open_answers_sha256": "d" * 64, "min_similarity": 1.0, "max": 4, "min_images": 2, "prior": 0.0,
                "answerer": "decoder"}
    path.write_text(json.dumps(_calibration()))
    assert open_calibration_for(str(path), "p" * 64, settings).groups
    assert "projector" in open_calibration_for(str(path), "q" * 64, settings).unused
    other = open_calibration_for(str(path), "p" * 64, dict(settings, max=8))
    assert "decoder.open_choices_max 4 and this profile uses 8" in other.unused and not other.fits
    # With the answer head taking open questions the decoder chooses for the others: another population
    head = open_calibration_for(str(path), "p" * 64, dict(settings, answerer="encoder_head"))
    assert "decoder.open_answerer decoder and this profile uses encoder_head" in head.unused
    # ... and which questions the head takes depends on the head and its thresholds, which are recorded with it
    by_head = _decoder(open_answerer="encoder_head", head_open_min_probability=0.05, head_open_min_similarity=0.96)
    assert fitted_settings(by_head, "d" * 64, "h" * 64) == dict(settings, answerer="encoder_head", head="h" * 64,
                                                                head_min_probability=0.05, head_min_similarity=0.96)
    path.write_text(json.dumps(_calibration(**fitted_settings(by_head, "d" * 64, "h" * 64))))
    assert not open_calibration_for(str(path), "p" * 64, fitted_settings(by_head, "d" * 64, "h" * 64)).unused
    assert "answer head hhhhhhhhhhhh… and this profile uses iiiiiiiiiiii…" in open_calibration_for(
        str(path), "p" * 64, fitted_settings(by_head, "d" * 64, "i" * 64)).unused
    # A file from before the answerer was recorded says so
    older = _calibration()
    del older["open_choices"]["answerer"]
    path.write_text(json.dumps(older))
    assert "fitted before decoder.open_answerer was recorded" in open_calibration_for(str(path), "p" * 64, settings).unused
    path.write_text(json.dumps(_calibration()))
    assert "the open answers file" in open_calibration_for(str(path), "p" * 64,
                                                           dict(settings, open_answers_sha256="e" * 64)).unused
    closed = tmp_path / "closed.json"
    closed.write_text(json.dumps({"fits": {"yes/no": {"a": 1.0, "b": 0.0}}}))
    assert "not fitted for open answers" in open_calibration_for(str(closed), None, settings).unused
    # An unused file: no confidence, nothing withheld, and the note says why.
    note = choice_note(judged(RECORD, open_calibration_for(str(path), "q" * 64, settings), GREY, _decoder()))
    assert "not measured for this model (the calibration file was fitted with projector" in note
    missing = open_calibration_for(str(tmp_path / "none.json"), None, settings)
    assert not missing.fits and not missing.unused and "no calibration of chosen open answers" in caplog.text
    assert fitted_settings(_decoder(open_choices_max=6), "d" * 64) == dict(settings, max=6)


@pytest.fixture(scope="module")
def calibrated_pipeline(tiny_pipeline, tmp_path_factory):
    folder = tmp_path_factory.mktemp("open-calibration")
    _write(folder / "open.safetensors")
    settings = copy.deepcopy(tiny_pipeline.settings)
    settings.decoder.open_choices = "training_answers"
    settings.decoder.open_answers = str(folder / "open.safetensors")
    digest = OpenAnswers.load(folder / "open.safetensors").digest
    body = _calibration(projector=tiny_pipeline.model.projector.sha256, digest=digest)
    body["groups"][COLOUR]["fits"][OPEN_CHOICE] = {"a": 0.0, "b": 5.0}  # every colour answer at 0.99 ...
    body["groups"][COLOUR]["threshold"] = {"met": True, "min_confidence": 0.5}  # ... and given
    body["groups"][GREY]["fits"][OPEN_CHOICE] = {"a": 0.0, "b": -5.0}  # every grey answer at 0.01: withheld
    (folder / "open.json").write_text(json.dumps(body))
    settings.decoder.open_calibration = str(folder / "open.json")
    return Pipeline(settings, tiny_pipeline.engine, tiny_pipeline.model)


def test_the_pipeline_withholds_a_chosen_answer_below_its_threshold_and_gives_it_above(calibrated_pipeline):
    assert not calibrated_pipeline.open_calibration.unused
    grey = np.full((48, 48, 3), 90, np.uint8)
    withheld = calibrated_pipeline.answer_done(grey, "Where is the liver?", use_retrieval=False)
    choice = withheld.open_choice
    assert choice["abstained"] and choice["answer"] in ("Left", "Right") and choice["confidence"] < 0.02
    assert withheld.answer == leaning(choice) and f"leans to {choice['answer']};" in withheld.answer
    colour = np.zeros((48, 48, 3), np.uint8)
    colour[..., 0] = 200
    given = calibrated_pipeline.answer_done(colour, "Where is the liver?", use_retrieval=False)
    assert not given.open_choice["abstained"] and given.answer == given.open_choice["answer"]
    assert given.open_choice["confidence"] > 0.99 and given.open_choice["share"] in (0.75, 0.25)
    # A written answer and a closed one are judged as before.
    assert calibrated_pipeline.answer_done(grey, "Describe the findings.", use_retrieval=False).open_choice is None


def test_the_calibration_script_fits_each_image_group_out_of_fold_and_marks_one_reaching_no_target(tmp_path):
    from calibrate_open import main, stamp

    rng = np.random.default_rng(0)
    n = 400
    group = np.where(np.arange(n) < 250, GREY, COLOUR)
    margin = rng.uniform(0, 3, n)
    # Grey answers are right more often the larger the margin; colour answers are rarely right at all.
    correct = np.where(group == GREY, rng.uniform(0, 1, n) < 1 / (1 + np.exp(-(2.5 * margin - 2))),
                       rng.uniform(0, 1, n) < 0.1)
    scores = {"margin": margin, "correct": correct, "recall": correct.astype(float), "share": rng.uniform(0.2, 1, n),
              "image": np.asarray([f"im{i // 2}.png" for i in range(n)]),
              "content": np.asarray([f"c{i // 4}" for i in range(n)]), "group": group,
              "data": np.where(group == GREY, "slake", "pathvqa"), "question": np.asarray(["q"] * n),
              "reference": np.asarray(["a"] * n), "choice": np.asarray(["a"] * n), "runner_up": np.asarray(["b"] * n)}
    settings = load_settings("offline")
    held_out = SimpleNamespace(data=["vqa-rad:train", "slake:train"], val=400, val_by_image=False, holdout_percent=15.0,
                               seed=0)
    # Scores of another hold-out (or model, or open choices) are refused.
    np.savez(tmp_path / "scores.npz", **scores, stamp=np.asarray(json.dumps(stamp(
        SimpleNamespace(**dict(vars(held_out), holdout_percent=10.0)), settings))))
    out = tmp_path / "open.json"
    with pytest.raises(SystemExit, match="score again"):
        main(["--scores", str(tmp_path / "scores.npz"), "--reuse", "--out", str(out), "--holdout-percent", "15"])
    np.savez(tmp_path / "scores.npz", **scores, stamp=np.asarray(json.dumps(stamp(held_out, settings))))
    assert main(["--scores", str(tmp_path / "scores.npz"), "--reuse", "--out", str(out), "--holdout-percent", "15"]) == 0
    body = json.loads(out.read_text())
    assert body["kind"] == OPEN_CHOICE and body["features"] == ["margin", "log training share of the chosen answer"]
    assert body["fitted_on"]["images"] == n // 4  # by content, not by file name
    assert body["open_choices"] == fitted_settings(settings.decoder, OpenAnswers.load(settings.decoder.open_answers).digest)
    assert set(body["groups"]) == {GREY, COLOUR}
    assert body["groups"][GREY]["threshold"]["met"] and body["groups"][GREY]["fits"][OPEN_CHOICE]["a"] > 1
    assert body["groups"][COLOUR]["threshold"]["abstain"] and not body["groups"][COLOUR]["threshold"]["met"]
    # What the app says of withheld answers: all of a group no threshold answers, those below it in the other.
    assert body["groups"][COLOUR]["withheld_out_of_fold"]["n"] == 150
    grey_held = body["groups"][GREY]["withheld_out_of_fold"]
    assert 0 < grey_held["n"] < 250 and grey_held["accuracy"] < body["groups"][GREY]["accuracy"]
    by_data = body["app_out_of_fold"]["by_data"]
    assert by_data["pathvqa"]["answered"] == 0 and by_data["slake"]["accuracy_answered"] >= 0.8
    loaded = Calibration.load(out)
    assert loaded.for_group(COLOUR).min_confidence(0.7) == math.inf
    assert not loaded.unusable_for_open(body["projector_sha256"], body["open_choices"])
    # The margin alone (--no-share) fits two parameters.
    assert main(["--scores", str(tmp_path / "scores.npz"), "--reuse", "--out", str(out), "--no-share",
                 "--holdout-percent", "15"]) == 0
    assert set(json.loads(out.read_text())["groups"][GREY]["fits"][OPEN_CHOICE]) == {"a", "b"}


def test_the_shipped_file_is_fitted_for_the_offline_profile():
    settings = load_settings("offline")
    body = json.loads((REPO_ROOT / "weights" / "offline" / "calibration-open.json").read_text())
    digest = OpenAnswers.load(settings.decoder.open_answers).digest
    projector = __import__("hashlib").sha256((REPO_ROOT / settings.projector.weights).read_bytes()).hexdigest()
    assert not Calibration.load(settings.decoder.open_calibration).unusable_for_open(
        projector, fitted_settings(settings.decoder, digest))
    assert body["fitted_on"]["holdout_percent"] == 15.0 and set(body["groups"]) == {GREY, COLOUR}


def test_a_withheld_open_answer_counts_as_an_open_abstention_and_claims_nothing(calibrated_pipeline, monkeypatch):
    from medvqa.metrics import AnswerTracker, ServingMetrics
    from medvqa.pipeline import Conversation, Done

    metrics = ServingMetrics()
    AnswerTracker(metrics).done({}, 1, None, {"abstained": True})
    AnswerTracker(metrics).done({}, 1, None, {"abstained": False})
    assert metrics.registry.get_sample_value("medvqa:open_abstentions_total") == 1
    assert metrics.registry.get_sample_value("medvqa:abstentions_total") == 0
    # The sources shown beside a withheld answer are found for the question, not for the answer it leans to.
    asked = []
    monkeypatch.setattr(calibrated_pipeline, "retrieve", lambda query, safe_meta=None, retriever=None: asked.append(query) or [])
    conversation = Conversation(image=np.full((48, 48, 3), 90, np.uint8))
    done = [e for e in calibrated_pipeline.ask(conversation, "Where is the liver?", warm=False) if isinstance(e, Done)][-1]
    assert done.open_choice["abstained"] and asked[-1] == "Where is the liver?"


def test_the_command_line_prints_the_leaning_and_the_note_once(calibrated_pipeline, monkeypatch, tmp_path, capsys):
    from PIL import Image

    from medvqa.__main__ import main

    image = tmp_path / "scan.png"
    Image.fromarray(np.full((48, 48, 3), 90, np.uint8)).save(image)
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: calibrated_pipeline))
    assert main(["ask", str(image), "Where is the liver?", "--no-retrieval"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("Uncertain — the model cannot tell from this image (it leans to") == 1
    assert "(Chosen by the language model among the 2 answers" in printed and "It is not given as the answer" in printed


def test_closed_calibration_folds_copies_of_one_image_together_and_warns_of_missing_files(tmp_path, capsys):
    from calibrate_closed import image_contents

    first, copy_, other = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    first.write_bytes(b"one image")
    copy_.write_bytes(b"one image")  # the same image under another name, as PathVQA has them
    other.write_bytes(b"another image")
    contents = image_contents([str(first), str(copy_), str(other)])
    assert contents[0] == contents[1] != contents[2]
    assert "warning" not in capsys.readouterr().err
    assert image_contents([str(tmp_path / "gone.png")])[0] == str(tmp_path / "gone.png")
    assert "1 image files of the scores are not found here" in capsys.readouterr().err
