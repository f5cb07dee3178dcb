"""Failure containment: an executor that raises on one request fails only that request; the
others' outputs are unchanged, the failed turn's conversation is left as it was before the turn
(a retry of the turn gives HF's greedy tokens), and the block accounting stays consistent
(audited after every step)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import transformers

from pensieve import SamplingParams
from pensieve.bench.engine_api import VirtualClock
from pensieve.core.outputs import QueryRange, RunnerOutput, ScheduledRequest, SchedulerOutput
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.engine.containment import execute_contained, restore_pending
from pensieve.engine.engine_core import EngineCore
from pensieve.engine.executor import Executor, TierSizes
from pensieve.engine.llm import build_engine_config
from pensieve.engine.llm_engine import LLMEngine
from pensieve.engine.request_output import RequestOutput
from pensieve.sim.simulator import SimEngine
from pensieve.sim.step_cost import StepCostModel

VOCAB = 256


class FailOn:
    """Runs each step on ``inner``, then raises, as a sampler would, if the step holds a
    request that ``when`` selects (its KV was written, its copies were made)."""

    def __init__(self, inner: Executor, when: Callable[[ScheduledRequest], bool]) -> None:
        self.inner = inner
        self.when = when
        self.calls = 0
        self.raised = 0

    @property
    def tiers(self) -> TierSizes:
        return self.inner.tiers

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.calls += 1
        out = self.inner.execute(sched)
        bad = [s.request_id for s in sched.requests if self.when(s)]
        if bad:
            self.raised += 1
            raise RuntimeError(f"sampler failed on {bad}")
        return out

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_restore_pending_merges_ranges_back() -> None:
    taken = [QueryRange(0, [1] * 64), QueryRange(200, [2] * 32)]
    assert restore_pending([(232, 260)], taken) == [(0, 64), (200, 260)]
    assert restore_pending([], [QueryRange(99, [5])]) == [(99, 100)]
    assert restore_pending([(300, 301)], [QueryRange(10, [1, 2])]) == [(10, 12), (300, 301)]


def _one(rid: str, n: int = 1) -> ScheduledRequest:
    return ScheduledRequest(rid, [0], [QueryRange(0, [1] * n)], True, SamplingParams(), 0)


def test_bisection_isolates_each_culprit_and_runs_the_rest() -> None:
    seen: list[list[str]] = []

    def execute(sched: SchedulerOutput) -> RunnerOutput:
        ids = [s.request_id for s in sched.requests]
        seen.append(ids)
        if "r2" in ids or "r6" in ids:
            raise ValueError("bad top_k")
        return RunnerOutput({i: 7 for i in ids}, step_time_s=1.0, swap_outs_in_flight=len(seen))

    step = execute_contained(execute, SchedulerOutput([_one(f"r{i}") for i in range(8)]))
    assert step.failed == {"r2": "ValueError: bad top_k", "r6": "ValueError: bad top_k"}
    assert sorted(step.output.sampled_token_ids) == ["r0", "r1", "r3", "r4", "r5", "r7"]
    assert step.executor_calls == len(seen) == 1 + 2 + 4 + 4  # whole, halves, quarters, pairs
    assert not any(seen[0] == s for s in seen[1:])
    ran = [s for s in seen if "r2" not in s and "r6" not in s]
    assert sorted(sum(ran, [])) == ["r0", "r1", "r3", "r4", "r5", "r7"]  # each once
    assert seen.count(["r2"]) == seen.count(["r6"]) == 1
    assert step.output.swap_outs_in_flight == len(seen)  # the last group's report
    assert step.output.step_time_s == 4.0  # groups that ran: r0 r1, r3, r4 r5, r7

    # Nothing reproduces alone (a transient error): nobody fails.
    flaky = iter([RuntimeError("transient")])

    def once(sched: SchedulerOutput) -> RunnerOutput:
        err = next(flaky, None)
        if err is not None:
            raise err
        return RunnerOutput({s.request_id: 1 for s in sched.requests})

    step = execute_contained(once, SchedulerOutput([_one("a"), _one("b")]))
    assert not step.failed and sorted(step.output.sampled_token_ids) == ["a", "b"]

    # Every request fails and the empty step too: the executor is broken, the step raises.
    calls = iter(range(100))

    def broken(sched: SchedulerOutput) -> RunnerOutput:
        raise OSError(f"device lost {next(calls)}")

    with pytest.raises(OSError, match="device lost 0$"):  # the first error
        execute_contained(broken, SchedulerOutput([_one("a"), _one("b")]))


Turns = dict[str, tuple[str, list[int], int]]


def _drive(eng: EngineCore, turns: Turns) -> dict[str, RequestOutput]:
    """Add the turns (request id -> (conversation, new ids, max tokens)), step to the end."""
    for rid, (cid, ids, n) in turns.items():
        eng.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        conversation_id=cid)
    outs: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            outs[o.request_id] = o
    assert set(outs) == set(turns)
    return outs


def test_simulated_culprits_fail_alone() -> None:
    clock = VirtualClock()
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16), 64, 64,
                    StepCostModel(base_s=1e-3), clock, lambda n: float(n), chunk_size=16)
    bad = {"t3", "t5"}
    eng = EngineCore(sim.scheduler, FailOn(sim.executor, lambda s: s.request_id in bad),
                     clock=clock.now)
    eng.audit = True
    outs = _drive(eng, {f"t{i}": (f"c{i}", [3] * (10 + 7 * i), 5) for i in range(8)})
    for rid, o in outs.items():
        if rid in bad:
            assert o.finish_reason == "error" and "sampler failed" in (o.error or "")
            assert eng.conversation_history(o.conversation_id or "") == []
        else:
            assert o.finish_reason == "length" and o.output_token_ids == [0] * 5
            assert o.error is None
    assert eng.cache_stats()["failed_requests"] == 2
    assert eng.failed_requests == 2
    eng.cache.check_integrity()


# ----------------------------------------------------------------------------- the real engine
def _hf(model: transformers.PreTrainedModel, context: list[int], n: int) -> list[int]:
    ids = torch.tensor([context])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(context):].tolist()


@pytest.mark.parametrize("at_output", [0, 3], ids=["prefill", "decode"])
def test_one_failing_request_among_concurrent_ones(tiny_llama, at_output: int) -> None:  # noqa: ANN001
    """Four conversations, tiers small enough to swap and drop; turn 2 of ``c1`` makes the
    executor raise (in its prefill step, or at its fourth token)."""
    path, model = tiny_llama
    base = LLMEngine(build_engine_config(model=path, dtype="float32", device="cpu",
                                         chunk_size=8, num_gpu_blocks=24, num_cpu_blocks=6,
                                         max_num_batched_tokens=64))
    faulty = FailOn(base.executor, lambda s: s.request_id == "c1-t2"
                    and s.num_output_tokens == at_output)
    eng = EngineCore(base.scheduler, faulty, clock=base.now, eos_token_ids=base.eos_token_ids,
                     vocab_size=base.vocab_size)
    eng.audit = True
    rng = random.Random(3)

    def new_ids(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    convs = [f"c{i}" for i in range(4)]
    turn1 = {f"{c}-t1": (c, new_ids(rng.randrange(20, 40)), 6) for c in convs}
    outs = _drive(eng, turn1)
    history = {c: eng.conversation_history(c) for c in convs}
    turn2 = {f"{c}-t2": (c, new_ids(rng.randrange(8, 24)), 6) for c in convs}
    outs |= _drive(eng, turn2)
    assert faulty.raised >= 1

    failed = outs["c1-t2"]
    assert failed.finish_reason == "error" and "sampler failed" in (failed.error or "")
    assert eng.conversation_history("c1") == history["c1"]  # as before the turn
    for c in convs:
        if c == "c1":
            continue
        o = outs[f"{c}-t2"]
        assert o.error is None
        assert o.output_token_ids == _hf(model, history[c] + turn2[f"{c}-t2"][1], 6)
        assert eng.conversation_history(c) == (history[c] + turn2[f"{c}-t2"][1]
                                               + o.output_token_ids)

    # The failed turn again, with the others' third turns: the conversation's KV (whatever
    # tier it is on) is intact.
    retry = {"c1-retry": ("c1", turn2["c1-t2"][1], 6)}
    turn3 = {f"{c}-t3": (c, new_ids(12), 4) for c in convs if c != "c1"}
    outs |= _drive(eng, retry | turn3)
    assert outs["c1-retry"].output_token_ids == _hf(model, history["c1"] + turn2["c1-t2"][1], 6)
    for rid, (c, ids, n) in turn3.items():
        ctx = history[c] + turn2[f"{c}-t2"][1] + outs[f"{c}-t2"].output_token_ids
        assert outs[rid].output_token_ids == _hf(model, ctx + ids, n)
    st = eng.cache_stats()
    assert st["failed_requests"] == 1
    assert st["swapped_out_tokens"] + st["dropped_tokens"] > 0  # the tiers were under pressure
    eng.cache.check_integrity()


class FailedCopy:
    """Runs each step on ``inner``; when the step swaps KV into a block of a request that
    ``when`` selects, that block's bytes are overwritten (as a copy that failed midway would
    leave them) and the step raises."""

    def __init__(self, inner: Executor, kv: list[torch.Tensor],
                 when: Callable[[ScheduledRequest], bool]) -> None:
        self.inner, self.kv, self.when = inner, kv, when
        self.raised = 0

    @property
    def tiers(self) -> TierSizes:
        return self.inner.tiers

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = self.inner.execute(sched)
        copied = {gpu for _, gpu in sched.swaps.swap_in}
        hit = [b for s in sched.requests if self.when(s) for b in s.block_table if b in copied]
        if hit:
            self.raised += 1
            for layer in self.kv:
                layer[:, hit] = 1e4
            raise RuntimeError(f"copy into blocks {hit} failed")
        return out

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_blocks_a_failed_steps_copies_were_to_fill_are_not_kept(tiny_llama) -> None:  # noqa: ANN001
    """A turn whose history is swapped in fails in that step, its swapped-in blocks left
    holding other bytes: the conversation keeps no chunk in those blocks (they are freed, the
    chunks recomputed), so the retry's tokens are HF's greedy tokens."""
    path, model = tiny_llama
    base = LLMEngine(build_engine_config(model=path, dtype="float32", device="cpu",
                                         chunk_size=8, num_gpu_blocks=14, num_cpu_blocks=24,
                                         max_num_batched_tokens=64))
    faulty = FailedCopy(base.executor, base.kv_caches, lambda s: s.request_id == "c0-t2")
    eng = EngineCore(base.scheduler, faulty, clock=base.now, eos_token_ids=base.eos_token_ids,
                     vocab_size=base.vocab_size)
    eng.audit = True
    rng = random.Random(5)

    def new_ids(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    history: dict[str, list[int]] = {}
    for c in ("c0", "c1", "c2"):  # c1 and c2 push c0's chunks to the CPU tier
        _drive(eng, {f"{c}-t1": (c, new_ids(30), 4)})
        history[c] = eng.conversation_history(c)
    ids = new_ids(6)
    outs = _drive(eng, {"c0-t2": ("c0", ids, 5)})
    assert faulty.raised == 1 and outs["c0-t2"].finish_reason == "error"
    assert eng.conversation_history("c0") == history["c0"]
    eng.cache.check_integrity()
    outs = _drive(eng, {"c0-retry": ("c0", ids, 5)})
    assert outs["c0-retry"].output_token_ids == _hf(model, history["c0"] + ids, 5)
