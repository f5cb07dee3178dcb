"""The composition: tier sizing for the three executors (engine.tiers), the engine over any
Executor, and the pure modules' imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pensieve.config import FP8_SCRATCH_BYTES, CacheConfig, EngineConfig, ModelConfig
from pensieve.core.eviction import POLICIES
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.engine.engine_core import EngineCore
from pensieve.engine.executor import TierSizes
from pensieve.engine.tiers import (
    GIB,
    DeviceMemory,
    activation_bytes,
    build_cache,
    cpu_tier_blocks,
    gib_blocks,
    gpu_tier_blocks,
    tier_sizes,
)

BB = 1 << 20  # 1 MiB blocks


def _cfg(**cache: object) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(**cache),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=1024))


def test_gpu_tier_sizes() -> None:
    assert gpu_tier_blocks(_cfg(num_gpu_blocks=7, gpu_kv_gb=9.0), BB, None) == 7
    assert gpu_tier_blocks(_cfg(gpu_kv_gb=0.5), BB, None) == 512
    assert gpu_tier_blocks(_cfg(gpu_kv_gb=1e-9), BB, None) == 1  # at least one block
    # CPU device: every running request to max_model_len (4 x 1024/32 blocks), at most 2 GiB
    assert gpu_tier_blocks(_cfg(), BB, None) == 4 * 32
    assert gpu_tier_blocks(_cfg(), GIB, None) == 2
    # GPU: free - (1 - utilization) x total - activations
    mem = DeviceMemory(free_bytes=60 * GIB, total_bytes=80 * GIB, activation_bytes=2 * GIB)
    assert gpu_tier_blocks(_cfg(gpu_memory_utilization=0.9), GIB, mem) == 50
    assert gpu_tier_blocks(_cfg(gpu_memory_utilization=0.5), GIB, mem) == 18
    assert gpu_tier_blocks(_cfg(gpu_memory_utilization=0.1), GIB, mem) == 1


def test_activation_estimate_doubles_with_mixed_graphs() -> None:
    eager = EngineConfig(model=ModelConfig(enforce_eager=True))
    graphs = EngineConfig()
    one = activation_bytes(eager, 4096, 11008, 32000, 2, False)
    sc = eager.scheduler
    assert one == (sc.max_num_batched_tokens * (8 * 4096 + 3 * 11008) * 2
                   + sc.max_num_seqs * 32000 * 12 + GIB)
    assert activation_bytes(graphs, 4096, 11008, 32000, 2, False) == 2 * one
    # an FP8 KV cache (KVLayout.fp8): the prefill scratch
    assert activation_bytes(eager, 4096, 11008, 32000, 2, True) == one + FP8_SCRATCH_BYTES


def test_cpu_tier_sizes() -> None:
    assert cpu_tier_blocks(CacheConfig(num_cpu_blocks=5, cpu_kv_gb=3.0), BB, "cuda") == 5
    assert cpu_tier_blocks(CacheConfig(cpu_kv_gb=2.0), BB, "cpu") == 2048
    assert cpu_tier_blocks(CacheConfig(cpu_kv_gb=2.0), BB, "cpu", ranks=2) == 1024
    assert cpu_tier_blocks(CacheConfig(), BB, "cuda") == 32 * 1024
    assert cpu_tier_blocks(CacheConfig(), BB, "cpu") == 1024
    for policy in ("gpu-only", "stateless"):
        assert cpu_tier_blocks(CacheConfig(cache_policy=policy, num_cpu_blocks=5), BB,
                               "cpu") == 0


def test_sim_tiers_and_cache() -> None:
    def sim(**cache: object) -> EngineConfig:
        return EngineConfig(cache=CacheConfig(**cache))

    assert tier_sizes(sim(gpu_kv_gb=1.0, cpu_kv_gb=0.5), BB, "sim") == TierSizes(1024, 512, BB)
    assert tier_sizes(sim(num_gpu_blocks=3, num_cpu_blocks=4), None, "sim") == TierSizes(3, 4, 0)
    with pytest.raises(ValueError, match="num_cpu_blocks, or cpu_kv_gb and block_bytes"):
        tier_sizes(sim(num_gpu_blocks=3, cpu_kv_gb=1.0), None, "sim")
    with pytest.raises(ValueError):
        gib_blocks(1.0, 0)
    cc = CacheConfig(chunk_size=16)
    tiers = TierSizes(10, 20, BB)
    assert build_cache(tiers, float, cc, policy=POLICIES["pensieve"]).cpu.num_blocks == 20
    assert build_cache(tiers, float, cc, policy=POLICIES["gpu-only"]).cpu is None


class _Echo:
    """The smallest executor: token 5 for every sampling request."""

    def __init__(self, tiers: TierSizes) -> None:
        self.tiers = tiers
        self.steps = 0
        self.stopped = False

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        return RunnerOutput({s.request_id: 5 for s in sched.requests if s.sample})

    def stats(self) -> dict[str, int]:
        return {"swap_in_bytes": 3 * self.steps, "swap_out_bytes": 0}

    def shutdown(self) -> None:
        self.stopped = True


def test_engine_core_over_any_executor() -> None:
    cc = CacheConfig(chunk_size=4, decode_reserve=0.0, share_prefixes=False, defer_admission=0)
    cache = build_cache(TierSizes(16, 8, 0), float, cc)
    ex = _Echo(TierSizes(16, 8, 0))
    seen: list[int] = []
    eng = EngineCore(Scheduler(SchedulerConfig(max_model_len=64), cache), ex,
                     clock=lambda: 0.0, observers=[lambda r: seen.append(r.num_requests)])
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3), conversation_id="c")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.output_token_ids for o in outs] == [[5, 5, 5]]
    assert seen == [1, 1, 1] and ex.steps == 3
    assert eng.cache_stats()["swap_in_bytes"] == 9
    assert eng.conversation_history("c") == [1, 2, 3, 5, 5, 5]
    eng.shutdown()
    assert ex.stopped
    # A cache larger than the executor's tiers is refused.
    big = build_cache(TierSizes(32, 8, 0), float, cc)
    with pytest.raises(ValueError, match="does not fit"):
        EngineCore(Scheduler(SchedulerConfig(), big), ex)
    with pytest.raises(ValueError, match="does not fit"):
        eng.replace_scheduler(Scheduler(SchedulerConfig(), big))


def test_pure_modules_import_no_torch() -> None:
    code = ("import sys\n"
            "import pensieve.engine.engine_core, pensieve.engine.tiers\n"
            "import pensieve.engine.containment\n"
            "import pensieve.engine.executor, pensieve.sim.simulator\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
