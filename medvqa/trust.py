"""What a clinician needs to check an answer: the claim it makes, citations retrieved for that claim,
each marked by a check that can say why, and whether a closed answer depends on the image.

- `claim(question, answer)`: what the answer asserts. An open answer asserts its own words
  ("cardiomegaly with pulmonary edema"); a Yes asserts the finding the question names ("Is the heart
  enlarged?" -> "heart enlarged"). An answer that denies a finding, in any words ("No", "There is no
  effusion", "without cardiomegaly", "Normal", "Not enlarged"), asserts an absence, which no
  passage can support: it has no terms (its citations are about the finding, marked related). A
  one-word side or direction ("Right", "upper") is never supported by the word alone: only by a
  sentence that names it with the finding the question asks about.
- `claim_query(question, answer, claim)`: what citations are retrieved for: the question and the
  claim, so the literature is about what the model said, not only about what was asked.
- `mark_support(claim, text)`: ("supports", evidence) where a sentence of the passage asserts one of
  the claim's terms or a listed synonym (cardiomegaly / enlarged cardiac silhouette): named, and not
  negated, hypothetical, possible, historical or about a relative by medspaCy's ConText
  (medvqa/assertion.py); ("contradicts", evidence) where no sentence asserts it and one denies it
  ("No pleural effusion is seen."); ("related", None) otherwise. The evidence is the sentence, the
  phrase in it and the cue: the mark is never given without a sentence it can show. Literature
  cannot confirm what a particular scan shows; "supports" means the passage describes the finding.
- `image_reliance(real, neutral)`: a closed answer whose choice and most of whose margin survive a
  neutral (blank) image comes from the question, not the image.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .assertion import Mention, mentions, word_status
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
    # Not "consolidation": a sign with many causes, not the diagnosis.
    "pneumonia": ("lung infection",),
    "edema": ("oedema",),
    "pulmonary edema": ("pulmonary oedema", "fluid in the lungs"),
    "atelectasis": ("collapse of the lung", "lung collapse"),
    "nodule": ("nodular opacity",),
    "mass": ("tumor", "tumour", "neoplasm", "lesion"),
    "fracture": ("broken bone", "break in the bone"),
    "hemorrhage": ("haemorrhage", "bleeding", "hematoma", "haematoma"),
    "infarct": ("infarction", "ischemic stroke", "ischaemic stroke"),
    "metastasis": ("metastases", "metastatic lesion", "metastatic lesions", "metastatic deposit"),
    "lymphadenopathy": ("adenopathy", "enlarged lymph node", "lymph node enlargement"),
    "hydronephrosis": ("dilated renal pelvis", "dilated pelvicalyceal system", "pelvicalyceal dilatation"),
    "ascites": ("peritoneal fluid", "fluid in the abdomen", "intraperitoneal fluid"),
    "splenomegaly": ("enlarged spleen", "spleen enlarged", "splenic enlargement"),
    "hepatomegaly": ("enlarged liver", "liver enlarged", "hepatic enlargement"),
    "nephrolithiasis": ("kidney stone", "renal stone", "renal calculus", "renal calculi"),
    "ct": ("computed tomography",),
    "mri": ("magnetic resonance",),
    "x-ray": ("radiograph", "xray", "x ray", "radiography"),
    "ultrasound": ("sonography", "ultrasonography"),
}


# An answer that is only one of these says where, not what: it needs the finding beside it.
SIDES = frozenset("""right left upper lower middle bilateral both anterior posterior superior inferior medial lateral
central peripheral proximal distal""".split())
# Words by which an answer says nothing is wrong: it asserts an absence.
_NORMAL = frozenset("normal unremarkable none nothing negative absent".split())
_SAME_SIDE = {"both": ("both", "bilateral", "bilaterally"), "bilateral": ("both", "bilateral", "bilaterally")}
# Words a wh-question uses to ask where something is; what remains is the finding it asks about.
_WHERE = frozenset("side location located locate part lobe region area position lies lie affected involved".split())


@dataclass
class Claim:
    terms: list[str] = field(default_factory=list)  # what a sentence must assert to support the answer
    finding: str = ""  # the finding a yes/no question names
    polarity: str = ""  # "yes", "no" (the answer denies a finding, in any words), or "" for an open answer
    side: str = ""  # a one-word side or direction answer: a sentence must name it beside a term


def claim(question: str, answer: str) -> Claim:
    """What `answer` asserts about `question` (see the module docstring)."""
    said = first_yes_no(answer) if answer else None
    if said is not None and normalise(answer).split()[:1] == [said]:
        finding = _finding(question)
        # The finding as a whole, or a listed finding it names: a passage that only shares a word
        # with it ("heart") is about the topic, not support for the claim.
        return Claim(terms=_claimed(finding) if said == "yes" and finding else [], finding=finding, polarity=said)
    if not words(answer):
        return Claim()
    content = word_status(answer, _STOP)  # [(word, negated)]
    kept = [word for word, negated in content if not negated and word not in _NORMAL]
    denied = any(negated for _, negated in content)
    if any(word in _NORMAL for word, _ in content) or (denied and not kept):
        # "There is no effusion", "Normal, without cardiomegaly", "Not enlarged": an absence. (An
        # answer that asserts one finding and denies another claims the one it asserts.)
        return Claim(terms=[], finding=" ".join(word for word, _ in content if word not in _NORMAL), polarity="no")
    if len(kept) == 1 and kept[0] in SIDES:
        topic = _topic(question)
        return Claim(terms=_claimed(topic) if topic else [], side=kept[0])
    # The answer's words as a phrase, and the listed findings in it: one word of a longer answer
    # ("left" of "left lung", "effusion" of "pericardial effusion") is not what it claims.
    return Claim(terms=_claimed(" ".join(kept)), finding="", polarity="")


def claim_query(question: str, answer: str, asserted: Claim | None = None) -> str:
    """The question and what the answer claims about it: what citations are retrieved for."""
    asserted = asserted or claim(question, answer)
    about = asserted.finding if asserted.polarity else answer.strip()
    return f"{question.strip()} {about}".strip() if about else question.strip()


def mark_support(asserted: Claim, text: str) -> tuple[str, Mention | None]:
    """("supports", the sentence that asserts the claim), ("contradicts", the sentence that denies
    it) or ("related", None): see the module docstring."""
    if not asserted.terms:
        return "related", None
    found = [mention for mention in mentions(text, phrases(asserted))
             if not asserted.side or _names(mention.sentence, asserted.side)]
    for status, mark in (("asserted", "supports"), ("negated", "contradicts")):
        for mention in found:
            if mention.status == status:
                return mark, mention
    return "related", None


def phrases(asserted: Claim) -> list[str]:
    """The claim's terms, with the state first ("heart enlarged" -> "enlarged heart"), and the
    listed synonyms of those that are listed findings: what a passage sentence is searched for."""
    return _unique(phrase for term in asserted.terms for form in _word_orders(term)
                   for phrase in (form, *SYNONYMS.get(form, ())) if phrase)


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


def _topic(question: str) -> str:
    """What a "where" question asks about: "Which side is the pleural effusion on?" -> "pleural
    effusion"; "Which lung has the nodule?" -> "nodule" (the noun after "which" is the place asked
    for, with its "of the brain")."""
    asked = words(question)
    if len(asked) > 1 and asked[0] in ("which", "what"):
        asked = asked[2:]
        if asked[:1] == ["of"]:
            asked = asked[3:] if asked[1:2] == ["the"] else asked[2:]
    kept = [word for word in asked if word not in _STOP and word not in _WHERE and word not in SIDES]
    return " ".join(kept)


def _names(sentence: str, side: str) -> bool:
    """Whether a sentence names a side as a word of its own ("right-sided" names right)."""
    same = _SAME_SIDE.get(side, (side,))
    return any(re.search(rf"(?<![a-z]){word}(?![a-z])", sentence.lower()) for word in same)


def _claimed(phrase: str) -> list[str]:
    """A phrase's terms: itself and the listed findings (SYNONYMS keys) it names, by name or by a
    synonym, compared without the words claims drop ("fluid pleural space" names "fluid in the
    pleural space") and in either order of a state ("renal pelvis dilated" names "dilated renal
    pelvis"). Where the phrase says more than the findings it names ("intracranial hemorrhage"),
    that qualifier is part of the claim: the terms are the phrase with the finding said each listed
    way ("intracranial bleeding", "intracranial hematoma"), not the bare finding, which a passage
    about a subcutaneous hemorrhage would hold."""
    content = _content(phrase)
    if not content:
        return []
    named = []  # (listed finding, the words the phrase names it by, the phrase in that word order)
    for order in _word_orders(content):
        for name, others in SYNONYMS.items():
            form = next((_content(other) for other in (name, *others) if f" {_content(other)} " in f" {order} "), None)
            if form is not None:
                named.append((name, form, order))
    covered = {word for _, form, _ in named for word in form.split()}
    qualifiers = [word for word in content.split() if word not in covered]
    if not qualifiers:
        return _unique([content] + [name for name, _, _ in named])
    said_otherwise = [variant for name, form, order in named for other in (name, *SYNONYMS[name])
                      for variant in (f" {order} ".replace(f" {form} ", f" {other} ").strip(),
                                      " ".join(qualifiers + [other]))]
    return _unique([content] + said_otherwise)


# States a yes/no question puts after the organ ("Is the heart enlarged?") and text puts before it.
_STATES = frozenset("enlarged dilated distended thickened collapsed calcified".split())


def _word_orders(phrase: str) -> list[str]:
    said = phrase.split()
    if len(said) >= 2 and said[-1] in _STATES:
        return [phrase, " ".join([said[-1], *said[:-1]])]
    return [phrase]


def _content(phrase: str) -> str:
    return " ".join(word for word in words(phrase) if word not in _STOP)


def _unique(items) -> list[str]:
    seen: list[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
