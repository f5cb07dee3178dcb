"""A step time target (``SchedulerConfig.step_time_target_s``): on a slow host a long prompt
beside running decodes goes in smaller pieces, so no decode waits much longer than the target
for its next token; on a fast one the pieces stay whole; 0 turns it off. Driven by reported
step times (the engine reports the time each step's forward took), not by the clock."""

from __future__ import annotations

import pytest

from pensieve.core.cache_config import CacheConfig
from pensieve.core.cost_model import CostModel
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import MIN_PROMPT_TOKENS, Scheduler
from pensieve.core.scheduling_config import SchedulerConfig, default_step_time_target
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.llm import build_engine_config
from pensieve.engine.step_record import prefill_decode_tokens

BUDGET = 256


def _scheduler(target: float) -> Scheduler:
    cost = CostModel.analytic(4, 4, 2, 64, 256, 512)
    cache = TieredKVCache(2000, 0, cost.chunk_cost,
                          CacheConfig(chunk_size=32, swap_out_threshold=0.25, decode_reserve=0.0,
                                      share_prefixes=False, defer_admission=0),
                          policy=get_policy("gpu-only"))
    cfg = SchedulerConfig(max_num_batched_tokens=BUDGET, max_model_len=16384,
                          step_time_target_s=target)
    return Scheduler(cfg, cache)


def _run(s: Scheduler, fixed_s: float, per_token_s: float, prompt: int = 4000,
         decodes: int = 3) -> list[tuple[int, int, float]]:
    """``decodes`` streams decode while a ``prompt``-token prompt arrives; each step 'takes'
    ``fixed_s`` plus ``per_token_s`` per prompt token (reported to the scheduler as the
    engine does). Returns each step's (prompt tokens, decodes, seconds) once the long prompt
    is queued, until it is done."""
    stream = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
    for i in range(decodes):
        s.add_request(Request(f"d{i}", [5 + i] * 16, stream))
    t, steps, long_done = 0.0, [], False

    def step() -> tuple[int, int, float]:
        nonlocal t
        out = s.schedule(t)
        p, d = prefill_decode_tokens(out)
        seconds = fixed_s + per_token_s * p
        sampled = {r.request_id: 7 for r in out.requests if r.sample}
        s.update_from_output(out, RunnerOutput(sampled_token_ids=sampled), t)
        s.observe_step(seconds, p, d)
        t += seconds
        return p, d, seconds

    for _ in range(5):  # the streams' prompts, then decode-only steps
        step()
    s.add_request(Request("long", list(range(3, 3 + prompt)),
                          SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    while not long_done:
        p, d, seconds = step()
        steps.append((p, d, seconds))
        long_done = "long" not in s.requests or s.requests["long"].num_pending == 0
    return steps


def test_a_slow_host_gets_smaller_pieces_and_every_decode_each_step() -> None:
    # 0.4 s a step plus 10 ms a prompt token: a whole 256-token piece would take ~2.9 s
    steps = _run(_scheduler(2.0), 0.4, 0.010)
    assert sum(p for p, _, _ in steps) >= 4000
    assert all(d == 3 for _, d, _ in steps), "a decode left out of a step"
    # measured on the streams' prompts and their decodes: every piece fits the target
    assert max(sec for _, _, sec in steps) <= 2.0 + 1e-9, steps
    assert max(p for p, _, _ in steps) < BUDGET - 3  # a whole piece: 0.4 + 2.53 s


def test_a_fast_host_keeps_whole_pieces() -> None:
    steps = _run(_scheduler(2.0), 0.05, 0.001)
    assert [p for p, _, _ in steps[:-1]] == [BUDGET - 3] * (len(steps) - 1)


def test_no_target_keeps_the_budget_however_slow() -> None:
    steps = _run(_scheduler(0.0), 0.4, 0.010)
    assert [p for p, _, _ in steps[:-1]] == [BUDGET - 3] * (len(steps) - 1)


def test_a_step_slower_than_the_target_by_itself_keeps_progress() -> None:
    # the fixed part alone is over the target: pieces do not shrink below the floor
    steps = _run(_scheduler(0.5), 0.8, 0.010)
    assert all(p >= MIN_PROMPT_TOKENS - 3 for p, _, _ in steps[:-1])
    assert sum(p for p, _, _ in steps) >= 4000


def test_defaults_per_device_and_bad_values() -> None:
    assert default_step_time_target("cpu") == 2.0
    assert default_step_time_target("cuda") == 0.0
    assert build_engine_config(device="cpu").scheduler.step_time_target_s == 2.0
    assert build_engine_config(device="cpu", step_time_target_s=0).scheduler \
        .step_time_target_s == 0.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="step_time_target_s"):
            SchedulerConfig(step_time_target_s=bad)
