"""Yes/no questions naming one value of an attribute, read as the open question they presuppose
(medvqa/presuppose.py), and the pipeline scoring them that way (decoder.presupposed_closed)."""

from __future__ import annotations

import numpy as np
import pytest

from medvqa.config import load_settings
from medvqa.confidence import PRESUPPOSED, YES_NO
from medvqa.pipeline import NEUTRAL_CONVERSATION, Conversation, Done
from medvqa.presuppose import (ABNORMALITY_QUESTION, DISEASES, MODALITY_QUESTION, NORMAL, ORGAN_QUESTION, ORGANS,
                               PLANE_QUESTION, REGION_QUESTION, head_kind, presupposition)


@pytest.mark.parametrize("question, kind, target", [
    ("Is this a CT?", "modality", "CT"),
    ("Is this image taken via X-Ray?", "modality", "X-Ray"),
    ("Is this an MRI scan?", "modality", "MRI"),
    ("Was the image obtained with computed tomography?", "modality", "CT"),
    ("Is this a transverse section?", "plane", "Transverse Plane"),
    ("Is this an axial image?", "plane", "Transverse Plane"),
    ("Is this sagittal plane?", "plane", "Sagittal Plane"),
    ("Is this a study of the pelvic cavity?", "region", "Pelvic Cavity"),
    ("Do the organs in the image exist in the chest?", "region", "Chest"),
    ("Does the picture contain liver?", "organ", "Liver"),
    ("Does the picture contain the spinal cord?", "organ", "Spinal Cord"),
    ("Does the picture contain brian?", "organ", "Brain"),  # SLAKE's spelling in 31 training questions
    ("Are/Is there kidneys in the picture?", "organ", "Kidney"),
    ("Does the heart appear in the image?", "organ", "Heart"),
    ("Does the small bowel exist in this picture?", "organ", "Small Bowel"),
])
def test_questions_naming_one_value_presuppose_its_open_question(question, kind, target):
    read = presupposition(question)
    assert read is not None and (read.kind, read.target) == (kind, target)
    assert read.target in read.options
    assert read.question == {"modality": MODALITY_QUESTION, "plane": PLANE_QUESTION, "region": REGION_QUESTION,
                             "organ": ORGAN_QUESTION}[kind]


@pytest.mark.parametrize("question", [
    "Is this a CT or an MRI?",  # names two values: a choice question already
    "Is this an MRI image with T2 weighted?",  # weighting is another attribute
    "Does the picture contain the organ that could be used for breathing?",
    "Does the picture contain a tumor?",  # not an organ of the list
    "Is there evidence of an aortic aneurysm?",
    "Is the lesion in the chest wall?",
    "What modality is used to take this image?",
    "",
])
def test_other_questions_are_not_read(question):
    assert presupposition(question) is None


def test_organ_values_are_distinct():
    assert len(set(ORGANS)) == len(ORGANS)
    assert len(set(DISEASES)) == len(DISEASES) and DISEASES[0] == NORMAL


@pytest.mark.parametrize("question", [
    "Is the liver not healthy?",  # SLAKE's training split asks this; "not" turns the question around
    "Isn't the lung abnormal?",
    "Is the lung nodule abnormal?",  # a finding, not an organ
    "Is the brain tumor healthy?",
    "Is the heart size abnormal?",  # a size (VQA-RAD), not whether the organ is diseased
    "Is the aortic arch shape abnormal?",
    "Is the gallbladder abnormal?",  # not one of SLAKE's organs
])
def test_questions_about_findings_sizes_or_negated_are_not_read_as_normal_or_not(question):
    assert presupposition(question) is None


@pytest.mark.parametrize("question, negated", [
    ("Is the lung healthy?", False),
    ("Does this image look normal?", False),
    ("Is this image normal?", False),
    ("Does the liver look normal?", False),
    ("Is the brain normal appearing?", False),
    ("Are there abnormalities in this image?", True),
    ("Does this image look abnormal?", True),
    ("Does the lung look abnormal?", True),
    ("Is the heart abnormal?", True),
    ("Does the patient have any abnormalities?", True),
    ("Is/Are there abnormalities in the patient's left lung?", True),
    ("Is/Are there abnormalities in the patient's right brain lobe?", True),
    ("Is the left kidney abnormal?", True),
    ("Is the lungs healthy?", False),
])
def test_whether_the_image_is_normal_presupposes_its_diseases(question, negated):
    """SLAKE's "is it healthy / abnormal?" questions: Yes when None is (or, negated, is not) the most likely
    answer to "What diseases are included in the picture?"; the answer head still counts them as "other"."""
    read = presupposition(question)
    assert read is not None and (read.kind, read.target, read.negated) == ("abnormality", NORMAL, negated)
    assert read.question == ABNORMALITY_QUESTION and read.options == DISEASES
    assert head_kind(read) == "other" and head_kind(presupposition("Is this a CT?")) == "modality"
    assert head_kind(None) == "other"


def _scored(pipeline, best: str):
    """An engine spy: every complete answer scores -5, the one reading `best` -1; records the
    conversation, whether it was background work, and the prompt's text."""
    engine, tokenizer = pipeline.engine, pipeline.prompts.tokenizer
    seen = []
    original = engine.score_options

    def spy(request, answers):
        seen.append((request.conversation_id, request.background,
                     tokenizer.decode([t for t in request.prompt.token_ids if t >= 0])))
        original(request, answers)  # the real path still runs
        texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in answers]
        return [-1.0 if text == best else -5.0 for text in texts]

    engine.score_options = spy
    return seen


@pytest.fixture
def presupposing(tiny_pipeline):
    decoder = tiny_pipeline.settings.decoder
    before = decoder.presupposed_closed
    decoder.presupposed_closed = True
    yield tiny_pipeline
    decoder.presupposed_closed = before
    tiny_pipeline.engine.__dict__.pop("score_options", None)


def _ask(pipeline, question):
    image = np.random.default_rng(3).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    conversation = Conversation(image=image)
    events = list(pipeline.ask(conversation, question, use_retrieval=False, constrained=True, warm=False))
    assert isinstance(events[-1], Done)
    return conversation, events[-1]


@pytest.mark.parametrize("best, answer", [("CT", "Yes"), ("MRI", "No")])
def test_a_presupposed_question_is_answered_by_the_value_it_names(presupposing, best, answer):
    seen = _scored(presupposing, best)
    conversation, done = _ask(presupposing, "Is this a CT?")
    assert done.answer == answer
    assert done.closed["kind"] == PRESUPPOSED
    assert done.closed["presupposed"] == {"question": MODALITY_QUESTION, "target": "CT"}
    assert done.closed["options"] == ({"yes": -1.0, "no": -5.0} if answer == "Yes" else {"yes": -5.0, "no": -1.0})
    # The values are scored after the open question, with the scan; then with the blank image.
    assert [(who, background) for who, background, _ in seen] == [(conversation.id, False), (NEUTRAL_CONVERSATION, True)]
    assert all(MODALITY_QUESTION in text and "Is this a CT?" not in text for _, _, text in seen)
    # The turn is remembered as asked.
    assert conversation.history[-1].question == "Is this a CT?"


def test_off_it_is_yes_against_no(tiny_pipeline):
    assert tiny_pipeline.settings.decoder.presupposed_closed is False  # the tiny profile follows the reference
    seen = _scored(tiny_pipeline, "Yes")
    try:
        _, done = _ask(tiny_pipeline, "Is this a CT?")
    finally:
        tiny_pipeline.engine.__dict__.pop("score_options", None)
    assert done.answer == "Yes" and done.closed["kind"] == YES_NO and "presupposed" not in done.closed
    assert "Is this a CT?" in seen[0][2]


@pytest.mark.parametrize("best, question, answer", [
    ("None", "Is the lung healthy?", "Yes"), ("Pneumonia", "Is the lung healthy?", "No"),
    ("None", "Are there abnormalities in this image?", "No"), ("Pneumonia", "Are there abnormalities in this image?", "Yes"),
])
def test_a_question_whether_it_is_normal_is_answered_by_the_diseases_reading(presupposing, best, question, answer):
    from medvqa.presuppose import reading_text

    _scored(presupposing, best)
    _, done = _ask(presupposing, question)
    assert done.answer == answer and done.closed["kind"] == PRESUPPOSED
    negated = "abnormalities" in question
    assert done.closed["presupposed"] == {"question": ABNORMALITY_QUESTION, "target": "None",
                                          **({"negated": True} if negated else {})}
    # Yes's score is the reading Yes stands for: None's for "healthy?", the best disease's for "abnormal?".
    assert done.closed["options"] == ({"yes": -1.0, "no": -5.0} if answer == "Yes" else {"yes": -5.0, "no": -1.0})
    assert reading_text(done.closed).endswith(f"None {'is' if best == 'None' else 'is not'} the model's most likely "
                                              "answer.")


def test_questions_it_does_not_read_stay_yes_against_no(presupposing):
    _scored(presupposing, "No")
    _, done = _ask(presupposing, "Is the heart enlarged?")
    assert done.answer == "No" and done.closed["kind"] == YES_NO


def test_a_kind_left_out_is_yes_against_no(presupposing):
    kinds = presupposing.settings.decoder.presupposed_kinds
    presupposing.settings.decoder.presupposed_kinds = ["plane", "region", "organ"]
    try:
        seen = _scored(presupposing, "Yes")
        _, done = _ask(presupposing, "Is this a CT?")
    finally:
        presupposing.settings.decoder.presupposed_kinds = kinds
    assert done.answer == "Yes" and done.closed["kind"] == YES_NO and "presupposed" not in done.closed
    assert "Is this a CT?" in seen[0][2]


def test_kinds_from_the_environment():
    settings = load_settings("offline", env={"MEDVQA_DECODER__PRESUPPOSED_KINDS": "modality:plane:region"})
    assert settings.decoder.presupposed_kinds == ["modality", "plane", "region"]
    assert load_settings("offline").decoder.presupposed_kinds == ["modality", "plane", "region", "organ", "abnormality"]


def test_profiles():
    assert load_settings("offline").decoder.presupposed_closed is True
    assert load_settings("llava-med").decoder.presupposed_closed is False


def test_the_reading_in_words():
    from medvqa.presuppose import reading_text

    closed = {"choice": "no", "presupposed": {"question": ORGAN_QUESTION, "target": "Liver"}}
    assert reading_text(closed) == ("Read as “What is the main organ in the image?”: Liver is not the model's most "
                                    "likely answer.")
    assert reading_text(dict(closed, choice="yes")).endswith("Liver is the model's most likely answer.")
    assert reading_text({"choice": "yes"}) == "" and reading_text(None) == ""
