"""Shared prefixes never change greedy outputs: conversations opening with one system prompt,
and branches of another conversation's history, under every policy and tiny tiers, generate
exactly what HF transformers generates from the full history."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pensieve.core.eviction import POLICIES
from tests.test_stateful_invariant import VOCAB, Reference, Workload, expected, make_llm, run


def shared_workload(seed: int, ref: Reference) -> Workload:
    """Round 1: conversations 0..n-1 open with one system prompt and a question of their own.
    Round 2: some continue. Round 3: new conversations branch from an earlier one's history
    (cut at a random point, then a new message), and some old ones continue."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(rng.randint(17, 40))]
    n = rng.randint(2, 4)
    workload: Workload = [[(c, system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                            rng.randint(1, 8)) for c in range(n)]]
    workload.append([(c, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))],
                      rng.randint(1, 8)) for c in rng.sample(range(n), rng.randint(1, n))])
    history: dict[int, list[int]] = {}
    for rnd in workload:  # the histories so far (the engine must reproduce them exactly)
        for c, ids, m in rnd:
            ctx = history.get(c, []) + ids
            history[c] = ctx + ref(ctx, m)
    last: list[tuple[int, list[int], int]] = []
    for k in range(rng.randint(1, 3)):
        src = history[rng.randrange(n)]
        cut = rng.randint(len(system), len(src))
        last.append((n + k, src[:cut] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
                     rng.randint(1, 8)))
    last += [(c, [rng.randrange(VOCAB)], rng.randint(1, 6)) for c in range(n) if rng.random() < .5]
    workload.append(last)
    return workload


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), gpu=st.sampled_from([24, 40]))
def test_every_policy_matches_hf_with_shared_prefixes_and_branches(
        tiny_llama, seed: int, gpu: int) -> None:  # noqa: ANN001
    path, model = tiny_llama
    ref = Reference(model)
    workload = shared_workload(seed, ref)
    want = expected(ref, workload)
    for policy in POLICIES:
        llm = make_llm(path, policy, num_gpu_blocks=gpu)
        assert run(llm, workload) == want, f"policy {policy} diverged"


def test_shared_tokens_are_counted_and_match(tiny_llama) -> None:  # noqa: ANN001
    """With room to keep them, the later conversations take the system prompt's full chunks
    from the first one (``shared_hit_tokens``), and still match HF; with sharing off they
    compute it (same tokens)."""
    path, model = tiny_llama
    ref = Reference(model)
    workload = shared_workload(7, ref)
    want = expected(ref, workload)
    for policy in ("pensieve", "lru", "prefix-lru", "gpu-only", "return"):
        llm = make_llm(path, policy, num_gpu_blocks=60)
        assert run(llm, workload) == want, policy
        assert llm.cache_stats()["shared_hit_tokens"] >= 16, policy  # two chunks of 8 at least
        assert llm.cache_stats()["shared_blocks"] > 0
    off = make_llm(path, "pensieve", num_gpu_blocks=60, share_prefixes=False)
    assert run(off, workload) == want
    assert off.cache_stats()["shared_hit_tokens"] == 0


def _first_turn(llm, rid: str, ids: list[int], tenant: str) -> dict[str, int]:  # noqa: ANN001
    """One conversation's first turn through the engine as ``tenant``; its cache counters."""
    from pensieve import SamplingParams

    eng = llm.engine
    eng.add_request(rid, ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                    conversation_id=rid, tenant=tenant)
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                assert out.cache_stats is not None
                return out.cache_stats
    raise AssertionError("no output")


def test_tenants_share_only_with_the_flag(tiny_llama) -> None:  # noqa: ANN001
    path, _ = tiny_llama
    prompt = list(range(3, 43))  # five full chunks of 8
    for across in (False, True):
        llm = make_llm(path, "pensieve", num_gpu_blocks=60,
                       share_prefixes_across_tenants=across)
        assert _first_turn(llm, "a", prompt + [1], "t1")["shared_hit_tokens"] == 0
        other = _first_turn(llm, "b", prompt + [2], "t2")["shared_hit_tokens"]
        same = _first_turn(llm, "c", prompt + [3], "t1")["shared_hit_tokens"]
        assert same == 40
        assert other == (40 if across else 0)


def cpu_shared_workload(seed: int) -> Workload:
    """Round 1: three conversations open with one system prompt (four full chunks of 8).
    Round 2: another with a prompt of its own that needs all but two GPU blocks, so the
    shared blocks leave the GPU (copied once to the CPU tier, all sharers holding the copy).
    Round 3: two new conversations open with the system prompt and take the CPU copies
    (``cpu_shared_tokens``), and the first three continue (swapping theirs in)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(32)]
    workload: Workload = [[(c, system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
                            rng.randint(1, 4)) for c in range(3)]]
    workload.append([(3, [rng.randrange(VOCAB) for _ in range(172)], 4)])
    workload.append([(c, system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
                      rng.randint(1, 4)) for c in (8, 9)]
                    + [(c, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
                        rng.randint(1, 4)) for c in range(3)])
    return workload


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000))
def test_every_policy_matches_hf_sharing_in_the_cpu_tier(tiny_llama, seed: int) -> None:  # noqa: ANN001
    """Shared blocks moved to the CPU tier and taken from there by new conversations (and
    swapped in by their old sharers) give HF's greedy tokens under every policy; under
    ``pensieve`` the CPU copies are shared (counted)."""
    path, model = tiny_llama
    ref = Reference(model)
    workload = cpu_shared_workload(seed)
    want = expected(ref, workload)
    for policy in POLICIES:
        llm = make_llm(path, policy, num_gpu_blocks=24, num_cpu_blocks=16)
        assert run(llm, workload) == want, f"policy {policy} diverged"
        if policy == "pensieve":
            assert llm.cache_stats()["cpu_shared_tokens"] >= 32, llm.cache_stats()
