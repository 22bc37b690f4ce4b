"""Ingest-time cleaning: passages are data, never instructions.

Every passage text goes through `sanitize_text` before it is chunked, embedded or stored, so the
decoder only ever sees cleaned text. Three things happen, in this order:

1. markup goes: HTML entities are decoded, then real HTML/JATS/chat tags are dropped (by name, so
   that clinical comparisons such as "<or =5 lesions" or "p<0.05 and AST/ALT ratio>" survive), and
   so is any tag with an event-handler attribute (`<details ontoggle=...>`, `<svg/onload=...>`),
   `<script>`/`<style>` blocks lose their content, and Markdown links and images, inline or by
   reference, keep only their text (a rendered Markdown image is a way to leak a conversation to a URL);
2. control and format characters go (C0/C1 controls, zero-width and bidirectional overrides), and
   unusual spaces become plain spaces;
3. instruction-like sentences ("ignore previous instructions", in English and a few other
   languages, "you are now ...", role tags such as "System:" or "<|im_start|>", prompt delimiters
   such as "[INST]", "<start_of_turn>" or "</source>") are replaced by `NEUTRALISED` so the passage
   still reads as a passage but carries no command. Sentences are matched on a folded copy too
   (textfold.fold), so look-alike letters ("Іgnоrе" in Cyrillic) do not hide a command.

The answer side has a broader check of its own (medvqa/injection.py): what this misses and a model
repeats is flagged there.
"""

from __future__ import annotations

import html
import re
import unicodedata

from medvqa.textfold import fold

NEUTRALISED = "[instruction-like text removed]"

# Tag names worth stripping: HTML, JATS (PubMed Central XML), MathML and the prompt's own tags.
_TAG_NAMES = (
    "a abbr b big blockquote body bold br caption center cite code col dd del div dl dt em "
    "ext-link fig font footer h1 h2 h3 h4 h5 h6 head header hr html i iframe img inline-formula "
    "input ins italic kbd label li link mark meta monospace nav object ol p pre q s sc section sec "
    "small source span strike strong sub sup svg table tbody td tfoot th thead title tr tt u ul "
    "underline xref math mi mn mo mrow msub msup mfrac msqrt mtext semantics annotation "
    "system user assistant instruction instructions context document passage"
).split()
_TAG = re.compile(
    r"</?(?:(?:mml|jats|xlink):)?(?:" + "|".join(re.escape(name) for name in _TAG_NAMES) + r")"
    r"(?:\s+[A-Za-z_:][-\w:.]*(?:\s*=\s*(?:\"[^\"]*\"|'[^']*'|[^\s\"'=<>`]+))?)*\s*/?>",
    re.IGNORECASE)
_SCRIPT_BLOCK = re.compile(r"<(script|style)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_COMMENT = re.compile(r"<!--.*?-->|<!\[CDATA\[.*?\]\]>", re.DOTALL)
_MD_IMAGE = re.compile(r"!\[([^\]]*)\]\([^)]*\)")
_MD_LINK = re.compile(r"\[([^\]]+)\]\((?:[a-z][a-z0-9+.-]*:|/|#)[^)]*\)", re.IGNORECASE)
_MD_REFERENCE_LINK = re.compile(r"\[([^\]\n]+)\]\[[^\]\n]*\]")
_MD_REFERENCE_DEFINITION = re.compile(r"^[ \t]*\[[^\]\n]+\]:[ \t]*\S+.*$", re.MULTILINE)
# Any tag carrying an event handler (onerror=, onload=, ontoggle=, ...), whatever its name.
_EVENT_TAG = re.compile(r"<[A-Za-z][\w:-]*(?=[\s/])[^<>]*?[\s/\"']on[a-z]+\s*=[^<>]*>", re.IGNORECASE)

# Special tokens and prompt delimiters of common chat templates: removed wherever they appear.
_SPECIAL_TOKEN = re.compile(
    r"<\|[^|<>]{0,40}\|>|\[/?INST\]|<<\s*/?SYS\s*>>|</?s>"
    r"|<\s*/?\s*(?:source|system|user|assistant|human|start_of_turn|end_of_turn)\b[^>]*>"
    r"|\bBEGIN_INSTRUCTIONS?\b|\bEND_INSTRUCTIONS?\b",
    re.IGNORECASE)

# Sentences that address the reader as a model. Matched on a case-folded NFKC copy of the sentence.
_INSTRUCTION_PATTERNS = [
    r"\b(?:ignore|disregard|forget|override|bypass|skip)\b[^.!?\n]{0,60}?\b(?:previous|prior|above|earlier|"
    r"preceding|all|any|your|the|system|these|those|other)\b[^.!?\n]{0,40}?\b(?:instructions?|prompts?|rules|"
    r"directions|guidelines|guardrails|messages?|context|policies|polic(?:y|ies))\b",
    r"\b(?:new|updated|real|actual|hidden|secret)\s+(?:instructions?|system\s+prompt|task)\s*[:\-]",
    r"\bsystem\s+prompt\b",
    r"\byou\s+are\s+(?:now|no\s+longer|actually)\b",
    r"\bfrom\s+now\s+on\b[^.!?\n]{0,40}\byou\b",
    r"\b(?:pretend|act)\s+(?:to\s+be|as\s+if\s+you|that\s+you)\b",
    r"\b(?:respond|reply|answer|output|say)\s+(?:only\s+)?(?:with|that)\b[^.!?\n]{0,60}\b(?:regardless|no\s+matter|"
    r"instead|always)\b",
    r"\b(?:do\s+not|don't|never)\s+(?:mention|cite|reveal|tell|disclose)\b[^.!?\n]{0,40}\b(?:user|clinician|"
    r"doctor|instructions?|sources?|this)\b",
    r"\b(?:reveal|print|repeat|show)\s+(?:your|the)\s+(?:system\s+)?(?:prompt|instructions)\b",
    r"\bjailbreak\b|\bprompt\s+injection\b|\bdeveloper\s+mode\b",
    r"^\s*(?:#+\s*)?(?:system|assistant|user|human|developer|instruction|instructions)\s*:",
    # Paraphrases found by scripts/redteam.py.
    r"\bset\s+aside\b[^.!?\n]{0,40}\b(?:guidance|instructions?|rules|directions|told|given)\b",
    r"\b(?:note|message|reminder|instructions?)\s+(?:to|for)\s+(?:the\s+|any\s+)?(?:ai|assistant|language\s+model|"
    r"llm|chatbot)\b",
    r"\byour\s+(?:real|actual|true|new|only)\s+(?:task|job|role|goal|purpose)\b",
    r"\bit\s+would\s+be\s+(?:most\s+|very\s+|really\s+)?(?:helpful|useful|best)\s+if\s+(?:any|every|each|your|the)\s+"
    r"(?:summary|summaries|answers?|repl(?:y|ies)|responses?)\b",
    # The first command above in French, German, Spanish, Italian, Portuguese, Russian, Chinese, Japanese.
    r"\b(?:ignore[zr]?|oublie[zr]?)\b[^.!?\n]{0,60}\b(?:instructions?|consignes)\b",
    r"\b(?:ignoriere|ignorieren|vergiss|vergessen)\b[^.!?\n]{0,60}\b(?:anweisungen|instruktionen|vorgaben|regeln)\b",
    r"\b(?:ignora|ignore|olvida|olvide|omite)\b[^.!?\n]{0,60}\b(?:instrucciones|istruzioni|instruções)\b",
    r"(?:игнорируй|игнорировать|забудь)[^.!?\n]{0,60}(?:инструкци|указани)",
    r"(?:忽略|无视|忘记|忘掉)[^。！？\n]{0,20}(?:指令|指示|说明|规则)", r"指示を無視",
]
_INSTRUCTION = re.compile("|".join(f"(?:{pattern})" for pattern in _INSTRUCTION_PATTERNS),
                          re.IGNORECASE | re.MULTILINE)
# Text between chat-template delimiters is a message to a model by construction: the whole span goes.
_OPENERS = r"\[INST\]|<\|im_start\|>|<<\s*SYS\s*>>|<\|(?:system|user|assistant)\|>|<start_of_turn>"
_CLOSERS = r"\[/INST\]|<\|im_end\|>|<<\s*/SYS\s*>>|<\|end\|>|<\|eot_id\|>|<end_of_turn>"
_DELIMITED = re.compile(rf"(?:{_OPENERS}).*?(?:{_CLOSERS})", re.IGNORECASE | re.DOTALL)
_OPEN_TO_END_OF_LINE = re.compile(rf"(?:{_OPENERS})[^\n]*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SPACES = re.compile(r"[ \t\f\v]+")
# Unicode categories Cc (controls, except tab and newline), Cf (zero-width, bidi overrides, soft hyphen,
# tag characters), Co (private use) and Cs (lone surrogates), spelled out as ranges: a regex is ~50x
# faster than a per-character unicodedata loop over a 10M-passage corpus.
_INVISIBLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2"
    "\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff"
    "\ue000-\uf8ff\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f\U000f0000-\U0010ffff]")
_UNUSUAL_SPACES = re.compile("[\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_LINE_BREAKS = re.compile("\r\n?|[\u2028\u2029\x85]")


def sanitize_text(text: str) -> str:
    """Return `text` without markup, control characters or instruction-like sentences."""
    text = html.unescape(text)
    text = _SCRIPT_BLOCK.sub(" ", text)
    text = _COMMENT.sub(" ", text)
    text = _MD_IMAGE.sub(r"\1", text)
    text = _MD_LINK.sub(r"\1", text)
    text = _MD_REFERENCE_DEFINITION.sub(" ", text)
    text = _MD_REFERENCE_LINK.sub(r"\1", text)
    text = _remove_control_characters(unicodedata.normalize("NFC", text))
    # Tags can be assembled from pieces once other tags are gone ("<sy<b>stem>"), so strip to a fixpoint.
    for _ in range(5):
        stripped = _EVENT_TAG.sub(" ", _TAG.sub(" ", text))
        if stripped == text:
            break
        text = stripped
    text = _DELIMITED.sub(f" {NEUTRALISED} ", text)
    text = _OPEN_TO_END_OF_LINE.sub(f" {NEUTRALISED} ", text)
    lines = [_neutralise_line(line) for line in text.split("\n")]
    lines = [_SPACES.sub(" ", line).strip() for line in lines]
    return "\n".join(line for line in lines if line)


def is_instruction_like(text: str) -> bool:
    """True when `text` reads as an instruction to a model (used for tests and diagnostics)."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return bool(_INSTRUCTION.search(folded) or _SPECIAL_TOKEN.search(folded) or _INSTRUCTION.search(fold(text)))


def sanitize_query(text: str, max_chars: int = 2000) -> str:
    """A user's question for retrieval: no control characters or markup, one line, bounded length."""
    text = _remove_control_characters(unicodedata.normalize("NFC", html.unescape(text)))
    text = _SPECIAL_TOKEN.sub(" ", _TAG.sub(" ", text))
    return _SPACES.sub(" ", text.replace("\n", " ")).strip()[:max_chars]


def _remove_control_characters(text: str) -> str:
    text = _LINE_BREAKS.sub("\n", text)
    text = _UNUSUAL_SPACES.sub(" ", text)
    return _INVISIBLE.sub("", text)


def _neutralise_line(line: str) -> str:
    """Replace each instruction-like sentence of `line`; drop special tokens and prompt delimiters."""
    had_special = bool(_SPECIAL_TOKEN.search(line.replace(NEUTRALISED, "")))
    line = _SPECIAL_TOKEN.sub(" ", line)
    sentences = _SENTENCE_END.split(line)
    out = []
    for sentence in sentences:
        if not sentence.strip():
            continue
        folded = unicodedata.normalize("NFKC", sentence).casefold()
        if _INSTRUCTION.search(folded) or _INSTRUCTION.search(fold(sentence)) or sentence.strip() == NEUTRALISED:
            if not out or out[-1] != NEUTRALISED:
                out.append(NEUTRALISED)
        else:
            out.append(sentence)
    if had_special and not any(NEUTRALISED in part for part in out):
        out.append(NEUTRALISED)
    return " ".join(out)
