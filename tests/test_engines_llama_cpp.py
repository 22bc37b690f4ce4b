"""The llama.cpp engine on the offline profile's real GGUF (skipped where llama-cpp-python is absent)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -r requirements-llama.txt)")

from medvqa.config import load_settings  # noqa: E402
from medvqa.engines import EngineRequest  # noqa: E402
from medvqa.model import embed_prompt, image_digest, image_key  # noqa: E402
from medvqa.pipeline import Conversation, Done, Pipeline  # noqa: E402


@pytest.fixture(scope="module")
def pipelines():
    llama = load_settings("offline")
    llama.decoder.engine = "llama.cpp"
    reference = load_settings("offline")
    reference.decoder.engine = "transformers"
    return (Pipeline.load(llama, with_retrieval=False), Pipeline.load(reference, with_retrieval=False))


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


def test_llama_cpp_logits_follow_transformers(pipelines):
    """Same weights (Q4_1 values, de-quantised exactly for transformers), same image tokens: the
    next-token distributions after the prompt agree."""
    llama, reference = pipelines
    image = _image(0)
    prompt = reference.prompts.build("What organ is shown in this image?")
    request = EngineRequest("", prompt, image, -7, lambda: llama.model.image_tokens(image))
    keyed = request.cache_ids()
    engine = llama.engine
    slot = engine._take_slot(keyed)
    try:
        ours, _ = engine._prefill(slot, request, keyed)
    finally:
        engine._give_back(slot)
    embeds = embed_prompt(reference.engine.language_model.embed, prompt.token_ids, prompt.image_mask,
                          lambda: reference.model.image_tokens(image))
    theirs = reference.engine.forward_embeds(embeds)[0][0].numpy()
    assert np.corrcoef(ours, theirs)[0, 1] > 0.98
    # llama.cpp also rounds activations to 8 bits inside its quantised products, so near-ties at the
    # top can swap order; each engine's choice is among the other's five best.
    assert int(np.argmax(ours)) in np.argsort(-theirs)[:5] and int(np.argmax(theirs)) in np.argsort(-ours)[:5]


def test_llama_cpp_streams_reuses_the_prefix_and_answers_closed_questions(pipelines):
    llama, _ = pipelines
    conversation = Conversation(image=_image(1))
    first = [e for e in llama.ask(conversation, "Describe the image.", constrained=False, max_new_tokens=12)][-1]
    second = [e for e in llama.ask(conversation, "Which side is abnormal?", constrained=False,
                                   max_new_tokens=12)][-1]
    assert isinstance(first, Done) and first.answer
    assert second.timings["reused_tokens"] > first.timings["prompt_tokens"] // 2
    answer, _ = llama.answer(_image(2), "Is there a pleural effusion?", use_retrieval=False, constrained=True)
    assert answer in ("Yes", "No")


def test_warming_the_next_turn_keeps_the_answer_and_shortens_the_prefill(pipelines):
    llama, _ = pipelines
    turns = []
    for warm in (True, False):
        conversation = Conversation(image=_image(6))
        list(llama.ask(conversation, "Describe the image.", constrained=False, max_new_tokens=8, warm=warm,
                       use_retrieval=False))
        turns.append(list(llama.ask(conversation, "Which side is abnormal?", constrained=False, max_new_tokens=8,
                                    warm=warm, use_retrieval=False))[-1])
        llama.end_conversation(conversation)
    warmed, cold = turns
    assert warmed.answer == cold.answer
    assert warmed.timings["reused_tokens"] > cold.timings["reused_tokens"]


def test_warming_before_the_first_question_keeps_the_answer(pipelines):
    """As the app does when a scan is shown: the image and the prompt up to the question are cached
    in a llama.cpp slot before the first question, which then reuses them."""
    llama, _ = pipelines
    turns = []
    for warm in (False, True):  # the cold turn first: ending it takes the image out of the slots
        conversation = Conversation(image=_image(7))
        if warm:
            assert llama.warm_next_turn(conversation) > llama.model.num_image_tokens
        turns.append(list(llama.ask(conversation, "Which side is abnormal?", constrained=False, max_new_tokens=8,
                                    warm=False, use_retrieval=False))[-1])
        llama.end_conversation(conversation)
    cold, warmed = turns
    assert warmed.answer == cold.answer
    assert warmed.timings["reused_tokens"] > cold.timings["reused_tokens"] + llama.model.num_image_tokens


def test_a_question_prefilled_as_typed_keeps_the_answer_and_leaves_one_token(pipelines):
    """The app prefills the question as it is typed: asked as typed, the slot already holds all of
    its prompt but the last token."""
    llama, _ = pipelines
    question = "Which side is abnormal?"
    turns = []
    for typed in (False, True):
        conversation = Conversation(image=_image(9))
        list(llama.ask(conversation, "Describe the image.", constrained=False, max_new_tokens=4, warm=False,
                       use_retrieval=False))
        if typed:
            llama.warm_next_turn(conversation, question)
        turns.append(list(llama.ask(conversation, question, constrained=False, max_new_tokens=8, warm=False,
                                    use_retrieval=False))[-1])
        llama.end_conversation(conversation)
    cold, typed = turns
    assert typed.answer == cold.answer
    assert typed.timings["prompt_tokens"] - typed.timings["reused_tokens"] == 1
    assert cold.timings["reused_tokens"] < typed.timings["reused_tokens"]


def test_ending_a_conversation_drops_its_scan_from_the_slots(pipelines):
    """llama.cpp's slots are shared by content; a conversation that ends takes its image's keys and
    values with it (the shared system prompt stays), unless a one-shot caller keeps them."""
    llama, _ = pipelines
    image = _image(8)
    key = image_key(image_digest(image))

    def slots_holding():
        return [slot for slot in llama.engine._slots if key in slot.cached]

    conversation = Conversation(image=image)
    first = list(llama.ask(conversation, "Describe the image.", constrained=False, max_new_tokens=4,
                           use_retrieval=False))[-1]
    assert slots_holding()
    llama.end_conversation(conversation)
    assert not slots_holding()
    again = list(llama.ask(Conversation(image=image), "Describe the image.", constrained=False, max_new_tokens=4,
                           use_retrieval=False, warm=False))[-1]
    assert again.answer == first.answer and again.timings["reused_tokens"] == first.timings["reused_tokens"] > 0
    llama.answer(image, "Describe the image.", use_retrieval=False, constrained=False)  # a one-shot keeps it
    assert slots_holding()
    assert llama.engine.forget_image(key) >= 1 and not slots_holding()


def test_interleaved_answers_match_answers_alone(pipelines):
    """Two conversations stepped in turn on one context give the answers each gives alone (the web
    app interleaves concurrent answers token by token)."""
    llama, _ = pipelines
    questions = [(_image(3), "Describe the image."), (_image(4), "What organ is shown?")]
    alone = [llama.answer(image, question, use_retrieval=False, constrained=False)[0]
             for image, question in questions]
    streams = [llama.ask(Conversation(image=image), question, use_retrieval=False, constrained=False)
               for image, question in questions]
    finished = [None, None]
    while any(f is None for f in finished):
        for index, stream in enumerate(streams):
            if finished[index] is None:
                event = next(stream)
                if isinstance(event, Done):
                    finished[index] = event.answer
    assert finished == alone


def test_requantized_gguf_is_made_once_and_read_as_its_type(tmp_path):
    from medvqa.config import resolve_path
    from medvqa.engines.llama_cpp import gguf_file_type, requantized_gguf

    source = resolve_path(load_settings("offline").decoder.name_or_path)
    assert requantized_gguf(source, "", tmp_path) == source
    assert requantized_gguf(source, gguf_file_type(source), tmp_path) == source
    made = requantized_gguf(source, "q8_0", tmp_path)
    assert made != source and gguf_file_type(made) == "Q8_0"
    stamp = os.stat(made).st_mtime_ns
    assert requantized_gguf(source, "Q8_0", tmp_path) == made and os.stat(made).st_mtime_ns == stamp
    assert not list(tmp_path.rglob("*.partial"))
    with pytest.raises(ValueError, match="llama_cpp_type"):
        requantized_gguf(source, "Q3_X", tmp_path)

    import torch

    from medvqa.engines import load_engine

    settings = load_settings("offline")  # the app's own cache folder, as a user's start would use
    settings.decoder.engine, settings.decoder.llama_cpp_type = "llama.cpp", "Q8_0"
    engine = load_engine(settings, torch.device("cpu"), torch.float32)
    assert gguf_file_type(engine.gguf_path) == "Q8_0" and engine.gguf_path.startswith(settings.cache_dir)
