"""Whether a sentence asserts a finding, denies it or only raises it, by medspaCy's ConText.

ConText (Harkema et al., J Biomed Inform 2009) is the rule-based algorithm clinical NLP uses for
this: cue phrases ("no", "without", "ruled out", "if", "may", "mother") modify the findings within
their scope (up to the end of the sentence or a terminating word such as "but"). medspaCy ships it
with the rule set the US Department of Veterans Affairs refined over years of clinical notes; no
model is downloaded. Literature words some denials and conditions in ways notes rarely do ("was
excluded", "was absent", "may develop"), so a few rules of the same form are added beside the
defaults (`EXTRA_RULES`).

- `mentions(text, phrases)`: each place a sentence of `text` names one of `phrases`, with its
  sentence, where it is, and what ConText says of it: "asserted", "negated" or "hedged"
  (hypothetical, possible, historical or about a relative).
- `word_status(text)`: the content words of a short text (an answer) and whether each is negated:
  "Not enlarged", "no effusion", "without cardiomegaly" deny what they name.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from dataclasses import dataclass

# Rules added to medspaCy's defaults: (literal, ConText category, direction, token pattern or None
# for the literal itself). Each is a wording of literature or of figure captions the defaults miss.
_BE = {"IN": ["is", "are", "was", "were", "be", "been", "has", "have", "had"]}
EXTRA_RULES = (
    ("was excluded", "NEGATED_EXISTENCE", "BACKWARD",
     [{"LOWER": _BE}, {"LOWER": {"IN": ["excluded", "absent", "resolved"]}}]),
    ("was not seen", "NEGATED_EXISTENCE", "BACKWARD",
     [{"LOWER": _BE}, {"LOWER": {"IN": ["not", "n't"]}},
      {"LOWER": {"IN": ["seen", "visible", "identified", "detected", "present", "observed", "found", "demonstrated",
                        "evident", "noted", "enlarged", "dilated", "increased"]}}]),
    ("did not develop", "NEGATED_EXISTENCE", "BACKWARD",
     [{"LOWER": {"IN": ["did", "does", "do"]}}, {"LOWER": {"IN": ["not", "n't"]}},
      {"LOWER": {"IN": ["develop", "occur", "recur", "appear"]}}]),
    ("neither", "NEGATED_EXISTENCE", "FORWARD", None),
    ("resolution of", "NEGATED_EXISTENCE", "FORWARD", [{"LOWER": "resolution"}, {"LOWER": "of"}]),
    # "CT without contrast shows a haemorrhage": "without" is about the technique, not the finding
    # (but "without contrast enhancement" denies enhancement).
    ("without contrast", "PSEUDO", "PSEUDO",
     [{"LOWER": "without"}, {"LOWER": {"IN": ["iv", "intravenous", "oral"]}, "OP": "?"}, {"LOWER": "contrast"},
      {"LOWER": {"NOT_IN": ["enhancement", "enhancing", "uptake", "extravasation", "leakage"]}}]),
    ("may develop", "HYPOTHETICAL", "FORWARD",
     [{"LOWER": {"IN": ["may", "might", "can", "could", "will"]}}, {"LOWER": "also", "OP": "?"},
      {"LOWER": {"IN": ["develop", "cause", "mimic", "lead", "result", "progress", "predispose"]}}]),
    # The default rule for "risk of" is written as one token and never matches.
    ("risk of", "HYPOTHETICAL", "FORWARD", [{"LOWER": {"IN": ["risk", "risks"]}}, {"LOWER": {"IN": ["of", "for"]}}]),
    ("to prevent", "HYPOTHETICAL", "FORWARD", [{"LOWER": {"IN": ["prevent", "prevents", "preventing", "avoid"]}}]),
    ("predispose to", "HYPOTHETICAL", "FORWARD", [{"LOWER": {"IN": ["predispose", "predisposes", "predisposing"]}}]),
    ("could represent", "POSSIBLE_EXISTENCE", "FORWARD",
     [{"LOWER": {"IN": ["may", "might", "could", "can"]}}, {"LOWER": {"IN": ["represent", "indicate", "be"]}}]),
    ("suggestive for", "POSSIBLE_EXISTENCE", "FORWARD",
     [{"LOWER": {"IN": ["suggestive", "suggesting", "suggests", "suspected", "suspicion"]}},
      {"LOWER": {"IN": ["of", "for"]}, "OP": "?"}]),
    ("differential diagnosis", "POSSIBLE_EXISTENCE", "FORWARD",
     [{"LOWER": "differential"}, {"LOWER": {"IN": ["diagnosis", "diagnoses"]}}]),
    ("previous", "HISTORICAL", "FORWARD", [{"LOWER": {"IN": ["previous", "prior"]}}]),
)
# Default rules left out: note-form "Cough: no" looks back past the colon; in a caption ("MRI
# abdomen: no metastasis") the colon ends a heading and "no" denies what follows.
_LEFT_OUT = {": no", ": none"}
_HEDGES = {"POSSIBLE_EXISTENCE", "HYPOTHETICAL", "FAMILY"}  # and HISTORICAL, unless also negated


@dataclass(frozen=True)
class Mention:
    phrase: str  # the phrase asked for, as given
    sentence: str  # the sentence that names it, as written
    start: int  # where it is named in `sentence` (characters)
    end: int
    status: str  # "asserted", "negated" or "hedged"
    cue: str = ""  # the words that deny or hedge it ("was excluded", "may develop")


def mentions(text: str, phrases: list[str] | tuple[str, ...]) -> list[Mention]:
    """Each mention of one of `phrases` in `text` (whole words, any case, a plural allowed), in order.
    Where mentions overlap the longer is kept ("pulmonary edema" over "edema")."""
    return list(_mentions(str(text or ""), tuple(phrases)))


def word_status(text: str, skip: set[str]) -> list[tuple[str, bool]]:
    """The words of `text` that are not in `skip` nor ConText cues, each with whether ConText finds
    it negated: "There is no pleural effusion" -> [("pleural", True), ("effusion", True)]."""
    nlp, context = _pipeline()
    doc = _sentences(nlp, text)
    from spacy.tokens import Span

    doc.ents = [Span(doc, token.i, token.i + 1, label="TERM") for token in doc
                if token.is_alpha and token.lower_ not in skip]
    context(doc)
    cues = {i for modifier in doc._.context_graph.modifiers for i in range(*modifier.modifier_span)}
    return [(entity.text.lower(), bool(entity._.is_negated)) for entity in doc.ents if entity.start not in cues]


@functools.lru_cache(maxsize=4096)
def _mentions(text: str, phrases: tuple[str, ...]) -> tuple[Mention, ...]:
    found = []  # (start, end, phrase) in text
    for phrase in phrases:
        pattern = _phrase_pattern(phrase)
        if pattern is not None:
            found += [(m.start(), m.end(), phrase) for m in pattern.finditer(text)]
    if not found:  # most passages: no need to parse them
        return ()
    nlp, context = _pipeline()
    doc = _sentences(nlp, text)
    from spacy.tokens import Span
    from spacy.util import filter_spans

    spans = []
    for start, end, phrase in found:
        span = doc.char_span(start, end, label="TERM", alignment_mode="expand")
        if span is not None:
            spans.append(Span(doc, span.start, span.end, label="TERM", kb_id=phrase))
    doc.ents = filter_spans(spans)
    context(doc)
    result = []
    for entity in doc.ents:
        categories = {modifier.category for modifier in entity._.modifiers}
        # "Previous nodule was not seen": a denial now; "a previous fracture": not one now either.
        status = ("hedged" if categories & _HEDGES else "negated" if "NEGATED_EXISTENCE" in categories
                  else "hedged" if "HISTORICAL" in categories else "asserted")
        cue = " ".join(doc[slice(*modifier.modifier_span)].text for modifier in entity._.modifiers)
        sentence = entity.sent
        result.append(Mention(entity.kb_id_, sentence.text, entity.start_char - sentence.start_char,
                              entity.end_char - sentence.start_char, status, cue))
    return tuple(result)


def _phrase_pattern(phrase: str) -> re.Pattern | None:
    """A phrase as a case-insensitive whole-word pattern: words apart by spaces or hyphens, the last
    one singular or plural ("pleural effusion" finds "pleural effusions", "x-ray" finds "X ray")."""
    parts = [part for part in re.split(r"[\s\-]+", phrase.strip().lower()) if part]
    if not parts:
        return None
    last = parts[-1]
    if len(last) > 3 and last.endswith("s") and not last.endswith(("ss", "us", "is")):
        last = last[:-1]
    words = [re.escape(part) for part in parts[:-1]] + [re.escape(last) + "(?:s|es)?"]
    return re.compile(r"(?<![\w-])" + r"[\s\-]+".join(words) + r"(?![\w-])", re.IGNORECASE)


def warm() -> None:
    """Load medspaCy now (a few seconds, ~190 MiB), so the first answer with passages does not wait for it."""
    _pipeline()


@functools.cache
def _pipeline():
    """medspaCy's tokenizer and ConText (default rules + EXTRA_RULES), and spaCy's rule-based sentence
    splitter: literature is punctuated prose, which needs none of PyRuSH's rules for clinical notes."""
    import medspacy
    from medspacy.context import ConTextRule

    nlp = medspacy.load(medspacy_enable=["medspacy_context"], load_rules=False)
    nlp.add_pipe("sentencizer", first=True)
    context = nlp.get_pipe("medspacy_context")
    # Where ConText itself reads its default rules from (the package's resources folder).
    defaults = ConTextRule.from_json(Path(medspacy.__file__).parents[1] / "resources" / "en" / "context_rules.json")
    context.add([rule for rule in defaults if rule.literal not in _LEFT_OUT])
    context.add([ConTextRule(literal, category, direction=direction, pattern=pattern)
                 for literal, category, direction, pattern in EXTRA_RULES])
    return nlp, context


def _sentences(nlp, text: str):
    """`text` tokenized and split into sentences (every component but ConText, which the caller runs
    once it has set the targets)."""
    doc = nlp.make_doc(text)
    for name, component in nlp.pipeline:
        if name != "medspacy_context":
            doc = component(doc)
    return doc
