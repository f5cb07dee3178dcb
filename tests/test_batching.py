"""Separate prefill/decode batches (``SchedulerConfig.batching="separate"``, the vLLM 0.2 baseline
of the paper's Figure 13): no step mixes prefill and decode tokens, prefills go first, every
turn still finishes with the outputs unified batching gives (and HF gives, end to end)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core import _req, _run_step, stateless_cache
from test_stateful_invariant import (
    CHUNK,
    DEVICE,
    TIERS,
    VOCAB,
    Reference,
    Workload,
    expected,
    workloads,
)

from pensieve.core.cache_config import CacheConfig
from pensieve.core.eviction import POLICIES, get_policy
from pensieve.core.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from pensieve.core.request import Request, RequestStatus
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler, is_decode
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache


def sched_is_decode(s: ScheduledRequest) -> bool:
    """A decode as the runner sees it: one token, the newest of a turn that has sampled."""
    return s.sample and s.num_output_tokens > 0 and s.num_scheduled_tokens == 1


def step_kinds(out: SchedulerOutput) -> set[str]:
    return {"decode" if sched_is_decode(s) else "prefill" for s in out.requests}


def test_invalid_batching_raises() -> None:
    with pytest.raises(ValueError, match="batching must be one of unified, separate"):
        SchedulerConfig(batching="mixed")
    assert SchedulerConfig().batching == "unified"
    assert SchedulerConfig(batching="separate").batching == "separate"


def test_separate_steps_prefill_first_then_decodes() -> None:
    """The case of test_core's unified test, now in separate batches; then a turn arriving
    while others decode runs alone first (prefill priority)."""
    cfg = SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8, max_model_len=64,
                          batching="separate")
    s = Scheduler(cfg, stateless_cache(64, 4, watermark=0.0))
    s.add_request(_req("a", 6, max_tokens=4))
    s.add_request(_req("b", 7, max_tokens=2))
    # step 1: a's whole prompt, b's first 4 tokens (a prefill step)
    assert _run_step(s)[0] == [("a", 0, 6, True), ("b", 0, 4, False)]
    # step 2: b's prompt is unfinished: prefill again, a's decode waits
    assert _run_step(s)[0] == [("b", 4, 3, True)]
    # step 3: no prefill work left: both decode; b reaches max_tokens=2
    assert _run_step(s) == ([("a", 6, 1, True), ("b", 7, 1, True)], ["b"])
    s.add_request(_req("c", 5, max_tokens=1))
    # step 4: c can be admitted: its prompt alone
    assert _run_step(s) == ([("c", 0, 5, True)], ["c"])
    assert _run_step(s)[0] == [("a", 7, 1, True)]
    assert _run_step(s) == ([("a", 8, 1, True)], ["a"])
    assert not s.has_unfinished()
    assert s.cache.gpu.num_free_blocks == 64


def test_separate_suspended_and_swapped_request_resumes_in_a_decode_step() -> None:
    """A suspended turn whose KV went to the CPU has only its newest token left: it comes back
    with a swap-in in a decode step (as vLLM swaps in), not in a prefill step."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                          batching="separate")
    cache = TieredKVCache(4, 8, lambda _: 1.0,
                          CacheConfig(chunk_size=4, decode_reserve=0.0, share_prefixes=False,
                                      defer_admission=0), policy=get_policy("pensieve"))
    s = Scheduler(cfg, cache)
    a, b = _req("a", 7, max_tokens=4), _req("b", 7, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    assert _run_step(s)[0] == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert _run_step(s)[0] == [("a", 7, 1, True), ("b", 7, 1, True)]
    # position 8 needs a third block each: b (newest) is suspended to the CPU
    assert _run_step(s)[0] == [("a", 8, 1, True)]
    assert b.status is RequestStatus.WAITING and cache.stats.swapped_out_tokens == 8
    assert _run_step(s) == ([("a", 9, 1, True)], ["a"])
    out = s.schedule()
    assert [(r.request_id, r.ranges[0].start_pos, r.num_scheduled_tokens) for r in out.requests] \
        == [("b", 8, 1)]
    assert step_kinds(out) == {"decode"} and len(out.swaps.swap_in) == 2


def test_separate_admits_a_prompt_only_with_blocks_for_all_of_it() -> None:
    """A chunked prompt admitted with blocks for its first chunk only would, once it cannot
    grow, suspend itself and be readmitted in every prefill step, and the running decode would
    never run again. Separate batches admit it only when all its blocks fit."""
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64,
                          batching="separate")
    s = Scheduler(cfg, stateless_cache(10, 4, watermark=0.0))
    s.add_request(_req("a", 8, max_tokens=20))
    assert _run_step(s)[0] == [("a", 0, 8, True)]
    s.add_request(_req("b", 36, max_tokens=1))  # 9 blocks; 8 are free
    steps = []
    while s.has_unfinished():
        assert len(steps) < 100, "no progress"
        steps.append(_run_step(s))
    assert [x[0] for x in steps[:19]] == [[("a", p, 1, True)] for p in range(8, 27)]
    assert steps[18][1] == ["a"]
    assert [x[0] for x in steps[19:]] == [[("b", p, min(8, 36 - p), p == 32)]
                                          for p in range(0, 36, 8)]
    assert s.num_suspended == 0


# ---------------------------------------------------------------- property: random multi-turn
def fake_token(context: list[int]) -> int:
    """A deterministic "model": the next token is a hash of the whole context."""
    h = 0
    for t in context:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % 50


Turns = list[list[tuple[list[int], int, int]]]  # per conversation: (new ids, max_tokens, wait)


@st.composite
def multi_turn(draw: st.DrawFn) -> tuple[Turns, list[int], dict[str, int | str]]:
    setup: dict[str, int | str] = {
        "policy": draw(st.sampled_from(sorted(POLICIES))),
        "gpu_blocks": draw(st.integers(12, 40)),
        "cpu_blocks": draw(st.integers(0, 16)),
        "decode_reserve": draw(st.sampled_from([0, 10])),  # percent
        "budget": draw(st.sampled_from([8, 16, 33, 64])),
        "max_seqs": draw(st.integers(1, 8)),
    }
    gpu = int(setup["gpu_blocks"])
    fits = (gpu - int(int(setup["decode_reserve"]) / 100 * gpu)) * CHUNK  # tokens, one alone
    rng = random.Random(draw(st.integers(0, 100_000)))
    convs: Turns = []
    for _ in range(draw(st.integers(1, 8))):
        turns, length = [], 0
        for _ in range(rng.randint(1, 4)):
            new, m = rng.randint(1, 40), rng.randint(1, 16)
            if length + new + m > min(fits, 200):
                break
            length += new + m
            turns.append(([rng.randrange(50) for _ in range(new)], m, rng.randint(0, 6)))
        convs.append(turns or [([1, 2, 3], 2, 0)])
    starts = [rng.randint(0, 15) for _ in convs]
    return convs, starts, setup


def drive(batching: str, convs: Turns, starts: list[int], setup: dict[str, int | str],
          ) -> tuple[list[list[list[int]]], list[set[str]]]:
    """Run every conversation's turns (each turn ``wait`` steps after the previous ended) with
    ``fake_token``; returns outputs per conversation and turn, and each step's kinds."""
    cache = TieredKVCache(int(setup["gpu_blocks"]), int(setup["cpu_blocks"]), lambda n: float(n),
                          CacheConfig(chunk_size=CHUNK,
                                      decode_reserve=int(setup["decode_reserve"]) / 100,
                                      share_prefixes=False, defer_admission=0),
                          policy=get_policy(str(setup["policy"])))
    cfg = SchedulerConfig(max_num_batched_tokens=int(setup["budget"]),
                          max_num_seqs=int(setup["max_seqs"]), max_model_len=256,
                          batching=batching)
    s = Scheduler(cfg, cache)
    outs: list[list[list[int]]] = [[] for _ in convs]
    next_turn = [0] * len(convs)
    ready_at = list(starts)
    live: dict[str, int] = {}
    kinds: list[set[str]] = []
    step = 0
    while any(n < len(t) for n, t in zip(next_turn, convs)) or s.has_unfinished():
        assert step < 5000, "no progress"
        for c, turns in enumerate(convs):
            busy = f"c{c}" in s.busy_conversations
            if next_turn[c] < len(turns) and ready_at[c] <= step and not busy:
                new, m, _ = turns[next_turn[c]]
                history = cache.conversations[f"c{c}"].token_ids \
                    if f"c{c}" in cache.conversations else []
                rid = f"c{c}-t{next_turn[c]}"
                s.add_request(Request(rid, history + new, SamplingParams(
                    max_tokens=m, temperature=0.0, ignore_eos=True), conversation_id=f"c{c}"))
                live[rid] = c
                next_turn[c] += 1
        out = s.schedule(float(step))
        cache.check_integrity()
        step += 1
        if not out.requests:
            if out.is_empty and not cache.has_pending_swap_outs:
                assert not s.has_unfinished(), "an empty step with work queued (the engine raises)"
                continue
            # copies only (or background swap-outs to wait for): the engine runs the step and
            # the runner reports every copy done
            s.update_from_output(out, RunnerOutput({}), float(step))
            cache.check_integrity()
            continue
        kinds.append(step_kinds(out))
        sampled = {}
        for sr in out.requests:
            if sr.sample:
                req = s.requests[sr.request_id]
                assert sr.context_len == req.num_tokens  # sampled at the newest position
                sampled[sr.request_id] = fake_token(req.all_token_ids)
        for req in s.update_from_output(out, RunnerOutput(sampled), float(step)):
            c = live.pop(req.request_id)
            outs[c].append(req.output_token_ids)
            ready_at[c] = step + convs[c][next_turn[c] - 1][2]
        if batching == "separate" and kinds[-1] == {"decode"}:
            # prefill priority: decodes ran because no prefill work was running
            assert all(is_decode(r, r.num_pending) for r in s.running)
        cache.check_integrity()
    return outs, kinds


def reference(convs: Turns) -> list[list[list[int]]]:
    outs: list[list[list[int]]] = []
    for turns in convs:
        history: list[int] = []
        mine = []
        for new, m, _ in turns:
            ctx = history + new
            gen: list[int] = []
            for _ in range(m):
                gen.append(fake_token(ctx + gen))
            mine.append(gen)
            history = ctx + gen
        outs.append(mine)
    return outs


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=multi_turn())
def test_separate_never_mixes_and_matches_unified(
        case: tuple[Turns, list[int], dict[str, int | str]]) -> None:
    convs, starts, setup = case
    want = reference(convs)
    sep, sep_kinds = drive("separate", convs, starts, setup)
    assert sep == want
    assert all(len(k) == 1 for k in sep_kinds), "a separate step mixed prefill and decode"
    uni, _ = drive("unified", convs, starts, setup)
    assert uni == want


def test_unified_does_mix() -> None:
    """The same driver sees mixed steps under unified batching (the check above is not
    vacuous)."""
    convs: Turns = [[([1] * 30, 8, 0)], [([2] * 30, 8, 0)], [([3] * 30, 8, 0)]]
    setup: dict[str, int | str] = {"policy": "pensieve", "gpu_blocks": 40, "cpu_blocks": 8,
                                   "decode_reserve": 10, "budget": 16, "max_seqs": 4}
    _, kinds = drive("unified", convs, [0, 3, 6], setup)
    assert any(len(k) == 2 for k in kinds)
    _, kinds = drive("separate", convs, [0, 3, 6], setup)
    assert all(len(k) == 1 for k in kinds) and {"prefill"} in kinds and {"decode"} in kinds


# ---------------------------------------------------------------- end to end, against HF
def make_engine(path: str, policy: str, batching: str, **kw: int):  # noqa: ANN201
    """The engine ``test_stateful_invariant.make_llm`` builds, with ``batching``."""
    from pensieve.engine.llm import build_engine_config
    from pensieve.engine.llm_engine import LLMEngine

    cfg = build_engine_config(model=path, dtype="float32", device=DEVICE, chunk_size=CHUNK,
                              cache_policy=policy, max_num_batched_tokens=64, **{**TIERS, **kw})
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler,
                                                                 batching=batching))
    engine = LLMEngine(cfg)
    engine.audit = True
    kinds: list[set[str]] = []
    inner = engine.runner.execute

    def execute(sched: SchedulerOutput) -> RunnerOutput:
        kinds.append(step_kinds(sched))
        return inner(sched)

    engine.runner.execute = execute  # type: ignore[method-assign]
    return engine, kinds


def run_engine(engine, workload: Workload) -> dict[int, list[list[int]]]:  # noqa: ANN001
    """``test_stateful_invariant.run`` on an engine: each round's turns in one batch."""
    outs: dict[int, list[list[int]]] = {}
    n = 0
    for rnd in workload:
        order = {}
        for c, ids, m in rnd:
            rid = f"r{n}"
            n += 1
            engine.add_request(rid, ids, SamplingParams(max_tokens=m, temperature=0.0,
                                                        ignore_eos=True),
                               conversation_id=f"c{c}")
            order[rid] = c
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out.output_token_ids
        for rid, c in order.items():
            outs.setdefault(c, []).append(done[rid])
    return outs


@pytest.mark.slow  # eight hypothesis workloads, two policies each; the fixed every-path one stays
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_separate_batches_match_hf(tiny_llama, workload: Workload) -> None:  # noqa: ANN001
    path, model = tiny_llama
    want = expected(Reference(model), workload)
    for policy in ("pensieve", "stateless"):
        engine, kinds = make_engine(path, policy, "separate")
        assert run_engine(engine, workload) == want, f"policy {policy} diverged"
        assert kinds and all(len(k) == 1 for k in kinds)


def test_separate_every_path_matches_hf(tiny_llama) -> None:  # noqa: ANN001
    """test_stateful_invariant's every-path workload (swaps, drops, suspensions, split ranges)
    in separate batches."""
    path, model = tiny_llama
    rng = random.Random(3)
    workload: Workload = []
    for r in range(3):
        rnd = [(c, [rng.randrange(VOCAB) for _ in range(rng.randint(18, 30))], 40 if r == 2 else 10)
               for c in range(5)]
        workload.append(rnd if r != 1 else rnd[::-1])
    want = expected(Reference(model), workload)
    engine, kinds = make_engine(path, "pensieve", "separate", num_gpu_blocks=30, num_cpu_blocks=8)
    assert run_engine(engine, workload) == want
    assert all(len(k) == 1 for k in kinds)
    assert {"prefill"} in kinds and {"decode"} in kinds
    stats = engine.cache_stats()
    for counter in ("cpu_hit_tokens", "recomputed_tokens", "swapped_in_tokens",
                    "suspended_requests"):
        assert stats[counter] > 0, (counter, stats)
