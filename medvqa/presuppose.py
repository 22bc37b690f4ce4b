"""Yes/no questions that name one value of an attribute, scored through the open question they presuppose.

"Is this a CT?" presupposes "What modality is used to take this image?"; "Does the picture contain the
liver?" presupposes "What is the main organ in the image?". The offline decoder reads the image better
when it names a value than when it weighs Yes against No (docs/encoder.md, "Where the answer is lost"), so with `decoder.presupposed_closed` the pipeline scores the attribute's
values after the open question, with the same image, and answers Yes when the value the question names
is the decoder's most likely one:

    presupposition("Is this image taken via CT?")
    # Presupposition(kind="modality", question="What modality is used to take this image?",
    #                options=("CT", "MRI", "X-Ray"), target="CT")

The attributes, their values and the open questions are SLAKE's training phrasing (the projector was
trained on those questions); a question this module does not recognise (None) is scored Yes against No
as before. Questions naming two values ("CT or MRI?") are choice questions already and are not read here.

Whether the image is normal ("Is the lung healthy?", "Are there abnormalities in this image?") presupposes
"What diseases are included in the picture?", whose answers in SLAKE's training split are its diseases or
"None": a question asking whether it is normal is answered Yes when None is the most likely answer, one
asking whether something is abnormal (`negated`) Yes when a disease is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .answers import normalise

KINDS = ("modality", "plane", "region", "organ", "abnormality")  # the attributes read (decoder.presupposed_kinds)
MODALITY_QUESTION = "What modality is used to take this image?"
PLANE_QUESTION = "Which plane is the image scanned?"
REGION_QUESTION = "Which part of the body does this image belong to?"
ORGAN_QUESTION = "What is the main organ in the image?"
ABNORMALITY_QUESTION = "What diseases are included in the picture?"

MODALITIES = {"CT": ("ct", "computed tomography"), "MRI": ("mri", "mr", "magnetic resonance"),
              "X-Ray": ("x ray", "xray", "radiograph", "plain film")}
PLANES = {"Transverse Plane": ("transverse", "axial"), "Coronal Plane": ("coronal",), "Sagittal Plane": ("sagittal",)}
REGIONS = {"Head": ("head", "brain"), "Neck": ("neck",), "Chest": ("chest", "thorax"), "Abdomen": ("abdomen",),
           "Pelvic Cavity": ("pelvic cavity", "pelvis")}
# The organs SLAKE's training questions ask about ("Does the picture contain X?"), in its answers'
# spelling; the keys of ORGAN_SPELLINGS are other spellings of them that its questions use.
ORGANS = ("Bladder", "Brain", "Brain Stem", "Colon", "Duodenum", "Ears", "Esophagus", "Eyes", "Femoral Head",
          "Heart", "Humerus Head", "Kidney", "Larynx", "Liver", "Lung", "Mandible", "Parotid", "Rectum", "Small Bowel",
          "Spinal Cord", "Spleen", "Stomach", "Temporal Lobe", "Trachea")
ORGAN_SPELLINGS = {"brian": "brain", "kidneys": "kidney", "lungs": "lung", "spine cord": "spinal cord",
                   "ear": "ears", "eye": "eyes", "oesophagus": "esophagus"}

# SLAKE's training answers to ABNORMALITY_QUESTION, each disease as it spells it (one-off misspellings left out).
NORMAL = "None"
DISEASES = (NORMAL, "Atelectasis", "Brain Edema", "Brain Enhancing Tumor", "Brain Non-enhancing Tumor", "Brain Tumor",
            "Cardiomegaly", "Effusion", "Infiltration", "Kidney Cancer", "Liver Cancer", "Lung Cancer", "Mass", "Nodule",
            "Pleural Effusion", "Pneumonia", "Pneumothorax", "Pulmonary Infiltration", "Pulmonary Mass",
            "Pulmonary Nodule")

_IMAGE = r"(?:image|picture|scan|study|film|slice)"
_ORGAN_PATTERNS = [re.compile(pattern) for pattern in (
    rf"^does (?:the|this) {_IMAGE} contains? (?:an? |the |any )?(?P<x>.+)$",
    rf"^(?:does|do|is|are) (?:an? |the )?(?P<x>.+?) (?:appear|exist|present|shown|visible|seen)s? in (?:the|this) {_IMAGE}$",
    rf"^(?:is|are|are is|is are) there (?:an? |the |any )?(?P<x>.+?) in (?:the|this) {_IMAGE}$",
)]
# "Is this (image) (a|an) (image taken via) CT (scan|image)?", "Was this taken with MRI?"
_MODALITY = re.compile(r"^(?:is|was) (?:this|the) (?:image |picture |scan |study )?(?:an? )?"
                       r"(?:(?:image |picture |scan )?(?:taken|obtained|acquired|done) (?:via|with|by|using) (?:an? )?)?"
                       r"(?P<x>.+?)(?: (?:scan|image|study|picture))?$")
# "Is this (a|an) transverse (plane|section|view|slice)?", "Is this image in the coronal plane?"
_PLANE = re.compile(r"^is (?:this|the) (?:image |picture |scan )?(?:in |taken in |scanned in )?(?:an? |the )?"
                    r"(?P<x>\w+)(?: (?:plane|section|view|slice|image|cut))?$")
# "Is this a study of the chest?", "Do the organs in the image exist in the head?"
_REGION = [re.compile(r"^is (?:this|the) (?:image |picture )?(?:an? )?(?:study|image|scan|picture) (?:of|from) (?:the )?(?P<x>.+)$"),
           re.compile(rf"^do (?:the|any of the|all the) organs in (?:the|this) {_IMAGE} (?:exist|lie|belong) in (?:the )?(?P<x>.+)$")]
_WEIGHTING = re.compile(r"\b(?:t1|t2|flair|weighted|contrast|enhanced|dwi|adc)\b")
# SLAKE's training phrasings of "is it normal?" and of "is something abnormal?" (normalised: "is/are" reads
# "is are"), `x` an organ (ORGANS, with a side or part: "left lung", "right brain lobe") or absent (the whole image); a
# question naming a finding, a size or a shape ("Is the heart size abnormal?") is not read, nor one saying "not".
_NORMAL = re.compile(rf"^(?:is the (?P<x>.+) healthy|does (?:this|the) {_IMAGE} look normal"
                     rf"|is (?:this|the) {_IMAGE} normal|does the (?P<y>.+) look normal|is the (?P<z>.+) normal appearing)$")
_ABNORMAL = re.compile(rf"^(?:are there abnormalities in (?:this|the) {_IMAGE}|does (?:this|the) {_IMAGE} look abnormal"
                       r"|does the (?P<x>.+) look abnormal|is the (?P<y>.+) abnormal"
                       r"|does the patient have any abnormalities|is are there abnormalities in the patient s (?P<z>.+))$")
_NEGATION = re.compile(r"\b(?:not|no|n t|never)\b")
_SIDES = re.compile(r"^(?:(?:left|right|upper|lower|both) )*(?P<organ>.+?)(?: lobes?)?$")


@dataclass(frozen=True)
class Presupposition:
    kind: str  # "modality", "plane", "region" or "organ"
    question: str  # the open question the yes/no question presupposes
    options: tuple[str, ...]  # the attribute's values, scored after `question`
    target: str  # the value the yes/no question names (one of `options`)
    negated: bool = False  # Yes means `target` is not the most likely value ("Are there abnormalities?")


def _value(phrase: str, values: dict[str, tuple[str, ...]]) -> str | None:
    """The one value `phrase` is (a whole-phrase match of one of its spellings), else None."""
    phrase = phrase.strip()
    for value, spellings in values.items():
        if phrase in spellings or phrase == normalise(value):
            return value
    return None


# The kinds decoder.head_answers names (the answer head's own question kinds, chosen before "abnormality" was
# read); a question of another kind, or of none, is "other" there.
HEAD_KINDS = ("modality", "plane", "region", "organ")


def head_kind(read: Presupposition | None) -> str:
    """The kind decoder.head_answers knows a question by: its attribute among HEAD_KINDS, else "other"."""
    return read.kind if read is not None and read.kind in HEAD_KINDS else "other"


def presupposition(question: str, kinds=KINDS) -> Presupposition | None:
    """The open question `question` presupposes, if it names one value of an attribute in `kinds`."""
    read = _presupposition(question)
    return read if read is not None and read.kind in kinds else None


def _presupposition(question: str) -> Presupposition | None:
    text = normalise(question.replace("/", " ").replace("-", " "))
    if not text or " or " in f" {text} ":
        return None
    for pattern in _ORGAN_PATTERNS:
        match = pattern.match(text)
        if match:
            phrase = ORGAN_SPELLINGS.get(match["x"], match["x"])
            organ = next((name for name in ORGANS if normalise(name) == phrase), None)
            if organ:
                return Presupposition("organ", ORGAN_QUESTION, ORGANS, organ)
    for pattern in _REGION:
        match = pattern.match(text)
        if match and (region := _value(match["x"], REGIONS)):
            return Presupposition("region", REGION_QUESTION, tuple(REGIONS), region)
    match = _PLANE.match(text)
    if match and (plane := _value(match["x"], PLANES)):
        return Presupposition("plane", PLANE_QUESTION, tuple(PLANES), plane)
    match = _MODALITY.match(text)
    if match and not _WEIGHTING.search(text) and (modality := _value(match["x"], MODALITIES)):
        return Presupposition("modality", MODALITY_QUESTION, tuple(MODALITIES), modality)
    for pattern, negated in ((_NORMAL, False), (_ABNORMAL, True)):
        match = pattern.match(text)
        if match and not _NEGATION.search(text) and _whole_or_organ(match):
            return Presupposition("abnormality", ABNORMALITY_QUESTION, DISEASES, NORMAL, negated=negated)
    return None


def _whole_or_organ(match: re.Match) -> bool:
    """Whether an "is it normal?" question asks about the whole image or one of ORGANS (with a side or part)."""
    phrase = next((match[name] for name in ("x", "y", "z") if match[name]), None)
    if phrase is None:
        return True
    organ = _SIDES.match(phrase)["organ"]
    organ = ORGAN_SPELLINGS.get(organ, organ)
    return any(normalise(name) == organ for name in ORGANS)


def reading_text(closed: dict | None) -> str:
    """What "Yes" meant for an answer scored through a presupposed open question (the pipeline's
    `closed` record), in a clinician's words; for an answer the encoder's answer head gave
    (decoder.closed_answerer), that it did; "" for any other answer."""
    if (closed or {}).get("answerer") == "encoder_head":
        return ("Answered by the image encoder's own answer head (a classifier trained with the encoder on "
                "public training sets), not by the language model.")
    read = (closed or {}).get("presupposed")
    if not read:
        return ""
    verdict = "is" if (closed.get("choice") == "yes") != bool(read.get("negated")) else "is not"
    return f"Read as “{read['question']}”: {read['target']} {verdict} the model's most likely answer."
