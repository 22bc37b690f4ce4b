"""Answers a clinician can check: the claim an answer makes, citations retrieved for it and marked by
a check that shows its match, and whether a closed answer depends on the image."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings as hypothesis_settings, strategies as st

from medvqa.pipeline import Conversation, Done, Sources
from medvqa.trust import SYNONYMS, claim, claim_query, image_reliance, mark_support


def test_a_yes_claims_the_finding_and_a_no_claims_nothing_a_passage_could_support():
    yes = claim("Is the heart enlarged?", "Yes")
    assert yes.finding == "heart enlarged" and "cardiomegaly" in yes.terms
    assert mark_support(yes, "Chest radiograph showing an enlarged cardiac silhouette") == \
        ("supports", "enlarged cardiac silhouette")
    assert mark_support(yes, "The heart is of normal size.")[0] == "related"  # shares a word, not the claim
    no = claim("Is the heart enlarged?", "No")
    assert no.terms == [] and mark_support(no, "an enlarged cardiac silhouette") == ("related", "")
    assert claim_query("Is the heart enlarged?", "No") == "Is the heart enlarged? heart enlarged"


def test_an_open_answer_claims_its_words_and_listed_findings():
    said = claim("What is the pathology?", "Cardiomegaly with pulmonary edema")
    assert mark_support(said, "Radiograph: cardiac enlargement.") == ("supports", "cardiac enlargement")
    assert mark_support(said, "Fluid in the lungs.")[0] == "supports"
    assert mark_support(claim("What organ is shown?", "Liver"), "A mass in the liver on CT.") == ("supports", "liver")
    assert claim_query("What is the pathology?", "Cardiomegaly") == "What is the pathology? Cardiomegaly"


@hypothesis_settings(max_examples=200, deadline=None)
@given(question=st.sampled_from(["Is the heart enlarged?", "What is the pathology?", "Is there a pleural effusion?",
                                 "Which organ is abnormal?"]),
       answer=st.text(max_size=40), passage=st.text(max_size=120))
def test_supports_is_never_said_without_a_match_it_can_show(question, answer, passage):
    """supported_precision is 1 by construction: a "supports" mark names a phrase that is in the
    passage and is one of the claim's terms or their listed synonyms."""
    from medvqa.answers import normalise

    asserted = claim(question, answer)
    mark, phrase = mark_support(asserted, passage)
    if mark == "supports":
        assert phrase and f" {normalise(phrase)} " in f" {normalise(passage)} "
        allowed = set(asserted.terms) | {s for t in asserted.terms for s in SYNONYMS.get(t, ())}
        allowed |= {name for name, others in SYNONYMS.items() for t in asserted.terms
                    if name in f" {t} " or any(o in t for o in others)}
        allowed |= {o for name in list(allowed) for o in SYNONYMS.get(name, ())}
        assert phrase in allowed
    else:
        assert phrase == ""


def test_a_closed_answer_that_survives_a_neutral_image_is_flagged():
    kept = image_reliance({"yes": -0.2, "no": -1.0}, {"yes": -0.3, "no": -0.9})
    assert kept["flagged"] and kept["answer"] == "yes" and kept["margin"] == 0.8
    changed = image_reliance({"yes": -0.2, "no": -1.0}, {"yes": -0.9, "no": -0.3})
    assert not changed["flagged"] and changed["without_image"] == "no"
    weaker = image_reliance({"yes": -0.2, "no": -1.0}, {"yes": -0.5, "no": -0.6})  # a tenth of the margin
    assert not weaker["flagged"]


def test_the_pipeline_cites_for_the_claim_and_marks_support(tiny_pipeline):
    from medvqa.retrieval import Passage

    queries = []

    class Recording:  # the retriever's interface
        def search(self, query, k=None, safe_meta=None):
            queries.append(query)
            return [Passage("p1", "An enlarged cardiac silhouette on the chest radiograph.", "https://pubmed.ncbi.nlm.nih.gov/1/",
                            "", "test", "CC0", 1.0, {"dense": 1}),
                    Passage("p2", "The lungs are clear.", "https://pubmed.ncbi.nlm.nih.gov/2/", "", "test", "CC0", 0.5,
                            {"dense": 2})]

    saved_retriever, saved_gate = tiny_pipeline.retriever, tiny_pipeline.settings.retrieval.prompt_gate
    tiny_pipeline.retriever, tiny_pipeline.settings.retrieval.prompt_gate = Recording(), "never"
    try:
        image = np.random.default_rng(1).integers(0, 256, (40, 30, 3), dtype=np.uint8)
        events = list(tiny_pipeline.ask(Conversation(image=image), "Is the heart enlarged?", warm=False))
    finally:
        tiny_pipeline.retriever, tiny_pipeline.settings.retrieval.prompt_gate = saved_retriever, saved_gate
    done = events[-1]
    sources = next(event for event in events if isinstance(event, Sources))
    assert isinstance(done, Done) and done.answer in ("Yes", "No")
    assert queries == ["Is the heart enlarged? heart enlarged"]  # retrieved after the answer, for its claim
    expected = [("supports", "enlarged cardiac silhouette"), ("related", "")] if done.answer == "Yes" \
        else [("related", ""), ("related", "")]
    assert sources.support == done.support == expected
    closed = done.closed
    assert set(closed["options"]) == {"yes", "no"} and closed["answer"] == done.answer.lower()
    assert isinstance(closed["flagged"], bool) and "image_reliance_s" in done.timings
