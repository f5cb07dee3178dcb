"""StepRecord / StepTotals: what an engine step reports to its observers."""

from __future__ import annotations

from pensieve.core.outputs import (
    QueryRange,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SwapPlan,
)
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.step_record import StepRecord, StepTotals

P = SamplingParams(max_tokens=4)


def test_record_splits_prefill_and_decode_and_counts_swaps() -> None:
    sched = SchedulerOutput(
        requests=[
            ScheduledRequest("a", [0, 1], [QueryRange(0, [1, 2, 3]), QueryRange(40, [4, 5])],
                             True, P, 0),                       # recompute + new prompt
            ScheduledRequest("b", [2], [QueryRange(7, [9])], True, P, 3),    # a decode
            ScheduledRequest("c", [3], [QueryRange(0, [9])], True, P, 0),    # 1-token prompt
        ],
        swaps=SwapPlan(swap_out_first=[(5, 1)], swap_in=[(2, 6), (3, 7)], swap_out=[(8, 4)]),
    )
    out = RunnerOutput({"a": 1, "b": 2, "c": 3}, step_time_s=0.5, swap_outs_in_flight=1)
    r = StepRecord.of(sched, out, 0.001, 0.5, 0.002)
    assert (r.prefill_tokens, r.decode_tokens, r.num_requests) == (6, 1, 3)
    assert (r.swap_in_chunks, r.swap_out_chunks, r.urgent_swap_out_chunks) == (2, 1, 1)
    assert r.has_prefill and r.swap_outs_in_flight == 1 and r.step_time_s == 0.5

    totals = StepTotals()
    totals(r)
    decode_only = SchedulerOutput(requests=[sched.requests[1]])
    totals(StepRecord.of(decode_only, RunnerOutput({"b": 1}), 0.0, 0.25, 0.0))
    d = totals.as_dict()
    assert d["steps"] == 2 and d["prefill_steps"] == 1
    assert d["prefill_step_execute_s"] == 0.5 and d["decode_step_execute_s"] == 0.25
    assert d["decode_tokens"] == 2 and d["prefill_tokens"] == 6


def test_engine_calls_observers_once_per_step() -> None:
    from pensieve.bench.engine_api import VirtualClock
    from pensieve.bench.simulator import SimEngine
    from pensieve.bench.step_cost import StepCostModel
    from pensieve.core.config import SchedulerConfig

    eng = SimEngine(SchedulerConfig(max_num_batched_tokens=512, max_model_len=512), 64, 64,
                    StepCostModel(base_s=0.01), VirtualClock(), lambda ctx: 1e-3,
                    chunk_size=16, vocab_size=256)
    seen: list[StepRecord] = []
    eng.step_observers.append(seen.append)
    eng.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert len(seen) == eng.num_steps == 3
    assert seen[0].prefill_tokens == 39 and [s.decode_tokens for s in seen] == [0, 1, 1]
