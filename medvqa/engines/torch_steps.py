"""Continuous batching for the transformers engine: one thread runs the decoder, batching decode steps.

With batching on, every use of the decoder by the transformers engine goes through one `StepBatcher`
thread. Conversations generating an answer hand it their next token (`step`); it runs all the tokens
waiting at that moment as one batched step (cpu_fast.LlamaDecodeStep.batch: one pass over the
weights for N conversations, each attending over its own key/value cache). Everything else (an
answer's prompt, a closed question's options, warming while the clinician types) is handed over as
a call (`call`) that runs between two steps, answers' prompts before warming; the engine cuts a
long prompt into calls of `PREFILL_CHUNK` positions, so the answers being read keep flowing while
it runs. Requests join and leave at every step.

A step starts once every answer being generated has handed over its token, or `GATHER_S` after the
first did (a reader busy elsewhere does not hold the others back). The caller waits inside
`request.waiting`, so the pipeline's turn is given up meanwhile and other conversations reach the
engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

PREFILL_CHUNK = 128  # prompt positions one call runs before the waiting answers take a step
GATHER_S = 0.004  # how long a step waits for the other answers' tokens once one has arrived
IDLE_S = 2.0  # the thread ends after this long without work


@dataclass(eq=False)
class _Work:
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None

    def wait(self, waiting: Callable[[], ContextManager]):
        if not self.done.is_set():
            with waiting():
                self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@dataclass(eq=False)
class _Step(_Work):
    embedding: torch.Tensor = None  # (1, d): the token's input embedding
    cache: object = None  # the conversation's DynamicCache
    position: int = 0


@dataclass(eq=False)
class _Call(_Work):
    run: Callable[[], object] = None
    urgency: int = 1  # 1: an answer's prompt or options; 2: warming
    arrival: float = field(default_factory=time.monotonic)


class StepBatcher:
    """The thread that owns a transformers decoder and runs the engine's work, decode steps batched.

    `single(embedding, cache, position)` runs one conversation's step (logits (1, V)); `batched(
    embeddings, caches, positions)` runs several (logits (N, V)). A step of one conversation takes
    `single`, so one clinician alone is served exactly as without batching."""

    def __init__(self, single: Callable, batched: Callable, gather_s: float = GATHER_S):
        self._single, self._batched = single, batched
        self.gather_s = gather_s
        self._steps: list[_Step] = []
        self._calls: list[_Call] = []
        self._generating = 0  # answers between their first and last token
        self._changed = threading.Condition()
        self._closing = False
        self.batches = 0  # steps run with more than one conversation (tests and benchmarks read it)
        # torch's thread count as the engine was built: the thread sets it for itself as it starts, as
        # a new thread otherwise takes the process-wide count of that moment, which a retrieval query
        # (search.query_threads) may have set to 1 for itself.
        self.threads = torch.get_num_threads()
        # Started with the first work and ended after IDLE_S without any, so an engine nobody closes
        # is not kept alive by its thread.
        self._thread: threading.Thread | None = None

    # --- callers -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def generating(self):
        """Held by an answer while it generates: a step waits (up to gather_s) for every such answer."""
        with self._changed:
            self._generating += 1
        try:
            yield
        finally:
            with self._changed:
                self._generating -= 1
                self._changed.notify()

    def step(self, embedding: torch.Tensor, cache, position: int, waiting: Callable[[], ContextManager]):
        """Logits (1, V) after one more token of a conversation (its cache is extended by it)."""
        return self._submit(_Step(embedding=embedding, cache=cache, position=position)).wait(waiting)

    def call(self, run: Callable[[], object], waiting: Callable[[], ContextManager], urgency: int = 1):
        """Run `run()` on the decoder's thread between two steps; its result."""
        return self._submit(_Call(run=run, urgency=urgency)).wait(waiting)

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=60)
        with self._changed:
            left, self._steps, self._calls = self._steps + self._calls, [], []
        for work in left:
            work.error = RuntimeError("The transformers engine was closed.")
            work.done.set()

    def _submit(self, work: _Work) -> _Work:
        with self._changed:
            if self._closing:
                work.error = RuntimeError("The transformers engine is closed.")
                work.done.set()
                return work
            # The queue is looked up under the lock: the loop swaps self._steps for a new list as it
            # takes the waiting steps, and a step put in the list it took would never run.
            (self._steps if isinstance(work, _Step) else self._calls).append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="transformers steps", daemon=True)
                self._thread.start()
            self._changed.notify()
        return work

    # --- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            with self._changed:
                idle_until = time.monotonic() + IDLE_S
                while not self._closing and not self._steps and not self._calls:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        self._thread = None  # the next work starts a new thread
                        return
                    self._changed.wait(left)
                if self._closing:
                    return
                if self._steps and not self._calls:
                    # Every answer's token, or as many as arrive within gather_s of the first.
                    deadline = time.monotonic() + self.gather_s
                    while (not self._closing and len(self._steps) < self._generating and not self._calls
                           and (left := deadline - time.monotonic()) > 0):
                        self._changed.wait(left)
                steps, self._steps = self._steps, []
                call = None
                if self._calls:
                    call = min(self._calls, key=lambda c: (c.urgency, c.arrival))
                    self._calls.remove(call)
            if steps:
                self._run_steps(steps)
            if call is not None:
                self._finish(call, call.run)

    def _run_steps(self, steps: list[_Step]) -> None:
        if len(steps) == 1:
            step = steps[0]
            return self._finish(step, lambda: self._single(step.embedding, step.cache, step.position))
        try:
            logits = self._batched(torch.cat([step.embedding.reshape(1, -1) for step in steps]),
                                   [step.cache for step in steps], [step.position for step in steps])
            self.batches += 1
        except BaseException as error:  # noqa: BLE001 - each waiting answer gets it; the loop lives on
            for step in steps:
                step.error = error
                step.done.set()
            return
        for row, step in enumerate(steps):
            step.result = logits[row:row + 1]
            step.done.set()

    @staticmethod
    def _finish(work: _Work, run: Callable[[], object]) -> None:
        try:
            work.result = run()
        except BaseException as error:  # noqa: BLE001 - the caller gets it
            work.error = error
        work.done.set()
