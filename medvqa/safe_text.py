"""Passage fields as they leave the app: one escaping, inert in HTML and in Markdown alike.

A passage's id, title, source, licence and text come from a corpus file, i.e. from whoever wrote
it. They leave the app in four places: the page (HTML inside Gradio's Markdown), the Markdown
export, the JSON export (whose reader may paste it into either) and the command line. `inert` is
the only escaping any of them applies, so a field can never be escaped for one reader and raw for
another.

Why numeric character references rather than backslashes: HTML decodes `&#91;` to the text `[`,
and CommonMark decodes it to the text `[` too, but never treats a decoded character as syntax (no
link, emphasis or tag can be built from it). Backslash escapes work for Markdown only and leave
`<` alive in HTML; `html.escape` works for HTML only and leaves `[x](url)` alive in Markdown.
Only the characters that can start markup are replaced, so ids such as `PMID21645374_c0` and
most titles read unchanged on a terminal and in JSON.

    inert("<img src=x onerror=alert(1)>")  ->  "&#60;img src=x onerror=alert(1)&#62;"
    safe_url("javascript:alert(1)")        ->  ""
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

# Characters that start markup anywhere in a line: HTML tags and entities, quotes (attribute values),
# Markdown links, images, code, emphasis, strikethrough, tables, maths, and backslash escapes.
_ALWAYS = "<>\"'`*[]|~$\\"
# A numeric character reference this function wrote is left as it is, so escaping twice changes nothing.
_AMPERSAND = re.compile(r"&(?!#\d{1,7};)")
# `_` makes emphasis only at a word's edge (CommonMark ignores it inside a word: PMID_c0 stays as it is).
_EDGE_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
# GFM extended autolinks need a literal "://", "www." or an e-mail address.
_SCHEME = re.compile(r":(?=//)")
_WWW = re.compile(r"(?i)(?<![0-9a-z])(www)\.")
# Block syntax counts at the start of a line only; the text is one line, so only its start matters.
_LINE_START = re.compile(r"^(?:[-+#](?=\s|$)|[-=]+$|\d{1,9}[.)](?=\s|$))")
# Controls (a terminal obeys ESC sequences), zero-width and bidirectional-override characters.
_INVISIBLE = re.compile("[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u202a-\u202e\u2060-\u2064"
                        "\u2066-\u206f\ufeff\ufff9-\ufffb]")
_WHITESPACE = re.compile(r"\s+")
# A link target the app may show: http(s), printable, no spaces, quotes or angle brackets.
_HTTP_URL = re.compile(r"https?://[^\s<>\"'`\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]+",
                       re.IGNORECASE)


def _reference(character: str) -> str:
    return f"&#{ord(character)};"


_TABLE = {ord(c): _reference(c) for c in _ALWAYS}


def inert(text: object) -> str:
    """`text` as one line that shows literally in HTML (text or quoted attribute) and in Markdown.

    Controls and invisible characters are dropped and whitespace (newlines included) collapses to
    single spaces, so the result can neither end an HTML block nor start a Markdown block."""
    text = _WHITESPACE.sub(" ", visible(text)).strip()
    text = _AMPERSAND.sub("&#38;", text)
    text = text.translate(_TABLE)
    text = _EDGE_UNDERSCORE.sub(_reference("_"), text)
    text = _SCHEME.sub(_reference(":"), text)
    text = _WWW.sub(lambda m: m.group(1) + _reference("."), text)
    text = text.replace("@", _reference("@"))
    match = _LINE_START.match(text)
    if match:  # a list item, heading or setext underline: its last character becomes a reference
        text = text[:match.end() - 1] + _reference(text[match.end() - 1]) + text[match.end():]
    return text


def visible(text: object) -> str:
    """`text` without controls, zero-width and bidirectional-override characters (U+202E and the rest
    of them can make a question or an answer read backwards or hide a part of it); newlines and tabs
    stay. Applied to every question and answer the app shows, exports or prints."""
    return _INVISIBLE.sub("", "" if text is None else str(text))


def safe_url(url: object) -> str:
    """`url` when it is a plain http(s) link (the only links the app makes) to a named host; otherwise "".
    Not a link with a user name before its host ("https://pubmed.ncbi.nlm.nih.gov@evil.example/" goes to
    evil.example) or a backslash (which browsers read as a slash, and which ends a Markdown link)."""
    if not isinstance(url, str):
        return ""
    url = url.strip()
    if not _HTTP_URL.fullmatch(url) or "\\" in url:
        return ""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return ""
    return url if host and "@" not in parts.netloc else ""


# Where PubMed and PubMed Central records live: a source on any other host has its host shown beside it.
LITERATURE_HOSTS = frozenset({"pubmed.ncbi.nlm.nih.gov", "pmc.ncbi.nlm.nih.gov", "www.ncbi.nlm.nih.gov",
                              "ncbi.nlm.nih.gov"})


def other_host(url: object) -> str:
    """The host of a source's link when it is not PubMed's or PMC's (shown beside the source, so a link
    to another site, or to a look-alike such as pubmed.ncbi.nlm.nih.gov.example.org, says where it goes);
    "" for a PubMed or PMC link, or no link."""
    url = safe_url(url)
    host = (urlsplit(url).hostname or "").lower() if url else ""
    return "" if host in LITERATURE_HOSTS else host
