"""The llama.cpp engine on the offline profile's real GGUF (skipped where llama-cpp-python is absent)."""

from __future__ import annotations

import contextlib
import os
import re
import threading

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -r requirements-llama.txt)")

from medvqa.config import load_settings  # noqa: E402
from medvqa.engines import EngineRequest  # noqa: E402
from medvqa.model import embed_prompt, image_digest, image_key  # noqa: E402
from medvqa.engines.llama_cpp import LlamaCppEngine  # noqa: E402
from medvqa.pipeline import Conversation, Done, Pipeline  # noqa: E402
from medvqa.prompt import Prompt  # noqa: E402
from .threads import join_all, until  # noqa: E402


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
    ours = np.asarray(llama.engine.score_options(request, [[token] for token in range(llama.engine.n_vocab)]))
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
    # The shipped calibration says "Uncertain" below its threshold, with the option it leans to.
    assert answer in ("Yes", "No") or re.match(r"Uncertain — .*leans to (Yes|No)", answer), answer


def test_the_offline_profile_judges_a_yes_no_answer_by_the_heads_agreement(pipelines):
    """As shipped: the decoder answers, the answer head reads the question a second time, and the
    calibration part of that agreement judges the confidence."""
    llama, _ = pipelines
    image = np.zeros((64, 64, 3), np.uint8)
    image[16:48, 20:44] = 180
    done = llama.answer_done(image, "Is there a pleural effusion?", use_retrieval=False, constrained=True)
    reading = done.closed["encoder_reading"]
    assert reading["answer"] in ("Yes", "No") and reading["agrees"] == (reading["answer"].lower() == done.closed["choice"])
    assert reading["strength"] >= 0  # the shipped parts weigh how firmly the head reads it
    part = "agrees" if reading["agrees"] else "disagrees"
    assert done.closed["calibration_group"] == f"grey, image encoder {part}"
    if done.closed["held_out"]:  # (None for a confidence in a bin no held-out answer of that part fell in)
        assert done.closed["held_out"]["group"] == done.closed["calibration_group"]


def test_warming_the_next_turn_keeps_the_answer_and_shortens_the_prefill(pipelines, monkeypatch):
    llama, _ = pipelines
    # With the earlier turn in the prompt (the offline profile asks each question alone, whose prompt
    # starts as the first one's, cached either way).
    monkeypatch.setattr(llama.settings.decoder, "history_turns", -1)
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

    # Another scan first, so the shared system prompt is in a slot whichever tests ran before.
    llama.answer(_image(18), "Describe the image.", use_retrieval=False, constrained=False, max_new_tokens=2)
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


def test_answers_in_one_batch_are_the_tokens_of_answers_alone(pipelines):
    """Greedy decoding: the same questions asked one at a time and all at once give the same tokens,
    prompts prefilled in shared steps included, and all at once took fewer llama_decode calls than
    the tokens generated (each step carried several answers' next tokens)."""
    import threading

    from medvqa.engines.llama_steps import Generation

    llama, _ = pipelines
    engine = llama.engine
    questions = ["Describe the image.", "What organ is shown?", "Which side is abnormal?",
                 "What abnormality is seen in this image?"]
    images = [_image(40 + i) for i in range(len(questions))]

    def token_ids(image, question, barrier=None) -> list[int]:
        # The engine's own path (stream() yields text; the job gives the ids it sampled).
        request = llama._request(image, llama.prompts.build(question), image_digest(image))
        job, _ = engine._start(request, Generation, sample=lambda logits: int(np.argmax(logits)), max_new_tokens=24,
                               stop_ids=frozenset(engine.stop_ids))
        if barrier is not None:
            barrier.wait(timeout=60)
        engine.loop.submit(job)
        ids = []
        try:
            while (token := job.next_token(request.waiting)) is not None:
                ids.append(token)
        finally:
            engine._finish(job)
        return ids

    def forget_images():
        for image in images:
            engine.forget_image(image_key(image_digest(image)))

    forget_images()
    alone = [token_ids(image, question) for image, question in zip(images, questions)]
    forget_images()
    together: list = [None] * len(questions)
    barrier = threading.Barrier(len(questions))
    steps_before = engine.loop.steps

    def run(index):
        together[index] = token_ids(images[index], questions[index], barrier)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    join_all(threads, timeout=300)
    steps = engine.loop.steps - steps_before
    forget_images()
    assert together == alone and all(alone)
    assert steps < sum(len(ids) for ids in alone)


def test_a_stopped_answer_leaves_the_batch_and_frees_its_slot(pipelines):
    """A reader that stops (the app's Stop) takes its answer out of the step loop at the next step;
    its slot is free again and another answer runs to the end."""
    llama, _ = pipelines
    stream = llama.ask(Conversation(image=_image(50)), "Describe the image.", constrained=False,
                       use_retrieval=False, warm=False)
    next(event for event in stream if not isinstance(event, Done) and getattr(event, "text", ""))
    stream.close()
    assert until(lambda: not any(slot.busy for slot in llama.engine._slots))
    answer, _ = llama.answer(_image(51), "What organ is shown?", use_retrieval=False, constrained=False)
    assert answer


def test_a_prefix_another_slot_holds_is_copied_and_answers_as_computed(pipelines):
    """A prompt whose start (the system prompt) only a busy slot holds is not run again: the engine
    copies those keys/values into a free slot, and the greedy answer is the one computed from scratch."""
    llama, _ = pipelines
    engine = llama.engine
    first, second = _image(60), _image(61)

    def clear_slots():
        with engine.loop.context_lock:
            for slot in engine._slots:
                engine.loop.truncate(slot, 0)

    def answer(image, question):
        timings: dict = {}
        request = llama._request(image, llama.prompts.build(question), image_digest(image))
        text = "".join(engine.stream(request, max_new_tokens=16, timings=timings))
        return text, timings["reused_tokens"]

    clear_slots()
    alone, reused = answer(second, "What organ is shown?")
    assert reused == 0
    clear_slots()
    answer(first, "Describe the image.")
    holder = max(engine._slots, key=lambda slot: len(slot.cached))
    copies = engine.loop.copies
    holder.busy = True  # answering someone else: the next prompt takes another slot
    try:
        borrowed, reused = answer(second, "What organ is shown?")
    finally:
        holder.busy = False
    system = llama.prompts.build("a").image_mask.index(True)  # positions before the image
    assert engine.loop.copies == copies + 1 and reused == system
    assert borrowed == alone
    clear_slots()


def test_a_new_conversation_takes_an_empty_slot_not_another_conversations(pipelines):
    """Warming a second scan's conversation does not evict the first one's warmed prompt from its slot
    (the system prompt they share is copied instead), so both first questions find their prompts cached."""
    llama, _ = pipelines
    engine = llama.engine
    with engine.loop.context_lock:
        for slot in engine._slots:
            engine.loop.truncate(slot, 0)
    conversations = [Conversation(image=_image(70 + i)) for i in range(2)]
    warmed = [llama.warm_next_turn(conversation) for conversation in conversations]
    held = [slot for slot in engine._slots if slot.cached]
    assert len(held) == 2 and all(len(slot.cached) == length for slot, length in zip(
        sorted(held, key=lambda slot: slot.last_used), warmed))
    for conversation, length in zip(conversations, warmed):
        done = [event for event in llama.ask(conversation, "Describe the image.", constrained=False,
                                             use_retrieval=False, warm=False) if isinstance(event, Done)][0]
        assert done.timings["reused_tokens"] == length
        llama.end_conversation(conversation)


def test_a_request_gives_up_its_turn_to_wait_for_a_slot_and_only_then(pipelines):
    """With a slot free it is taken at once; with every slot in use the caller waits inside
    `waiting` (its turn given up, since the answers holding slots need turns to end), decided in the
    same hold of the lock that takes the slot. Deciding first and taking after left a caller that
    lost the race for the last free slot waiting with its turn held: every answer stopped."""
    engine = pipelines[0].engine
    waited = []

    @contextlib.contextmanager
    def waiting():
        waited.append("given up")
        yield
        waited.append("taken back")

    held = [engine._take_slot([1, 2, 3], waiting) for _ in engine._slots]
    assert waited == [] and all(slot.busy for slot in engine._slots)
    got = []
    thread = threading.Thread(target=lambda: got.append(engine._take_slot([1, 2, 3], waiting)), daemon=True)
    thread.start()
    try:
        assert until(lambda: waited == ["given up"])
        engine._give_back(held[0])
        join_all([thread], timeout=30)
    finally:
        for slot in held[1:] + got:
            engine._give_back(slot)
    assert got == [held[0]] and waited == ["given up", "taken back"]
    assert not any(slot.busy for slot in engine._slots)


def test_an_image_forgotten_while_a_slot_is_handed_back_is_dropped_too(pipelines, monkeypatch):
    """forget_image on a slot in use asks for its keys to be dropped when it is given back; a key
    asked for while those are being dropped is dropped as well (it used to be cleared unseen)."""
    engine = pipelines[0].engine
    slot = engine._take_slot([])
    try:
        with engine.loop.context_lock:
            engine.loop.truncate(slot, 0)
        slot.cached[:] = [11, -102, 12, -101, 13]  # ids only: no step runs on this slot here
        slot.forget = {-101}
        drop = engine._drop_keys
        late = threading.Thread(target=engine.forget_image, args=(-102,), daemon=True)

        def drop_while_another_is_forgotten(target, keys):
            drop(target, keys)
            if -101 in keys:
                late.start()  # another tab closes just as this slot's first image was dropped
                assert until(lambda: -102 in slot.forget)

        monkeypatch.setattr(engine, "_drop_keys", drop_while_another_is_forgotten)
        engine._give_back(slot)
        join_all([late], timeout=30)
        assert slot.cached == [11] and slot.forget == set() and not slot.busy
    finally:
        monkeypatch.undo()
        with engine.loop.context_lock:
            engine.loop.truncate(slot, 0)  # the ids set above never matched its keys/values


def test_shared_prefix_survives_a_list_cut_short_while_it_reads():
    """The step loop cuts a slot's ids while a request compares its prompt with them."""
    from medvqa.engines.base import shared_prefix

    cached = [1, 2, 3, 4, 5, 6]

    class Cutting(int):
        def __eq__(self, other):
            if int(self) == 2:
                del cached[2:]  # the loop truncates the slot mid-comparison
            return int(self) == other

        def __ne__(self, other):
            return not self.__eq__(other)

        __hash__ = int.__hash__

    assert shared_prefix(cached, [Cutting(i) for i in (1, 2, 3, 4, 5, 6)]) == 2


def test_an_option_too_long_for_one_step_is_refused_not_left_waiting(pipelines):
    """An option's ids run in one step; one longer than a step takes could never run."""
    llama, _ = pipelines
    image = _image(12)
    prompt = llama.prompts.build("Is it normal?")
    request = EngineRequest("", prompt, image, -12, lambda: llama.model.image_tokens(image))
    with pytest.raises(ValueError, match="longer than one step"):
        llama.engine.score_options(request, [[5] * 600, [6]])
    assert not any(slot.busy for slot in llama.engine._slots)
    assert len(llama.engine.score_options(request, [[5] * 3, [6]])) == 2


def test_closing_a_running_answer_does_not_wait_for_the_step_loop(pipelines):
    """Gradio closes a stopped answer's generator on the server's event loop: the close returns at
    once, whatever the step in progress, and the slot is freed once the answer is out of the loop."""
    llama, _ = pipelines
    stream = llama.ask(Conversation(image=_image(52)), "Describe the image.", constrained=False,
                       use_retrieval=False, warm=False, max_new_tokens=64)
    next(event for event in stream if not isinstance(event, Done) and getattr(event, "text", ""))
    closer = threading.Thread(target=stream.close, name="closer", daemon=True)
    with llama.engine.loop.context_lock:  # no step can finish meanwhile
        closer.start()
        join_all([closer], timeout=30)
    assert until(lambda: not any(slot.busy for slot in llama.engine._slots))


def test_an_answer_running_as_the_engine_closes_fails_with_a_clear_error():
    """Closing the engine (the app shutting down) fails what is still running and what comes after
    with "closed", not an error of the engine's insides."""
    settings = load_settings("offline")
    settings.decoder.engine = "llama.cpp"
    pipeline = Pipeline.load(settings, with_retrieval=False)
    stream = pipeline.ask(Conversation(image=_image(70)), "Describe the image.", constrained=False,
                          use_retrieval=False, warm=False, max_new_tokens=64)
    next(event for event in stream if not isinstance(event, Done) and getattr(event, "text", ""))
    pipeline.engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(stream)
    with pytest.raises(RuntimeError, match="closed"):
        list(pipeline.ask(Conversation(image=_image(71)), "Describe the image.", constrained=False,
                          use_retrieval=False, warm=False))


def test_one_token_steps_run_on_their_own_thread_count_and_prompts_on_all(pipelines):
    """An answer's next token runs on decoder.llama_cpp_token_threads (1 by default), prompts and steps
    of several answers on the engine's full count; 0 means the full count for both."""
    llama, _ = pipelines
    engine, lib = llama.engine, llama.engine._lib
    assert (engine.token_threads, engine.batch_threads) == (1, engine.batch_threads)
    assert lib.llama_n_threads(engine.ctx) == 1 and lib.llama_n_threads_batch(engine.ctx) == engine.batch_threads
    with pytest.raises(ValueError, match="llama_cpp_token_threads"):
        LlamaCppEngine(engine.gguf_path, engine.tokenizer, engine.config, token_threads=-1)


def test_the_bare_token_step_leaves_the_cache_and_the_threads_as_they_were(pipelines):
    """time_token_step (benchmarks' floor for the time per token) times bare llama_decode calls after a
    prompt, then gives the slot back holding just the prompt, with the thread counts restored; an
    answer to the same prompt afterwards is the one given before."""
    llama, _ = pipelines
    engine, lib = llama.engine, llama.engine._lib
    ids = list(range(300, 340))
    request = EngineRequest("timed", Prompt(ids, [False] * len(ids)), image=None, image_key=-1)
    before = "".join(engine.stream(request, max_new_tokens=8))
    for threads in (None, engine.batch_threads):
        seconds = engine.time_token_step(request, 3, threads)
        assert len(seconds) == 3 and all(second > 0 for second in seconds)
    assert lib.llama_n_threads(engine.ctx) == engine.token_threads
    assert lib.llama_n_threads_batch(engine.ctx) == engine.batch_threads
    assert not any(slot.busy for slot in engine._slots)
    assert any(slot.cached == ids for slot in engine._slots)
    assert "".join(engine.stream(request, max_new_tokens=8)) == before
