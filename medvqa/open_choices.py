"""Open questions answered by the decoder choosing among the answers training gave to the same question
(`decoder.open_choices` "training_answers", on in the offline profile; the LLaVA-Med profile generates).

Most open questions of SLAKE, VQA-RAD and PathVQA are asked in the same words about many images, and
their answers come from a short list: "Where is the liver?" is answered "Left", "Right", "Upper Left" and
a few others, "What modality is used to take this image?" "CT", "MRI" or "X-Ray". Written freely, the
frozen 135M decoder often answers something off that list. With this setting the decoder still answers,
with the same image and prompt, but as it answers a closed question: it scores each answer that the
training data gave to the training question most like the clinician's, and the best one is the answer.
A question unlike every training question ("Describe the findings in this scan.") is generated as before.

    answers = OpenAnswers.load("weights/offline/open_answers.safetensors")
    answers.find("Where is the liver?", min_similarity=1.0, max_answers=4, min_images=2)
    # Choices(nearest="Where is the liver?", similarity=1.0, answers=("Left", "Right", ...), counts=(41, 12, ...), images=...)

Only answers training gave for at least `decoder.open_choices_min_images` different images are candidates (an
answer given for one image is that image's finding: "left lobe mass 1.5 x 1.8 cm"), and a question needs at
least two of them: with fewer, the decoder would not be choosing, and the answer is written. Questions match
case-insensitively. Each answer's score is its mean token log-probability after the prompt (the engine's
score_options) plus `decoder.open_choices_prior` times the log of how often training gave it to that question;
the settings were chosen on the held-out training images (scripts/tune_open_choices.py). The file is built
from the training images only, those held out left out (scripts/build_open_answers.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .answer_head import QUESTION_EMBEDDER, question_form


class OpenAnswersError(ValueError):
    """The open answers file cannot be used (missing, unreadable, another embedder)."""


@dataclass(frozen=True)
class Choices:
    """The answers one open question is chosen among: those training gave to `nearest`."""

    nearest: str  # the training question most like the asked one (question_form)
    similarity: float  # their MiniLM cosine similarity; 1.0 for the same words
    answers: tuple[str, ...]  # as the training answers most often write them, most frequent first
    counts: tuple[int, ...]  # how often training gave each to `nearest`
    images: int = 0  # of how many different images training asked `nearest`

    def share(self, answer: str) -> float:
        """`answer`'s share of how often training gave these answers to `nearest` (how usual an answer it is)."""
        return self.counts[self.answers.index(answer)] / sum(self.counts)


def content_digest(questions: list[str], answers: list[list[list]], images: list[int] | None = None) -> str:
    """SHA-256 of the questions, their answers with counts and images, and each question's images (what a
    run's name says it used)."""
    return hashlib.sha256(json.dumps([questions, answers, images], ensure_ascii=False).encode()).hexdigest()


def choose(scores: list[float], counts: tuple[int, ...] | list[int], prior: float) -> tuple[int, list[float]]:
    """(index of the chosen answer, each answer's combined score): mean log-probability + prior x
    log(count); the first (most frequent) answer wins a tie."""
    combined = [float(score) + prior * math.log(max(int(count), 1)) for score, count in zip(scores, counts)]
    return int(np.argmax(combined)), combined


def chosen(choices: Choices, scores: list[float], decoder) -> dict:
    """Done.open_choice: the answer among `choices` that the decoder's `scores` (mean log-probabilities, one per
    answer) and decoder.open_choices_prior pick, with the runner-up and the margin to it."""
    best, combined = choose(scores, choices.counts, decoder.open_choices_prior)
    runner_up = max((k for k in range(len(combined)) if k != best), key=lambda k: combined[k])  # find() gives two or more
    return {"answer": choices.answers[best], "nearest": choices.nearest, "similarity": choices.similarity,
            "min_similarity": decoder.open_choices_min_similarity, "choices": len(choices.answers),
            "images": choices.images, "prior": decoder.open_choices_prior, "runner_up": choices.answers[runner_up],
            "margin": combined[best] - combined[runner_up], "share": choices.share(choices.answers[best])}


def judged(record: dict, calibration, group: str, decoder) -> dict:
    """`record` (chosen()) with how likely it is to be right and whether the app says "Uncertain" instead: the
    open-answer calibration (decoder.open_calibration, scripts/calibrate_open.py) of the image's `group`
    (confidence.image_group) turns the margin (and, for a fit that weighs it, the chosen answer's training
    share) into a confidence, with the out-of-fold share right of its bin
    ("held_out"); below the threshold the file chose out of fold (decoder.min_confidence without one; never
    for a group the file marks answered by no threshold) the answer is withheld (decoder.abstain). Without a
    usable file the confidence is None and nothing is withheld ("uncalibrated": why the file is not used)."""
    from .confidence import NEVER, OPEN_CHOICE

    part = calibration.for_group(group) if calibration.groups else calibration
    # A fit may also weigh how usual the chosen answer is (the log of its share; calibrate_open.py --share).
    usual = math.log(record["share"]) if record.get("share") else None
    confidence = part.confidence(record["margin"], OPEN_CHOICE, usual)
    threshold = part.min_confidence(decoder.min_confidence, decoder.threshold_from_calibration)
    abstained = bool(decoder.abstain and confidence is not None and confidence < threshold)
    judged_record = {**record, "confidence": confidence, "held_out": part.held_out(confidence), "abstained": abstained,
                     **({"uncalibrated": calibration.unused} if calibration.unused else {})}
    withheld = part.meta.get("withheld_out_of_fold")
    if (abstained and withheld and withheld.get("n")
            and (threshold == NEVER or threshold == (part.meta.get("threshold") or {}).get("min_confidence"))):
        # What the withheld answers of this part were worth out of fold (not the bin's figure: a bin may straddle
        # the threshold, and a part no threshold answers may hold a few confident answers that were right).
        judged_record["withheld"] = {**withheld, "every": threshold == NEVER, "group": part.group,
                                     "target_accuracy": part.meta["threshold"].get("target_accuracy")}
    return judged_record


def leaning(record: dict) -> str:
    """What the app says instead of a chosen open answer it withholds (judged()'s "abstained"): the answer it leans
    to and how often the answers withheld like it were right out of fold."""
    from .confidence import OPEN_CHOICE, Verdict, leaning_text

    withheld = record.get("withheld")  # None: a file without that table, or a threshold other than the file's
    verdict = Verdict(record["answer"], record["margin"], OPEN_CHOICE, record["confidence"], True,
                      withheld or record.get("held_out"))
    if not withheld:
        return leaning_text(verdict)
    return leaning_text(verdict, "chosen answers about such images" if withheld["every"]
                        else "chosen answers with a confidence below the threshold")


def fitted_settings(decoder, digest: str, head_digest: str | None = None) -> dict:
    """The settings a chosen answer's margin depends on, as an open-answer calibration records them: the open
    answers file (its content digest), decoder.open_choices_* and decoder.open_answerer. With "encoder_head" the
    head takes the open questions it reads firmly and the decoder chooses for the rest, another population, which
    the head (`head_digest`) and its thresholds decide: those are recorded too."""
    fitted = {"open_answers_sha256": digest, "min_similarity": decoder.open_choices_min_similarity,
              "max": decoder.open_choices_max, "min_images": decoder.open_choices_min_images,
              "prior": decoder.open_choices_prior, "answerer": decoder.open_answerer}
    if decoder.open_answerer == "encoder_head":
        fitted.update(head=head_digest, head_min_probability=decoder.head_open_min_probability,
                      head_min_similarity=decoder.head_open_min_similarity)
    return fitted


class OpenAnswers:
    """The training open questions (question_form), their answers with counts, and their embeddings."""

    def __init__(self, questions: list[str], answers: list[list[list]], vectors, meta: dict | None = None,
                 embedder=None, images: list[int] | None = None):
        images = images if images is not None else [0] * len(questions)
        if (len(questions) != len(answers) or len(questions) != int(vectors.shape[0]) or len(images) != len(questions)
                or not questions):
            raise OpenAnswersError(f"{len(questions)} questions, {len(answers)} answer lists, {len(images)} image counts "
                                   f"and {int(vectors.shape[0])} embeddings: they must be as many, and not none")
        self.questions = questions  # question_form, as training most often writes it
        # Per question: [[spelling, count, images], ...], most frequent first (images: of how many images).
        self.answers = answers
        self.images = images  # per question, of how many images training asked it
        self._vectors = np.asarray(vectors, dtype=np.float32)
        self._index = {match_key(question): i for i, question in enumerate(questions)}
        self.meta = meta or {}
        self.digest = self.meta.get("content_sha256") or content_digest(questions, answers, images)
        self._embedder = embedder

    @classmethod
    def load(cls, path: str | Path, embedder=None) -> "OpenAnswers":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise OpenAnswersError(f"no open answers at {path}: decoder.open_choices 'training_answers' needs the "
                                   "file scripts/build_open_answers.py writes (decoder.open_answers)")
        try:
            with safe_open(str(path), "np") as handle:
                meta = handle.metadata() or {}
                vectors = handle.get_tensor("embeddings")
        except Exception as error:  # safetensors' own errors are not ValueErrors
            raise OpenAnswersError(f"{path} is not a readable safetensors file: {error}") from error
        if meta.get("embedder") != QUESTION_EMBEDDER:
            raise OpenAnswersError(f"{path} was embedded with {meta.get('embedder')!r}; the app embeds questions "
                                   f"with {QUESTION_EMBEDDER!r}")
        try:
            questions, answers = json.loads(meta["questions"]), json.loads(meta["answers"])
            images = json.loads(meta["images"])
        except (KeyError, json.JSONDecodeError) as error:
            raise OpenAnswersError(f"{path} does not list its questions, answers and images ({error}); rebuild it "
                                   "with scripts/build_open_answers.py") from None
        found = cls(questions, answers, vectors, meta, embedder, images)
        if meta.get("content_sha256") and meta["content_sha256"] != content_digest(questions, answers, images):
            raise OpenAnswersError(f"{path}: its questions and answers do not match the content_sha256 it records")
        return found

    def embed(self, texts: list[str]) -> np.ndarray:
        if self._embedder is None:
            from .retrieval.embed import load_embedder

            self._embedder = load_embedder(QUESTION_EMBEDDER, device="cpu")
        vectors = np.asarray(self._embedder.encode(texts, batch_size=128), dtype=np.float32)
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

    def nearest(self, question: str) -> tuple[float, int]:
        """(cosine similarity, index) of the training question most like `question`; the same words
        (question_form) are 1.0 without embedding anything."""
        form = question_form(question)
        if match_key(form) in self._index:
            return 1.0, self._index[match_key(form)]
        similarities = self._vectors @ self.embed([form])[0]
        best = int(np.argmax(similarities))
        return float(similarities[best]), best

    def find(self, question: str, min_similarity: float, max_answers: int, min_images: int = 2) -> Choices | None:
        """The answers to choose among for `question`: of the training question most like it, those training
        gave for at least `min_images` different images, the `max_answers` most frequent; None when no training
        question is at least `min_similarity` like it or fewer than two answers qualify (nothing to choose)."""
        if min_similarity >= 1.0 and match_key(question_form(question)) not in self._index:
            return None  # only a training question's own words: nothing to embed
        similarity, index = self.nearest(question)
        if similarity < min_similarity:
            return None
        kept = [row for row in self.answers[index] if int(row[2]) >= min_images][:max_answers]
        if len(kept) < 2:
            return None
        return Choices(self.questions[index], round(similarity, 6), tuple(str(row[0]) for row in kept),
                       tuple(int(row[1]) for row in kept), int(self.images[index]))

    def warm(self) -> "OpenAnswers":
        """Load the question embedder now, so that the first answer does not wait for it."""
        self.embed(["warm"])
        return self


def match_key(question: str) -> str:
    """How a question is looked up among the training questions: its question_form, case-folded."""
    return question_form(question).casefold()


def choice_note(record: dict | None) -> str:
    """What the app says under an open answer chosen among training answers (Done.open_choice); "" for
    any other answer."""
    if not record:
        return ""
    like = ("the same question" if record["similarity"] >= 1.0
            else f"the training question most like yours, \u201c{record['nearest']}\u201d")
    images = f", asked of {record['images']} images in training" if record.get("images") else ""
    weighted = ", weighted toward the answers given most often" if record.get("prior") else ""
    return (f"Chosen by the language model among the {record['choices']} answers training data gave most often to "
            f"{like}{images}: each scored with this image{weighted}; not written freely. {_confidence(record)}")


def _confidence(record: dict) -> str:
    """The sentence on how often such an answer is right (a withheld answer's leaning already says it)."""
    from .confidence import held_out_text

    if record.get("abstained"):
        withheld = record.get("withheld")
        if not withheld:  # the threshold in force is decoder.min_confidence, not one the file chose
            return "It is not given as the answer: its confidence is below the app's threshold (decoder.min_confidence)."
        target = f"{100 * withheld['target_accuracy']:.0f} %" if withheld.get("target_accuracy") else "often enough"
        if withheld.get("every"):
            return (f"It is not given as the answer: on held-out training images like this one, no confidence "
                    f"picked out enough chosen answers that were right {target} of the time.")
        return (f"It is not given as the answer: its confidence is below the threshold at which such answers were "
                f"right {target} of the time on held-out training images.")
    if record.get("held_out"):
        return f"Confidence: {held_out_text(record['held_out'])}."
    if record.get("confidence") is not None:
        return f"Confidence: estimated {record['confidence']:.0%} likely to be right."
    if record.get("uncalibrated"):
        return ("How often such answers are right is not measured for this model (the calibration file was "
                f"{record['uncalibrated']}).")
    return "How often such answers are right is not measured for this model."


def load_open_calibration(settings, answers: OpenAnswers | None, projector_sha256: str | None,
                          head_digest: str | None = None):
    """How often a chosen open answer is right (decoder.open_calibration): only a file fitted for this projector,
    open answers file, open_choices settings and open answerer (with the head answering open questions,
    `head_digest`: the head loaded) (confidence.open_calibration_for); None without `answers`."""
    from .confidence import open_calibration_for

    if answers is None:
        return None
    return open_calibration_for(settings.decoder.open_calibration, projector_sha256,
                                fitted_settings(settings.decoder, answers.digest, head_digest))


def load_open_answers(settings, scores_options: bool) -> OpenAnswers | None:
    """The training open answers when `decoder.open_choices` is "training_answers" and the engine can
    score answers; None otherwise (an engine that cannot, such as a remote server, generates: logged)."""
    import logging

    from .config import resolve_path

    decoder = settings.decoder
    if decoder.open_choices != "training_answers":
        return None
    if not 0.0 <= decoder.open_choices_min_similarity <= 1.0:
        raise OpenAnswersError(f"decoder.open_choices_min_similarity is {decoder.open_choices_min_similarity}; it is a "
                               "cosine similarity, from 0 (every open question) to 1 (only a training question's words)")
    if decoder.open_choices_min_images < 1:
        raise OpenAnswersError(f"decoder.open_choices_min_images is {decoder.open_choices_min_images}; it counts the "
                               "images training gave an answer for, at least 1")
    if decoder.open_choices_max < 2:
        raise OpenAnswersError(f"decoder.open_choices_max is {decoder.open_choices_max}; at least two answers are scored "
                               "(with one there is nothing to choose among)")
    if not scores_options:
        logging.getLogger(__name__).info("decoder.open_choices: the %r engine cannot score answers; open questions "
                                         "are generated", decoder.engine)
        return None
    answers = OpenAnswers.load(resolve_path(decoder.open_answers) if decoder.open_answers else "")
    # Below 1 a question in other words is embedded: load the embedder now, not during the first answer.
    return answers.warm() if decoder.open_choices_min_similarity < 1.0 else answers
