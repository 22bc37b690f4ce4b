"""Answer normalisation, closed-question candidates and the VQA metrics.

Metrics follow the usual medical-VQA practice (and LLaVA-Med's evaluation):
- closed accuracy, strict: the normalised answer equals the normalised reference; for a yes/no
  reference the first yes/no *word* of the answer counts ("no" inside "normal" never does);
- open token recall: the fraction of reference words present among the answer's words;
- open exact match: normalised equality.
"""

from __future__ import annotations

import re
import string

# Names the way closed questions are read and scored, for result files that depend on it: 2 reads
# comma lists and multi-word options and scores whole answers (with their end-of-turn marker); 3
# stopped offering Yes and No beside the options of "Is there X or Y?".
CLOSED_DECODING = "options3"
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation.replace('-', ''))}]")
_YES_NO = {"yes", "no"}
# "Any" opens the clipped yes/no questions clinicians type ("Any pleural effusion?"); the 4 such questions of
# VQA-RAD train are all closed.
_YES_NO_STARTERS = {"is", "are", "was", "were", "does", "do", "did", "can", "could", "has", "have", "had",
                    "will", "would", "should", "shall", "may", "might", "must", "any"}
# ... and so does a finding followed by one of these words, with no question word anywhere ("Pleural effusion
# present?", "Fracture seen?"); no question of VQA-RAD or SLAKE train is worded so, so neither reading moves a
# benchmark question (CLOSED_DECODING stays).
_CLIPPED_YES_NO_ENDINGS = {"present", "seen", "visible", "noted", "evident", "identified"}
_QUESTION_WORDS = {"what", "where", "which", "who", "whom", "whose", "why", "how", "when"}


def normalise(text: str) -> str:
    return " ".join(_PUNCTUATION.sub(" ", text.lower()).split())


def words(text: str) -> list[str]:
    return normalise(text).split()


def first_yes_no(text: str) -> str | None:
    for word in words(text):
        if word in _YES_NO:
            return word
    return None


def closed_correct(answer: str, reference: str) -> bool:
    reference = normalise(reference)
    if reference in _YES_NO:
        return first_yes_no(answer) == reference
    return normalise(answer) == reference


def open_recall(answer: str, reference: str) -> float:
    reference_words = words(reference)
    if not reference_words:
        return 0.0
    answer_words = set(words(answer))
    return sum(word in answer_words for word in reference_words) / len(reference_words)


def open_exact(answer: str, reference: str) -> bool:
    return normalise(answer) == normalise(reference)


# Words that end an option named after "or" ("left or right side of the brain", "T2 weighted MRI
# image", "larger than ..."): the option is what comes before them.
_OPTION_STOPS = {"side", "sides", "of", "in", "on", "at", "to", "than", "relative", "used", "scan", "image",
                 "images", "view", "as", "seen", "shown", "located", "for", "with"}
_ARTICLES = {"a", "an", "the", "just"}


def closed_candidates(question: str) -> list[str] | None:
    """The answers a closed question allows, read from the question itself.

    "Is the lesion on the left or right?" -> ["Left", "Right"]; "Which is bigger, small bowel or
    kidney?" -> ["Small bowel", "Kidney"]; "MRI, CT or X-Ray?" -> ["MRI", "CT", "X-Ray"];
    "Is there an effusion?" -> ["Yes", "No"]; None when the question names no options and is not a
    yes/no question.
    """
    words_: list[str] = []  # normalise()'s words with their casing, and the commas as words
    for index, piece in enumerate(question.split(",")):
        words_ += ([","] if index else []) + _PUNCTUATION.sub(" ", piece).split()
    lowered = [word.lower() for word in words_]
    # A question naming options is answered with one of them. Some are yes/no questions about both
    # ("Are there epidural or subdural bleeds?" -> No); in VQA-RAD + SLAKE train that is 8 of the 104
    # option questions that start like a yes/no question, too few to offer Yes and No beside the options.
    options = _options(words_, lowered) if "or" in lowered[1:-1] else []
    if options:
        return options
    if lowered and lowered[0] in _YES_NO_STARTERS:
        return ["Yes", "No"]
    if len(lowered) > 1 and lowered[-1] in _CLIPPED_YES_NO_ENDINGS and not _QUESTION_WORDS & set(lowered):
        return ["Yes", "No"]
    return None


def _options(words_: list[str], lowered: list[str]) -> list[str]:
    """The options around the last "or": comma-separated lists ("A, B or C", "..., A, B, or C") and
    multi-word options ("transverse plane or coronal plane", "T1 weighted or T2 weighted")."""
    at = len(lowered) - 1 - lowered[::-1].index("or")
    segments: list[list[int]] = [[]]  # word indices split at commas, up to the "or"
    for index in range(at):
        if lowered[index] == ",":
            segments.append([])
        else:
            segments[-1].append(index)
    after = []
    for index in range(at + 1, len(lowered)):
        if lowered[index] == "," or (after and lowered[index] in _OPTION_STOPS):
            break
        if not after and lowered[index] in _ARTICLES:
            continue
        after.append(index)
    if not after:
        return []
    left = segments[-1]
    if len(segments) > 1 and left:
        # "..., A, B or C": the options are the comma-separated segments after the first one.
        items = [segment for segment in segments[1:] if segment]
    elif len(segments) > 2 and not left:
        # "... A, B, or C" (serial comma): the first option is the end of the first segment, as
        # long as the option after it.
        middle = [segment for segment in segments[1:-1] if segment]
        items = [segments[0][-len(middle[0]):]] + middle
    else:
        # No comma: one word each side, or as many as the two sides share at their ends ("transverse
        # plane or coronal plane", "T1 weighted or T2 weighted MRI").
        span = 1
        for candidate in (2, 3):
            if (candidate <= min(len(after), len(left))
                    and [lowered[i] for i in left[-(candidate - 1):]] == [lowered[i] for i in after[1:candidate]]):
                span = candidate
        items = [left[-span:]]
        after = after[:span]
        if span > 1:  # the benchmarks answer both ways: "Coronal Plane", but "T2" for "T1 weighted or T2 weighted"
            items += [after, [left[-span]]]
            after = [after[0]]
    items = [[i for i in item if lowered[i] not in _ARTICLES] or item for item in items] + [after]
    options = []
    for item in items:
        option = _answer_case(" ".join(words_[i] for i in item))
        if option and option.lower() not in {o.lower() for o in options}:
            options.append(option)
    return options if len(options) > 1 else []


def surface_forms(option: str) -> list[str]:
    """The spellings an option is scored in: as named ("Small bowel") and title-cased ("Small Bowel",
    SLAKE's spelling of multi-word answers); constrained decoding keeps an option's best."""
    title = " ".join(word[:1].upper() + word[1:] for word in option.split())
    return [option] if title == option else [option, title]


def _answer_case(word: str) -> str:
    """Training answers mostly start with a capital ("Left", "CT"); score candidates in that form."""
    return word[:1].upper() + word[1:]
