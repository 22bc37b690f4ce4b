"""The README and docs/ link to each other by heading: every relative link must name a file that exists
and, where it has an anchor, a heading of that file (GitHub's slugs), so that a renamed heading cannot
leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(<?([^)\s>]+)>?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, Markdown marks and punctuation dropped (word
    characters, hyphens and spaces kept), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        base = slug(match[1])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_slug_follows_githubs_rules():
    assert slug("`decoder` (DecoderConfig)") == "decoder-decoderconfig"
    assert slug("One answer's next token on one thread (issue 35)") == "one-answers-next-token-on-one-thread-issue-35"
    assert slug("How often a chosen answer is right, and when the app says Uncertain (2026-12-04)") == \
        "how-often-a-chosen-answer-is-right-and-when-the-app-says-uncertain-2026-12-04"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(document):
    text = _FENCE.sub("", document.read_text(encoding="utf-8"))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http(s), mailto, data: not checked here
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{document.name}: {broken}"
