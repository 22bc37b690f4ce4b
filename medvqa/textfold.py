"""Text folded for comparison: look-alike letters, width, case, accents and invisible characters
stop mattering.

Used where text written to steer the model is looked for (retrieval/sanitize.py at ingest,
injection.py at the answer): "Іgnоrе" spelled with Cyrillic letters, "ＩＧＮＯＲＥ" in full-width
forms or "ig\u200bnore" with a zero-width space must read as "ignore", or a pattern list written
in Latin letters misses them. Folding is for comparing only; text shown or stored is never folded.
"""

from __future__ import annotations

import re
import unicodedata

# Cyrillic and Greek letters that look like Latin ones (the common part of Unicode's confusables list).
_CONFUSABLES = str.maketrans({
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c",
    "т": "t", "у": "y", "х": "x", "і": "i", "ї": "i", "ј": "j", "ѕ": "s", "ԁ": "d", "һ": "h", "ӏ": "l",
    "ԛ": "q", "ԝ": "w", "ɡ": "g", "ո": "n", "ս": "u", "ց": "g", "օ": "o",
    "α": "a", "β": "b", "ε": "e", "η": "n", "ι": "i", "κ": "k", "μ": "u", "ν": "v", "ο": "o", "ρ": "p",
    "τ": "t", "υ": "u", "χ": "x", "ω": "w", "ς": "s",
})
# Zero-width, joiners, bidirectional controls, soft hyphen, BOM, tag characters.
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180e\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\U000e0000-\U000e007f]")
_WHITESPACE = re.compile(r"\s+")


def fold(text: str) -> str:
    """Case-folded, NFKC-normalised, without invisible characters, with Cyrillic and Greek look-alikes
    read as Latin letters and accents dropped; whitespace collapsed to single spaces."""
    text = unicodedata.normalize("NFKC", _INVISIBLE.sub("", text)).casefold()
    text = text.translate(_CONFUSABLES)
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    return _WHITESPACE.sub(" ", text).strip()


def fold_case(text: str) -> str:
    """Case-folded and NFKC-normalised, without invisible characters, letters otherwise kept (for
    patterns written in the passage's own script, e.g. Russian)."""
    text = unicodedata.normalize("NFKC", _INVISIBLE.sub("", text)).casefold()
    return _WHITESPACE.sub(" ", text).strip()
