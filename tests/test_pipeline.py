"""The pipeline on the tiny profile (random CLIP ViT + random Llama): answering, streaming, warming,
conversations and their caches, the prompt gate."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from medvqa.config import load_settings
from medvqa.model import embed_prompt, merge_image_features
from medvqa.pipeline import NEUTRAL_CONVERSATION, Conversation, Done, Sources, Token
from medvqa.projector import PREFIX, Projector, ProjectorShapeError, map_llava_med_projector

from .conftest import prompt_gate, require_shared_data


def _image(seed: int = 0, shape=(48, 40)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def test_streaming_yields_several_pieces_then_done(tiny_pipeline):
    conversation = Conversation(image=_image())
    events = list(tiny_pipeline.ask(conversation, "Is there a pleural effusion?", max_new_tokens=8,
                                   constrained=False))
    assert isinstance(events[0], Sources)
    tokens = [e for e in events if isinstance(e, Token)]
    assert len(tokens) > 1
    assert isinstance(events[-1], Done)
    assert events[-1].answer == "".join(t.text for t in tokens).strip()
    assert conversation.history[-1].question == "Is there a pleural effusion?"


def test_empty_question_is_refused(tiny_pipeline):
    with pytest.raises(ValueError, match="question"):
        list(tiny_pipeline.ask(Conversation(image=_image()), "   "))


def test_second_turn_reuses_image_and_prefix_with_identical_answer(tiny_pipeline):
    image = _image(3)
    conversation = Conversation(image=image, window="lung window (C -600 / W 1500)")
    calls = tiny_pipeline.model.encoder_calls
    list(tiny_pipeline.ask(conversation, "Is there an effusion?", max_new_tokens=6, constrained=False))
    second = list(tiny_pipeline.ask(conversation, "Which side?", max_new_tokens=6))[-1]
    assert tiny_pipeline.model.encoder_calls == calls + 1  # the image was encoded once
    assert second.timings["reused_tokens"] > tiny_pipeline.model.vision.num_tokens
    fresh = Conversation(image=image, window=conversation.window, history=conversation.history[:1])
    again = list(tiny_pipeline.ask(fresh, "Which side?", max_new_tokens=6))[-1]
    assert again.timings["reused_tokens"] == 0
    assert again.answer == second.answer


def test_history_turns_sets_how_many_earlier_turns_the_prompt_carries(tiny_pipeline, monkeypatch):
    """decoder.history_turns: -1 every earlier turn (the default), 0 none (the question as if asked first),
    N the last N; the conversation keeps every turn either way."""
    conversation = Conversation(image=_image(4))
    for question in ("Is there an effusion?", "Is the heart enlarged?", "Which side?"):
        list(tiny_pipeline.ask(conversation, question, max_new_tokens=3, constrained=False, warm=False))

    def prompt_questions(keep: int) -> list[str]:
        monkeypatch.setattr(tiny_pipeline.settings.decoder, "history_turns", keep)
        return [turn.question for turn in tiny_pipeline._history(conversation)]

    assert prompt_questions(-1) == ["Is there an effusion?", "Is the heart enlarged?", "Which side?"]
    assert prompt_questions(1) == ["Which side?"] and prompt_questions(5) == prompt_questions(-1)
    assert prompt_questions(0) == [] and len(conversation.history) == 3
    # With none, the next question's answer is the one it gets asked first.
    done = list(tiny_pipeline.ask(conversation, "What organ is shown?", max_new_tokens=4, warm=False))[-1]
    alone = list(tiny_pipeline.ask(Conversation(image=_image(4)), "What organ is shown?", max_new_tokens=4,
                                   warm=False))[-1]
    assert done.answer == alone.answer and len(conversation.history) == 4


def test_warming_leaves_only_the_next_question_to_prefill(tiny_pipeline):
    """After an answer the pipeline caches the start of the next turn; the next answer is unchanged
    and its prefill covers little more than the question's own tokens."""
    rest = tiny_pipeline.prompts.build("Which side is it on?").text.split("Question:")[-1]  # question + template tail
    question_tokens = len(tiny_pipeline.engine.tokenizer(rest, add_special_tokens=False)["input_ids"])
    turns = []
    for warm in (True, False):
        conversation = Conversation(image=_image(11))
        list(tiny_pipeline.ask(conversation, "Is there an effusion?", max_new_tokens=6, constrained=False, warm=warm))
        turns.append(list(tiny_pipeline.ask(conversation, "Which side is it on?", max_new_tokens=6, warm=warm))[-1])
        tiny_pipeline.end_conversation(conversation)
    warmed, cold = turns
    assert warmed.answer == cold.answer
    assert warmed.timings["prompt_tokens"] == cold.timings["prompt_tokens"]
    assert warmed.timings["reused_tokens"] > cold.timings["reused_tokens"]
    assert warmed.timings["prompt_tokens"] - warmed.timings["reused_tokens"] <= question_tokens + 1


def test_warming_before_the_first_question_leaves_only_the_question_to_prefill(tiny_pipeline):
    """The app warms a conversation when its scan is shown: system prompt, image tokens and user
    header are cached, the first answer is unchanged and prefills little more than the question."""
    question = "Is there an effusion?"
    rest = tiny_pipeline.prompts.build(question).text.split("Question:")[-1]
    question_tokens = len(tiny_pipeline.engine.tokenizer(rest, add_special_tokens=False)["input_ids"])
    turns = []
    for warm in (True, False):
        conversation = Conversation(image=_image(12))
        if warm:
            assert tiny_pipeline.warm_next_turn(conversation) > tiny_pipeline.model.vision.num_tokens
        turns.append(list(tiny_pipeline.ask(conversation, question, max_new_tokens=6, constrained=False,
                                            warm=False))[-1])
        tiny_pipeline.end_conversation(conversation)
    warmed, cold = turns
    assert warmed.answer == cold.answer and cold.timings["reused_tokens"] == 0
    assert warmed.timings["prompt_tokens"] - warmed.timings["reused_tokens"] <= question_tokens + 1


def test_a_question_prefilled_as_typed_leaves_one_token_to_run(tiny_pipeline):
    """The app prefills the question as it is typed (warm_next_turn with a draft). Asked as typed,
    one prompt token is left to run; asked after an edit, the cache is cut back to where the two
    prompts part. The answer is the same either way."""
    question = "Which side is it on?"
    turns = []
    with prompt_gate(tiny_pipeline, "never"):  # as in the offline profile: passages beside the answer
        for draft in (question, "Which part of it", None):
            conversation = Conversation(image=_image(13))
            list(tiny_pipeline.ask(conversation, "Is there an effusion?", max_new_tokens=6, constrained=False,
                                   warm=False))
            if draft:
                assert tiny_pipeline.warm_next_turn(conversation, draft) > tiny_pipeline.model.vision.num_tokens
            turns.append(list(tiny_pipeline.ask(conversation, question, max_new_tokens=6, constrained=False,
                                                warm=False))[-1])
            tiny_pipeline.end_conversation(conversation)
    typed, edited, cold = turns
    assert typed.answer == edited.answer == cold.answer
    assert typed.timings["prompt_tokens"] - typed.timings["reused_tokens"] == 1
    assert cold.timings["reused_tokens"] < edited.timings["reused_tokens"] < typed.timings["reused_tokens"]


def test_a_draft_is_not_prefilled_when_passages_come_before_it(tiny_pipeline):
    """With passages in the prompt (retrieval.prompt_gate "always") the question follows passages
    that are only found once it is asked: only the part before them is warmed."""
    with prompt_gate(tiny_pipeline, "always"):
        conversation = Conversation(image=_image(14))
        without = tiny_pipeline.warm_next_turn(conversation)
        assert tiny_pipeline.warm_next_turn(conversation, "Which side is it on?") == without
        tiny_pipeline.end_conversation(conversation)


def test_ending_a_conversation_drops_its_image_tokens(tiny_pipeline):
    """The scan's projected tokens leave the in-memory cache with its conversation; a one-shot caller
    (the evaluation, keep_image) keeps them for the next question on the same image."""
    from medvqa.model import image_digest

    for keep in (True, False):
        image = _image(15 + keep)
        conversation = Conversation(image=image)
        list(tiny_pipeline.ask(conversation, "Describe it.", max_new_tokens=2, constrained=False, warm=False))
        assert tiny_pipeline.model.token_cache.get(image_digest(image)) is not None
        tiny_pipeline.end_conversation(conversation, keep_image=keep)
        assert (tiny_pipeline.model.token_cache.get(image_digest(image)) is not None) == keep


def test_constrained_answer_is_one_of_the_candidates(tiny_pipeline):
    answer, _ = tiny_pipeline.answer(_image(), "Is the heart enlarged?", use_retrieval=False, constrained=True)
    assert answer in ("Yes", "No")
    answer, _ = tiny_pipeline.answer(_image(), "Is the lesion on the left or the right?", use_retrieval=False,
                                     constrained=True)
    assert answer in ("Left", "Right")


def test_offline_profile_answers_a_real_image():
    data = require_shared_data()
    from medvqa.imaging import load_scan
    from medvqa.pipeline import Pipeline

    settings = load_settings("offline")
    pipeline = Pipeline.load(settings, with_retrieval=False)
    assert pipeline.model.vision.hidden_size == 1280 and pipeline.engine.hidden_size == 576
    scan = load_scan(data / "vqa_rad" / "images" / "synpic42202.jpg")
    events = list(pipeline.ask(pipeline.new_conversation(scan), "Is there evidence of an aortic aneurysm?",
                               max_new_tokens=16))
    answer = events[-1].answer
    assert answer and any(c.isalpha() for c in answer)


def test_prefix_cache_is_not_reused_across_different_pixels(tiny_pipeline):
    conversation = Conversation(image=_image(11))
    list(tiny_pipeline.ask(conversation, "What is shown?", max_new_tokens=4))
    conversation.image = _image(12)  # same conversation id, new pixels (e.g. a window change)
    done = list(tiny_pipeline.ask(conversation, "And now?", max_new_tokens=4))[-1]
    start = tiny_pipeline.prompts.build("x").image_mask.index(True)
    assert done.timings["reused_tokens"] <= start  # only the text before the image can be shared


def test_conversation_hashes_each_image_once_and_keeps_it_unedited():
    from medvqa.model import image_digest

    first = _image(13)
    conversation = Conversation(image=first)
    assert conversation.digest == image_digest(first)
    assert conversation.__dict__["_digest"] == conversation.digest  # kept, not hashed again per turn
    with pytest.raises(ValueError, match="read-only"):
        first[0, 0, 0] ^= 1  # an in-place edit would leave a stale key: refused
    second = _image(14)
    conversation.image = second
    assert conversation.digest == image_digest(second) != image_digest(first)


def test_prompt_gate_controls_whether_the_decoder_reads_the_passages(tiny_pipeline):
    from medvqa.retrieval import Passage

    class OnePassage:  # the retriever's interface: search(query, k, safe_meta) -> [Passage]
        def search(self, query, k=None, safe_meta=None):
            return [Passage("p1", "Pleural effusion is fluid in the pleural space.",
                            "https://pubmed.ncbi.nlm.nih.gov/1/", "", "test", "CC0", 1.0, {"dense": 1})]

    settings = tiny_pipeline.settings
    saved_retriever, saved_gate = tiny_pipeline.retriever, settings.retrieval.prompt_gate
    tiny_pipeline.retriever = OnePassage()
    try:
        lengths = {}
        for gate in ("always", "never", "open"):
            settings.retrieval.prompt_gate = gate
            events = list(tiny_pipeline.ask(Conversation(image=_image()), "What is shown?", max_new_tokens=2))
            found = [i for i, event in enumerate(events) if isinstance(event, Sources)]
            assert len(found) == 1
            sources = events[found[0]]
            assert [p.id for p in sources.passages] == ["p1"]  # always shown to the user
            assert sources.in_prompt == events[-1].in_prompt == (gate != "never")
            # Passages the decoder reads come before the answer; passages only shown beside it come
            # after the answer's last token, so finding them does not delay the first word.
            assert found[0] == (0 if gate != "never" else len(events) - 2)
            lengths[gate] = events[-1].timings["prompt_tokens"]
        assert lengths["always"] > lengths["never"] and lengths["open"] == lengths["always"]
        settings.retrieval.prompt_gate = "open"
        closed = list(tiny_pipeline.ask(Conversation(image=_image()), "Is there an effusion?"))
        assert closed[-1].in_prompt is False  # closed question: passages kept out under "open"
    finally:
        tiny_pipeline.retriever, settings.retrieval.prompt_gate = saved_retriever, saved_gate


def test_warming_is_skipped_when_no_longer_wanted_once_the_turn_comes(tiny_pipeline):
    """The app's warming may wait for the model's turn; `still_wanted` is asked when the turn comes,
    so a conversation replaced (or answering) meanwhile is not warmed."""
    conversation = Conversation(image=_image(31))
    assert tiny_pipeline.warm_next_turn(conversation, still_wanted=lambda: False) == 0
    assert tiny_pipeline.engine.prefixes.get(conversation.id) is None
    assert tiny_pipeline.warm_next_turn(conversation, still_wanted=lambda: True) > 0
    tiny_pipeline.end_conversation(conversation)


def test_conversations_take_turns_on_the_model(tiny_pipeline):
    """Each step of an answer and each warming takes the pipeline's one first-come-first-served turn:
    while another holds it, a warming waits, and runs once it is released."""
    import threading

    conversation = Conversation(image=_image(32))
    finished = threading.Event()
    with tiny_pipeline.turns.turn():
        worker = threading.Thread(target=lambda: (tiny_pipeline.warm_next_turn(conversation), finished.set()),
                                  daemon=True)
        worker.start()
        assert not finished.wait(0.3)  # blocked behind the turn held here
    worker.join(timeout=60)
    assert finished.is_set() and tiny_pipeline.engine.prefixes.get(conversation.id) is not None
    tiny_pipeline.end_conversation(conversation)


def test_a_turn_set_aside_lets_others_through_and_is_taken_back():
    """What a batching engine does while it waits for its steps: the waiting thread gives up its turn
    (others take theirs meanwhile) and holds a turn again once it is done waiting."""
    import threading

    from medvqa.pipeline import TurnTaking

    turns = TurnTaking()
    taken = []

    def other():
        with turns.turn():
            taken.append(threading.current_thread().name)

    with turns.turn():
        with turns.aside():
            first = threading.Thread(target=other, name="first", daemon=True)
            first.start()
            first.join(timeout=10)
            assert taken == ["first"]
        second = threading.Thread(target=other, name="second", daemon=True)
        second.start()
        second.join(timeout=0.3)
        assert second.is_alive()  # the turn is held again
    second.join(timeout=10)
    assert taken == ["first", "second"]
    with turns.aside():  # outside a turn there is nothing to give up
        other()
    assert taken[-1] == threading.current_thread().name


def test_the_image_reliance_check_runs_as_background_work(tiny_pipeline):
    """A closed answer's options are scored for the waiting clinician; the same options with a blank
    image (trust.image_reliance, after the answer is shown) go to the engine as background work."""
    engine = tiny_pipeline.engine
    seen = []
    original = engine.score_options

    def spy(request, answers):
        seen.append((request.conversation_id, request.background))
        return original(request, answers)

    engine.score_options = spy
    try:
        conversation = Conversation(image=_image(7))
        events = list(tiny_pipeline.ask(conversation, "Is the heart enlarged?", use_retrieval=False,
                                        constrained=True, warm=False))
    finally:
        del engine.score_options
    assert isinstance(events[-1], Done) and "flagged" in events[-1].closed
    assert seen == [(conversation.id, False), (NEUTRAL_CONVERSATION, True)]


def test_the_prompt_puts_the_image_where_the_projector_was_trained_to_read_it(tiny_pipeline, tmp_path):
    """A projector file trained with the image after the question (train_projector.py --image-position
    after) makes the pipeline's prompts put it there, in later turns too; the default stays LLaVA's."""
    from medvqa.model import VisionLanguageModel
    from medvqa.pipeline import Pipeline

    trained = tiny_pipeline.model.projector
    path = tmp_path / "projector.safetensors"
    trained.save(path, metadata={"image_position": "after"})
    projector = Projector(trained.linear_1.in_features, trained.linear_1.out_features,
                          trained.linear_2.out_features).load(path)
    assert projector.image_position == "after" and trained.image_position == "before"
    pipeline = Pipeline(tiny_pipeline.settings, tiny_pipeline.engine,
                        VisionLanguageModel(tiny_pipeline.model.vision, projector))
    before = tiny_pipeline.prompts.build("Is there an effusion?").text
    assert before.index("<image>") < before.index("Is there an effusion?")
    first = pipeline.prompts.build("Is there an effusion?").text
    assert first.index("Is there an effusion?") < first.index("<image>")
    answer, _ = pipeline.answer(_image(41), "Is there an effusion?", use_retrieval=False, constrained=True)
    assert answer in ("Yes", "No")
    conversation = Conversation(image=_image(42))
    done = list(pipeline.ask(conversation, "Is there an effusion?", max_new_tokens=4, constrained=False))[-1]
    assert isinstance(done, Done)
    second = pipeline.prompts.build("Which side?", conversation.history)
    assert sum(second.image_mask) == tiny_pipeline.model.vision.num_tokens
    assert second.text.index("Is there an effusion?") < second.text.index("<image>") < second.text.index("Which side?")


def test_an_answer_says_how_many_earlier_turns_did_not_fit_the_context(tiny_pipeline):
    """A conversation longer than the decoder's context: the oldest turns are left out of the prompt, and
    Done, the chat, the transcript and its Markdown say how many the answer did not read."""
    from medvqa.prompt import Turn
    from medvqa.ui.render import _render_answer
    from medvqa.ui.session import _Answer
    from medvqa.ui.transcript import _transcript_record, export_markdown

    conversation = Conversation(image=_image(5), history=[Turn("What is shown? " * 30, "An image. " * 30)
                                                          for _ in range(10)])
    done = list(tiny_pipeline.ask(conversation, "Is there an effusion?", max_new_tokens=3, constrained=False,
                                  warm=False))[-1]
    assert isinstance(done, Done) and done.dropped_turns > 0
    short = list(tiny_pipeline.ask(Conversation(image=_image(5)), "Is there an effusion?", max_new_tokens=3,
                                   constrained=False, warm=False))[-1]
    assert short.dropped_turns == 0
    scan = SimpleNamespace(frame_index=0, series=None, describe_window=lambda: "")
    answer = _Answer("Is there an effusion?", scan, text=done.answer, dropped_turns=done.dropped_turns)
    said = f"did not read the {done.dropped_turns} oldest earlier turns it would have carried"
    assert said in _render_answer(answer, final=True)
    assert said not in _render_answer(_Answer("q", scan=None, text="Yes"), final=True)
    scan = SimpleNamespace(frame_index=0, series=None, describe_window=lambda: "")
    turns = [answer.record(), _Answer("q", scan, text="Yes").record()]
    assert turns[0]["earlier_turns_not_read"] == done.dropped_turns and "earlier_turns_not_read" not in turns[1]
    source = SimpleNamespace(source_format="png", frame_count=1, safe_meta={})
    record = _transcript_record(SimpleNamespace(source=source, study=None, turns=turns), SimpleNamespace(profile="tiny"))
    assert export_markdown(record).count(said) == 1
