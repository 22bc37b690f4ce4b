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

_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation.replace('-', ''))}]")
_YES_NO = {"yes", "no"}
_YES_NO_STARTERS = {"is", "are", "was", "were", "does", "do", "did", "can", "could", "has", "have", "had",
                    "will", "would", "should", "shall", "may", "might", "must"}


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


def closed_candidates(question: str) -> list[str] | None:
    """The answers a closed question allows, read from the question itself.

    "Is the lesion on the left or right?" -> ["left", "right"]; "Is there an effusion?" -> ["yes", "no"];
    None when the question names no options and is not a yes/no question.
    """
    original = _PUNCTUATION.sub(" ", question).split()  # same split as normalise(), casing kept
    tokens = [word.lower() for word in original]
    if "or" in tokens[1:-1]:
        at = len(tokens) - 1 - tokens[::-1].index("or")  # the last "or"
        after = [i for i in range(at + 1, len(tokens)) if tokens[i] not in ("a", "an", "the")]
        before = at - 1
        # One word each side covers the benchmark's option questions ("left or right", "CT or MRI",
        # "liver or spleen", "T1 or T2"); a phrase on one side would need a parser.
        if after and tokens[before] not in ("a", "an", "the") and tokens[before] != tokens[after[0]]:
            return [_answer_case(original[before]), _answer_case(original[after[0]])]
    if tokens and tokens[0] in _YES_NO_STARTERS:
        return ["Yes", "No"]
    return None


def _answer_case(word: str) -> str:
    """Training answers mostly start with a capital ("Left", "CT"); score candidates in that form."""
    return word[:1].upper() + word[1:]
