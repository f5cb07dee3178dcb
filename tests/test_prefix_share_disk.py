"""Shared prefixes with the disk tier and a restart: random workloads of conversations that
open with one system prompt, branches of another conversation's history, tiers small enough
that chunks move through GPU, CPU and disk, and a restart after the first round. Every policy
with a CPU tier (the disk tier lies below it) generates HF's greedy tokens from the full
history, and the engine's audit (reference counts, pools, the disk index) holds at every
step. A policy without a CPU tier and a disk tier is a clear error at start."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_disk_tier import make_llm
from test_prefix_share_tokens import shared_workload
from test_stateful_invariant import Reference, expected, run

from pensieve.core.eviction import POLICIES


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), gpu=st.sampled_from([16, 24]))
def test_shared_prefixes_through_disk_and_a_restart_match_hf(
        tiny_llama, tmp_path_factory, seed: int, gpu: int) -> None:  # noqa: ANN001
    path, model = tiny_llama
    ref = Reference(model)
    workload = shared_workload(seed, ref)
    want = expected(ref, workload)
    for policy in (name for name, p in POLICIES.items() if p.uses_cpu_tier):
        disk = str(tmp_path_factory.mktemp(f"disk-{policy}"))
        llm = make_llm(path, disk, cache_policy=policy, num_gpu_blocks=gpu, num_cpu_blocks=6)
        got = run(llm, workload[:1])
        conversations = {c for c, _, _ in workload[0]}
        histories = {c: llm.engine.conversation_history(f"c{c}") for c in conversations}
        llm.engine.shutdown()  # writes every idle chunk not on disk yet
        again = make_llm(path, disk, cache_policy=policy, num_gpu_blocks=gpu,
                         num_cpu_blocks=40)  # room for a step's reads from disk
        for c, hist in histories.items():
            again.engine.restore_conversation(f"c{c}", hist)
        for c, outs in run(again, workload[1:]).items():
            got.setdefault(c, []).extend(outs)
        assert got == want, f"policy {policy} diverged"
        stats = again.cache_stats()
        # round 2 continues from the files the first engine wrote; round 3's branches and
        # new turns take the system prompt's chunks from the continued conversations
        assert stats["disk_hit_tokens"] > 0 and stats["shared_hit_tokens"] > 0, (policy, stats)
        again.engine.cache.disk.check()
        again.engine.shutdown()


def test_disk_tier_without_a_cpu_tier_is_a_clear_error(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    import pytest

    path, _ = tiny_llama
    for policy in (name for name, p in POLICIES.items() if not p.uses_cpu_tier):
        with pytest.raises(ValueError, match="below the CPU tier"):
            make_llm(path, str(tmp_path), cache_policy=policy)
    with pytest.raises(ValueError, match="below the CPU tier"):
        make_llm(path, str(tmp_path), cache_policy="pensieve", num_cpu_blocks=0)
