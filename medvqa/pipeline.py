"""One object that owns the loaded parts and answers questions about scans.

    pipeline = Pipeline.load(load_settings("offline"))
    conversation = pipeline.new_conversation(scan)
    for event in pipeline.ask(conversation, "Is there a pleural effusion?"):
        ...  # Sources(passages), Token(text) pieces, Done(answer, ...): Sources comes first when the
             # decoder reads the passages, after the last Token when they are only shown beside it

The pipeline holds no per-user state of its own beyond bounded caches keyed by content (image
tokens) or by a random conversation id (the engine's prefix cache): everything about a user's scan
and chat lives in their `Conversation` object. It talks to whichever engine the settings chose
through one interface (engines/base.py) and never asks which one it has.

Concurrent conversations take turns: each step of an answer (and each warming) holds one
first-come-first-served turn, so answers interleave token by token instead of contending for the
cores and the tokenizer, which is not thread-safe. An engine that batches (llama.cpp) runs its work
in its own steps for every request at once; while a request waits for it, its turn is given up
(`EngineRequest.waiting`), so the turn covers only the pipeline's own work around the engine.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from .answers import closed_candidates
from .closed import ClosedQuestions, load_answer_head
from .confidence import HEAD, calibration_for, image_group, leaning_text
from .config import Settings
from .device import pick_device, pick_dtype
from .engines import Engine, EngineRequest, choose_engine, load_engine
from .engines.base import shared_prefix
from .language_model import hub_offline_env
from .metrics import AnswerTracker
from .model import BLANK_DIGEST, BLANK_IMAGE, VisionLanguageModel, check_weight_files, image_digest, image_key
from .open_choices import chosen, judged, leaning, load_open_answers, load_open_calibration
from .prompt import FORMATS, Prompt, PromptBuilder, Turn
from .trust import claim, claim_query, image_reliance, mark_support

log = logging.getLogger(__name__)


@dataclass
class Sources:
    passages: list  # retrieval.Passage, numbered [1..n] in this order
    note: str = ""  # why there are none, when there are none
    in_prompt: bool = True  # whether the decoder reads them (see retrieval.prompt_gate)
    # Passages shown beside the answer are retrieved for its claim (trust.claim_query) after it and
    # come marked: per passage trust.mark_support's (mark, evidence). Passages the decoder
    # reads come before the answer, unmarked; their marks arrive with Done.
    support: list = field(default_factory=list)


@dataclass
class Token:
    text: str


@dataclass
class Done:
    answer: str
    passages: list
    window: str
    timings: dict = field(default_factory=dict)
    in_prompt: bool = True  # whether the passages were in the decoder's prompt
    support: list = field(default_factory=list)  # per passage: trust.mark_support's (mark, evidence)
    # A closed answer's scores: {"options": {option: score}, and trust.image_reliance's keys when the
    # options were also scored with a neutral image}; None for free text.
    closed: dict | None = None
    # Why an answer has no confidence: a closed question's options were not scored (it was generated as
    # free text, decoder.constrained_closed off: UNSCORED_CLOSED_NOTE), or an open answer was written freely
    # (FREE_TEXT_NOTE); "" otherwise.
    confidence_note: str = ""
    # With decoder.open_answerer "encoder_head", an open question's answer head reading: {"answer",
    # "probability" (among its answers other than yes/no), "min_probability", "vocabulary" (how many
    # answers it picks from), "answered" (whether it is the answer given; else the decoder's is)}, and
    # with decoder.head_open_min_similarity set, "similarity" and "nearest" (the training question most
    # like this one) and "min_similarity".
    head_open: dict | None = None
    # With decoder.open_choices "training_answers", an open answer the decoder chose among the answers
    # training gave to the question most like this one: {"answer", "nearest" (that training question),
    # "similarity", "min_similarity", "choices" (how many were scored), "images" (of how many images training
    # asked that question), "prior", "runner_up" (the next best answer), "margin" (their score difference),
    # "confidence" (decoder.open_calibration's; None without a usable file), "held_out" (its out-of-fold bin),
    # "abstained" (the app said "Uncertain" and named this answer as its leaning), and "uncalibrated" (why the
    # file is not used) when it is not}; None for an answer written freely.
    open_choice: dict | None = None
    # How many of the oldest earlier turns the prompt left out because the conversation no longer fits the
    # decoder's context (PromptBuilder.build); the answer did not read them.
    dropped_turns: int = 0


@dataclass
class Conversation:
    """One user's scan and chat. Never shared between users."""

    image: np.ndarray  # (H, W, 3) uint8, exactly what the model sees
    window: str = ""  # description of the window applied, for the prompt and the export
    history: list[Turn] = field(default_factory=list)
    id: str = field(default_factory=lambda: secrets.token_hex(8))

    def __setattr__(self, name, value) -> None:
        if name == "image":
            # Caches are keyed by the image's content: an image is replaced (a window or frame change
            # assigns a new array), never edited in place, so its hash is computed once per image.
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
            self.__dict__.pop("_digest", None)
            self.__dict__.pop("_image_group", None)
        super().__setattr__(name, value)

    @property
    def digest(self) -> str:
        """image_digest(self.image), computed once per image assigned (not per turn or keystroke)."""
        if "_digest" not in self.__dict__:
            self.__dict__["_digest"] = image_digest(self.image)
        return self.__dict__["_digest"]

    @property
    def image_group(self) -> str:
        """confidence.image_group(self.image) (grey or with colour), computed once per image assigned:
        every closed answer's calibration depends on it, and on a large radiograph it takes ~0.1 s."""
        if "_image_group" not in self.__dict__:
            self.__dict__["_image_group"] = image_group(self.image)
        return self.__dict__["_image_group"]

    @classmethod
    def from_scan(cls, scan) -> "Conversation":
        describe = getattr(scan, "describe_window", None)
        return cls(image=scan.pixels, window=describe() if callable(describe) else "")


# What the app says of a closed question answered in free text: nothing measured how often it is right.
UNSCORED_CLOSED_NOTE = ("Confidence: not measured. This closed question was answered in free text; "
                        "confidence and abstention need its options scored (decoder.constrained_closed, "
                        "off in this profile as in the model's reference, and an engine that scores them).")
# ... when options would be scored but the engine gives no scores (a chat-completions server).
UNSCORED_BY_ENGINE_NOTE = ("Confidence: not measured. This closed question was answered in free text: this "
                           "engine gives no scores of given answers, which confidence and abstention need.")
# ... and of an open question answered in free text (not chosen among training answers nor by the answer head).
FREE_TEXT_NOTE = ("Confidence: not measured. This answer was written freely by the model; how often such answers "
                  "are right was not measured, so treat it as unverified.")


# The prefix-cache key of prompts asked with the neutral (blank) image: one shared entry, since the
# image is the same for everyone and the question is whichever was typed last.
NEUTRAL_CONVERSATION = "neutral-image"


class TurnTaking:
    """A first-come-first-served lock shared by every conversation of one pipeline."""

    def __init__(self):
        self._condition = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._held = threading.local()  # the ticket of the turn this thread holds, if any

    @contextlib.contextmanager
    def turn(self):
        self._take()
        try:
            yield
        finally:
            self._give_up()

    @contextlib.contextmanager
    def aside(self):
        """Give up this thread's turn (if it holds one) while it waits for work that runs without
        turns, such as a batching engine's steps; take a new turn, at the back of the queue, after."""
        if getattr(self._held, "ticket", None) is None:
            yield
            return
        self._give_up()
        try:
            yield
        finally:
            self._take()

    def _take(self) -> None:
        ticket = object()
        with self._condition:
            self._waiting.append(ticket)
            while self._waiting[0] is not ticket:
                self._condition.wait()
        self._held.ticket = ticket

    def _give_up(self) -> None:
        self._held.ticket = None
        with self._condition:
            self._waiting.popleft()
            self._condition.notify_all()


class Pipeline(ClosedQuestions):
    def __init__(self, settings: Settings, engine: Engine, model: VisionLanguageModel | None = None,
                 retriever=None, metrics=None):
        self.settings = settings
        self.metrics = metrics  # metrics.ServingMetrics the answers are recorded in, or None
        self.engine = engine
        self.model = model  # None when the engine runs the vision side itself (a remote server)
        self.retriever = retriever
        self.index_build = None  # retrieval.background.IndexBuild while the index is built beside the app
        self.retrieval_unavailable = ""  # why the index asked for could not be opened (Pipeline.load), if so
        # An engine with no tokenizer renders its own template: prompts are then the messages alone.
        self.prompts = PromptBuilder(engine.tokenizer, model.num_image_tokens if model else 0,
                                     settings.decoder.context_window,
                                     reserve_for_answer=settings.decoder.max_new_tokens,
                                     format=FORMATS[settings.decoder.conversation_format],
                                     image_position=model.projector.image_position if model else "before")
        self.turns = TurnTaking()
        # decoder.closed_answerer "encoder_head": the encoder's answer head answers yes/no questions
        # (outside the LLaVA design; medvqa/answer_head.py), with its own calibration file. It reads the
        # image and the question alone, not the earlier turns.
        # decoder.open_answerer "encoder_head": the same head answers open questions when it is confident
        # enough (decoder.head_open_min_probability), the decoder the rest.
        self.answer_head = load_answer_head(settings, model)
        self.head_closes = self.answer_head is not None and settings.decoder.closed_answerer == "encoder_head"
        self.head_opens = self.answer_head is not None and settings.decoder.open_answerer == "encoder_head"
        # decoder.open_choices "training_answers": an open question worded like a training question is
        # answered by the decoder scoring the answers training gave to it (medvqa/open_choices.py).
        self.open_answers = load_open_answers(settings, engine.scores_options)
        # How often a chosen open answer is right (decoder.open_calibration), when the app chooses any.
        self.open_calibration = load_open_calibration(
            settings, self.open_answers, model.projector.sha256 if model else None,
            self.answer_head.digest if self.head_opens else None)
        # Only a calibration fitted for this projector file, yes_bias and yes/no answerer; a remote
        # engine's vision side is not a file of ours, so no file-bound calibration describes it either.
        self.calibration = calibration_for(
            settings.decoder.head_calibration if self.head_closes else settings.decoder.calibration,
            model.projector.sha256 if model else None, settings.decoder.yes_bias,
            *((self.answer_head.digest, settings.decoder.head_answers) if self.head_closes else ()))
        if (settings.decoder.head_agreement and self.answer_head is not None and not self.head_closes
                and self.calibration.fits and self.calibration.agreement is None):
            log.warning("decoder.head_agreement is on but the calibration %s is not split by the answer head's "
                        "agreement (scripts/calibrate_closed.py --head-agreement): the head's second reading is not used",
                        settings.decoder.calibration)

    @classmethod
    def load(cls, settings: Settings, with_retrieval: bool | None = None, progress: bool = True,
             metrics=None, index_in_background: bool = False) -> "Pipeline":
        """The loaded pipeline. A missing literature index is built first (from its corpus), or with
        `index_in_background` beside the running pipeline, which answers without literature until it is
        ready (the web app's first start; see retrieval.background)."""
        hub_offline_env(settings.offline)
        torch.manual_seed(settings.seed)
        device = pick_device(settings.device)
        dtype = pick_dtype(device, settings.dtype)
        if choose_engine(settings) != "openai":  # (the openai engine's server holds its own weights)
            check_weight_files(settings)  # a missing file is said before the decoder's slow first conversion
        engine = load_engine(settings, device, dtype)
        model = VisionLanguageModel.load(settings, device, dtype, engine.hidden_size) \
            if engine.takes_image_tokens else None
        retriever, build, unavailable = None, None, ""
        if with_retrieval if with_retrieval is not None else settings.retrieval.enabled:
            from .retrieval import RetrievalError, Retriever, ensure_default_index
            from .retrieval.index import check_buildable, default_index_ready

            if index_in_background and not default_index_ready(settings.retrieval):
                check_buildable(settings.retrieval)  # no corpus to build from: said now, as without
                from .retrieval.background import IndexBuild

                build = IndexBuild(settings.retrieval)
            else:
                try:
                    ensure_default_index(settings.retrieval, progress=progress)
                    retriever = Retriever.open(settings.retrieval)
                except RetrievalError as error:  # a damaged or mismatched index: answers without sources, said
                    unavailable = str(error)
                    log.info("literature retrieval is unavailable: %s", error)  # (callers say it)
                else:
                    from .assertion import warm

                    warm()  # passages get support marks: load their sentence check before the first answer
        pipeline = cls(settings, engine, model, retriever, metrics)
        pipeline.retrieval_unavailable = unavailable
        if build is not None:
            pipeline.index_build = build
            build.on_ready = pipeline._index_ready
            build.start()
        return pipeline

    def _index_ready(self, retriever) -> None:
        self.retriever = retriever  # one assignment: an answer sees the old value or the new, never half

    def literature_state(self) -> str:
        """Literature retrieval as the page says it: "on (N indexed passages)", "being built: ..." or "off"."""
        retriever, build = self.retriever, self.index_build
        if retriever is not None:
            return f"on ({len(retriever):,} indexed passages)"
        if build is not None and build.state != "ready":
            return f"off until its index is built — the index is {build.describe()}" if build.building else \
                f"off — the literature index {build.describe()}"
        if self.retrieval_unavailable:
            return "off — the literature index could not be opened (the server's log says why)"
        return "off — answers are not grounded in literature"

    # --- conversations ---------------------------------------------------------------------------

    def new_conversation(self, scan) -> Conversation:
        return Conversation.from_scan(scan)

    def end_conversation(self, conversation: Conversation, *, keep_image: bool = False) -> None:
        """Drop the conversation's cached prefix and its scan's projected image tokens and cached
        keys/values. `keep_image` keeps the last two (a caller asking one question at a time about the
        same image, as the evaluation does)."""
        if keep_image or (conversation.image is None and "_digest" not in conversation.__dict__):
            # (an image dropped by the app's memory budget keeps its digest: its caches go too)
            self.engine.forget(conversation.id)
            return
        digest = conversation.digest
        self.engine.forget(conversation.id, image_key(digest))
        if self.model is not None:
            self.model.forget_image(digest)

    # --- retrieval -----------------------------------------------------------------------------

    def retrieve(self, question: str, safe_meta: dict | None = None, retriever=None) -> list:
        """Passages for `question` from `retriever`, by default the pipeline's (read once: the index may
        arrive meanwhile, see index_build)."""
        retriever = retriever if retriever is not None else self.retriever
        if retriever is None:
            return []
        return retriever.search(question, self.settings.retrieval.top_k, safe_meta=safe_meta)

    def _no_sources_note(self, use_retrieval: bool, searched: bool) -> str:
        """Why an answer has no sources."""
        if not use_retrieval:
            return "Retrieval is off."
        if searched:
            return "No literature passage was relevant enough to cite."
        build = self.index_build
        if build is not None and build.building:
            return f"The literature index is still {build.describe()}, so this answer has no sources."
        if self.retrieval_unavailable:
            return "The literature index could not be opened, so this answer has no sources."
        return "Retrieval is off."

    def passages_in_prompt(self, question: str) -> bool:
        """Whether retrieved passages go into the decoder's prompt (they are always shown to the user).

        `retrieval.prompt_gate`: "always"; "open" keeps them out of closed (yes/no, either/or) questions;
        "never" shows them as related literature only. The offline profile's 135M decoder, trained
        without passages, answers worse with them in its prompt (scripts/evaluate.py), so it uses "never".
        An answer the encoder's answer head gives (decoder.closed_answerer / open_answerer) reads none,
        whatever the gate: Done.in_prompt says what was read.
        """
        gate = self.settings.retrieval.prompt_gate
        return gate == "always" or (gate == "open" and closed_candidates(question) is None)

    # --- answering -------------------------------------------------------------------------------

    def _history(self, conversation: Conversation) -> list:
        """The earlier turns the prompt carries (decoder.history_turns: -1 all, 0 none, N the last N). The
        conversation keeps them all: the transcript and a later change of the setting see every turn."""
        keep, turns = self.settings.decoder.history_turns, list(conversation.history)
        if keep < 0:
            return turns
        return turns[-keep:] if keep else []

    def ask(self, conversation: Conversation, question: str, **options) -> Iterator[Sources | Token | Done]:
        """Answer `question` about the conversation's image, streaming; history is updated at the end.
        Options: use_retrieval (True), safe_meta, max_new_tokens, constrained (closed questions scored
        over their options; default decoder.constrained_closed: off, they are generated like any
        question and Done.confidence_note says their confidence is not measured), warm (True).

        With `warm` (and `decoder.warm_next_turn`), iterating past Done prefills the start of the
        next turn (see warm_next_turn); a one-shot caller passes warm=False. Each step runs in one
        turn on the model (see TurnTaking)."""
        tracker = AnswerTracker(self.metrics)
        events = self._answer_events(conversation, question, tracker=tracker, **options)
        try:
            while True:
                with self.turns.turn():
                    event = next(events, None)
                if event is None:
                    return
                yield event
        finally:
            events.close()  # a caller that stops reading (Stop) releases what the engine holds
            tracker.close()

    def _answer_events(self, conversation: Conversation, question: str, *, use_retrieval: bool = True,
                       safe_meta: dict | None = None, max_new_tokens: int | None = None,
                       constrained: bool | None = None, warm: bool = True,
                       tracker: AnswerTracker | None = None) -> Iterator[Sources | Token | Done]:
        tracker = tracker or AnswerTracker(None)
        question = question.strip()
        if not question:
            raise ValueError("Please type a question about the image.")
        timings: dict[str, float] = {}
        start = time.perf_counter()
        if constrained is None:
            constrained = self.settings.decoder.constrained_closed
        options = closed_candidates(question)
        candidates = options if constrained and self.engine.scores_options else None
        route, presupposed = self._closed_route(question, candidates) if candidates else (None, None)
        head_open = self._head_open(conversation, question) if options is None and self.head_opens else None
        # The encoder's answer head reads the image and the question only: when it answers, no passage
        # goes into a prompt, and those shown beside the answer are related literature, not sources read.
        by_head = route == HEAD or bool(head_open and head_open["answered"])
        choices = (self.open_answers.find(question, self.settings.decoder.open_choices_min_similarity,
                                          self.settings.decoder.open_choices_max, self.settings.decoder.open_choices_min_images)
                   if options is None and self.open_answers is not None and not by_head else None)
        open_choice = None
        in_prompt = self.passages_in_prompt(question) and not by_head

        def sources(query: str) -> Sources:
            nonlocal passages
            began = time.perf_counter()
            retriever = self.retriever  # the index searched, read once (it may arrive meanwhile: index_build)
            searched = retriever is not None
            passages = self.retrieve(query, safe_meta, retriever=retriever) if use_retrieval else []
            timings["retrieval_s"] = time.perf_counter() - began
            note = "" if passages else self._no_sources_note(use_retrieval, searched)
            return Sources(passages, note, in_prompt)

        # Passages the decoder reads are found first, for the question; passages shown beside the
        # answer are found after it, for what it claims, so they do not delay its first word.
        passages: list = []
        if in_prompt:
            yield sources(question)

        prompt_passages = passages if in_prompt else []
        history = self._history(conversation)
        prompt = self.prompts.build(question, history, prompt_passages, self._prompt_window(conversation))
        if prompt_passages:
            passages = passages[:len(passages) - prompt.dropped_passages]
            prompt_passages = passages
        if prompt.token_ids:
            timings["prompt_tokens"] = len(prompt)
        request = self._request(conversation.image, prompt, conversation.digest, conversation.id)
        closed = None
        confidence_note = ("" if candidates or not options
                           else UNSCORED_BY_ENGINE_NOTE if constrained else UNSCORED_CLOSED_NOTE)
        if candidates:
            # Closed question: the best of the options it names (structured output), no free text.
            if presupposed:
                # Through the open question it presupposes: "Yes" when the value it names is the best.
                open_prompt = self.prompts.build(presupposed.question, history, prompt_passages,
                                                 self._prompt_window(conversation))
                request = self._request(conversation.image, open_prompt, conversation.digest, conversation.id)
            choice, scores = self._closed_scores(route, request, question, candidates, presupposed,
                                                 conversation.image, conversation.digest)
            closed, verdict = self._closed_verdict(conversation, scores, route, presupposed, question)
            # Below the calibrated confidence the app says so, with its leaning, instead of answering.
            pieces: Iterator[str] = iter([leaning_text(verdict, spelling=choice) if verdict.abstained else choice])
        elif head_open and head_open["answered"]:
            pieces = iter([head_open["answer"]])  # the answer head's (decoder.open_answerer)
        elif choices is not None:
            # The best of the answers training gave to the nearest training question (decoder.open_choices).
            scores = self.engine.score_options(request, [self.prompts.answer_ids(a) for a in choices.answers])
            open_choice = judged(chosen(choices, scores, self.settings.decoder), self.open_calibration,
                                 conversation.image_group, self.settings.decoder)
            # Below the calibrated confidence the app says so, with its leaning, instead of answering.
            pieces = iter([leaning(open_choice) if open_choice["abstained"] else open_choice["answer"]])
        else:
            pieces = self.engine.stream(request, max_new_tokens=max_new_tokens, seed=self.settings.seed,
                                        timings=timings)
            confidence_note = confidence_note or FREE_TEXT_NOTE
        answer_parts = []
        for piece in pieces:
            now = time.perf_counter()
            if not answer_parts:
                timings["ttft_s"] = now - start
            tracker.piece(now)
            answer_parts.append(piece)
            yield Token(piece)
        answer = "".join(answer_parts).strip()
        timings.setdefault("ttft_s", time.perf_counter() - start)
        # An "Uncertain" answer asserts nothing: its sources are about the question.
        claimed = "" if any(scored and scored["abstained"] for scored in (closed, open_choice)) else answer
        asserted = claim(question, claimed)
        if not in_prompt:
            shown = sources(claim_query(question, claimed, asserted))
            shown.support = [mark_support(asserted, passage.text) for passage in passages]
            yield shown
        support = [mark_support(asserted, passage.text) for passage in passages]
        if closed is not None and self.settings.decoder.image_reliance:
            # Once the answer and its sources are out: whether its choice survives a neutral image.
            began = time.perf_counter()
            neutral = self._request(BLANK_IMAGE, request.prompt, BLANK_DIGEST, NEUTRAL_CONVERSATION, background=True)
            neutral_scores = self._closed_scores(route, neutral, question, candidates, presupposed,
                                                 BLANK_IMAGE, BLANK_DIGEST)[1]
            closed.update(image_reliance(closed["options"], neutral_scores))
            timings["image_reliance_s"] = time.perf_counter() - began
        timings["total_s"] = time.perf_counter() - start
        tracker.done(timings, len(answer_parts), closed, open_choice)
        conversation.history.append(Turn(question, answer, prompt_passages))
        yield Done(answer, passages, conversation.window, timings, in_prompt, support, closed, confidence_note,
                   head_open, open_choice, prompt.dropped_turns)
        # Runs once the caller has taken Done (and shown the whole answer): while the clinician reads
        # and types, the engine caches the start of the next turn, so the next question only has its
        # own words to prefill.
        if warm and self.settings.decoder.warm_next_turn:
            self._warm(conversation)

    def _head_open(self, conversation: Conversation, question: str) -> dict:
        """The answer head's reading of an open question (Done.head_open): it answers when its
        probability is above decoder.head_open_min_probability and, where decoder.head_open_min_similarity
        is set, the question is like one it was trained on."""
        answer, probability = self.answer_head.open_answer(
            self.model.vision_tokens(conversation.image, conversation.digest), question)
        decoder = self.settings.decoder
        reading = {"answer": answer, "probability": probability, "min_probability": decoder.head_open_min_probability,
                   "vocabulary": len(self.answer_head.vocabulary) - 2}
        answered = probability > decoder.head_open_min_probability
        if decoder.head_open_min_similarity > 0:
            similarity, nearest = self.answer_head.nearest_question(question)
            reading.update(similarity=similarity, nearest=nearest, min_similarity=decoder.head_open_min_similarity)
            answered = answered and similarity >= decoder.head_open_min_similarity
        reading["answered"] = answered
        return reading

    def warm_next_turn(self, conversation: Conversation, draft: str = "", *,
                       still_wanted: Callable[[], bool] | None = None) -> int:
        """Extend the conversation's cached prefix with the part of the next prompt that does not
        depend on the next question (the last answer as the template renders it, end of turn, the
        next user header); returns how many prompt tokens are now cached (0 if nothing was done).

        Before the first question it caches the system prompt, the image tokens and the user header:
        the app calls it when a scan is shown, so the first question, too, has only its own words to
        prefill (the vision encoder has run by then as well).

        With `draft` (the question as typed so far) it caches the whole prompt for that question but
        its last token: asked as it stands, the question then has one token left to prefill; edited,
        the cache is cut back to where the prompts part and only the rest runs. Not when passages go
        into the prompt: they come before the question and are not known until it is asked.

        `still_wanted` is asked once the turn is taken (the wait may be long): the app skips warming
        a conversation that was replaced, or started an answer, meanwhile."""
        with self.turns.turn():
            if still_wanted is not None and not still_wanted():
                return 0
            return self._warm(conversation, draft)

    def _warm(self, conversation: Conversation, draft: str = "") -> int:
        if not self.engine.caches_prompts:
            return 0  # the engine keeps no cache of its own (a remote server caches for itself)
        window = self._prompt_window(conversation)
        draft = draft.strip()
        if len(draft) > 8 * self.settings.decoder.context_window:
            return 0  # far too long to ask (the question will say so): not worth tokenising per keystroke
        if draft and not self.passages_in_prompt(draft):
            try:
                prompt = self.prompts.build(draft, self._history(conversation), (), window)
            except ValueError:
                return 0  # too long to ask: the question will say so
            length = len(prompt) - 1  # the question's last token runs when it is asked, for the logits
        else:
            # Two prompts that differ only in the question share exactly the question-independent part.
            history = self._history(conversation)
            prompt = self.prompts.build("a", history, (), window)
            length = shared_prefix(prompt.token_ids, self.prompts.build("b", history, (), window).token_ids)
        if prompt.dropped_turns or length <= 0:
            return 0  # the next prompt is cut differently anyway
        start = Prompt(prompt.token_ids[:length], prompt.image_mask[:length])
        return self.engine.prefill(self._request(conversation.image, start, conversation.digest, conversation.id))

    def _prompt_window(self, conversation: Conversation) -> str:
        return conversation.window if self.settings.decoder.window_in_prompt else ""

    def _request(self, image: np.ndarray, prompt: Prompt, digest: str, conversation_id: str = "",
                 background: bool = False) -> EngineRequest:
        model = self.model
        tokens = (lambda: model.image_tokens(image, digest)) if model is not None else None
        return EngineRequest(conversation_id, prompt, image, image_key(digest), tokens, waiting=self.turns.aside,
                             background=background)

    def answer(self, image: np.ndarray, question: str, *, use_retrieval: bool = True,
               constrained: bool | None = None, window: str = "",
               max_new_tokens: int | None = None) -> tuple[str, list]:
        """One-shot answer to a single question (evaluation); returns (answer, passages retrieved)."""
        done = self.answer_done(image, question, use_retrieval=use_retrieval, constrained=constrained,
                                window=window, max_new_tokens=max_new_tokens)
        return done.answer, done.passages

    def answer_done(self, image: np.ndarray, question: str, *, use_retrieval: bool = True,
                    constrained: bool | None = None, window: str = "", max_new_tokens: int | None = None) -> "Done":
        """As answer(), the whole Done: with a closed answer's verdict (confidence, kind) in `closed`."""
        conversation = Conversation(image=image, window=window)
        done = None
        for event in self.ask(conversation, question, use_retrieval=use_retrieval, constrained=constrained,
                              max_new_tokens=max_new_tokens, warm=False):
            if isinstance(event, Done):
                done = event
        # The next call is often about the same image (the evaluation goes image by image): llama.cpp's
        # slots keep its keys/values for it, bounded by the slot count.
        self.end_conversation(conversation, keep_image=True)
        return done
