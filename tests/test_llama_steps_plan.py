"""What one step of the llama.cpp engine's loop carries (llama_steps.StepLoop._plan), without a context:
answers' next tokens first, then waited-for prompts, then background work within its share."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from medvqa.engines.llama_steps import BATCH_CAPACITY, Generation, Job, Piece, Prefill, Scoring, StepLoop


@dataclass
class _Slot:
    seq_id: int
    cached: list = field(default_factory=list)


def _loop(jobs: list, budget: int = 64, warm_share: int = 8) -> StepLoop:
    loop = StepLoop.__new__(StepLoop)  # no llama.cpp context: only the planning is under test
    loop.budget, loop.warm_share, loop._jobs = budget, warm_share, jobs
    return loop


def _job(kind, seq_id: int, positions: int, arrival: float, **fields) -> Job:
    piece = Piece(list(range(positions)), tokens=list(range(positions)), logits="last")
    return kind(slot=_Slot(seq_id), pieces=collections.deque([piece]), keep=0, arrival=arrival, **fields)


def _planned(loop: StepLoop) -> dict[int, int]:
    return {job.slot.seq_id: count for job, _, count in loop._plan()}


def test_background_work_shares_one_allowance_while_answers_are_generated():
    """Several warmings and a background scoring (the image-reliance check) take warm_share positions
    in all, not each, while an answer streams; a waited-for prompt goes before them."""
    answer = _job(Generation, 0, 1, 0.0)
    answer.generated = 3  # streaming: its next token
    warmings = [_job(Prefill, 1 + i, 40, 1.0 + i) for i in range(3)]
    check = _job(Scoring, 4, 40, 0.5, background=True)
    prompt = _job(Scoring, 5, 30, 9.0)  # a closed question someone waits for, asked last
    plan = _planned(_loop([answer, *warmings, check, prompt]))
    assert plan[0] == 1 and plan[5] == 30
    assert sum(count for seq, count in plan.items() if seq in (1, 2, 3, 4)) == 8
    assert plan[4] == 8, "the oldest background work goes first"


def test_background_work_takes_the_whole_budget_when_no_answer_streams():
    warmings = [_job(Prefill, i, 40, float(i)) for i in range(3)]
    check = _job(Scoring, 3, 40, 0.5, background=True)
    plan = _planned(_loop([*warmings, check]))
    assert sum(plan.values()) == 64 and plan == {0: 40, 3: 24}


def test_background_scoring_waits_for_the_prompts_of_waited_for_answers():
    check = _job(Scoring, 0, 60, 0.0, background=True)
    prompts = [_job(Generation, 1 + i, 30, 1.0 + i) for i in range(2)]
    assert check.urgency() == 2 and prompts[0].urgency() == 1
    assert _planned(_loop([check, *prompts])) == {1: 30, 2: 30, 0: 4}


def test_a_waited_for_prompt_fills_the_batch_while_no_answer_streams():
    """With nobody reading, a prompt is not held to the 64-position budget (a lone first turn runs as
    fast as it did before the loop); background work still keeps to the budget, after it."""
    prompt = _job(Generation, 0, 700, 0.0)
    warming = _job(Prefill, 1, 100, 1.0)
    assert _planned(_loop([prompt, warming])) == {0: BATCH_CAPACITY}
    short = _job(Generation, 2, 40, 0.0)
    assert _planned(_loop([short, _job(Prefill, 3, 100, 1.0)])) == {2: 40, 3: 24}


def test_a_prompt_keeps_to_the_budget_while_an_answer_streams():
    answer = _job(Generation, 0, 1, 0.0)
    answer.generated = 2
    prompt = _job(Generation, 1, 700, 1.0)
    assert _planned(_loop([answer, prompt])) == {0: 1, 1: 64}
