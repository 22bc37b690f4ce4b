"""The transformers engine's step thread (torch_steps.StepBatcher) on its own, with stand-in steps."""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

from medvqa.engines.torch_steps import StepBatcher

from .threads import join_all


def _batcher() -> StepBatcher:
    """Steps that return the position they were given, alone or batched."""
    def single(embedding, cache, position):
        return torch.tensor([[float(position)]])

    def batched(embeddings, caches, positions):
        return torch.tensor([[float(p)] for p in positions])

    return StepBatcher(single, batched, gather_s=0.0005)


def test_no_step_is_lost_while_steps_and_calls_race():
    """Many answers stepping at once, with calls between: every step gets its own result.

    A step handed over just as the thread took the waiting steps used to be put in the list it had
    taken, after that list was run, so its answer waited for ever (a full test run hung on it)."""
    batcher = _batcher()
    results: dict[int, list[float]] = {}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to open every window

    def answer(index: int) -> None:
        with batcher.generating():
            got = []
            for position in range(300):
                got.append(float(batcher.step(torch.zeros(1, 1), None, position, contextlib.nullcontext)[0, 0]))
                if position % 50 == 0:
                    batcher.call(lambda: None, contextlib.nullcontext, urgency=1 + index % 2)
            results[index] = got

    threads = [threading.Thread(target=answer, args=(index,), name=f"answer {index}", daemon=True) for index in range(6)]
    try:
        for thread in threads:
            thread.start()
        join_all(threads, timeout=120)
    finally:
        sys.setswitchinterval(interval)
        batcher.close()
    assert results == {index: [float(p) for p in range(300)] for index in range(6)}
    assert batcher.batches > 0


def test_work_after_the_thread_idled_out_starts_a_new_one(monkeypatch):
    """The thread ends after IDLE_S without work; the next step starts another and is answered."""
    from medvqa.engines import torch_steps

    monkeypatch.setattr(torch_steps, "IDLE_S", 0.01)
    batcher = _batcher()
    try:
        first = batcher.step(torch.zeros(1, 1), None, 3, contextlib.nullcontext)
        thread = batcher._thread
        if thread is not None:
            thread.join(timeout=10)
        assert batcher._thread is None
        second = batcher.step(torch.zeros(1, 1), None, 4, contextlib.nullcontext)
    finally:
        batcher.close()
    assert float(first[0, 0]) == 3.0 and float(second[0, 0]) == 4.0


def test_the_step_thread_keeps_the_engines_thread_count_whatever_a_query_set():
    """A retrieval query sets torch to one thread for itself, through torch's process-wide count; a
    step thread started meanwhile used to take that count and decode on one thread for its life."""
    from medvqa.retrieval.search import query_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batcher = StepBatcher(lambda embedding, cache, position: torch.tensor([[float(torch.get_num_threads())]]),
                              lambda embeddings, caches, positions: None)
        try:
            with query_threads(1):
                seen = batcher.step(torch.zeros(1, 1), None, 0, contextlib.nullcontext)
        finally:
            batcher.close()
    finally:
        torch.set_num_threads(before)
    assert float(seen[0, 0]) == 2.0
