"""`python -m medvqa` (medvqa/__main__.py): what goes wrong is said on one `error:` line with exit
status 2, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medvqa.__main__ import main

from .imaging_helpers import encode


@pytest.fixture
def picture(tmp_path):
    path = tmp_path / "chest.png"
    path.write_bytes(encode(Image.fromarray(np.full((32, 32), 90, np.uint8)), "PNG"))
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_decoder_not_downloaded_is_one_line(monkeypatch, capsys, picture):
    from medvqa.language_model import ModelMissingError
    from medvqa.pipeline import Pipeline

    def missing(cls, *args, **kwargs):
        raise ModelMissingError("The decoder 'x' of profile 'llava-med' is not available locally. Download it once.")

    monkeypatch.setattr(Pipeline, "load", classmethod(missing))
    assert main(["ask", str(picture), "Is there a mass?", "--profile", "llava-med", "--no-retrieval"]) == 2
    assert "is not available locally. Download it once." in one_error_line(capsys)


@pytest.mark.parametrize("command", [["ask", "IMAGE", "Is there a mass?"], ["prompt", "Is there a mass?"]])
def test_an_unknown_profile_in_the_environment_is_one_line(monkeypatch, capsys, picture, command):
    monkeypatch.setenv("MEDVQA_PROFILE", "nosuch")
    assert main([str(picture) if part == "IMAGE" else part for part in command]) == 2
    assert "Unknown profile 'nosuch'; choose one of offline" in one_error_line(capsys)


@pytest.mark.parametrize("history, problem", [
    ([{"question": None, "answer": 5}], "turn 1 is not an object whose question and answer are texts"),
    ([{"question": "Is it a CT?", "answer": "Yes."}, "No."], "turn 2 is not an object"),
    ({"question": "Is it a CT?", "answer": "Yes."}, "the file holds no JSON list"),
    ([{"q": "Is it a CT?"}], "turn 1 is not an object"),
])
def test_a_malformed_history_says_what_shape_is_expected(tmp_path, capsys, history, problem):
    path = tmp_path / "history.json"
    path.write_text(json.dumps(history))
    assert main(["prompt", "Is there a mass?", "--profile", "llava-med", "--history", str(path)]) == 2
    err = one_error_line(capsys)
    assert '--history needs a JSON list of {"question": "...", "answer": "..."} objects' in err and problem in err


def test_a_well_formed_history_goes_into_the_prompt(tmp_path, capsys):
    path = tmp_path / "history.json"
    path.write_text(json.dumps([{"question": "Is it a CT?", "answer": "Yes."}]))
    assert main(["prompt", "Is there a mass?", "--profile", "llava-med", "--history", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.index("Is it a CT?") < out.index("Yes.") < out.index("Is there a mass?")


def test_scan_refuses_a_file_and_a_pacs_together(capsys, picture):
    assert main(["scan", str(picture), "--pacs-url", "http://127.0.0.1:9/dicom-web"]) == 2
    assert "not both" in one_error_line(capsys)


@pytest.mark.parametrize("command", [["scan", "PATH"], ["scan", "PATH", "--json"], ["ask", "PATH", "Is there a mass?"]])
def test_a_path_that_does_not_exist_is_said(tmp_path, capsys, command):
    path = tmp_path / "no_such_scan.dcm"
    assert main([str(path) if part == "PATH" else part for part in command]) == 2
    assert one_error_line(capsys) == f"error: No such file or folder: {path}\n"


def test_scan_of_a_picture_names_its_format_once(capsys, picture):
    assert main(["scan", str(picture)]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.lower().startswith("format:")] == ["format: PNG"]


@pytest.mark.parametrize("question", ["", "  \n"])
def test_prompt_refuses_an_empty_question_as_ask_does(capsys, monkeypatch, picture, question):
    assert main(["prompt", question, "--profile", "llava-med"]) == 2
    assert one_error_line(capsys) == "error: Please type a question about the image.\n"
    from medvqa.pipeline import Pipeline

    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: pytest.fail("loaded a model")))
    assert main(["ask", str(picture), question]) == 2  # before the model is loaded
    assert one_error_line(capsys) == "error: Please type a question about the image.\n"


def test_an_empty_window_and_a_negative_passage_count_are_refused(capsys, picture):
    for argv in (["ask", str(picture), "Is there a mass?", "--window", " "],
                 ["prompt", "Is there a mass?", "--passages", "-3"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    assert "--window needs a value" in capsys.readouterr().err


def test_a_wrong_argument_is_one_line_without_the_usage_block(capsys, picture):
    for argv, said in ((["prompt", "q", "--passages", "x"], "'x' is not a whole number"),
                       (["ask", str(picture), "q", "--slice", "abc"], "argument --slice"),
                       (["ask", str(picture), "q", "--profile", "nope"], "invalid choice: 'nope'"),
                       (["bogus"], "invalid choice: 'bogus'")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and said in err, err
        assert "usage:" not in err and "_count" not in err and "--help" in err


def test_ask_on_a_tiny_profile_says_its_answers_mean_nothing(capsys, monkeypatch, picture, tiny_pipeline):
    from medvqa.pipeline import Pipeline

    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline))
    assert main(["ask", str(picture), "Is there a mass?", "--profile", "tiny", "--no-retrieval"]) == 0
    assert "random weights for tests: its answers mean nothing" in capsys.readouterr().err


def test_ask_answers_without_literature_when_the_search_fails(capsys, monkeypatch, picture, tiny_pipeline):
    """An index that fails under the search (a file changed under it): `medvqa ask` says so on one line and
    answers without sources, not with a traceback."""
    from medvqa.pipeline import Pipeline
    from medvqa.retrieval import RetrievalError

    searched = []

    def broken(*args, **kwargs):
        searched.append(True)
        raise RetrievalError("The index at /somewhere is damaged; rebuild it.")

    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline))
    monkeypatch.setattr(tiny_pipeline, "retrieve", broken)
    assert main(["ask", str(picture), "Is there a mass?", "--profile", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert searched and "warning: the literature search failed, answering again without it" in err
    assert "Traceback" not in err and out.strip()


@pytest.mark.parametrize("variable", ["MEDVQA_PROJECTOR__WEIGHTS", "MEDVQA_VISION__NAME_OR_PATH"])
def test_trained_weights_named_but_missing_are_one_line_not_an_untrained_guess(monkeypatch, capsys, picture,
                                                                              tmp_path, variable):
    """A projector file named but absent used to give answers from an untrained projector (a guess with a
    warning in the log); the offline encoder's missing file a traceback. Both are refused in one line."""
    monkeypatch.setenv(variable, str(tmp_path / "gone.safetensors"))
    refuse_decoder_loads(monkeypatch)
    assert main(["ask", str(picture), "Is there a mass?", "--no-retrieval"]) == 2
    error = one_error_line(capsys)
    assert "gone.safetensors were not found" in error


def refuse_decoder_loads(monkeypatch):
    """Weights files are checked before the decoder loads: a first start converts it for minutes (and
    prints its progress), only to be told then that the projector file is missing."""
    import medvqa.pipeline

    def too_late(*args, **kwargs):
        raise AssertionError("the decoder was loaded before the weights files were checked")

    monkeypatch.setattr(medvqa.pipeline, "load_engine", too_late)


LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 17000000\n"


@pytest.mark.parametrize("damage", ["cut short", "a Git LFS pointer"])
@pytest.mark.parametrize("variable", ["MEDVQA_PROJECTOR__WEIGHTS", "MEDVQA_VISION__NAME_OR_PATH"])
def test_damaged_weights_are_one_line(monkeypatch, capsys, picture, tmp_path, variable, damage):
    """A weights file cut short (an interrupted copy) or left as a Git LFS pointer used to end in a
    traceback from safetensors; it is said in one line naming the file, before the decoder loads."""
    from medvqa.config import load_settings

    settings = load_settings("offline")
    shipped = Path(settings.projector.weights if "PROJECTOR" in variable else settings.vision.name_or_path)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(shipped.read_bytes()[: shipped.stat().st_size // 2] if damage == "cut short"
                        else LFS_POINTER)
    monkeypatch.setenv(variable, str(damaged))
    refuse_decoder_loads(monkeypatch)
    assert main(["ask", str(picture), "Is there a mass?", "--no-retrieval"]) == 2
    error = one_error_line(capsys)
    assert f"{damaged} could not be read" in error and "or check out the shipped file again" in error


def test_a_projector_of_another_encoder_is_one_line(monkeypatch, capsys, picture, tmp_path):
    """An encoder rebuilt (or swapped) under the shipped projector: the projector would map features it
    never saw, so the pair is refused in one line, before the decoder loads."""
    from safetensors.torch import load_file, save_file

    from medvqa.config import load_settings

    other = tmp_path / "other-encoder.safetensors"
    save_file(load_file(load_settings("offline").vision.name_or_path), str(other), metadata={"note": "rebuilt"})
    monkeypatch.setenv("MEDVQA_VISION__NAME_OR_PATH", str(other))
    refuse_decoder_loads(monkeypatch)
    assert main(["ask", str(picture), "Is there a mass?", "--no-retrieval"]) == 2
    assert "was trained on the features of encoder" in one_error_line(capsys)


def test_the_app_refuses_damaged_weights_in_one_line_too(monkeypatch, capsys, tmp_path):
    """app.py says the damaged file on its last line, exit status 2, before the decoder loads."""
    import importlib.util

    from .conftest import REPO

    spec = importlib.util.spec_from_file_location("medvqa_app_main", REPO / "app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    damaged = tmp_path / "projector.safetensors"
    damaged.write_bytes(LFS_POINTER)
    monkeypatch.setenv("MEDVQA_PROJECTOR__WEIGHTS", str(damaged))
    monkeypatch.setenv("MEDVQA_RETRIEVAL__ENABLED", "false")
    refuse_decoder_loads(monkeypatch)
    assert app.main(["--profile", "offline"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(f"error: The projector weights {damaged} "
                                                                      "could not be read")


def test_a_damaged_decoder_gguf_is_said_not_a_traceback(monkeypatch, capsys, picture, tmp_path):
    """A GGUF cut short (an interrupted copy) fails in the first conversion: said as the file's fault."""
    from medvqa.config import load_settings, resolve_path

    shipped = Path(resolve_path(load_settings("offline").decoder.name_or_path))
    damaged = tmp_path / "decoder.gguf"
    with shipped.open("rb") as source:
        damaged.write_bytes(source.read(3_000_000))
    monkeypatch.setenv("MEDVQA_DECODER__NAME_OR_PATH", str(damaged))
    monkeypatch.setenv("MEDVQA_CACHE", str(tmp_path / "cache"))
    assert main(["ask", str(picture), "Is there a mass?", "--no-retrieval"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(f"error: The decoder GGUF file {damaged} "
                                                                      "could not be read or converted (")
