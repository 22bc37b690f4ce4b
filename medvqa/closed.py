"""Closed questions: how their options are scored, and the calibrated verdict (the closed-question
half of pipeline.Pipeline, which it is mixed into).

A closed question (yes/no, or "A or B") is answered by scoring the options it names, along one of
three routes chosen per question (`ClosedQuestions._closed_route`):

- `None`: the decoder's mean log-probability of each option in its best spelling (`decoder.yes_bias`
  added to "Yes");
- `PRESUPPOSED`: a yes/no question naming one value ("Is this a CT?") scored through the open question
  it presupposes, over the attribute's values (medvqa/presuppose.py, `decoder.presupposed_closed`);
- `HEAD`: with `decoder.closed_answerer = "encoder_head"`, the encoder's answer head's Yes and No logits
  (medvqa/answer_head.py; outside the LLaVA design, off by default).

The same route scores the blank image for the image-reliance check, and the route is the kind of
question the calibration judges the margin by (medvqa/confidence.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .answers import normalise, surface_forms
from .confidence import HEAD, PRESUPPOSED, YES_NO, question_kind, ranked
from .engines import EngineRequest
from .model import VisionLanguageModel, image_digest
from .presuppose import Presupposition, head_kind, presupposition
from .prompt import Prompt

log = logging.getLogger(__name__)


def load_answer_head(settings, model: VisionLanguageModel | None):
    """The encoder's answer head when `decoder.closed_answerer` or `decoder.open_answerer` is
    "encoder_head", or `decoder.head_agreement` is on, checked against the profile's encoder; None otherwise
    (and, for head_agreement alone, when it cannot be loaded or read this encoder: logged)."""
    decoder = settings.decoder
    uses = [name for name in ("closed_answerer", "open_answerer") if getattr(decoder, name) == "encoder_head"]
    if decoder.head_agreement:
        uses.append("head_agreement")
    if not uses:
        return None
    from .answer_head import AnswerHeadError

    if "open_answerer" in uses and not 0.0 <= decoder.head_open_min_probability <= 1.0:
        raise AnswerHeadError(f"decoder.head_open_min_probability is {decoder.head_open_min_probability}; "
                              "it is a probability, from 0 (the head answers every open question) to 1 (none)")
    if "open_answerer" in uses and not 0.0 <= decoder.head_open_min_similarity <= 1.0:
        raise AnswerHeadError(f"decoder.head_open_min_similarity is {decoder.head_open_min_similarity}; it is a cosine "
                              "similarity, from 0 (off) to 1 (only questions nearly word for word like a training question)")
    if model is None and uses == ["head_agreement"]:
        log.info("decoder.head_agreement: the %r engine runs its own vision side; the answer head does not read "
                 "its answers, and the image groups' fits are used", decoder.engine)
        return None
    if model is None:
        raise AnswerHeadError(f"decoder.{uses[0]} 'encoder_head' reads the local image encoder's tokens; "
                              f"the {decoder.engine!r} engine runs its own vision side")
    if uses != ["head_agreement"]:
        return _load_head(settings, model, uses)
    try:
        return _load_head(settings, model, uses)
    except Exception as error:  # noqa: BLE001 - only a second reader: the app answers as before without it
        log.warning("decoder.head_agreement: the answer head is not used (%s: %s); the image groups' fits judge the "
                    "decoder's answers", type(error).__name__, error)
        return None


def _load_head(settings, model: VisionLanguageModel, uses: list[str]):
    """load_answer_head's head for `uses`, checked against the profile's encoder and warmed."""
    from .answer_head import AnswerHead, AnswerHeadError
    from .config import resolve_path
    from .vision import encoder_sha256

    decoder = settings.decoder
    head = AnswerHead.load(resolve_path(decoder.answer_head) if decoder.answer_head else "")
    head.check_encoder(encoder_sha256(settings.vision), model.vision.hidden_size, model.num_image_tokens)
    questions = resolve_path(decoder.head_questions) if decoder.head_questions else ""
    if "open_answerer" in uses and decoder.head_open_min_similarity > 0:
        head.attach_questions(questions)
    elif questions and Path(questions).is_file():
        # Not needed without a similarity threshold, but it spells the head's answers as written, and a
        # calibration may tell apart the yes/no questions worded like the training ones (confidence.WORDED).
        try:
            head.attach_questions(questions)
        except AnswerHeadError as error:
            log.warning("the head's training questions are not loaded (its answers are shown lower-cased, and a "
                        "calibration split by wording uses its image groups' fits): %s", error)
    head.warm()  # its question embedder, before the first answer
    model.keep_features = True  # the head reads the encoder's tokens: keep them beside the projected ones
    answers = [("yes/no questions (decoder.closed_answerer)" if use == "closed_answerer" else
                f"open questions above probability {decoder.head_open_min_probability:g}"
                + (f" like its training questions (similarity ≥ {decoder.head_open_min_similarity:g})"
                   if decoder.head_open_min_similarity > 0 else "") + " (decoder.open_answerer)")
               for use in uses if use != "head_agreement"]
    log.info("the encoder's answer head %s %s%s", decoder.answer_head,
             f"answers {' and '.join(answers)}" if answers else "answers nothing",
             "; it reads the decoder's yes/no answers a second time (decoder.head_agreement)"
             if "head_agreement" in uses else "")
    return head


class ClosedQuestions:
    """Mixed into pipeline.Pipeline, whose settings, engine, prompts, model, calibration, answer_head,
    head_closes, turns and _request it uses."""

    def _closed_route(self, question: str, candidates: list[str]) -> tuple[str | None, Presupposition | None]:
        """(HEAD, PRESUPPOSED or None, the presupposed open question when PRESUPPOSED) for a question
        whose options are `candidates`."""
        if question_kind(candidates) != YES_NO:
            return None, None
        named = presupposition(question)
        if self.head_closes and head_kind(named) in self.settings.decoder.head_answers:
            return HEAD, None
        if self.settings.decoder.presupposed_closed and named and named.kind in self.settings.decoder.presupposed_kinds:
            return PRESUPPOSED, named
        return None, None

    def _closed_scores(self, route: str | None, request: EngineRequest, question: str, candidates: list[str],
                       presupposed: Presupposition | None, image: np.ndarray, digest: str) -> tuple[str, dict[str, float]]:
        """(the answer as shown, each option's score) along `route`; `request` is the decoder's prompt
        with `image` (the presupposed open question's for PRESUPPOSED), unused by HEAD."""
        if route == HEAD:
            scores = self.answer_head.scores(self.model.vision_tokens(image, digest), question)
            return ("Yes" if scores["yes"] >= scores["no"] else "No"), scores
        if route == PRESUPPOSED:
            return self._presupposed_scores(request, presupposed)
        return self._option_scores(request, candidates)

    def wording_similarity(self, question: str) -> float | None:
        """The question's similarity to the nearest training yes/no question when the calibration tells
        questions worded like them apart (Calibration.wording) and the answer head holds those questions;
        None otherwise."""
        head = self.answer_head
        if self.calibration.wording is None:
            return None
        fitted_with = (self.calibration.meta.get("wording") or {}).get("yes_no_questions_sha256") or ""
        have = head.yes_no_digest if head is not None and head.yes_no_questions else ""
        if not have or (fitted_with and fitted_with != have):
            if not getattr(self, "_wording_warned", False):
                log.warning("the closed-answer calibration is split by likeness to the yes/no questions %s…, which "
                            "decoder.head_questions %s: the image groups' fits are used", fitted_with[:12] or "?",
                            f"does not hold (it holds {have[:12]}…)" if have else "does not provide")
                self._wording_warned = True
            return None
        return head.yes_no_similarity([question])[0]

    def encoder_reading(self, question: str, image: np.ndarray,
                        digest: str | None = None) -> tuple[str, float | None] | None:
        """("yes" or "no", its strength): how the encoder's answer head reads a yes/no question the decoder
        answers, when decoder.head_agreement is on and the calibration is fitted by agreement with this head
        (Calibration.agreement); None otherwise. The strength is what the calibration's parts weigh
        (Calibration.strength_wording): the head's |Yes − No| logit for a question worded like its training
        yes/no questions, 0 for another; None for a calibration that does not weigh it (and the reading is
        None when the head does not hold the questions the calibration measured the wording against)."""
        fitted, head = self.calibration.agreement, self.answer_head
        if fitted is None or head is None or not self.settings.decoder.head_agreement:
            return None
        if fitted != head.digest:
            if not getattr(self, "_agreement_warned", False):
                log.warning("the closed-answer calibration is split by agreement with answer head %s…, not with "
                            "decoder.answer_head %s…: the image groups' fits are used", fitted[:12], head.digest[:12])
                self._agreement_warned = True
            return None
        weighs = self.calibration.strength_wording
        if weighs is not None and weighs[0] > 0:
            have = head.yes_no_digest if head.yes_no_questions else ""
            if not have or (weighs[1] and weighs[1] != have):
                if not getattr(self, "_strength_warned", False):
                    log.warning("the closed-answer calibration weighs the answer head's reading by likeness to the "
                                "yes/no questions %s…, which decoder.head_questions %s: the image groups' fits are used",
                                weighs[1][:12] or "?",
                                f"does not hold (it holds {have[:12]}…)" if have else "does not provide")
                    self._strength_warned = True
                return None
        scores = head.scores(self.model.vision_tokens(image, digest), question)
        answer = "yes" if scores["yes"] >= scores["no"] else "no"
        if weighs is None:
            return answer, None
        worded = weighs[0] <= 0 or head.yes_no_similarity([question])[0] >= weighs[0]
        return answer, (abs(float(scores["yes"]) - float(scores["no"])) if worded else 0.0)

    def encoder_agrees(self, question: str, choice: str, kind: str | None, image: np.ndarray,
                       digest: str | None = None) -> tuple[str | None, bool | None, float | None]:
        """(the head's reading, whether it is the decoder's `choice`, its strength as encoder_reading gives it)
        for a yes/no question the decoder answered (kind YES_NO or PRESUPPOSED); (None, None, None) for other
        answers or without encoder_reading. `digest`: image_digest(image) when the caller has it (computed only
        when the head reads)."""
        if kind not in (YES_NO, PRESUPPOSED) or normalise(choice) not in ("yes", "no"):
            return None, None, None
        read = self.encoder_reading(question, image, digest)
        if read is None:
            return None, None, None
        return read[0], read[0] == normalise(choice), read[1]

    def _closed_verdict(self, conversation, scores: dict[str, float], route: str | None,
                        presupposed: Presupposition | None, question: str = ""):
        """(the `closed` record Done carries, the Verdict): the confidence from the calibration of the
        image's group (and of the question's wording, or of whether the encoder's answer head agrees,
        where the file fits that), and whether the app abstains."""
        decoder = self.settings.decoder
        similarity = self.wording_similarity(question) if question else None
        reading, agrees, strength = (self.encoder_agrees(question, ranked(scores)[0], route or question_kind(scores),
                                                         conversation.image, conversation.digest)
                                     if question and route != HEAD else (None, None, None))
        calibration = (self.calibration.for_group(conversation.image_group, similarity, agrees)  # the group's fit
                       if self.calibration.groups else self.calibration)
        threshold = calibration.min_confidence(decoder.min_confidence, decoder.threshold_from_calibration)
        verdict = calibration.judge(scores, threshold, decoder.abstain, kind=route, strength=strength)
        closed = {"options": scores, **verdict.record()}
        chosen = calibration.meta.get("threshold", {})
        if verdict.abstained and decoder.threshold_from_calibration and chosen.get("target_accuracy"):
            # Why it was withheld, which the page says instead of repeating the leaning's figure.
            closed["withheld_below"] = {"target_accuracy": float(chosen["target_accuracy"]),
                                        "never_met": bool(chosen.get("abstain"))}
        if route == HEAD:
            closed["answerer"] = "encoder_head"
        if calibration.group:
            closed["calibration_group"] = calibration.group
        if similarity is not None:
            closed["wording_similarity"] = round(similarity, 4)
        if reading is not None:
            closed["encoder_reading"] = {"answer": reading.capitalize(), "agrees": agrees,
                                         **({} if strength is None else {"strength": round(strength, 4)})}
        if verdict.confidence is None and self.calibration.unused:
            closed["uncalibrated"] = self.calibration.unused  # the configured file fits another model
        if presupposed:
            closed["presupposed"] = {"question": presupposed.question, "target": presupposed.target,
                                     **({"negated": True} if presupposed.negated else {})}
        return closed, verdict

    def choose_closed(self, request: EngineRequest, options: list[str], yes_bias: float | None = None) -> str:
        """The option with the best score, each option scored in its best spelling (surface_forms);
        "Yes" gets `decoder.yes_bias` added (chosen on held-out training questions by
        scripts/tune_closed.py)."""
        return self._option_scores(request, options, yes_bias)[0]

    def _option_scores(self, request: EngineRequest, options: list[str],
                       yes_bias: float | None = None) -> tuple[str, dict[str, float]]:
        """(the best spelling of the best option, each option's best score)."""
        yes_bias = self.settings.decoder.yes_bias if yes_bias is None else yes_bias
        forms = [form for option in options for form in surface_forms(option)]
        scores = np.asarray(self.engine.score_options(request, [self.prompts.answer_ids(form) for form in forms]))
        scores = scores + yes_bias * np.asarray([form == "Yes" for form in forms])
        by_option: dict[str, float] = {}
        for form, score in zip(forms, scores.tolist()):
            option = normalise(form)
            by_option[option] = max(score, by_option.get(option, float("-inf")))
        return forms[int(np.argmax(scores))], by_option

    def _presupposed_scores(self, request: EngineRequest, presupposed: Presupposition) -> tuple[str, dict[str, float]]:
        """("Yes" or "No", {"yes": the named value's score, "no": the best other value's}) after the
        open question in `request` (the other way round for a negated question, where Yes means the named
        value is not the most likely): the margin between them is what the confidence is fitted on."""
        values = self._option_scores(request, list(presupposed.options), yes_bias=0.0)[1]
        named = values.pop(normalise(presupposed.target))
        other = max(values.values())
        if presupposed.negated:
            return ("Yes" if other >= named else "No"), {"yes": other, "no": named}  # a tie: Yes, as ranked()
        return ("Yes" if named >= other else "No"), {"yes": named, "no": other}

    def option_scores(self, image: np.ndarray, prompt: Prompt, forms: list[str], digest: str | None = None) -> list[float]:
        """Mean token log-probability of each complete answer in `forms` after `prompt` with `image`."""
        request = self._request(image, prompt, digest or image_digest(image))
        with self.turns.turn():
            return self.engine.score_options(request, [self.prompts.answer_ids(form) for form in forms])
