"""Export the VQA model as a Hugging Face `LlavaForConditionalGeneration` checkpoint.

vLLM and SGLang serve that class with paged attention, prefix caching and continuous batching, so a
deployment that outgrows one process points them at the exported folder.

The bottleneck projector (d_v -> h -> d_l with h < d_l) is exported exactly: LLaVA's projector is
d_v -> d_l -> d_l, so `linear_1` gains d_l - h zero rows and `linear_2` as many zero columns. The
extra hidden units compute GELU(0) = 0 and contribute nothing.

What a server needs to serve it as the reference runs it:

- `text_config.architectures` names the language model's own class (LLaVA-Med's checkpoint says
  `LlavaMistralForCausalLM`, which vLLM refuses), and `text_config` holds only the keys that class
  knows: the original training code's (`mm_*`, `tokenizer_*`, `unfreeze_mm_vision_tower`, ...) are
  left out;
- weights in fp16, as LLaVA-Med's builder runs them;
- an image processor that pads to a square with the mean colour before resizing (transformers'
  `LlavaImageProcessor` with `do_pad`, LLaVA's expand2square), for a profile that pads so, so a
  client other than this app sends what the model saw in training instead of a centre crop;
- the profile's conversation format (prompt.FORMATS) as the chat template of both the processor and
  the tokenizer, so a server renders the prompt the model was trained with whichever it reads;
- the image before the question, as LLaVA reads it: a projector trained with it after the question
  (`train_projector.py --image-position after`) is refused, since a server puts the image wherever a
  client's message puts it;
- `<image>` never generated: its id is suppressed in `generation_config.json` (`suppress_tokens`,
  `bad_words_ids`; its output row alone would give a logit of 0, not minus infinity). Where the
  tokenizer lacks `<image>` (LLaVA-Med's uses an id outside the vocabulary), it is added as a special
  token and the vocabulary grows by zero rows, on a copy: the app's own tokenizer is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import Settings
from .language_model import LanguageModel
from .model import VisionLanguageModel
from .prompt import FORMATS, IMAGE_PLACEHOLDER, jinja_template
from .vision import ClipVisionEncoder, pad_colour


class ExportError(ValueError):
    pass


def clean_text_config(language_config) -> dict:
    """The language model's config as a plain Hugging Face config of its own class: only the keys a
    default config of that class has (LLaVA's training code adds its own, which mean nothing there)."""
    known = set(type(language_config)().to_dict())
    return {key: value for key, value in language_config.to_dict().items() if key in known}


def padded_projector_state(projector, text_size: int) -> dict[str, torch.Tensor]:
    hidden = projector.linear_1.out_features
    if hidden > text_size:
        raise ExportError(f"The projector's hidden width {hidden} exceeds the decoder width {text_size}; "
                          f"LLaVA's projector cannot hold it exactly.")
    vision = projector.linear_1.in_features
    w1 = torch.zeros(text_size, vision)
    b1 = torch.zeros(text_size)
    w2 = torch.zeros(text_size, text_size)
    w1[:hidden] = projector.linear_1.weight.detach().float().cpu()
    b1[:hidden] = projector.linear_1.bias.detach().float().cpu()
    w2[:, :hidden] = projector.linear_2.weight.detach().float().cpu()
    return {"linear_1.weight": w1, "linear_1.bias": b1, "linear_2.weight": w2,
            "linear_2.bias": projector.linear_2.bias.detach().float().cpu().clone()}


def load_for_export(settings: Settings) -> tuple[VisionLanguageModel, LanguageModel]:
    """The profile's vision side and its decoder as a transformers model (whatever engine the app
    runs), on the CPU in fp32: what export_llava reads."""
    from .language_model import hub_offline_env

    hub_offline_env(settings.offline)
    device, dtype = torch.device("cpu"), torch.float32
    language_model = LanguageModel.load(settings.decoder, device, dtype, settings.cache_dir, settings.offline,
                                        settings.profile)
    return VisionLanguageModel.load(settings, device, dtype, language_model.hidden_size), language_model


def export_llava(model: VisionLanguageModel, decoder: LanguageModel, out_dir: str | Path, profile: str = "",
                 conversation_format: str = "chat_template", dtype: torch.dtype = torch.float16) -> Path:
    """Write the checkpoint and its processor to `out_dir`; `dtype` of the weights (fp16 as the
    reference runs, or fp32 where exact comparison matters)."""
    import copy

    from transformers import (CLIPImageProcessor, GenerationConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaImageProcessor, LlavaProcessor)

    vision, projector = model.vision, model.projector
    if not isinstance(vision, ClipVisionEncoder):
        raise ExportError(f"Profile {profile!r} uses a {type(vision).__name__}, a CNN with no Hugging Face "
                          f"LLaVA form (LLaVA needs a CLIP-style vision tower); export supports profiles "
                          f"whose encoder is a Hugging Face vision transformer, such as 'tiny' and 'llava-med'.")
    if vision.pooled_tokens:
        raise ExportError("Token pooling has no LLaVA equivalent; export a model trained on all patch tokens.")
    if projector.image_position != "before":
        raise ExportError("This projector was trained with the image after the question; a server renders the "
                          "image wherever each client's message puts it, so the checkpoint cannot hold that "
                          "order. Export a projector trained with the image before the question (LLaVA's).")
    out_dir = Path(out_dir)
    tokenizer = copy.deepcopy(decoder.tokenizer)  # the app's own is not changed
    if IMAGE_PLACEHOLDER not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_PLACEHOLDER]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    chat_template = jinja_template(FORMATS[conversation_format]) or tokenizer.chat_template
    tokenizer.chat_template = chat_template
    text_config = decoder.model.config
    vocab = max(text_config.vocab_size, len(tokenizer))
    config = LlavaConfig(vision_config=vision.tower.config.to_dict(), text_config=clean_text_config(text_config),
                         image_token_index=image_token_id, projector_hidden_act="gelu",
                         vision_feature_select_strategy="default", vision_feature_layer=vision.feature_layer,
                         image_seq_length=vision.grid_tokens, multimodal_projector_bias=True,
                         tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)))
    config.text_config.vocab_size = vocab
    config.text_config.architectures = [type(decoder.model).__name__]
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.model.vision_tower.load_state_dict(vision.tower.state_dict())
    language = decoder.model
    if language.get_input_embeddings().weight.shape[0] < vocab:
        # The image token's embedding row is never read (image features replace it); zeros keep it inert.
        language = _with_vocab(language, vocab)
    model.model.language_model.load_state_dict(language.model.state_dict())
    model.lm_head.load_state_dict(language.lm_head.state_dict())
    model.model.multi_modal_projector.load_state_dict(
        padded_projector_state(projector, text_config.hidden_size))
    # The image token is never generated (servers and `generate` read these with the checkpoint).
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, suppress_tokens=[image_token_id], bad_words_ids=[[image_token_id]])
    model.to(dtype).save_pretrained(out_dir)

    side = vision.image_size
    shape = dict(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                 image_mean=list(vision.mean), image_std=list(vision.std), resample=3)
    if vision.pad_fill == pad_colour(vision.mean):
        # LLaVA's expand2square with the mean colour, then resize: what the app does to every image.
        image_processor = LlavaImageProcessor(do_pad=True, **shape)
    else:
        # A profile that pads with black: the app pads before it sends, so a plain resize matches (a
        # client of its own must pad to a square with black first).
        image_processor = CLIPImageProcessor(**shape)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=vision.tower.config.patch_size,
                               vision_feature_select_strategy="default", image_token=IMAGE_PLACEHOLDER,
                               num_additional_image_tokens=1, chat_template=chat_template)
    processor.save_pretrained(out_dir)
    _loadable_by_transformers_4(Path(out_dir) / "tokenizer_config.json")
    return out_dir


def _loadable_by_transformers_4(config_path: Path) -> None:
    """transformers 5 names a tokenizer loaded from tokenizer.json alone "TokenizersBackend", a class that
    transformers 4 (which a vLLM or SGLang install may pin) does not have; "PreTrainedTokenizerFast" reads
    the same tokenizer.json in both, to the same ids. The keys of how this folder was loaded go too."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _with_vocab(language, vocab: int):
    import copy

    language = copy.deepcopy(language)
    old = language.get_input_embeddings().weight.shape[0]
    language.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        language.get_input_embeddings().weight[old:] = 0
        if language.lm_head.weight.shape[0] == vocab and not language.config.tie_word_embeddings:
            language.lm_head.weight[old:] = 0
    return language
