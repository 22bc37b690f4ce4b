"""Open questions answered by the decoder choosing among the answers training gave to the same question
(decoder.open_choices "training_answers", medvqa/open_choices.py), with the tiny decoder."""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from medvqa.answer_head import QUESTION_EMBEDDER
from medvqa.config import REPO_ROOT, load_settings
from medvqa.open_choices import (Choices, OpenAnswers, OpenAnswersError, choice_note, choose, chosen, content_digest,
                                 load_open_answers)
from medvqa.pipeline import Pipeline

from .conftest import jsonl_bench

sys.path.insert(0, str(REPO_ROOT / "scripts"))

QUESTIONS = ["What modality is used to take this image?", "Where is the liver?", "Which organ is abnormal?"]
# [spelling, count, images]: "Brain" was given for one image only, and is never scored.
ANSWERS = [[["CT", 40, 35], ["MRI", 30, 30], ["X-Ray", 20, 18]], [["Left", 9, 7], ["Right", 3, 2]],
           [["Liver", 5, 4], ["Lung", 4, 3], ["Brain", 1, 1]]]
IMAGES = [80, 9, 8]


class _Embedder:
    """Counts what it embeds; a fixed vector per known text, another for anything else."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def encode(self, texts, batch_size=128):
        self.calls.append(list(texts))
        vectors = {"What modality is used to take this image?": [1, 0, 0],
                   "Which modality was used for this image?": [0.98, 0.2, 0],
                   "Where is the liver?": [0, 1, 0], "Which organ is abnormal?": [0, 0, 1]}
        return np.asarray([vectors.get(text, [0.5, -0.5, -0.7]) for text in texts], dtype=np.float32)


def _write(path, questions=QUESTIONS, answers=ANSWERS, vectors=None, images=IMAGES, **meta) -> None:
    from safetensors.numpy import save_file

    if vectors is None:
        vectors = OpenAnswers(questions, answers, np.zeros((len(questions), 1))).embed(questions)
    metadata = {"questions": json.dumps(questions), "answers": json.dumps(answers), "images": json.dumps(images),
                "content_sha256": content_digest(questions, answers, images), "embedder": QUESTION_EMBEDDER}
    if images is None:  # a file written before answers counted their images
        del metadata["images"]
    metadata.update(meta)
    save_file({"embeddings": np.asarray(vectors, np.float16)}, str(path), metadata=metadata)


def _stub_file(tmp_path) -> OpenAnswers:
    path = tmp_path / "open.safetensors"
    embedder = _Embedder()
    _write(path, vectors=embedder.encode(QUESTIONS))
    return OpenAnswers.load(path, embedder=embedder)


def test_a_training_questions_own_words_find_its_answers_without_embedding(tmp_path):
    answers = _stub_file(tmp_path)
    answers._embedder.calls.clear()
    found = answers.find("  where is THE liver ", min_similarity=0.99, max_answers=32)  # case does not matter
    assert found == Choices("Where is the liver?", 1.0, ("Left", "Right"), (9, 3), images=9)
    assert answers._embedder.calls == []
    # Only answers given for at least min_images images, then at most max_answers, the most frequent first.
    assert answers.find("Which organ is abnormal?", 0.99, 8) == Choices(QUESTIONS[2], 1.0, ("Liver", "Lung"), (5, 4), 8)
    assert answers.find("Which organ is abnormal?", 0.99, 8, min_images=1).answers == ("Liver", "Lung", "Brain")
    assert answers.find("Which organ is abnormal?", 0.99, 2, min_images=1).answers == ("Liver", "Lung")
    # Fewer than two answers left: nothing to choose among, the decoder writes.
    assert answers.find("Where is the liver?", 0.99, 32, min_images=3) is None
    assert answers.find("Where is the liver?", 0.99, 1) is None


def test_other_words_find_the_most_similar_training_question_above_the_threshold(tmp_path):
    answers = _stub_file(tmp_path)
    found = answers.find("Which modality was used for this image?", min_similarity=0.9, max_answers=8)
    assert found.nearest == QUESTIONS[0] and 0.9 < found.similarity < 1.0
    assert found.answers == ("CT", "MRI", "X-Ray")
    # Unlike every training question: no choices (the decoder writes the answer).
    assert answers.find("Describe the findings.", min_similarity=0.6, max_answers=8) is None
    assert answers.find("Which modality was used for this image?", min_similarity=0.99, max_answers=8) is None
    # At 1.0 only a training question's own words count, and nothing is embedded to find that out.
    answers._embedder.calls.clear()
    assert answers.find("Which modality was used for this image?", min_similarity=1.0, max_answers=8) is None
    assert answers._embedder.calls == []


def test_the_score_adds_the_prior_times_the_log_count_and_a_tie_goes_to_the_most_frequent():
    best, combined = choose([-1.0, -0.9], (100, 1), prior=0.0)
    assert best == 1 and combined == [-1.0, -0.9]
    best, combined = choose([-1.0, -0.9], (100, 1), prior=0.5)
    assert best == 0 and combined[0] == pytest.approx(-1.0 + 0.5 * np.log(100))
    assert choose([-1.0, -1.0], (3, 3), prior=1.0)[0] == 0
    # The record the pipeline keeps: the best, the runner-up and the margin between them.
    decoder = SimpleNamespace(open_choices_prior=0.0, open_choices_min_similarity=1.0)
    record = chosen(Choices("Where is the liver?", 1.0, ("Left", "Right", "Centre"), (9, 3, 2), 9), [-2.0, -0.5, -1.0],
                    decoder)
    assert (record["answer"], record["runner_up"], record["margin"]) == ("Right", "Centre", 0.5)
    assert record["choices"] == 3 and record["images"] == 9 and record["prior"] == 0.0


def test_a_file_is_refused_when_it_is_missing_unreadable_or_of_another_embedder(tmp_path):
    with pytest.raises(OpenAnswersError, match="build_open_answers.py"):
        OpenAnswers.load(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(OpenAnswersError, match="not a readable"):
        OpenAnswers.load(tmp_path / "bad.safetensors")
    _write(tmp_path / "other.safetensors", vectors=np.eye(3), embedder="pkg:other/model")
    with pytest.raises(OpenAnswersError, match="embedded with"):
        OpenAnswers.load(tmp_path / "other.safetensors")
    _write(tmp_path / "edited.safetensors", vectors=np.eye(3), content_sha256="0" * 64)
    with pytest.raises(OpenAnswersError, match="content_sha256"):
        OpenAnswers.load(tmp_path / "edited.safetensors")
    _write(tmp_path / "old.safetensors", vectors=np.eye(3), images=None)
    with pytest.raises(OpenAnswersError, match="rebuild it"):
        OpenAnswers.load(tmp_path / "old.safetensors")
    _write(tmp_path / "short.safetensors", vectors=np.eye(2)[:, :2])
    with pytest.raises(OpenAnswersError, match="as many"):
        OpenAnswers.load(tmp_path / "short.safetensors")


def test_the_table_counts_open_answers_and_their_images_per_question_in_their_usual_spelling():
    from build_open_answers import open_table

    rows = [("Where is the liver?", "Left", "a"), ("where is the liver", "left", "b"), ("Where is the liver?", "Left ", "b"),
            ("Where is the liver?", "Right", "c"), ("Is this a CT?", "Yes", "a"), ("What organ?", "No", "a"),
            ("  ", "Lung", "a"), ("Which organ is abnormal?", "Liver", "d")]
    examples = [SimpleNamespace(question=q, answer=a, image=i) for q, a, i in rows]
    questions, answers, images = open_table(examples, image_of=lambda example: example.image)
    assert questions == ["Where is the liver?", "Which organ is abnormal?"]
    assert answers == [[["Left", 3, 2], ["Right", 1, 1]], [["Liver", 1, 1]]]
    assert images == [3, 1]


def test_settings_are_checked_and_an_engine_that_cannot_score_generates(tmp_path, caplog):
    settings = load_settings("offline")
    assert settings.decoder.open_choices == "training_answers"
    path = tmp_path / "open.safetensors"
    _write(path, vectors=np.eye(3))
    settings.decoder.open_answers = str(path)
    assert isinstance(load_open_answers(settings, scores_options=True), OpenAnswers)
    with caplog.at_level("INFO"):
        assert load_open_answers(settings, scores_options=False) is None
    assert "cannot score answers" in caplog.text
    for name, value, match in (("open_choices_min_similarity", 1.5, "cosine similarity"),
                               ("open_choices_max", 1, "at least two"), ("open_choices_min_images", 0, "at least 1")):
        broken = copy.deepcopy(settings)
        setattr(broken.decoder, name, value)
        with pytest.raises(OpenAnswersError, match=match):
            load_open_answers(broken, scores_options=True)
    assert load_settings("llava-med").decoder.open_choices == "free"  # the reference writes its answers
    with pytest.raises(ValueError, match="open_choices"):
        load_settings("offline", env={"MEDVQA_DECODER__OPEN_CHOICES": "probe"})


def test_the_shipped_file_holds_the_training_questions_of_the_images_not_held_out():
    settings = load_settings("offline")
    shipped = OpenAnswers.load(settings.decoder.open_answers)
    assert shipped.meta["holdout_percent"] == "15" and "slake:train" in json.loads(shipped.meta["data"])
    assert shipped.digest == content_digest(shipped.questions, shipped.answers, shipped.images)
    found = shipped.find("What modality is used to take this image?", 0.96, 32)
    assert {"CT", "MRI"} <= set(found.answers) and found.similarity == 1.0
    assert all(answer.lower() not in ("yes", "no") and 1 <= images <= count
               for row in shipped.answers for answer, count, images in row)
    assert all(images >= max(row_images for _, _, row_images in row) for row, images in zip(shipped.answers, shipped.images))
    # Matching ignores case; an answer given for one image only is never scored.
    assert shipped.find("what modality is used to take this image", 1.0, 8) == found
    assert all(images >= 2 for q in shipped.questions[:200] if (c := shipped.find(q, 1.0, 8)) is not None
               for images in [shipped.answers[shipped.questions.index(c.nearest)][c.answers.index(a)][2]
                              for a in c.answers])


@pytest.fixture(scope="module")
def choices_pipeline(tiny_pipeline, tmp_path_factory):
    path = tmp_path_factory.mktemp("open") / "open.safetensors"
    _write(path)  # the real MiniLM embeddings of QUESTIONS
    settings = copy.deepcopy(tiny_pipeline.settings)
    settings.decoder.open_choices = "training_answers"
    settings.decoder.open_answers = str(path)
    return Pipeline(settings, tiny_pipeline.engine, tiny_pipeline.model)


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


def test_an_open_question_like_a_training_one_is_answered_among_its_answers(choices_pipeline):
    image = _image(3)
    done = choices_pipeline.answer_done(image, "Where is the liver?", use_retrieval=False)
    chosen = done.open_choice
    assert done.answer in ("Left", "Right") and chosen["answer"] == done.answer
    assert chosen["nearest"] == "Where is the liver?" and chosen["similarity"] == 1.0 and chosen["choices"] == 2
    assert chosen["images"] == 9
    assert chosen["runner_up"] in ("Left", "Right") and chosen["runner_up"] != done.answer and chosen["margin"] >= 0
    # The decoder's own scores of the answers, after the same prompt and image: the best is the answer.
    prompt = choices_pipeline.prompts.build("Where is the liver?")
    scores = choices_pipeline.option_scores(image, prompt, ["Left", "Right"])
    prior = choices_pipeline.settings.decoder.open_choices_prior
    assert done.answer == ["Left", "Right"][choose(scores, (9, 3), prior)[0]] and chosen["prior"] == prior
    assert choice_note(chosen).startswith("Chosen by the language model among the 2 answers training data gave most "
                                          "often to the same question, asked of 9 images in training: each scored "
                                          "with this image; not written freely.")
    assert "weighted toward the answers given most often; not" in choice_note(dict(chosen, prior=0.5))
    assert done.closed is None and done.head_open is None


def test_questions_unlike_training_ones_and_closed_questions_are_answered_as_before(choices_pipeline, tiny_pipeline):
    image = _image(4)
    free = choices_pipeline.answer_done(image, "Describe the findings in this scan.", use_retrieval=False)
    assert free.open_choice is None
    assert free.answer == tiny_pipeline.answer_done(image, "Describe the findings in this scan.",
                                                    use_retrieval=False).answer
    closed = choices_pipeline.answer_done(image, "Is there a liver?", use_retrieval=False, constrained=True)
    assert closed.open_choice is None and closed.closed is not None
    assert tiny_pipeline.answer_done(image, "Where is the liver?", use_retrieval=False).open_choice is None


def test_the_page_and_transcript_say_the_answer_was_chosen_among_training_answers():
    from medvqa.imaging import Scan
    from medvqa.ui.render import _render_answer
    from medvqa.ui.session import _Answer

    chosen = {"answer": "Left", "nearest": "Where is the <b>liver</b>?", "similarity": 0.97, "min_similarity": 0.96,
              "choices": 7, "images": 30, "prior": 0.5, "runner_up": "Right", "margin": 0.3}
    scan = Scan(np.zeros((2, 2, 3), np.uint8), None, 0, 1, {}, "png")
    answer = _Answer("Where is the liver?", scan=scan, passages=[], text="Left", open_choice=chosen)
    page = _render_answer(answer, final=True)
    assert "Chosen by the language model among the 7 answers training data gave most often to the training question " \
           "most like yours, \u201cWhere is the &lt;b&gt;liver&lt;/b&gt;?\u201d, asked of 30 images in training:" in page
    turn = answer.record()
    assert turn["answered_by"]["answerer"] == "decoder_choice" and turn["answered_by"]["choices"] == 7
    assert turn["answered_by"]["nearest_training_question"] == "Where is the <b>liver</b>?"
    answer.open_choice = None
    assert "Chosen by the language model" not in _render_answer(answer, final=True) and "answered_by" not in answer.record()


def test_the_tuning_grid_gives_each_question_the_answer_the_app_would_give():
    from tune_open_choices import answer, needs_written, recall

    chosen = {"similarity": 1.0, "exact": True, "answers": ["Left", "Right", "Centre"], "counts": [9, 3, 1],
              "images": [7, 2, 1], "real": [-2.0, -1.0, 0.0], "shuffled": [-1.0, -2.0, 0.0],
              "written": {"real": "the liver", "shuffled": "kidney"}, "reference": "Right"}
    # Scored: the decoder's best of the answers given for 2 images or more, or the most frequent once the
    # prior outweighs the scores.
    assert answer(chosen, "real", 0.0, 8, 1.0, 2) == "Right" and answer(chosen, "shuffled", 0.0, 8, 1.0, 2) == "Left"
    assert answer(chosen, "real", 0.0, 8, 1.0, 1) == "Centre"
    assert answer(chosen, "real", 1.0, 8, 1.0, 2) == "Left"  # -2 + log 9 > -1 + log 3
    # Fewer than two answers left, not the same words at 1.0, or below the similarity: the written answer.
    assert answer(chosen, "real", 0.0, 1, 1.0, 2) == "the liver"
    assert answer(chosen, "real", 0.0, 8, 1.0, 3) == "the liver"
    assert answer(dict(chosen, exact=False, similarity=1.00001), "real", 0.0, 8, 1.0, 2) == "the liver"
    assert answer(dict(chosen, exact=False, similarity=0.95), "real", 0.0, 8, 0.96, 2) == "the liver"
    assert answer(dict(chosen, exact=False, similarity=0.97), "real", 0.0, 8, 0.96, 2) == "Right"
    assert recall([chosen], "real", 0.0, 8, 1.0, 2) == 1.0 and recall([chosen], "shuffled", 0.0, 8, 1.0, 2) == 0.0
    assert needs_written(dict(chosen, exact=False)) and needs_written(chosen)  # at 3 images only "Left" is left
    assert not needs_written(dict(chosen, images=[7, 5, 3]))


def test_evaluate_reports_open_recall_by_route_and_names_the_run_by_the_choices(tmp_path, tiny_cache):
    import os
    import subprocess

    data = jsonl_bench(tmp_path / "bench", 3, 70, lambda i: [
        {"question": "Where is the liver?", "answer": "Left", "answer_type": "OPEN"},
        {"question": "Describe the findings.", "answer": "lung", "answer_type": "OPEN"}])
    answers = tmp_path / "open.safetensors"
    _write(answers)
    # An open-answer calibration for these answers: every chosen answer at sigmoid(0) = 0.5, below its 0.6.
    calibration = tmp_path / "open.json"
    calibration.write_text(json.dumps({
        "fits": {"open choice": {"a": 0.0, "b": 0.0}}, "kind": "open choice", "projector_sha256": None,
        "threshold": {"met": True, "min_confidence": 0.6},
        "open_choices": {"open_answers_sha256": OpenAnswers.load(answers).digest, "min_similarity": 1.0, "max": 4,
                         "min_images": 2, "prior": 0.0, "answerer": "decoder"}}))
    env = dict(os.environ, MEDVQA_CACHE=str(tiny_cache), OMP_NUM_THREADS="1", MEDVQA_DECODER__OPEN_CHOICES="training_answers",
               MEDVQA_DECODER__OPEN_ANSWERS=str(answers), MEDVQA_DECODER__OPEN_CALIBRATION=str(calibration))
    command = [sys.executable, "scripts/evaluate.py", "--profile", "tiny", "--dataset", "jsonl", "--data", str(data),
               "--split", "test", "--conditions", "no_retrieval", "shuffled_image", "--open-only",
               "--run-dir", str(tmp_path / "runs"), "--max-new-tokens", "4"]
    out = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["open_choices"] == {"min_similarity": 1.0, "max": 4, "prior": 0.0, "min_images": 2}
    routes = summary["open_by_route"]
    assert routes["chosen"]["n"] == 3 and routes["not_chosen"]["n"] == 3
    assert set(routes["chosen"]) == {"n", "no_retrieval", "shuffled_image"}
    # What the app would do with the chosen answers (measured with abstention off, judged when summarising).
    withheld = summary["open_abstention"]
    assert withheld["chosen"] == 3 and withheld["answered"] == 0 and withheld["recall_answered"] is None
    assert "the app gives 0.0 %" in out.stdout
    run = next((tmp_path / "runs").glob("*.jsonl"))
    digest = OpenAnswers.load(answers).digest
    assert f"-choices1-4-0-i2-{digest[:8]}-" in run.name
    kept = [json.loads(line) for line in run.read_text().splitlines()]
    assert all((row["open_choice"] is not None) == (row["question"] == "Where is the liver?") for row in kept)
    assert all(row["no_retrieval"] in ("Left", "Right") for row in kept if row["open_choice"])
