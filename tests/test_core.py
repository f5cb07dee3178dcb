"""The pure-Python core: block pool, KV manager and scheduler, with exact expectations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pensieve.core.block_pool import BlockPool, OutOfBlocksError
from pensieve.core.cache_config import CacheConfig
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput
from pensieve.core.request import Request, RequestStatus
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache


def stateless_cache(num_blocks: int, chunk_size: int, watermark: float = 0.0) -> TieredKVCache:
    """A stateless GPU-only cache: what the engine is for one-off requests."""
    return TieredKVCache(num_blocks, 0, lambda _: 1.0,
                         CacheConfig(chunk_size=chunk_size, decode_reserve=watermark,
                                     share_prefixes=False, defer_admission=0),
                         policy=get_policy("stateless"))


def test_core_imports_no_torch() -> None:
    code = (
        "import sys, pensieve, pensieve.core.scheduler, pensieve.core.tiered_cache, "
        "pensieve.core.outputs, pensieve.config, pensieve.engine.engine_core, "
        "pensieve.sim.simulator\n"
        "heavy = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\nprint('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_block_pool_lowest_first_and_double_free() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(2) == [1, 3]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.free([0])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([0])


def _req(rid: str, n: int, max_tokens: int = 4, **kw: object) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens,
                   temperature=0.0, **kw))  # type: ignore[arg-type]


def _run_step(s: Scheduler, token: int = 7) -> tuple[list[tuple[str, int, int, bool]], list[str]]:
    out = s.schedule()
    summary = [(r.request_id, r.ranges[0].start_pos, r.num_scheduled_tokens, r.sample)
               for r in out.requests]
    res = RunnerOutput({r.request_id: token for r in out.requests if r.sample})
    done = s.update_from_output(out, res)
    s.cache.check_integrity()
    return summary, [r.request_id for r in done]


def test_unified_batch_chunked_prefill_and_decode() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8, max_model_len=64)
    s = Scheduler(cfg, stateless_cache(64, 4, watermark=0.0))
    s.add_request(_req("a", 6, max_tokens=4))
    s.add_request(_req("b", 7, max_tokens=2))
    # step 1: a's whole prompt (6), b's first 4 tokens (chunked): no sample for b
    assert _run_step(s)[0] == [("a", 0, 6, True), ("b", 0, 4, False)]
    # step 2: a decodes one token, b finishes its prompt (3 tokens) and samples
    assert _run_step(s)[0] == [("a", 6, 1, True), ("b", 4, 3, True)]
    # step 3: both decode; b reaches max_tokens=2
    assert _run_step(s) == ([("a", 7, 1, True), ("b", 7, 1, True)], ["b"])
    assert _run_step(s) == ([("a", 8, 1, True)], ["a"])
    assert not s.has_unfinished()
    assert s.cache.gpu.num_free_blocks == 64


def test_stops_on_eos_and_stop_tokens_unless_ignore_eos() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(cfg, stateless_cache(32, 4, watermark=0.0))
    eos = Request("e", [1, 2], SamplingParams(max_tokens=9, temperature=0), eos_token_ids=(7,))
    ign = Request("i", [1, 2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                  eos_token_ids=(7,))
    stop = Request("s", [1, 2], SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[7]))
    for r in (eos, ign, stop):
        s.add_request(r)
    _, done = _run_step(s, token=7)
    assert sorted(done) == ["e", "s"]
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [7]
    _run_step(s, token=7)
    assert _run_step(s, token=7)[1] == ["i"]
    assert ign.status is RequestStatus.FINISHED_LENGTH and ign.output_token_ids == [7, 7, 7]


def test_running_cap_and_fcfs() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2, max_model_len=64)
    s = Scheduler(cfg, stateless_cache(64, 4, watermark=0.0))
    for rid in "abc":
        s.add_request(_req(rid, 3, max_tokens=1))
    assert [r[0] for r in _run_step(s)[0]] == ["a", "b"]
    assert [r[0] for r in _run_step(s)[0]] == ["c"]


def test_priority_orders_admission_lower_first() -> None:
    """vLLM's scheduling priority: lower first, equal ones in arrival order; a later turn of a
    lower value passes the waiting ones, not the running one."""
    cfg = SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=1, max_model_len=64)
    s = Scheduler(cfg, stateless_cache(64, 4, watermark=0.0))
    for rid, p in (("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5)):
        s.add_request(_req(rid, 3, max_tokens=1, priority=p))
    order = [_run_step(s)[0][0][0] for _ in range(2)]
    s.add_request(_req("f", 3, max_tokens=1, priority=-2))
    order += [_run_step(s)[0][0][0] for _ in range(4)]
    assert order == ["c", "a", "f", "d", "b", "e"]
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=1.5)  # type: ignore[arg-type]


def test_preemption_of_newest_and_recompute() -> None:
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens each take 2 blocks each.
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    s = Scheduler(cfg, stateless_cache(4, 4, watermark=0.0))
    a, b = _req("a", 7, max_tokens=4), _req("b", 7, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    assert _run_step(s)[0] == [("a", 0, 7, True), ("b", 0, 7, True)]
    # each now has 8 tokens: position 7 fits the second block; step runs both decodes
    assert _run_step(s)[0] == [("a", 7, 1, True), ("b", 7, 1, True)]
    # position 8 needs a third block each: b (newest) is preempted, a continues
    assert _run_step(s)[0] == [("a", 8, 1, True)]
    assert s.num_suspended == 1 and b.pending == []
    assert b.status is RequestStatus.WAITING
    # a finishes (4 tokens); only then are there blocks for b, recomputed from its
    # prompt and its 2 outputs (9 tokens) in one range
    assert _run_step(s) == ([("a", 9, 1, True)], ["a"])
    assert _run_step(s)[0] == [("b", 0, 9, True)]
    assert b.output_token_ids == [7, 7, 7]


def test_rejects_prompts_that_cannot_run() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=16)
    s = Scheduler(cfg, stateless_cache(8, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(_req("long", 16))
    s2 = Scheduler(SchedulerConfig(max_model_len=1000), stateless_cache(2, 4))
    with pytest.raises(ValueError, match="KV blocks"):
        s2.add_request(_req("big", 20))
    with pytest.raises(ValueError, match="empty prompt"):
        Request("x", [], SamplingParams())
    s.add_request(_req("ok", 3))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(_req("ok", 3))


def test_sampling_params_validation() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("bad", [{"top_k": 2**64}, {"top_k": -2}, {"seed": -1},
                                 {"seed": 2**63}, {"temperature": float("nan")},
                                 {"temperature": float("inf")}, {"stop_token_ids": (1.5,)},
                                 {"stop_token_ids": (-1,)}])
def test_sampling_params_reject_what_the_sampler_cannot_take(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
