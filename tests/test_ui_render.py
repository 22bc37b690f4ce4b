"""The chat's HTML (medvqa/ui/render.py): model text cannot make links or markup; citation markers
link only to the URLs of the passages the answer was given.
"""

from __future__ import annotations

import re


def test_model_text_is_inert_and_markers_link_to_passages():
    from medvqa.retrieval import Passage
    from medvqa.ui.render import _render_answer
    from medvqa.ui.session import _Answer

    passages = [Passage("p1", "Effusion <b>text</b> & more", "https://pubmed.ncbi.nlm.nih.gov/1/", "T1", "PubMed",
                        "", 1.0),
                Passage("p2", "Other", "javascript:alert(1)", "T2", "", "", 0.5)]
    answer = _Answer("q", scan=None, passages=passages, text=(
        "Yes [1], see [2] and [7]. <script>alert(1)</script> [click](https://evil.example/x) "
        "https://evil.example www.evil.example mail@evil.example ![img](https://evil.example/i.png)"))
    rendered = _render_answer(answer, final=True)
    hrefs = re.findall(r'href="([^"]+)"', rendered)
    assert hrefs == ["https://pubmed.ncbi.nlm.nih.gov/1/", "https://pubmed.ncbi.nlm.nih.gov/1/"]
    assert '<a class="medvqa-cite" href="https://pubmed.ncbi.nlm.nih.gov/1/"' in rendered  # the [1] marker
    assert "<script>" not in rendered and "&lt;script&gt;" in rendered
    assert "https://evil" not in rendered and "www.evil" not in rendered and "@evil" not in rendered
    assert "\\[7\\]" in rendered  # a marker with no passage stays text
    assert "javascript:" not in rendered.split("<details>")[0].split("T2")[0] and "T2" in rendered
    assert "Effusion &lt;b&gt;text&lt;/b&gt; &amp; more" in rendered
