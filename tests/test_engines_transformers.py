"""The transformers engine on the tiny Llama: its prefix cache, option scoring, the fused CPU step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from medvqa.config import load_settings
from medvqa.model import embed_prompt, merge_image_features
from medvqa.pipeline import Conversation, Done, Sources, Token
from medvqa.projector import PREFIX, Projector, ProjectorShapeError, map_llava_med_projector

from .conftest import prompt_gate, require_shared_data
from .threads import join_all


def _image(seed: int = 0, shape=(48, 40)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def test_the_kept_prefix_matches_its_cache_whether_the_answer_ended_or_was_cut(tiny_pipeline):
    """An answer that ends at its end-of-turn token has fed every token back, one cut at the length
    limit all but the last: the ids kept for prefix reuse must cover exactly what the cache holds."""
    engine = tiny_pipeline.engine

    def answer(eos_ids):
        saved, engine.stop_ids = engine.stop_ids, eos_ids
        try:
            conversation = Conversation(image=_image(21))
            done = list(tiny_pipeline.ask(conversation, "What is shown?", max_new_tokens=4, constrained=False,
                                          warm=False))[-1]
        finally:
            engine.stop_ids = saved
        state = tiny_pipeline.engine.prefixes.get(conversation.id)
        tiny_pipeline.end_conversation(conversation)
        return state, state.ids[done.timings["prompt_tokens"]:]

    cut, generated = answer(set())  # no end token: cut at 4 tokens, the last one never fed back
    assert len(generated) == 3 and len(cut.ids) == cut.cache.get_seq_length()
    ended, kept = answer({generated[1]})  # ends where the second token was: the first was fed back
    assert kept == generated[:1] and len(ended.ids) == ended.cache.get_seq_length()


def test_option_scores_are_the_mean_log_probability_of_the_whole_answer(tiny_pipeline):
    """An option is scored with its end-of-turn marker: "Right" is a complete answer, not the start
    of "Right kidney"."""
    image = _image(4)
    prompt = tiny_pipeline.prompts.build("Which is bigger, liver or right kidney?")
    forms = ["Liver", "Right kidney"]
    scores = tiny_pipeline.option_scores(image, prompt, forms)
    decoder = tiny_pipeline.engine.language_model
    for form, score in zip(forms, scores):
        ids = tiny_pipeline.prompts.answer_ids(form)
        assert ids[-1] == decoder.tokenizer.eos_token_id
        embeds = embed_prompt(decoder.embed, prompt.token_ids + ids, prompt.image_mask + [False] * len(ids),
                              lambda: tiny_pipeline.model.image_tokens(image))
        with torch.no_grad():
            log_probs = torch.log_softmax(decoder.forward(embeds).logits[0].float(), -1)
        start = len(prompt.token_ids) - 1  # the logits that predict the answer's first token
        expected = np.mean([log_probs[start + i, token].item() for i, token in enumerate(ids)])
        assert score == pytest.approx(expected, abs=1e-4)


def _transformers_prefill(decoder, embeds, cache, length):
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=decoder.model.config)
    positions = torch.arange(length, length + embeds.shape[1]).unsqueeze(0)
    with torch.no_grad():
        out = decoder.model(inputs_embeds=embeds, cache=cache, position_ids=positions, use_cache=True)
    return out.logits[:, -1].float(), out.cache


def test_fast_decode_step_matches_the_transformers_forward(tiny_pipeline):
    """The fused step (engines/cpu_fast.py) gives the full forward's logits and cache, for a prompt, for
    several tokens after a cache (the next question) and for one token at a time."""
    engine, decoder = tiny_pipeline.engine, tiny_pipeline.engine.language_model
    assert engine.fast_step is not None  # the tiny Llama on CPU takes the fast path
    prompt = decoder.embed([5, 9, 14, 3, 22, 7])
    logits, cache = engine.forward_embeds(prompt)
    expected, reference = _transformers_prefill(decoder, prompt, None, 0)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    length = prompt.shape[1]
    for tokens in ([11, 4, 30], [2], [8], [17, 6]):
        fast = engine.fast_step(decoder.embed(tokens), cache, length)
        slow, reference = _transformers_prefill(decoder, decoder.embed(tokens), reference, length)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)
        length += len(tokens)
    for ours, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-4)


def test_fast_decode_keeps_the_answers_and_the_weights(tiny_pipeline):
    engine, decoder = tiny_pipeline.engine, tiny_pipeline.engine.language_model
    attention = decoder.model.model.layers[0].self_attn
    fused = engine.fast_step.layers[0].qkv
    assert attention.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # views
    prompt = decoder.embed(list(range(3, 15)))
    fast = "".join(engine.generate(prompt, max_new_tokens=12, ignore_eos=True))
    step, engine.fast_step = engine.fast_step, None
    try:
        slow = "".join(engine.generate(prompt, max_new_tokens=12, ignore_eos=True))
    finally:
        engine.fast_step = step
    assert fast == slow


def test_batched_step_gives_each_conversation_its_own_step(tiny_pipeline):
    """One batched step over conversations with caches of different lengths (cpu_fast.batch) equals
    each conversation's one-token step alone: logits and the caches they leave."""
    import copy

    engine, decoder = tiny_pipeline.engine, tiny_pipeline.engine.language_model
    prompts = [list(range(3, 3 + length)) for length in (4, 11, 7)]
    caches = [engine.forward_embeds(decoder.embed(ids))[1] for ids in prompts]
    alone_caches = [copy.deepcopy(cache) for cache in caches]
    tokens, positions = [21, 8, 40], [len(ids) for ids in prompts]
    alone = torch.cat([engine.fast_step(decoder.embed([token]), cache, position)
                       for token, cache, position in zip(tokens, alone_caches, positions)])
    batched = engine.fast_step.batch(decoder.embed(tokens)[0], caches, positions)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)
    for ours, theirs in zip(caches, alone_caches):
        assert ours.get_seq_length() == theirs.get_seq_length()
        for mine, reference in zip(ours.layers, theirs.layers):
            torch.testing.assert_close(mine.keys, reference.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, reference.values, atol=1e-5, rtol=1e-4)


def test_concurrent_answers_share_steps_and_keep_their_tokens(tiny_pipeline):
    """Answers generated at the same time are batched (torch_steps.py) and each is, token for token,
    the answer it gets alone (greedy); an option scoring and a warming in between change nothing."""
    import threading

    engine, decoder = tiny_pipeline.engine, tiny_pipeline.engine.language_model
    assert engine.batcher is not None  # decoder.batch_decode "auto" on CPU
    prompts = [decoder.embed(list(range(start, start + 5 + start % 7))) for start in (3, 17, 40, 61)]

    def answer(prompt, out=None, index=0):
        generated = []
        text = "".join(engine.generate(prompt, max_new_tokens=16, ignore_eos=True, generated=generated))
        if out is not None:
            out[index] = (text, generated)
        return text, generated

    alone = [answer(prompt) for prompt in prompts]
    before = engine.batcher.batches
    together: list = [None] * len(prompts)
    threads = [threading.Thread(target=answer, args=(prompt, together, index), daemon=True)
               for index, prompt in enumerate(prompts)]
    for thread in threads:
        thread.start()
    scored = tiny_pipeline.option_scores(_image(905), tiny_pipeline.prompts.build("Is it normal?"), ["Yes", "No"])
    join_all(threads, timeout=60)
    assert together == alone
    assert engine.batcher.batches > before  # some steps carried several answers
    assert len(scored) == 2 and all(np.isfinite(scored))


def test_concurrent_conversations_through_the_pipeline_are_answered_as_alone(tiny_pipeline):
    """Four conversations asking at once through the pipeline (its turn given up while an answer
    waits for the batcher) get the answers they get one at a time."""
    import threading

    def ask(index, out):
        conversation = Conversation(image=_image(930 + index))
        events = list(tiny_pipeline.ask(conversation, f"What is shown in view {index}?", max_new_tokens=10,
                                        constrained=False, warm=False))
        out[index] = "".join(event.text for event in events if isinstance(event, Token))
        tiny_pipeline.end_conversation(conversation)

    alone: dict = {}
    for index in range(4):
        ask(index, alone)
    together: dict = {}
    threads = [threading.Thread(target=ask, args=(index, together), daemon=True) for index in range(4)]
    for thread in threads:
        thread.start()
    join_all(threads, timeout=120)
    assert together == alone and all(alone.values())


def test_batch_decode_setting(tiny_settings):
    """decoder.batch_decode "off" keeps the engine on the caller's thread, one step at a time."""
    import dataclasses

    from medvqa.engines.transformers import batch_decode_on
    from medvqa.pipeline import Pipeline

    assert batch_decode_on("on", "cpu") and not batch_decode_on("off", "cuda") and batch_decode_on("auto", "cuda")
    settings = dataclasses.replace(tiny_settings, decoder=dataclasses.replace(tiny_settings.decoder, batch_decode="off"))
    pipeline = Pipeline.load(settings, with_retrieval=False)
    assert pipeline.engine.batcher is None
    conversation = Conversation(image=_image(902))
    events = list(pipeline.ask(conversation, "What is shown?", max_new_tokens=4, constrained=False, warm=False))
    assert isinstance(events[-1], Done)
