"""The `tiny` profiles: random CLIP ViT + random Llama (`tiny`) or Mistral (`tiny-llava-med`) of the
real architectures, for tests.

Built deterministically from a seed in a few seconds and saved as ordinary Hugging Face folders, so
every code path that loads `openai/clip-vit-large-patch14-336` or a Llama-family decoder runs
unchanged on them. The tokenizer is a byte-level BPE trained here on a small built-in text, so
nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<image>"]

# Mistral-7B-Instruct-v0.2's chat template in its documented form (the one LLaVA-Med v1.5's tokenizer
# came with): BOS, then [INST] user [/INST] answer</s> pairs; a system role raises.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

_TRAINING_TEXT = """
Is there a pleural effusion? yes no left right both. The chest x-ray shows the heart, lungs, liver,
spleen and kidney. Which side is abnormal? Is the aorta enlarged? What organ is shown in this CT
scan of the abdomen? The MRI of the brain shows a mass in the frontal lobe. Question: Answer:
Is this a normal image? Where is the lesion located? axial coronal sagittal plane T1 T2 FLAIR.
The sources describe pneumothorax, cardiomegaly, consolidation, nodule, fracture and edema.
"""


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>",
                                        bos_token="<|im_start|>", unk_token=None)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_mistral_tokenizer(image_token: bool = True):
    """A sentencepiece-style tokenizer as Mistral's: "▁" word marks, <s> added before every text,
    </s> ending a turn, the Mistral-7B-Instruct-v0.2 chat template. Without `image_token` it lacks
    <image>, as LLaVA-Med's own tokenizer does (the export must add it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + ["<image>"] * image_token,
                                  show_progress=False)
    core.train_from_iterator([_TRAINING_TEXT + " [INST] [/INST] Yes No"] * 4, trainer=trainer)
    core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                        special_tokens=[("<s>", core.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


def make_tiny_models(folder: str | Path, seed: int = 0, vision_width: int = 32, text_width: int = 48) -> Path:
    """Write `folder/clip` (CLIPVisionModel + image processor), `folder/llama` (LlamaForCausalLM +
    a ChatML tokenizer) and `folder/mistral` (MistralForCausalLM + a Mistral-style tokenizer); return
    `folder`. Existing folders are reused."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM)

    folder = Path(folder)
    clip_dir, llama_dir, mistral_dir = folder / "clip", folder / "llama", folder / "mistral"
    if all((path / "config.json").is_file() for path in (clip_dir, llama_dir, mistral_dir)):
        return folder
    torch.manual_seed(seed)
    vision_config = CLIPVisionConfig(hidden_size=vision_width, intermediate_size=2 * vision_width,
                                     num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=8,
                                     projection_dim=vision_width)
    CLIPVisionModel(vision_config).save_pretrained(clip_dir)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(clip_dir)

    tokenizer = build_tokenizer()
    text_config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=2048, tie_word_embeddings=False,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(text_config).save_pretrained(llama_dir)
    tokenizer.save_pretrained(llama_dir)

    tokenizer = build_mistral_tokenizer()
    mistral_config = MistralConfig(vocab_size=len(tokenizer), hidden_size=text_width,
                                   intermediate_size=2 * text_width, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2048, sliding_window=None,
                                   tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id)
    MistralForCausalLM(mistral_config).save_pretrained(mistral_dir)
    tokenizer.save_pretrained(mistral_dir)
    return folder
