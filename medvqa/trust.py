"""What a clinician needs to check an answer: the claim it makes, citations retrieved for that claim,
each marked by a check that can say why, and whether a closed answer depends on the image.

- `claim(question, answer)`: the terms the answer asserts. An open answer asserts its own words
  ("cardiomegaly with pulmonary edema"); a Yes asserts the finding the question names ("Is the heart
  enlarged?" -> "heart enlarged"); a No asserts an absence, which no passage describing the finding
  supports, so it has no terms to support (its citations are about the finding, marked related).
- `claim_query(question, answer, claim)`: what citations are retrieved for: the question and the
  claim, so the literature is about what the model said, not only about what was asked.
- `mark_support(claim, text)`: "supports" when the passage contains one of the claim's terms or a
  listed synonym (cardiomegaly / enlarged cardiac silhouette), with the phrase it matched; "related"
  otherwise. It never says "supports" without a match it can show.
- `image_reliance(real, neutral)`: a closed answer whose choice and most of whose margin survive a
  neutral (blank) image comes from the question, not the image.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .answers import first_yes_no, normalise, words

# Words that carry no finding: question scaffolding, articles, image talk.
_STOP = set("""a an the is are was were be been does do did can could has have had will would should
shall may might must there this that these those it its of in on at to for from with by as and or
any some image images picture scan shown seen see visible present evidence what which where how
who when why patient study film view here show shows""".split())
_YES_NO_SCAFFOLD = re.compile(r"^(is|are|was|were|does|do|did|can|could|has|have|had|will|would|should)\s+",
                              re.IGNORECASE)

# Findings and the other ways literature says them (all lower case; matched as whole words).
SYNONYMS: dict[str, tuple[str, ...]] = {
    "cardiomegaly": ("enlarged cardiac silhouette", "enlarged heart", "cardiac enlargement", "heart enlarged",
                     "enlargement of the heart"),
    "pleural effusion": ("fluid in the pleural space", "pleural fluid", "hydrothorax"),
    "pneumothorax": ("collapsed lung", "air in the pleural space"),
    "pneumonia": ("consolidation", "airspace disease", "lung infection"),
    "edema": ("oedema",),
    "pulmonary edema": ("pulmonary oedema", "fluid in the lungs"),
    "atelectasis": ("collapse of the lung", "lung collapse"),
    "nodule": ("nodular opacity",),
    "mass": ("tumor", "tumour", "neoplasm", "lesion"),
    "fracture": ("broken bone", "break in the bone"),
    "hemorrhage": ("haemorrhage", "bleeding", "hematoma", "haematoma"),
    "infarct": ("infarction", "ischemic stroke", "ischaemic stroke"),
    "ct": ("computed tomography",),
    "mri": ("magnetic resonance",),
    "x-ray": ("radiograph", "xray", "x ray", "radiography"),
    "ultrasound": ("sonography", "ultrasonography"),
}


@dataclass
class Claim:
    terms: list[str] = field(default_factory=list)  # what a passage must contain to support the answer
    finding: str = ""  # the finding a yes/no question names
    polarity: str = ""  # "yes", "no", or "" for an open answer


def claim(question: str, answer: str) -> Claim:
    """The terms `answer` asserts about `question` (see the module docstring)."""
    said = first_yes_no(answer) if answer else None
    if said is not None and normalise(answer).split()[:1] == [said]:
        finding = _finding(question)
        # The finding as a whole, or a listed finding it names: a passage that only shares a word
        # with it ("heart") is about the topic, not support for the claim.
        terms = [finding] + _listed_within(finding)
        return Claim(terms=_unique(terms) if said == "yes" and finding else [], finding=finding, polarity=said)
    content = [word for word in words(answer) if word not in _STOP]
    phrase = " ".join(content)
    # A short answer ("Liver", "Left lung", "CT") is its words; a longer one its phrase and the
    # listed findings in it.
    terms = [phrase] + (content if len(content) <= 2 else _listed_within(phrase))
    return Claim(terms=_unique(t for t in terms if t), finding="", polarity="")


def claim_query(question: str, answer: str, asserted: Claim | None = None) -> str:
    """The question and what the answer claims about it: what citations are retrieved for."""
    asserted = asserted or claim(question, answer)
    about = asserted.finding if asserted.polarity else answer.strip()
    return f"{question.strip()} {about}".strip() if about else question.strip()


def mark_support(asserted: Claim, text: str) -> tuple[str, str]:
    """("supports", the phrase matched) when the passage contains one of the claim's terms or one
    of their listed synonyms, else ("related", "")."""
    passage = " " + normalise(text) + " "
    for term in asserted.terms:
        for phrase in (term, *SYNONYMS.get(term, ()), *_synonyms_within(term)):
            if phrase and f" {normalise(phrase)} " in passage:
                return "supports", phrase
    return "related", ""


def image_reliance(real: dict[str, float], neutral: dict[str, float]) -> dict:
    """Whether a closed answer depends on the image. `real` and `neutral` map each option to its
    score with the scan and with a neutral (blank) image. Flagged when the neutral image picks the
    same option with at least half the margin: the answer and most of its margin come from the
    question alone."""
    def pick(scores: dict[str, float]) -> tuple[str, float]:
        ranked = sorted(scores.items(), key=lambda item: -item[1])
        margin = ranked[0][1] - ranked[1][1] if len(ranked) > 1 else 0.0
        return ranked[0][0], margin

    answer, margin = pick(real)
    without, neutral_margin = pick(neutral)
    flagged = without == answer and neutral_margin >= 0.5 * margin
    return {"answer": answer, "margin": margin, "without_image": without, "margin_without_image": neutral_margin,
            "flagged": flagged}


def _finding(question: str) -> str:
    text = _YES_NO_SCAFFOLD.sub("", question.strip().rstrip("?").strip())
    kept = [word for word in words(text) if word not in _STOP]
    return " ".join(kept)


def _listed_within(phrase: str) -> list[str]:
    """The listed findings (SYNONYMS keys) a phrase names, by name or by a synonym."""
    padded = f" {phrase} "
    return [name for name, others in SYNONYMS.items()
            if f" {name} " in padded or any(f" {other} " in padded for other in others)]


def _synonyms_within(term: str) -> list[str]:
    """Synonyms of the listed findings a multi-word term contains ("heart enlarged" -> cardiomegaly's)."""
    found = []
    padded = f" {term} "
    for name, others in SYNONYMS.items():
        if f" {name} " in padded or any(f" {other} " in padded for other in others):
            found += [name, *others]
    return found


def _unique(items) -> list[str]:
    seen: list[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
