"""Core model on the tiny profile (random CLIP ViT + random Llama): the real code paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from medvqa.config import load_settings
from medvqa.pipeline import Conversation, Done, Sources, Token
from medvqa.projector import PREFIX, Projector, ProjectorShapeError, map_llava_med_projector
from medvqa.prompt import merge_image_features

from .conftest import prompt_gate, require_shared_data


def _image(seed: int = 0, shape=(48, 40)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def test_only_projector_is_trainable(tiny_pipeline):
    trainable = {name for name, p in tiny_pipeline.vision.named_parameters() if p.requires_grad}
    trainable |= {name for name, p in tiny_pipeline.decoder.named_parameters() if p.requires_grad}
    assert trainable == set()
    assert all(p.requires_grad for p in tiny_pipeline.projector.parameters())
    tiny_pipeline.vision.train()
    tiny_pipeline.decoder.train()
    assert not tiny_pipeline.vision.training and not tiny_pipeline.decoder.model.training


def test_vision_drops_cls_and_uses_penultimate_layer(tiny_pipeline):
    vision = tiny_pipeline.vision
    pixels = vision.preprocess([_image()])
    features = vision.encode(pixels)
    assert features.shape == (1, 16, 32)  # 32x32 input, 8x8 patches, CLS dropped
    with torch.no_grad():
        hidden = vision.tower(pixel_values=pixels, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, hidden[-2][:, 1:])


def test_image_tokens_land_at_placeholder(tiny_pipeline):
    prompt = tiny_pipeline.prompts.build("Is there an effusion?")
    n = tiny_pipeline.vision.num_tokens
    assert sum(prompt.image_mask) == n
    start = prompt.image_mask.index(True)
    assert prompt.image_mask[start:start + n] == [True] * n  # contiguous
    embeds = tiny_pipeline._prompt_embeddings(_image(), prompt.token_ids, prompt.image_mask)
    image_tokens = tiny_pipeline.image_tokens(_image())
    torch.testing.assert_close(embeds[0, start:start + n], image_tokens[0])
    text = tiny_pipeline.decoder.embed(prompt.token_ids)
    torch.testing.assert_close(embeds[0, :start], text[0, :start])
    torch.testing.assert_close(embeds[0, start + n:], text[0, start + n:])


def test_image_token_count_mismatch_is_refused():
    text = torch.zeros(1, 10, 4)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 2:5] = True
    with pytest.raises(ValueError, match="3.*image positions.*4 tokens"):
        merge_image_features(text, mask, torch.ones(1, 4, 4))


def test_projector_save_load_round_trip_is_exact(tmp_path):
    projector = Projector(32, 24, 48)
    path = tmp_path / "projector.safetensors"
    projector.save(path)
    other = Projector(32, 24, 48).load(path)
    for name, tensor in projector.state_dict().items():
        assert torch.equal(tensor, other.state_dict()[name])


def test_wrong_shape_projector_file_fails_clearly(tmp_path):
    path = tmp_path / "projector.safetensors"
    Projector(32, 16, 48).save(path)
    with pytest.raises(ProjectorShapeError, match=r"linear_1\.(weight|bias) has shape \(16.*expected \(24"):
        Projector(32, 24, 48).load(path)


def test_llava_med_projector_keys_map_to_ours(tmp_path):
    """A tiny checkpoint in LLaVA-Med's layout (model.mm_projector.0/.2) loads into our projector."""
    from medvqa.projector import convert_llava_med_projector

    torch.manual_seed(0)
    theirs = {"model.mm_projector.0.weight": torch.randn(24, 32), "model.mm_projector.0.bias": torch.randn(24),
              "model.mm_projector.2.weight": torch.randn(48, 24), "model.mm_projector.2.bias": torch.randn(48),
              "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4)}
    shard = tmp_path / "model-00001-of-00001.safetensors"
    save_file(theirs, str(shard))
    ours = convert_llava_med_projector([shard], tmp_path / "projector.safetensors")
    projector = Projector(32, 24, 48).load(ours)
    assert torch.equal(projector.linear_1.weight, theirs["model.mm_projector.0.weight"])
    assert torch.equal(projector.linear_2.bias, theirs["model.mm_projector.2.bias"])
    assert set(map_llava_med_projector(theirs)) == {PREFIX + k for k in projector.state_dict()}


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
    calls = tiny_pipeline.encoder_calls
    list(tiny_pipeline.ask(conversation, "Is there an effusion?", max_new_tokens=6, constrained=False))
    second = list(tiny_pipeline.ask(conversation, "Which side?", max_new_tokens=6))[-1]
    assert tiny_pipeline.encoder_calls == calls + 1  # the image was encoded once
    assert second.timings["reused_tokens"] > tiny_pipeline.vision.num_tokens
    fresh = Conversation(image=image, window=conversation.window, history=conversation.history[:1])
    again = list(tiny_pipeline.ask(fresh, "Which side?", max_new_tokens=6))[-1]
    assert again.timings["reused_tokens"] == 0
    assert again.answer == second.answer


def test_the_kept_prefix_matches_its_cache_whether_the_answer_ended_or_was_cut(tiny_pipeline):
    """An answer that ends at its end-of-turn token has fed every token back, one cut at the length
    limit all but the last: the ids kept for prefix reuse must cover exactly what the cache holds."""
    decoder = tiny_pipeline.decoder

    def answer(eos_ids):
        saved, decoder.eos_ids = decoder.eos_ids, eos_ids
        try:
            conversation = Conversation(image=_image(21))
            done = list(tiny_pipeline.ask(conversation, "What is shown?", max_new_tokens=4, constrained=False,
                                          warm=False))[-1]
        finally:
            decoder.eos_ids = saved
        state = tiny_pipeline.prefix_cache.get(conversation.id)
        tiny_pipeline.end_conversation(conversation)
        return state, state.ids[done.timings["prompt_tokens"]:]

    cut, generated = answer(set())  # no end token: cut at 4 tokens, the last one never fed back
    assert len(generated) == 3 and len(cut.ids) == cut.cache.get_seq_length()
    ended, kept = answer({generated[1]})  # ends where the second token was: the first was fed back
    assert kept == generated[:1] and len(ended.ids) == ended.cache.get_seq_length()


def test_warming_leaves_only_the_next_question_to_prefill(tiny_pipeline):
    """After an answer the pipeline caches the start of the next turn; the next answer is unchanged
    and its prefill covers little more than the question's own tokens."""
    rest = tiny_pipeline.prompts.build("Which side is it on?").text.split("Question:")[-1]  # question + template tail
    question_tokens = len(tiny_pipeline.decoder.tokenizer(rest, add_special_tokens=False)["input_ids"])
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
    question_tokens = len(tiny_pipeline.decoder.tokenizer(rest, add_special_tokens=False)["input_ids"])
    turns = []
    for warm in (True, False):
        conversation = Conversation(image=_image(12))
        if warm:
            assert tiny_pipeline.warm_next_turn(conversation) > tiny_pipeline.vision.num_tokens
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
                assert tiny_pipeline.warm_next_turn(conversation, draft) > tiny_pipeline.vision.num_tokens
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
    from medvqa.pipeline import image_digest

    for keep in (True, False):
        image = _image(15 + keep)
        conversation = Conversation(image=image)
        list(tiny_pipeline.ask(conversation, "Describe it.", max_new_tokens=2, constrained=False, warm=False))
        assert tiny_pipeline.image_token_cache.get(image_digest(image)) is not None
        tiny_pipeline.end_conversation(conversation, keep_image=keep)
        assert (tiny_pipeline.image_token_cache.get(image_digest(image)) is not None) == keep


def test_changing_the_window_reencodes(tiny_pipeline):
    calls = tiny_pipeline.encoder_calls
    image = _image(5)
    tiny_pipeline.image_tokens(image)
    tiny_pipeline.image_tokens(image)
    tiny_pipeline.image_tokens(np.clip(image.astype(int) + 10, 0, 255).astype(np.uint8))
    assert tiny_pipeline.encoder_calls == calls + 2


def test_constrained_answer_is_one_of_the_candidates(tiny_pipeline):
    answer, _ = tiny_pipeline.answer(_image(), "Is the heart enlarged?", use_retrieval=False, constrained=True)
    assert answer in ("Yes", "No")
    answer, _ = tiny_pipeline.answer(_image(), "Is the lesion on the left or the right?", use_retrieval=False,
                                     constrained=True)
    assert answer in ("Left", "Right")


def test_option_scores_are_the_mean_log_probability_of_the_whole_answer(tiny_pipeline):
    """An option is scored with its end-of-turn marker: "Right" is a complete answer, not the start
    of "Right kidney"."""
    from medvqa.decoder import answer_ids

    image = _image(4)
    prompt = tiny_pipeline.prompts.build("Which is bigger, liver or right kidney?")
    forms = ["Liver", "Right kidney"]
    scores = tiny_pipeline.option_scores(image, prompt, forms)
    decoder = tiny_pipeline.decoder
    for form, score in zip(forms, scores):
        ids = answer_ids(decoder.tokenizer, form)
        assert ids[-1] == decoder.tokenizer.eos_token_id
        embeds = tiny_pipeline._prompt_embeddings(image, prompt.token_ids + ids, prompt.image_mask + [False] * len(ids))
        with torch.no_grad():
            log_probs = torch.log_softmax(decoder.forward(embeds).logits[0].float(), -1)
        start = len(prompt.token_ids) - 1  # the logits that predict the answer's first token
        expected = np.mean([log_probs[start + i, token].item() for i, token in enumerate(ids)])
        assert score == pytest.approx(expected, abs=1e-4)


def test_contrast_subtracts_the_blank_image_scores(tiny_pipeline):
    from medvqa.pipeline import BLANK_DIGEST, BLANK_IMAGE

    image = _image(6)
    prompt = tiny_pipeline.prompts.build("Is the lesion on the left or right side of the brain?")
    options = ["Left", "Right"]
    real = np.asarray(tiny_pipeline.option_scores(image, prompt, options))
    blank = np.asarray(tiny_pipeline.option_scores(BLANK_IMAGE, prompt, options, BLANK_DIGEST))
    for contrast in (0.0, 0.5, 1.0, 3.0):
        expected = options[int(np.argmax(real - contrast * blank))]
        assert tiny_pipeline.choose_closed(image, prompt, options, contrast=contrast) == expected
    # A contrast large enough answers against the blank image's preference.
    assert tiny_pipeline.choose_closed(image, prompt, options, contrast=1e6) == options[int(np.argmin(blank))]


def _transformers_prefill(decoder, embeds, cache, length):
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=decoder.model.config)
    positions = torch.arange(length, length + embeds.shape[1]).unsqueeze(0)
    with torch.no_grad():
        out = decoder.model(inputs_embeds=embeds, cache=cache, position_ids=positions, use_cache=True)
    return out.logits[:, -1].float(), out.cache


def test_fast_decode_step_matches_the_transformers_forward(tiny_pipeline):
    """The fused step (fast_decode.py) gives the full forward's logits and cache, for a prompt, for
    several tokens after a cache (the next question) and for one token at a time."""
    decoder = tiny_pipeline.decoder
    assert decoder.fast_step is not None  # the tiny Llama on CPU takes the fast path
    prompt = decoder.embed([5, 9, 14, 3, 22, 7])
    logits, cache = decoder.prefill(prompt)
    expected, reference = _transformers_prefill(decoder, prompt, None, 0)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    length = prompt.shape[1]
    for tokens in ([11, 4, 30], [2], [8], [17, 6]):
        fast = decoder.fast_step(decoder.embed(tokens), cache, length)
        slow, reference = _transformers_prefill(decoder, decoder.embed(tokens), reference, length)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)
        length += len(tokens)
    for ours, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-4)


def test_fast_decode_keeps_the_answers_and_the_weights(tiny_pipeline):
    decoder = tiny_pipeline.decoder
    attention = decoder.model.model.layers[0].self_attn
    fused = decoder.fast_step.layers[0].qkv
    assert attention.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # views
    prompt = decoder.embed(list(range(3, 15)))
    fast = "".join(decoder.stream(prompt, max_new_tokens=12, ignore_eos=True))
    step, decoder.fast_step = decoder.fast_step, None
    try:
        slow = "".join(decoder.stream(prompt, max_new_tokens=12, ignore_eos=True))
    finally:
        decoder.fast_step = step
    assert fast == slow


def test_context_budget_drops_old_turns_not_the_question(tiny_pipeline):
    from medvqa.prompt import Turn

    builder = tiny_pipeline.prompts
    history = [Turn("What is shown? " * 30, "An image. " * 30) for _ in range(10)]
    prompt = builder.build("Is there an effusion?", history)
    assert prompt.dropped_turns > 0
    assert len(prompt) <= builder.context_window - builder.reserve_for_answer
    assert sum(prompt.image_mask) == tiny_pipeline.vision.num_tokens  # the image survives
    assert "Is there an effusion?" in prompt.text
    with pytest.raises(ValueError, match="too long"):
        builder.build("why " * 5000)


def test_export_matches_our_logits(tiny_pipeline, tmp_path):
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    from medvqa.export import export_llava

    folder = export_llava(tiny_pipeline, tmp_path / "llava")
    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    processor = LlavaProcessor.from_pretrained(folder)
    image = _image(7, shape=(32, 32))
    prompt = tiny_pipeline.prompts.build("Is there an effusion?")
    ours_embeds = tiny_pipeline._prompt_embeddings(image, prompt.token_ids, prompt.image_mask)
    with torch.no_grad():
        ours = tiny_pipeline.decoder(ours_embeds).logits
        ids = torch.tensor([[model.config.image_token_index if m else t
                             for t, m in zip(prompt.token_ids, prompt.image_mask)]])
        pixels = tiny_pipeline.vision.preprocess([image])
        theirs = model(input_ids=ids, pixel_values=pixels).logits
        # The exported processor turns the same square image into the same pixel values.
        processed = processor.image_processor(images=image, return_tensors="pt")["pixel_values"]
    vocab = ours.shape[-1]
    torch.testing.assert_close(theirs[..., :vocab], ours, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(processed, pixels, atol=2e-2, rtol=0)


def test_offline_profile_export_says_why_not():
    from medvqa.export import ExportError, export_llava

    class FakePipeline:  # only the encoder type matters for this refusal
        class settings:
            profile = "offline"
        vision = object()
        decoder = projector = None

    with pytest.raises(ExportError, match="no Hugging Face LLaVA form"):
        export_llava(FakePipeline(), "/nonexistent")


def test_settings_overrides_from_file_and_environment(tmp_path):
    config = tmp_path / "medvqa.json"
    config.write_text('{"decoder": {"max_new_tokens": 7}, "retrieval": {"top_k": 5}}')
    settings = load_settings("offline", config_file=config,
                             env={"MEDVQA_DECODER__TEMPERATURE": "0.5", "MEDVQA_RETRIEVAL__ENABLED": "false"})
    assert settings.decoder.max_new_tokens == 7 and settings.retrieval.top_k == 5
    assert settings.decoder.temperature == 0.5 and settings.retrieval.enabled is False
    with pytest.raises(ValueError, match="Unknown setting"):
        load_settings("offline", env={"MEDVQA_DECODER__NOPE": "1"})
    with pytest.raises(ValueError, match="Unknown profile"):
        load_settings("huge", env={})


def test_missing_model_gives_one_clear_message(tmp_path):
    from medvqa.decoder import Decoder, ModelMissingError

    settings = load_settings("llava-med", env={"MEDVQA_CACHE": str(tmp_path)})
    with pytest.raises(ModelMissingError, match="llava-med.*not available locally"):
        Decoder.load(settings.decoder, torch.device("cpu"), torch.float32, tmp_path, offline=True,
                     profile="llava-med")


def test_offline_profile_answers_a_real_image():
    data = require_shared_data()
    from medvqa.imaging import load_scan
    from medvqa.pipeline import Pipeline

    settings = load_settings("offline")
    pipeline = Pipeline.load(settings, with_retrieval=False)
    assert pipeline.vision.hidden_size == 1280 and pipeline.decoder.hidden_size == 576
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
    from medvqa.pipeline import image_digest

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


def test_projector_trained_on_other_token_count_is_refused(tiny_settings, tmp_path):
    import copy

    from medvqa.pipeline import build_projector

    path = tmp_path / "projector.safetensors"
    Projector(32, 24, 48).save(path, metadata={"image_tokens": 49})
    settings = copy.deepcopy(tiny_settings)
    settings.projector.weights = str(path)
    with pytest.raises(ProjectorShapeError, match="trained on 49 image tokens.*gives 16"):
        build_projector(settings, 32, 48, image_tokens=16)
    assert build_projector(settings, 32, 48, image_tokens=49) is not None


def test_the_projector_file_says_where_the_prompt_puts_the_image(tiny_pipeline, tiny_settings, tmp_path):
    import copy

    from medvqa.pipeline import Pipeline, build_projector

    path = tmp_path / "projector.safetensors"
    tiny_pipeline.projector.save(path, metadata={"image_position": "after"})
    settings = copy.deepcopy(tiny_settings)
    settings.projector.weights = str(path)  # settings say "before"; the file's own record wins
    projector = build_projector(settings, tiny_pipeline.vision.hidden_size, tiny_pipeline.decoder.hidden_size)
    assert projector.image_position == "after"
    pipeline = Pipeline(settings, tiny_pipeline.vision, projector, tiny_pipeline.decoder)
    prompt = pipeline.prompts.build("Is there an effusion?")
    assert prompt.text.index("Is there an effusion?") < prompt.text.index("<image>")
    answer, _ = pipeline.answer(_image(), "Is there an effusion?", use_retrieval=False, constrained=True)
    assert answer in ("Yes", "No")
    # A second turn keeps the image where the first turn put it.
    conversation = Conversation(image=_image())
    list(pipeline.ask(conversation, "Is there an effusion?", use_retrieval=False, max_new_tokens=4))
    second = pipeline.prompts.build("Which side?", conversation.history)
    assert sum(second.image_mask) == tiny_pipeline.vision.num_tokens
    assert second.text.index("Is there an effusion?") < second.text.index("<image>") < second.text.index("Which side?")
