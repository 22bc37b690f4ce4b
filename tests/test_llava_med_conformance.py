"""The `llava-med` profile against microsoft/LLaVA-Med's reference implementation, on tiny random
models of its architectures (profile `tiny-llava-med`: CLIP ViT + Mistral with the
Mistral-7B-Instruct-v0.2 chat template). Each test pins one point of the reference:

1. prompts: `--conv-mode mistral_instruct` (llava/conversation.py) rendered and tokenised as
   `tokenizer_image_token` does (llava/mm_utils.py), never through the tokenizer's template; the
   profile's defaults as llava/eval/model_vqa.py (that prompt sent with retrieval on, closed questions
   generated, 1024 new tokens, fp16 on a GPU, `<image>` removed from the question);
2. closed options, when scoring is turned on, scored without an end-of-turn token (LLaVA-Med answers
   in sentences);
3. pad to square with the CLIP mean (`image_aspect_ratio: "pad"`, expand2square);
4. an export servers load and that serves as the reference (fp16, mean-colour padding in its
   processor, one chat template on processor and tokenizer, `<image>` never generated, no
   training-only keys, the image token added where the tokenizer lacks it);
5. MedCPT retrieval (query length 64, whole [title, text] articles, inner product, its
   cross-encoder): test_retrieval_medcpt.py;
6. 4-bit loading as the reference builder (NF4, double quantisation, fp16 compute);
7. a 2048-token context.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from medvqa.config import load_settings
from medvqa.model import embed_prompt
from medvqa.pipeline import Conversation, Done, Pipeline
from medvqa.prompt import FORMATS, PromptBuilder, Turn

from .conftest import REPO
from .test_retrieval_medcpt import medcpt  # noqa: F401  (the tiny MedCPT index, a fixture)

QUESTION = "Is there a pleural effusion?"


@pytest.fixture(scope="module")
def llava_settings(tiny_cache):
    settings = load_settings("tiny-llava-med", env={"MEDVQA_CACHE": str(tiny_cache)})
    settings.retrieval.enabled = False
    return settings


@pytest.fixture(scope="module")
def llava_pipeline(llava_settings):
    return Pipeline.load(llava_settings, with_retrieval=False)


def _image(seed: int, shape=(40, 30)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def reference_token_ids(prompt_text: str, tokenizer, n_image_tokens: int) -> list[int]:
    """What LLaVA-Med's tokenizer_image_token gives, image positions expanded to n_image_tokens
    fillers (-1): every piece between <image> tokenised on its own with the tokenizer's special tokens,
    the BOS kept from the first piece only."""
    pieces = [tokenizer(piece).input_ids for piece in prompt_text.split("<image>")]
    ids = [pieces[0][0]] if pieces[0] and pieces[0][0] == tokenizer.bos_token_id else []
    skip = len(ids)
    for index, piece in enumerate(pieces):
        if index:
            ids += [-1] * n_image_tokens
        ids += piece[skip:]
    return ids


# --- 1. the conversation format -------------------------------------------------------------------

def test_one_turn_is_the_reference_prompt_character_for_character(llava_pipeline):
    prompt = llava_pipeline.prompts.build(QUESTION)
    assert prompt.text == f"[INST] <image>\n{QUESTION} [/INST]"


def test_later_turns_follow_the_llama_2_separator_style(llava_pipeline):
    history = [Turn("Is there a pleural effusion?", "Yes, a small one on the left."), Turn("How large?", "Small.")]
    prompt = llava_pipeline.prompts.build("Which side?", history)
    assert prompt.text == ("[INST] <image>\nIs there a pleural effusion? [/INST] Yes, a small one on the left. </s>"
                           "[INST] How large? [/INST] Small. </s>[INST] Which side? [/INST]")
    assert prompt.text.count("<image>") == 1  # the image in the first turn only


def test_tokens_match_tokenizer_image_token_with_one_bos(llava_pipeline):
    tokenizer = llava_pipeline.engine.tokenizer
    n = llava_pipeline.model.num_image_tokens
    for history in ([], [Turn("Is there a pleural effusion?", "Yes."), Turn("How large?", "Small.")]):
        prompt = llava_pipeline.prompts.build("Which side?", history)
        ours = [-1 if masked else token for token, masked in zip(prompt.token_ids, prompt.image_mask)]
        assert ours == reference_token_ids(prompt.text, tokenizer, n)
        assert ours[0] == tokenizer.bos_token_id and ours.count(tokenizer.bos_token_id) == 1


def test_the_tokenizer_template_is_never_used(llava_pipeline):
    """Mistral-7B-Instruct-v0.2's template raises on a system role; the format does not go through it."""
    tokenizer = llava_pipeline.engine.tokenizer
    with pytest.raises(Exception, match="roles"):
        tokenizer.apply_chat_template([{"role": "system", "content": "rules"}, {"role": "user", "content": "q"}],
                                      tokenize=False)
    assert llava_pipeline.prompts.build(QUESTION).messages[0]["role"] == "user"  # no system message


def test_passages_go_after_the_question_and_only_add_to_the_reference(llava_pipeline):
    class Passage:
        text = "Pleural effusion is fluid in the pleural space."

    prompt = llava_pipeline.prompts.build(QUESTION, passages=[Passage()])
    assert prompt.text.startswith(f"[INST] <image>\n{QUESTION}\n")
    assert prompt.text.endswith("<source id=1>Pleural effusion is fluid in the pleural space.</source> [/INST]")


def test_the_prompt_command_prints_the_reference_prompt():
    env = {key: value for key, value in os.environ.items() if key != "MEDVQA_PROFILE"}
    completed = subprocess.run([sys.executable, "-m", "medvqa", "prompt", "--profile", "llava-med", QUESTION],
                               capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == f"[INST] <image>\n{QUESTION} [/INST]\n"


# --- reference mode: the profile's defaults ---------------------------------------------------------

def test_the_profile_defaults_are_the_references():
    """model_vqa.py: no passages in the prompt, every question generated (closed ones too), 1024 new
    tokens, fp16 on a GPU (builder.py loads in float16)."""
    from medvqa.device import pick_dtype

    for profile in ("llava-med", "tiny-llava-med"):
        settings = load_settings(profile, env={})
        assert settings.retrieval.prompt_gate == "never" and settings.decoder.constrained_closed is False
        assert settings.dtype == "float16_on_gpu" and settings.decoder.temperature == 0.0
    assert load_settings("llava-med", env={}).decoder.max_new_tokens == 1024
    # Greedy: top_p is read only when sampling, and is then the reference's 1.0 (model_vqa.py passes --top_p None).
    assert load_settings("llava-med", env={}).decoder.top_p == 1.0
    # builder.py's vision tower: CLIP ViT-L/14 at 336 px, mm_vision_select_layer -2, patches only ("patch"),
    # images padded to a square with the processor's mean (image_aspect_ratio "pad").
    vision = load_settings("llava-med", env={}).vision
    assert (vision.kind, vision.name_or_path, vision.image_size) == ("clip", "openai/clip-vit-large-patch14-336", 336)
    assert vision.feature_layer == -2 and vision.pad == "mean" and vision.pooled_tokens == 0
    assert load_settings("tiny-llava-med", env={}).vision.feature_layer == -2
    for device in ("cuda", "mps"):
        assert pick_dtype(torch.device(device), "float16_on_gpu") == torch.float16
    assert pick_dtype(torch.device("cpu"), "float16_on_gpu") == torch.float32  # no fp16 matmuls on a CPU
    assert load_settings("offline", env={}).decoder.constrained_closed is True  # the offline profile keeps its own


def test_the_app_sends_the_reference_prompt_with_retrieval_on(llava_pipeline, llava_settings, medcpt, monkeypatch):
    """With the profile's defaults and retrieval on (MedCPT with its cross-encoder, on tiny BERTs), the
    engine receives exactly the reference prompt; a closed question is generated greedily, not scored,
    and its confidence is said to be not measured."""
    from dataclasses import replace

    from medvqa.retrieval import Retriever

    settings = copy.deepcopy(llava_settings)
    settings.retrieval = replace(medcpt[0], enabled=True)
    pipeline = Pipeline(settings, llava_pipeline.engine, llava_pipeline.model, Retriever.open(settings.retrieval))
    engine, sent = pipeline.engine, []
    stream = engine.stream

    def recording_stream(request, **options):
        sent.append((request.prompt, options))
        return stream(request, **options)

    def no_scoring(*args, **kwargs):
        raise AssertionError("options were scored")

    monkeypatch.setattr(engine, "stream", recording_stream)
    monkeypatch.setattr(engine, "score_options", no_scoring)
    image = _image(6)
    events = list(pipeline.ask(Conversation(image=image), QUESTION, warm=False))
    ((prompt, options),) = sent
    assert prompt.text == f"[INST] <image>\n{QUESTION} [/INST]"
    ours = [-1 if masked else token for token, masked in zip(prompt.token_ids, prompt.image_mask)]
    assert ours == reference_token_ids(prompt.text, engine.tokenizer, pipeline.model.num_image_tokens)
    done = events[-1]
    assert isinstance(done, Done) and done.passages and not done.in_prompt  # shown beside the answer
    assert done.closed is None and "not measured" in done.confidence_note
    # Greedy: the answer is the arg-max continuation, the same on every run.
    again = list(pipeline.ask(Conversation(image=image), QUESTION, warm=False))[-1]
    assert again.answer == done.answer and options.get("max_new_tokens") is None


def test_a_typed_image_token_never_adds_an_image_slot(llava_pipeline):
    """A literal <image> in the question, a passage or an earlier answer is removed, as the reference
    removes it from the question ("prompt has N image positions" never happens)."""
    class Passage:
        text = "See <image> here."

    history = [Turn("What <image> is this?", "A chest <image> radiograph.")]
    prompt = llava_pipeline.prompts.build("Is <image> there an effusion?", history, [Passage()])
    assert sum(prompt.image_mask) == llava_pipeline.model.num_image_tokens
    assert prompt.text.count("<image>") == 1
    answer = list(llava_pipeline.ask(Conversation(image=_image(7)), "Describe <image> the image.", use_retrieval=False,
                                     max_new_tokens=4, warm=False))[-1]
    assert isinstance(answer, Done)


def test_the_app_format_keeps_its_system_rules_and_question_line(tiny_pipeline):
    """The offline and tiny profiles keep the chat-template format their projectors were trained with."""
    prompt = tiny_pipeline.prompts.build(QUESTION)
    assert prompt.messages[0]["role"] == "system" and f"Question: {QUESTION}" in prompt.text


# --- 2. closed options ----------------------------------------------------------------------------

def test_closed_options_are_scored_without_an_end_of_turn_token(llava_pipeline, tiny_pipeline):
    tokenizer = llava_pipeline.engine.tokenizer
    assert llava_pipeline.prompts.answer_ids("Yes") == tokenizer("Yes", add_special_tokens=False)["input_ids"]
    assert tiny_pipeline.prompts.answer_ids("Yes")[-1] == tiny_pipeline.engine.tokenizer.eos_token_id
    # The score is the mean log-probability of the option's own tokens after the prompt.
    image = _image(1)
    prompt = llava_pipeline.prompts.build(QUESTION)
    scores = llava_pipeline.option_scores(image, prompt, ["Yes", "No"])
    decoder = llava_pipeline.engine.language_model
    for form, score in zip(["Yes", "No"], scores):
        ids = llava_pipeline.prompts.answer_ids(form)
        embeds = embed_prompt(decoder.embed, prompt.token_ids + ids, prompt.image_mask + [False] * len(ids),
                              lambda: llava_pipeline.model.image_tokens(image))
        with torch.no_grad():
            log_probs = torch.log_softmax(decoder.forward(embeds).logits[0].float(), -1)
        start = len(prompt.token_ids) - 1
        assert score == pytest.approx(np.mean([log_probs[start + i, t].item() for i, t in enumerate(ids)]), abs=1e-4)


# --- 3. pad to square ------------------------------------------------------------------------------

def test_images_are_padded_with_the_clip_mean_as_llava_pads_them(llava_pipeline):
    from PIL import Image
    from transformers import CLIPImageProcessor

    vision = llava_pipeline.model.vision
    assert vision.pad_fill == tuple(int(x * 255) for x in vision.mean) == (122, 116, 104)
    image = _image(2, shape=(40, 24))
    # The reference: expand2square with the mean colour (centred), then the CLIP processor.
    square = Image.new("RGB", (40, 40), vision.pad_fill)
    square.paste(Image.fromarray(image), ((40 - 24) // 2, 0))
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                   image_mean=list(vision.mean), image_std=list(vision.std), resample=3)
    expected = processor(images=square, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(vision.preprocess([image]), expected, atol=1e-5, rtol=0)
    corner = vision.preprocess([image])[0, :, 0, 0]  # padding, normalised: the mean maps to about 0
    assert float(corner.abs().max()) < 0.02


def test_the_openai_engine_pads_with_the_same_colour():
    from medvqa.vision import pad_fill_for, pad_to_square

    settings = load_settings("llava-med", env={})
    assert pad_fill_for(settings.vision) == (122, 116, 104)
    assert pad_fill_for(load_settings("offline", env={}).vision) == (0, 0, 0)
    padded = pad_to_square(np.zeros((4, 2, 3), np.uint8), (122, 116, 104))
    assert padded[0, 0].tolist() == [122, 116, 104] and padded[0, 1].tolist() == [0, 0, 0]


# --- 4. the export ---------------------------------------------------------------------------------

# LLaVA's training code writes these into a checkpoint's language config (llava/train/train.py); they
# mean nothing to a Hugging Face Mistral config.
TRAINING_KEYS = {"mm_vision_tower": "openai/clip-vit-large-patch14-336", "mm_hidden_size": 1024,
                 "mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -2, "mm_use_im_start_end": False,
                 "mm_use_im_patch_token": False, "mm_patch_merge_type": "flat", "mm_projector_lr": None,
                 "mm_vision_tower_lr": None, "image_aspect_ratio": "pad", "tokenizer_model_max_length": 2048,
                 "tokenizer_padding_side": "right", "tune_mm_mlp_adapter": False, "freeze_mm_mlp_adapter": False,
                 "unfreeze_mm_vision_tower": False, "use_mm_proj": True}


def test_the_export_is_one_servers_load(llava_pipeline, llava_settings, tmp_path):
    from jinja2 import Template
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlavaProcessor, MistralConfig

    from medvqa.hf_export import export_llava
    from medvqa.prompt import jinja_template

    decoder = copy.deepcopy(llava_pipeline.engine.language_model)
    for key, value in TRAINING_KEYS.items():  # as a LLaVA-Med checkpoint's language config carries them
        setattr(decoder.model.config, key, value)
    folder = export_llava(llava_pipeline.model, decoder, tmp_path / "export", "tiny-llava-med", "mistral_instruct")
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    assert text["architectures"] == ["MistralForCausalLM"] and text["model_type"] == "mistral"
    assert not set(text) & set(TRAINING_KEYS) and set(text) <= set(MistralConfig().to_dict()) | {"architectures"}
    (weights,) = folder.glob("*.safetensors")
    with safe_open(str(weights), "pt") as handle:  # fp16, as the reference's builder runs
        assert {handle.get_tensor(key).dtype for key in handle.keys()} == {torch.float16}
    # One chat template, the format's, on the processor and on the tokenizer.
    template = jinja_template(FORMATS["mistral_instruct"])
    assert LlavaProcessor.from_pretrained(folder).chat_template == template
    assert AutoTokenizer.from_pretrained(folder).chat_template == template
    rendered = Template(template).render(bos_token="<s>", messages=[
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}])
    assert rendered == "<s>" + llava_pipeline.prompts.build(QUESTION).text
    # A tokenizer class transformers 4 also has (a vLLM or SGLang install may pin it; "TokenizersBackend" is
    # transformers 5's alone), tokenising as the app's tokenizer does; no keys of how the folder was loaded.
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] != "TokenizersBackend"
    assert not {"is_local", "local_files_only"} & set(tokenizer_config)
    exported = AutoTokenizer.from_pretrained(folder)
    text = llava_pipeline.prompts.build(QUESTION).text
    assert exported(text).input_ids == llava_pipeline.engine.language_model.tokenizer(text).input_ids


def test_the_exported_processor_pads_a_non_square_image_as_the_app(llava_pipeline, tmp_path):
    """A client other than this app sends the image as it is: the exported processor pads it to a
    square with the CLIP mean (expand2square) and resizes, giving the app's pixel values; a
    centre crop (CLIP's own processor) would not."""
    from transformers import AutoProcessor, CLIPImageProcessor

    from medvqa.hf_export import export_llava

    folder = export_llava(llava_pipeline.model, llava_pipeline.engine.language_model, tmp_path / "export",
                          "tiny-llava-med", "mistral_instruct")
    vision = llava_pipeline.model.vision
    image = _image(8, shape=(40, 24))  # taller than wide
    exported = AutoProcessor.from_pretrained(folder).image_processor(images=image, return_tensors="pt")["pixel_values"]
    ours = vision.preprocess([image])
    torch.testing.assert_close(exported, ours, atol=1e-5, rtol=0)
    cropped = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                 image_mean=list(vision.mean), image_std=list(vision.std))(
        images=image, return_tensors="pt")["pixel_values"]
    assert float((cropped - ours).abs().max()) > 0.5


def _final_hidden_state(model, **inputs) -> torch.Tensor:
    """(d,) the input of the output head at the last position."""
    captured = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: captured.append(args[0][0, -1]))
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return captured[0]


def test_the_export_never_generates_the_image_token(llava_pipeline, tmp_path):
    from transformers import LlavaForConditionalGeneration

    from medvqa.hf_export import export_llava

    folder = export_llava(llava_pipeline.model, llava_pipeline.engine.language_model, tmp_path / "fp32",
                          "tiny-llava-med", "mistral_instruct", dtype=torch.float32)
    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    image_id = model.config.image_token_index
    assert model.generation_config.suppress_tokens == [image_id]
    prompt = llava_pipeline.prompts.build("Describe the image.")
    ids = torch.tensor([[image_id if m else t for t, m in zip(prompt.token_ids, prompt.image_mask)]])
    inputs = {"input_ids": ids, "pixel_values": llava_pipeline.model.vision.preprocess([_image(9, (32, 32))])}
    hidden = _final_hidden_state(model, **inputs)
    with torch.no_grad():  # make <image> by far the likeliest next token
        model.lm_head.weight[image_id] = 1e3 * hidden / hidden.norm() ** 2
        unguarded = model.generate(**inputs, max_new_tokens=1, do_sample=False, suppress_tokens=None,
                                   bad_words_ids=None)
        guarded = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert unguarded[0, -1].item() == image_id  # the test can fail
    assert image_id not in guarded[0, ids.shape[1]:].tolist()


def test_the_app_never_generates_the_image_token(llava_pipeline):
    """Nor does the app's own engine: a generated <image> would be an image slot in the next prompt."""
    from medvqa.engines.transformers import TransformersEngine

    language_model = copy.deepcopy(llava_pipeline.engine.language_model)
    image_id = language_model.tokenizer.convert_tokens_to_ids("<image>")
    prompt = llava_pipeline.prompts.build("Describe the image.")
    image = _image(11, shape=(32, 32))
    embeds = embed_prompt(language_model.embed, prompt.token_ids, prompt.image_mask,
                          lambda: llava_pipeline.model.image_tokens(image))
    hidden = _final_hidden_state(language_model.model, inputs_embeds=embeds)
    with torch.no_grad():  # make <image> by far the likeliest next token
        language_model.model.lm_head.weight[image_id] = 1e3 * hidden / hidden.norm() ** 2
        assert int(language_model(embeds).logits[0, -1].argmax()) == image_id  # the test can fail
    engine = TransformersEngine(language_model, llava_pipeline.settings.decoder)
    try:
        generated: list[int] = []
        for _ in engine.generate(embeds, max_new_tokens=3, generated=generated):
            pass
    finally:
        engine.close()
    assert generated and image_id not in generated


def test_the_export_adds_the_image_token_where_the_tokenizer_lacks_it(llava_pipeline, tmp_path):
    """LLaVA-Med's tokenizer has no <image> (the reference uses an id outside the vocabulary): the export
    adds it, grows the vocabulary by an inert row, and gives our logits on the original vocabulary."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration, MistralConfig, MistralForCausalLM

    from medvqa.config import DecoderConfig
    from medvqa.hf_export import export_llava
    from medvqa.language_model import LanguageModel
    from medvqa.tiny import build_mistral_tokenizer

    tokenizer = build_mistral_tokenizer(image_token=False)
    assert "<image>" not in tokenizer.get_vocab()
    vocab = len(tokenizer)
    width = llava_pipeline.engine.language_model.hidden_size
    torch.manual_seed(1)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id))
    decoder = LanguageModel(mistral, tokenizer, DecoderConfig())
    folder = export_llava(llava_pipeline.model, decoder, tmp_path / "added", "tiny-llava-med", "mistral_instruct",
                          dtype=torch.float32)
    assert "<image>" not in tokenizer.get_vocab()  # the app's tokenizer is not changed
    exported_tokenizer = AutoTokenizer.from_pretrained(folder)
    image_id = exported_tokenizer.convert_tokens_to_ids("<image>")
    assert image_id == vocab and "<image>" in exported_tokenizer.all_special_tokens
    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    assert model.config.image_token_index == image_id and model.config.text_config.vocab_size == vocab + 1
    assert model.generation_config.suppress_tokens == [image_id]
    # The same logits as our pipeline's on the original vocabulary, for a prompt with the image.
    builder = PromptBuilder(tokenizer, llava_pipeline.model.num_image_tokens, format=FORMATS["mistral_instruct"])
    prompt = builder.build(QUESTION)
    image = _image(10, shape=(32, 32))
    ours_embeds = embed_prompt(decoder.embed, prompt.token_ids, prompt.image_mask,
                               lambda: llava_pipeline.model.image_tokens(image))
    ids = torch.tensor([[image_id if m else t for t, m in zip(prompt.token_ids, prompt.image_mask)]])
    with torch.no_grad():
        ours = decoder(ours_embeds).logits
        theirs = model(input_ids=ids, pixel_values=llava_pipeline.model.vision.preprocess([image])).logits
    torch.testing.assert_close(theirs[..., :vocab], ours, atol=1e-4, rtol=1e-4)
    assert float(theirs[..., image_id].abs().max()) == 0.0  # an inert row, and suppressed above


def test_the_export_generates_what_the_pipeline_generates(llava_pipeline, tmp_path):
    from transformers import LlavaForConditionalGeneration

    from medvqa.hf_export import export_llava

    folder = export_llava(llava_pipeline.model, llava_pipeline.engine.language_model, tmp_path / "fp32",
                          "tiny-llava-med", "mistral_instruct", dtype=torch.float32)
    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    image = _image(3, shape=(32, 32))
    conversation = Conversation(image=image)
    ours = list(llava_pipeline.ask(conversation, "Describe the image.", use_retrieval=False, constrained=False,
                                   max_new_tokens=8, warm=False))[-1]
    assert isinstance(ours, Done)
    prompt = llava_pipeline.prompts.build("Describe the image.")
    ids = torch.tensor([[model.config.image_token_index if m else t
                         for t, m in zip(prompt.token_ids, prompt.image_mask)]])
    pixels = llava_pipeline.model.vision.preprocess([image])
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=8, do_sample=False,
                             eos_token_id=llava_pipeline.engine.tokenizer.eos_token_id)
    theirs = llava_pipeline.engine.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert theirs == ours.answer


# --- 6, 7 and the device -----------------------------------------------------------------------------

def test_4_bit_loading_is_the_references_nf4():
    from medvqa.language_model import quantization_config

    settings = load_settings("llava-med", env={})
    settings.decoder.load_in_4bit = True
    config = quantization_config(settings.decoder)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.float16


def test_the_prompt_may_use_the_checkpoints_2048_tokens_and_the_answer_1024_more():
    """The reference cuts its input at tokenizer_model_max_length (2048, llava_arch.py) and generates up to
    1024 tokens after it: the answer's tokens are not taken out of the prompt's."""
    from medvqa.prompt import PromptBuilder

    decoder = load_settings("llava-med", env={}).decoder
    builder = PromptBuilder(None, 576, decoder.context_window, reserve_for_answer=decoder.max_new_tokens)
    assert builder.context_window - builder.reserve_for_answer == 2048


def test_the_tiny_profile_reads_the_penultimate_layer_without_cls(llava_pipeline):
    """mm_vision_select_layer -2 and select_feature "patch" (clip_encoder.py), on the tiny CLIP."""
    vision = llava_pipeline.model.vision
    pixels = vision.preprocess([_image(3)])
    with torch.no_grad():
        hidden = vision.tower(pixel_values=pixels, output_hidden_states=True).hidden_states
    torch.testing.assert_close(vision.encode(pixels), hidden[-2][:, 1:])


def test_the_projector_is_mlp2x_gelu_with_the_exact_gelu(llava_pipeline):
    """multimodal_projector/builder.py: Linear, nn.GELU() (erf, not the tanh approximation), Linear."""
    projector = llava_pipeline.model.projector
    assert isinstance(projector.act, torch.nn.GELU) and projector.act.approximate == "none"
    features = torch.randn(1, 3, projector.linear_1.in_features)
    expected = projector.linear_2(torch.nn.functional.gelu(projector.linear_1(features)))
    torch.testing.assert_close(projector(features), expected)


def test_apple_silicon_gets_mps_in_half_precision(monkeypatch):
    from medvqa.device import pick_device, pick_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    device = pick_device("auto")
    assert device.type == "mps" and pick_dtype(device) == torch.float16
    assert pick_dtype(torch.device("cpu")) == torch.float32
    assert pick_dtype(device, "float32") == torch.float32


# --- end to end -----------------------------------------------------------------------------------

def test_the_command_line_answers_on_the_tiny_llava_med_profile(tiny_cache, tmp_path):
    from PIL import Image

    path = tmp_path / "scan.png"
    Image.fromarray(_image(4)).save(path)
    env = dict(os.environ, MEDVQA_CACHE=str(tiny_cache), MEDVQA_PROFILE="tiny-llava-med")
    completed = subprocess.run([sys.executable, "-m", "medvqa", "ask", str(path), "Describe the image.",
                                "--no-retrieval"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip()


def test_the_web_app_answers_on_the_tiny_llava_med_profile(llava_pipeline, llava_settings, tmp_path):
    """Upload, ask, answer through the real Gradio server with the mistral_instruct format."""
    from PIL import Image

    from medvqa.ui import build_app, launch

    from .ui_helpers import client, last_reply, upload

    path = tmp_path / "scan.png"
    Image.fromarray(_image(5)).save(path)
    demo = build_app(llava_pipeline, llava_settings, max_upload_mb=10)
    _, url, _ = launch(demo, host="127.0.0.1", port=None, max_upload_mb=10, block=False, quiet=True)
    try:
        c = client(url)
        upload(c, path)
        chat, _ = c.predict(QUESTION, api_name="/ask")
        assert last_reply(chat).split('<div class="medvqa-sources', 1)[0].strip()
    finally:
        demo.close()


def test_the_install_check_runs_on_the_tiny_llava_med_profile(tiny_cache):
    """scripts/check_install.py, the user's check of a llava-med install, on the tiny fixture."""
    from .conftest import require_shared_data

    data = require_shared_data()
    env = dict(os.environ, MEDVQA_CACHE=str(tiny_cache), MEDVQA_RETRIEVAL__ENABLED="false")
    completed = subprocess.run([sys.executable, str(REPO / "scripts" / "check_install.py"), "--profile",
                                "tiny-llava-med", "--n", "4", "--max-new-tokens", "4", "--json",
                                "--data", str(data / "vqa_rad")],
                               capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["n"] == 4 and result["n_closed"] == 2 and result["n_open"] == 2
    assert 0.0 <= result["closed_accuracy"] <= 1.0 and result["ttft_p50_s"] is not None
    assert "published for scale" in completed.stdout


def test_the_prepared_cuda_check_says_when_there_is_no_gpu(monkeypatch, capsys):
    """scripts/check_cuda.py (issue 33, step 4) runs on a GPU machine; without one it says so."""
    from .conftest import load_script

    script = load_script("check_cuda")
    assert script.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert script.first_difference([1, 2, 3], [1, 5, 3]) == 1 and script.first_difference([1, 2], [1, 2, 3]) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2 and "no CUDA device" in capsys.readouterr().err
