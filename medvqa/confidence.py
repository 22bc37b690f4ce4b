"""How likely a closed answer is to be right, and when the app says "Uncertain" instead.

The constrained decoder scores every option a closed question names (closed.ClosedQuestions._option_scores). The
margin between the best and the second-best option is turned into a probability of being right by a
logistic fit (Platt scaling), one per kind of question ("yes/no", and "choice" for "A or B?"), fitted
by `scripts/calibrate_closed.py` on closed questions about training images that the projector never
saw (`train_projector.py --val-by-image`), never on a validation or test split. The fit is a JSON
file beside the projector:

    calibration = Calibration.load("weights/offline/calibration.json")
    verdict = calibration.judge({"yes": -0.61, "no": -0.75}, min_confidence=0.7)
    verdict.choice, verdict.confidence, verdict.abstained     # "yes", 0.58, True

Below `decoder.min_confidence` the app answers "Uncertain — the model cannot tell from this image"
and shows the option it leans to, instead of a coin flip presented as an answer
(`decoder.abstain = false` turns that off). The script also chooses that threshold out of fold (the
lowest at which answered questions reach a target accuracy); a file holding such a choice replaces
`decoder.min_confidence` unless `decoder.threshold_from_calibration = false`. A profile without a
calibration file shows no confidence and never abstains: there is nothing measured to base either on.
A file fitted for another model is not used either (`Calibration.unusable_for`): it names the projector
file (SHA-256) and `decoder.yes_bias` it was fitted with, and the margins of any other projector or bias
are not the ones it measured. The app then says the answer's confidence was not measured, and why.

A file may also hold a fit per group of images (`groups`): the held-out questions are dominated by
PathVQA's stained slides, whose answers are right more often at the same margin than radiology's, so
one pooled fit and threshold overstate the confidence of answers about grey radiographs. `image_group`
tells the groups apart by colour (what the model sees, not metadata); an image of a group the file fits
gets that group's fits, threshold and reliability table (`Calibration.for_image`).

The clinician is not shown the fit's own probability but how often answers with such a confidence
were right on held-out training images, scored by a fit that had not seen them (the out-of-fold
reliability table the script stores, `Verdict.held_out`): the in-sample fit grades its own homework.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .answers import normalise
from .imaging.windowing import is_grey

log = logging.getLogger(__name__)

YES_NO = "yes/no"
CHOICE = "choice"
# A yes/no question scored through the open question it presupposes (medvqa/presuppose.py): its margin
# is the named value's score over the best other value's, fitted on its own.
PRESUPPOSED = "presupposed"
# A yes/no question answered by the encoder's answer head (decoder.closed_answerer "encoder_head"): its
# margin is the head's Yes-minus-No logit, fitted on its own.
HEAD = "head"
KINDS = (YES_NO, CHOICE, PRESUPPOSED, HEAD)
# An open answer the decoder chose among training answers (medvqa/open_choices.py): its margin is the chosen
# answer's score over the runner-up's, fitted in a file of its own (scripts/calibrate_open.py,
# decoder.open_calibration).
OPEN_CHOICE = "open choice"

# Image groups a calibration may be fitted for (image_group).
COLOUR = "colour"
GREY = "grey"
# Within an image group, a file may fit the questions worded like the training yes/no questions and the
# rest apart ("grey, worded like training", "grey, worded otherwise"; `wording` in the file): SLAKE's
# templated questions are right more often at the same margin than VQA-RAD's freely worded ones
# (calibrate_closed.py --wording-similarity).
WORDED = ", worded like training"
WORDED_OTHERWISE = ", worded otherwise"
# Within an image group, a file may also fit the decoder's yes/no answers that the encoder's answer head
# reads the same way and those it reads the other way apart ("grey, image encoder agrees"; `agreement` in
# the file; calibrate_closed.py --head-agreement). The decoder still answers; the head, trained with the
# encoder's medical stage, is a second reader whose disagreement marks the answers not to trust.
AGREES = ", image encoder agrees"
DISAGREES = ", image encoder disagrees"
# A part's fits may also weigh how strongly the head reads the question (its |Yes − No| logit, the reading's
# `strength`): P(right) = sigmoid(a * margin + b + c * strength), "c" in the file (calibrate_closed.py
# --head-agreement; --no-head-strength fits the margin alone). The decoder's answer is more often right
# where the head agrees firmly, and less often where it disagrees firmly.
# The threshold of a part whose answers are all "Uncertain" (a part fitted by agreement where no threshold
# reached the target accuracy out of fold: calibrate_closed.py marks it `abstain`).
NEVER = math.inf
def image_group(image: np.ndarray) -> str:
    """COLOUR for an image with colour (a stained slide, a photograph), GREY for one without (radiology,
    shown as grey RGB), judged on the pixels the model sees (imaging.windowing.is_grey)."""
    return GREY if is_grey(image) else COLOUR


def question_kind(options) -> str:
    """"yes/no" when the options are yes and no (in any spelling), else "choice"."""
    return YES_NO if {str(o).strip().lower() for o in options} == {"yes", "no"} else CHOICE


def ranked(scores: dict[str, float]) -> tuple[str, float]:
    """(the best option, its margin over the second best; 0 with a single option)."""
    order = sorted(scores.items(), key=lambda item: -item[1])
    return order[0][0], (order[0][1] - order[1][1] if len(order) > 1 else 0.0)


@dataclass(frozen=True)
class Verdict:
    choice: str  # the option with the best score (the leaning, when abstained)
    margin: float  # its score minus the runner-up's (mean log-probability units)
    kind: str  # YES_NO or CHOICE
    confidence: float | None  # calibrated probability that `choice` is right; None without calibration
    abstained: bool  # the app says "Uncertain" and shows `choice` as the leaning
    # {"bin", "accuracy", "n"}: how often answers in `confidence`'s bin were right out of fold
    # (Calibration.held_out); None for a file without that table, or a bin no held-out answer fell in.
    held_out: dict | None = None

    def record(self) -> dict:
        return {"choice": self.choice, "margin": round(self.margin, 4), "kind": self.kind,
                "confidence": None if self.confidence is None else round(self.confidence, 4),
                "abstained": self.abstained, "held_out": self.held_out}


@dataclass
class Calibration:
    """Per kind of question, P(right | margin) = sigmoid(a * margin + b), or, for a part fitted with the
    answer head's strength (see AGREES), sigmoid(a * margin + b + c * strength)."""
    fits: dict[str, tuple[float, ...]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # where and how it was fitted (written by the script)
    # Why the configured file is not in force ("" when it is, or when none was configured): the
    # pipeline replaces a file fitted for another model by an empty calibration carrying the reason.
    unused: str = ""
    # Per image group (image_group): that group's fits, threshold and out-of-fold table, in the same
    # form (its meta names the group); images of other groups, or files without groups, use this one.
    groups: dict[str, "Calibration"] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        data = json.loads(Path(path).read_text())
        try:
            return cls._from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{path} is not a closed-answer calibration (fits: {{kind: {{a, b}}}})") from error

    @classmethod
    def _from_dict(cls, data: dict, group: str | None = None) -> "Calibration":
        fits = {kind: (float(fit["a"]), float(fit["b"]), *([float(fit["c"])] if "c" in fit else []))
                for kind, fit in data["fits"].items()}
        meta = {k: v for k, v in data.items() if k not in ("fits", "groups")}
        if group is not None:
            meta["group"] = group
        groups = {name: cls._from_dict(body, name) for name, body in (data.get("groups") or {}).items()}
        return cls(fits, meta, groups=groups)

    def _to_dict(self) -> dict:
        body = {"fits": {kind: dict(zip("abc", fit)) for kind, fit in self.fits.items()},
                **{k: v for k, v in self.meta.items() if k != "group"}}
        if self.groups:
            body["groups"] = {name: group._to_dict() for name, group in self.groups.items()}
        return body

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self._to_dict(), indent=2) + "\n")

    def for_image(self, image: np.ndarray, similarity: float | None = None,
                  agrees: bool | None = None) -> "Calibration":
        """The calibration for answers about `image`: its group's when the file fits one, else this
        (`similarity` and `agrees` as for for_group)."""
        return self.for_group(image_group(image), similarity, agrees) if self.groups else self

    def for_group(self, group: str, similarity: float | None = None, agrees: bool | None = None) -> "Calibration":
        """The calibration for answers about an image of `group` (image_group): that group's fit when the
        file has one, else this. With the question's `similarity` to the nearest training yes/no question
        (AnswerHead.yes_no_similarity) and a file fitted by wording (`wording`), the fit of that group's
        questions worded like training (similarity at or above the file's threshold) or of the rest,
        when the file has one. With `agrees` (whether the encoder's answer head gives the decoder's yes/no
        answer; None for an answer it does not read) and a file fitted by agreement (`agreement`), the fit
        of that group's answers the head agrees with, or of those it does not, when the file has one."""
        if agrees is not None and self.agreement is not None:
            part = self.groups.get(group + (AGREES if agrees else DISAGREES))
            if part is not None:
                return part
        if similarity is not None and self.wording is not None:
            part = self.groups.get(group + (WORDED if similarity >= self.wording else WORDED_OTHERWISE))
            if part is not None:
                return part
        return self.groups.get(group, self)

    @property
    def wording(self) -> float | None:
        """The similarity at or above which a question counts as worded like training (None: the file
        does not tell them apart)."""
        value = (self.meta.get("wording") or {}).get("min_similarity")
        return None if value is None else float(value)

    @property
    def agreement(self) -> str | None:
        """The digest of the answer head whose agreement with the decoder's yes/no answers the file fits
        apart (None: the file does not tell them apart)."""
        value = (self.meta.get("agreement") or {}).get("answer_head_digest")
        return None if value is None else str(value)

    @property
    def strength_wording(self) -> tuple[float, str] | None:
        """How the file's agreement parts weigh the answer head's strength: (the similarity to a training
        yes/no question at or above which a reading's strength counts, 0 for every question; the SHA-256
        of those questions, "" with 0); None when they fit the decoder's margin alone."""
        value = (self.meta.get("agreement") or {}).get("strength")
        if not value:
            return None
        return float(value.get("min_similarity") or 0.0), str(value.get("yes_no_questions_sha256") or "")

    @property
    def group(self) -> str | None:
        """The image group this calibration was fitted for; None for the pooled one."""
        return self.meta.get("group")

    def unusable_for(self, projector_sha256: str | None, yes_bias: float, answer_head_digest: str | None = None,
                     head_answers: list[str] | None = None) -> str:
        """Why this calibration does not describe a model with this projector file (its SHA-256; None
        for no file), `decoder.yes_bias` and yes/no answerer (with decoder.closed_answerer "encoder_head",
        the answer head's `heads_digest` and the questions it takes, `decoder.head_answers`; None for the
        decoder); "" when it does, or when the file does not say (files fitted with no projector file, or
        older than these fields)."""
        fitted_head = self.meta.get("answer_head_digest")
        if fitted_head != answer_head_digest and (fitted_head or answer_head_digest):
            fitted_with = f"answer head {fitted_head[:12]}…" if fitted_head else "the decoder"
            answering = f"answer head {answer_head_digest[:12]}…" if answer_head_digest else "the decoder"
            return (f"fitted with {fitted_with} answering yes/no questions and this profile answers them with "
                    f"{answering}; refit it with scripts/calibrate_closed.py")
        fitted_answers = self.meta.get("head_answers")
        if answer_head_digest and fitted_answers is not None and sorted(fitted_answers) != sorted(head_answers or []):
            return (f"fitted with the answer head taking {', '.join(sorted(fitted_answers))} questions and this "
                    f"profile gives it {', '.join(sorted(head_answers or [])) or 'none'} (decoder.head_answers); "
                    f"refit it with scripts/calibrate_closed.py")
        fitted = self.meta.get("projector_sha256")
        if fitted and fitted != projector_sha256:
            loaded = f"projector {projector_sha256[:12]}…" if projector_sha256 else "no projector file"
            return (f"fitted with projector {fitted[:12]}… and this model has {loaded}; "
                    f"refit it with scripts/calibrate_closed.py")
        fitted_bias = self.meta.get("yes_bias")
        if fitted_bias is not None and abs(float(fitted_bias) - float(yes_bias)) > 1e-9:
            return (f"fitted with decoder.yes_bias {float(fitted_bias):g} and this profile uses "
                    f"{float(yes_bias):g}; refit it with scripts/calibrate_closed.py")
        return ""

    def unusable_for_open(self, projector_sha256: str | None, open_choices: dict) -> str:
        """Why this file does not describe the open answers chosen among training answers by a model with this
        projector file and these `open_choices` settings (scripts/calibrate_open.py's open_choices_meta: the
        open answers file's digest, min_similarity, max, min_images, prior, answerer, and with the head answering open
        questions its digest and thresholds); "" when it does."""
        if self.meta.get("kind") != OPEN_CHOICE:
            return "not fitted for open answers chosen among training answers; fit one with scripts/calibrate_open.py"
        fitted = self.meta.get("projector_sha256")
        if fitted and fitted != projector_sha256:
            loaded = f"projector {projector_sha256[:12]}…" if projector_sha256 else "no projector file"
            return (f"fitted with projector {fitted[:12]}… and this model has {loaded}; "
                    "refit it with scripts/calibrate_open.py")
        recorded = self.meta.get("open_choices") or {}
        for key, value in open_choices.items():
            fitted = recorded.get(key)
            if fitted == value:
                continue
            if key in ("open_answers_sha256", "head"):
                what = "the open answers file" if key == "open_answers_sha256" else "answer head"
                return (f"fitted with {what} {str(fitted)[:12]}… and this profile uses {str(value)[:12]}…; "
                        "refit it with scripts/calibrate_open.py")
            setting = _OPEN_SETTINGS.get(key, f"decoder.open_choices_{key}")
            if fitted is None:
                return (f"fitted before {setting} was recorded (this profile uses {value}); "
                        "refit it with scripts/calibrate_open.py")
            return (f"fitted with {setting} {fitted} and this profile uses {value}; "
                    "refit it with scripts/calibrate_open.py")
        return ""

    def confidence(self, margin: float, kind: str, strength: float | None = None) -> float | None:
        """P(right) for an answer of `kind` with `margin`; with a fit that weighs the answer head's reading,
        `strength` is how firmly the head read the question (|Yes − No| logit) and None gives None (the
        fit does not describe an answer without it). None for a kind the file does not fit."""
        fit = self.fits.get(kind)
        if fit is None or (len(fit) > 2 and strength is None):
            return None
        return _sigmoid(fit[0] * margin + fit[1] + (fit[2] * strength if len(fit) > 2 else 0.0))

    @property
    def weighs_strength(self) -> bool:
        """Whether a fit of this calibration weighs the answer head's strength (its "c")."""
        return any(len(fit) > 2 for fit in self.fits.values())

    def held_out(self, confidence: float | None) -> dict | None:
        """The out-of-fold reliability bin `confidence` falls in, as {"bin", "accuracy", "n"}; None
        when the file has no such table (files older than it) or no held-out answer fell in that bin."""
        if confidence is None:
            return None
        for row in self.meta.get("out_of_fold", {}).get("reliability", []):
            low, high = (float(edge) for edge in row["bin"].split("-"))
            if low <= confidence and (confidence < high or high >= 1.0):  # as reliability() bins
                found = {"bin": row["bin"], "accuracy": float(row["accuracy"]), "n": int(row["n"])}
                return {**found, "group": self.group} if self.group else found
        return None

    def min_confidence(self, configured: float, from_calibration: bool = True) -> float:
        """The confidence below which the app abstains: the threshold the script chose out of fold,
        when `from_calibration` and the file holds one that met its target accuracy; NEVER for a part
        the file marks as answered by no threshold (`abstain`: the head's disagreeing answers, where no
        confidence reached the target); else `configured` (decoder.min_confidence)."""
        chosen = self.meta.get("threshold", {})
        if from_calibration and chosen.get("met") and chosen.get("min_confidence") is not None:
            return float(chosen["min_confidence"])
        if from_calibration and chosen.get("abstain"):
            return NEVER
        return configured

    def judge(self, scores: dict[str, float], min_confidence: float, abstain: bool = True,
              kind: str | None = None, strength: float | None = None) -> Verdict:
        """The answer to `scores` (the best option), its confidence (`strength`: as for confidence) and
        whether the app abstains below `min_confidence`."""
        choice, margin = ranked(scores)
        kind = kind or question_kind(scores)
        confidence = self.confidence(margin, kind, strength)
        abstained = bool(abstain and confidence is not None and confidence < min_confidence)
        return Verdict(choice, margin, kind, confidence, abstained, self.held_out(confidence))


# open_choices.fitted_settings' keys that are not decoder.open_choices_*
_OPEN_SETTINGS = {"answerer": "decoder.open_answerer", "head_min_probability": "decoder.head_open_min_probability",
                  "head_min_similarity": "decoder.head_open_min_similarity"}


def load_calibration(path: str, answers: str = "closed answers") -> Calibration:
    """The calibration at `path`; an empty one (no confidence, no abstention) when `path` is "" or
    names no file, which is logged (`answers`: which answers it would have judged). A file that is not a
    calibration is an error."""
    if not path:
        return Calibration()
    if not Path(path).is_file():
        log.warning("no calibration of %s at %s: they are shown without a confidence", answers, path)
        return Calibration()
    return Calibration.load(path)


def _in_force(path: str, answers: str, why_not) -> Calibration:
    """load_calibration(path), or an empty calibration whose `unused` says why when `why_not(calibration)` says
    the file was fitted for another model (logged)."""
    calibration = load_calibration(path, answers)
    if not calibration.fits and not calibration.meta:  # no file: nothing fitted for anything (logged)
        return calibration
    reason = why_not(calibration)
    if reason:
        log.warning("calibration %s not used: it was %s; %s are shown without a confidence", path, reason, answers)
        return Calibration(unused=reason)
    return calibration


def calibration_for(path: str, projector_sha256: str | None, yes_bias: float,
                    answer_head_digest: str | None = None, head_answers: list[str] | None = None) -> Calibration:
    """load_calibration(path), or an empty calibration whose `unused` says why when the file was
    fitted for another projector, yes_bias or yes/no answerer (logged)."""
    return _in_force(path, "closed answers",
                     lambda calibration: calibration.unusable_for(projector_sha256, yes_bias, answer_head_digest,
                                                                  head_answers))


def open_calibration_for(path: str, projector_sha256: str | None, open_choices: dict) -> Calibration:
    """load_calibration(path) for open answers chosen among training answers (decoder.open_calibration), or an
    empty calibration whose `unused` says why when the file was fitted for another projector, open answers
    file or open_choices settings (logged)."""
    return _in_force(path, "chosen open answers",
                     lambda calibration: calibration.unusable_for_open(projector_sha256, open_choices))


def fit_platt(margins, correct, strength=None, *, iterations: int = 100, ridge: float = 1e-3) -> tuple[float, ...]:
    """Logistic regression of `correct` (0/1) on `margin` (and on the answer head's `strength`, when
    given) by Newton's method, with a small ridge on the slopes so that a feature that predicts nothing
    fits a slope near 0. Returns (a, b), or (a, b, c) with `strength`."""
    x = np.asarray(margins, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    if len(x) == 0:
        raise ValueError("no questions to fit a calibration on")
    columns = [x, np.ones_like(x)] + ([] if strength is None else [np.asarray(strength, dtype=np.float64)])
    design = np.stack(columns, axis=1)
    weights = np.zeros(len(columns))
    penalty = np.diag([ridge * len(x), 0.0] + [ridge * len(x)] * (len(columns) - 2))
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(design @ weights)))
        gradient = design.T @ (p - y) + penalty @ weights
        hessian = design.T @ (design * (p * (1 - p))[:, None]) + penalty + 1e-9 * np.eye(len(columns))
        step = np.linalg.solve(hessian, gradient)
        weights -= step
        if np.abs(step).max() < 1e-10:
            break
    return tuple(float(w) for w in weights)


RELIABILITY_BINS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# The fewest answers an out-of-fold bin the app quotes may hold (calibrate_*.py join smaller ones).
MIN_BIN_ANSWERS = 30


def reliability(confidences, correct, bins=RELIABILITY_BINS, split_at: float | None = None,
                min_count: int = 0) -> list[dict]:
    """Per confidence bin: how many answers, their mean confidence and how many were right. `split_at` (the
    abstention threshold) is made an edge too: the figure the app shows beside an answer (Calibration.held_out)
    is then of answers on the same side of the threshold, never one bin for an answer given and one withheld.
    With `min_count`, a bin of fewer answers is joined to its neighbour on the same side of the threshold,
    away from it (a figure on a dozen answers says little); a side with fewer in all is one bin."""
    c = np.asarray(confidences, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    split = round(float(split_at), 2) if split_at is not None and bins[0] < split_at < bins[-1] else None
    if split is not None:
        bins = tuple(sorted({*bins, split}))
    spans = [(low, high) for low, high in zip(bins[:-1], bins[1:])]

    def inside(low: float, high: float) -> np.ndarray:
        return (c >= low) & ((c < high) | (high >= 1.0))

    if min_count:
        below = [span for span in spans if split is not None and span[1] <= split][::-1]  # outward from the split
        above = [span for span in spans if split is None or span[0] >= split]
        spans = sorted(_joined(below, inside, min_count) + _joined(above, inside, min_count))
    rows = []
    for low, high in spans:
        mask = inside(low, high)
        if mask.any():
            rows.append({"bin": f"{_edge(low)}-{_edge(high)}", "n": int(mask.sum()),
                         "mean_confidence": round(float(c[mask].mean()), 4),
                         "accuracy": round(float(y[mask].mean()), 4)})
    return rows


def _joined(spans: list[tuple[float, float]], inside, min_count: int) -> list[tuple[float, float]]:
    """`spans` (in order away from the threshold) joined until each holds `min_count` answers; a remainder
    too small joins the last one made."""
    joined, start, count = [], None, 0
    for low, high in spans:
        start = (low, high) if start is None else (min(start[0], low), max(start[1], high))
        count += int(inside(low, high).sum())
        if count >= min_count:
            joined.append(start)
            start, count = None, 0
    if start is not None:
        if joined and count:
            last = joined.pop()
            joined.append((min(last[0], start[0]), max(last[1], start[1])))
        elif count or not joined:
            joined.append(start)
    return joined


def leaning_text(verdict: Verdict, subject: str = "answers like this", spelling: str = "") -> str:
    """The answer shown instead of an answer the model cannot be trusted on (a closed one, or an open one chosen
    among training answers), its first letter raised and the rest as written ("CT" stays "CT"); its held-out
    figure is of `subject` (held_out_text). `spelling`: the leaning as the question or the answer writes it
    (a closed question's options are scored lower-cased: "ct" is shown "CT", not "Ct"), used when it is
    the same option."""
    choice = spelling if spelling and normalise(spelling) == normalise(verdict.choice) else verdict.choice
    choice = choice[:1].upper() + choice[1:]
    if verdict.held_out is not None:
        return (f"Uncertain — the model cannot tell from this image (it leans to {choice}; "
                f"{held_out_text(verdict.held_out, subject)}).")
    return (f"Uncertain — the model cannot tell from this image (it leans to {choice}, "
            f"estimated {verdict.confidence:.0%} likely to be right).")


def confidence_text(closed: dict) -> str:
    """A scored closed answer's confidence as plain text (the command line, the exported transcript):
    the out-of-fold share right, the fitted probability for files without that table, or why it was
    not measured."""
    if closed.get("held_out"):
        return held_out_text(closed["held_out"])
    if closed.get("confidence") is not None:
        return f"{100 * closed['confidence']:.0f} %"
    if closed.get("uncalibrated"):
        return f"not measured (the calibration file was {closed['uncalibrated']})"
    return "not measured"


def held_out_text(held_out: dict, subject: str = "answers like this") -> str:
    """Verdict.held_out as the clinician reads it: a measured share with its count, not a fitted curve (of
    `subject`: the answers in the confidence's bin, or those the sentence names)."""
    group = str(held_out.get("group") or "")
    base = group.removesuffix(WORDED).removesuffix(WORDED_OTHERWISE).removesuffix(AGREES).removesuffix(DISAGREES)
    images = {GREY: "grey training images", COLOUR: "training images with colour"}.get(base, "training images")
    if group.endswith(WORDED):
        images += ", of questions worded like the training questions"
    elif group.endswith(WORDED_OTHERWISE):
        images += ", of questions worded unlike the training questions"
    elif group.endswith(AGREES):
        images += ", where the image encoder's own reading gave the same answer"
    elif group.endswith(DISAGREES):
        images += ", where the image encoder's own reading gave the other answer"
    return (f"{subject} were right {100 * held_out['accuracy']:.0f} % of the time on held-out "
            f"{images} (n = {held_out['n']})")


def _edge(value: float) -> str:
    """A bin edge as the table names it: "0.6", or "0.66" for a threshold between the tenths."""
    return f"{value:.1f}" if round(value, 1) == round(value, 2) else f"{value:.2f}"


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
