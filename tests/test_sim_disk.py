"""The simulator's disk tier (``bench/sim_disk.py``): the core's disk index and plans carried
out on virtual time. Reads are timed at the disk's rate and steps wait for them (while
requests run, only the turns waiting for them do); a long-idle
load over tiers too small for it gets disk hits from a fast disk and recomputes under a slow
one (the core's read-or-recompute choice at ``read_chunk_s``)."""

from __future__ import annotations

import heapq
import random

import pytest

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.disk_index import DiskEntry, spilled_key
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.sim.disk import SIM_DISK_PATH, SimDiskTier
from pensieve.sim.simulator import SimEngine
from pensieve.sim.step_cost import StepCostModel

CHUNK = 8
BLOCK_BYTES = 1 << 22  # 4 MiB a chunk: 1 GiB of disk holds 256
STEP = StepCostModel.analytic(num_params=13e9, num_layers=40, num_heads=40, num_kv_heads=10,
                              head_dim=128, chunk_size=CHUNK)
RECOMPUTE_S = 1e-3
"""Cost(l) of every chunk: reading (4 MiB) is sooner above 4.2 GB/s."""


def _entry(i: int) -> DiskEntry:
    return DiskEntry("", i, CHUNK, f"{i:032x}", spilled_key((1.0, 0.0, "c", float(i))))


def test_reads_take_their_time_and_a_step_waits_for_them() -> None:
    clock = VirtualClock(10.0)
    disk = SimDiskTier(16, CHUNK, BLOCK_BYTES, clock, read_gbps=2.0, write_gbps=1.0)
    read_s, write_s = BLOCK_BYTES / 2e9, BLOCK_BYTES / 1e9
    assert disk.index.read_chunk_s == pytest.approx(read_s)
    for i in range(3):
        assert disk.index.store("c", _entry(i), i, False)
    disk.index.plan.writes.clear()  # on disk already
    disk.prefetch("c")
    disk.prefetch("c")  # reads already under way are not queued twice
    assert disk.bytes_read == 3 * BLOCK_BYTES and clock.now() == 10.0
    disk.collect()  # one after another at the rate: the step starts when the last is done
    assert clock.now() == pytest.approx(10.0 + 3 * read_s)
    assert disk.read_wait_s == pytest.approx(3 * read_s) and disk.read_waits == 1
    assert all(e.ready for e in disk.index.of("c"))
    disk.collect()  # nothing left to wait for
    assert disk.read_waits == 1
    # writes are queued, never waited for; a chunk read back while its write is queued
    # comes from memory
    t = clock.now()
    for i in (3, 4):
        assert disk.index.store("c", _entry(i), block=i, from_gpu=False)
    disk.apply(disk.index.take_plan())
    assert clock.now() == t and disk.bytes_written == 2 * BLOCK_BYTES
    assert disk.write_backlog_max_s == pytest.approx(2 * write_s)
    disk.prefetch("c")
    disk.collect()
    assert clock.now() == t and disk.reads_from_memory == 2
    assert disk.bytes_read == 3 * BLOCK_BYTES
    clock.sleep_until(t + 10.0)  # the writes are done: a read is a disk read again
    disk.index.get("c", 3).ready = False  # type: ignore[union-attr]
    disk.prefetch("c")
    disk.collect()
    assert clock.now() == pytest.approx(t + 10.0 + read_s)
    disk.index.check()


def test_while_requests_run_a_step_takes_only_the_reads_done() -> None:
    """The engine's rule: with ``wait=False`` (requests run) nothing is waited for; the
    conversation whose reads still run stays in ``DiskIndex.reading`` until the last is done;
    the what-if ``wait="always"`` waits as before."""
    read_s = BLOCK_BYTES / 2e9
    for mode in ("running", "always"):
        clock = VirtualClock(10.0)
        disk = SimDiskTier(16, CHUNK, BLOCK_BYTES, clock, read_gbps=2.0, write_gbps=1.0,
                           wait=mode)
        for i in range(3):
            assert disk.index.store("c", _entry(i), i, False)
        disk.index.plan.writes.clear()  # on disk already
        disk.prefetch("c")
        disk.prefetch("c")  # the same turn waits for each read once
        assert disk.index.reading == {"c": 3}
        disk.collect(wait=False)
        if mode == "always":
            assert clock.now() == pytest.approx(10.0 + 3 * read_s)
            assert disk.index.reading == {} and all(e.ready for e in disk.index.of("c"))
            continue
        assert clock.now() == 10.0 and disk.read_waits == 0
        assert disk.index.reading == {"c": 3}
        clock.sleep_until(10.0 + 2.5 * read_s)  # two of the three are done
        disk.collect(wait=False)
        assert disk.index.reading == {"c": 1}
        assert sorted(e.index for e in disk.index.of("c") if e.ready) == [0, 1]
        disk.collect(wait=True)  # nothing runs: the step waits for the last
        assert clock.now() == pytest.approx(10.0 + 3 * read_s)
        assert disk.index.reading == {} and disk.read_waits == 1
        disk.index.check()


def _sim(clock: VirtualClock, read_gbps: float | None, prefetch: str = "all") -> SimEngine:
    """Tiers for ~3 conversations of ~200 tokens, a disk for all (None: no disk)."""
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8,
                                    max_model_len=512), 40, 24, STEP, clock,
                    lambda _l: RECOMPUTE_S, chunk_size=CHUNK, cache_policy="pensieve",
                    block_bytes=BLOCK_BYTES, vocab_size=256,
                    disk_kv_gb=None if read_gbps is None else 1.0, disk_read_gbps=read_gbps,
                    disk_prefetch=prefetch)
    sim.audit = True
    return sim


def _long_idle(sim: SimEngine, clock: VirtualClock, convs: int = 12, turns: int = 4
               ) -> dict[str, list[int]]:
    """Conversations that think for a minute between turns, more of them than the tiers
    hold; returns their histories (checked turn by turn against what was sent)."""
    heap = [(0.2 * i, f"c{i}", 0) for i in range(convs)]
    history: dict[str, list[int]] = {f"c{i}": [] for i in range(convs)}
    expect: dict[str, list[int]] = {}
    while heap or expect:
        while heap and heap[0][0] <= clock.now():
            _, cid, k = heapq.heappop(heap)
            rng = random.Random(f"{cid}:{k}")  # the same turn whatever the timing
            ids = [rng.randrange(1, 256) for _ in range(rng.randrange(20, 40))]
            expect[f"{cid}-t{k}"] = history[cid] + ids
            sim.add_request(f"{cid}-t{k}", ids, SamplingParams(max_tokens=12, ignore_eos=True),
                            conversation_id=cid)
        if not expect:
            clock.sleep_until(heap[0][0])
            continue
        for out in sim.step():
            cid, k = out.conversation_id, int(out.request_id.rsplit("t", 1)[1])
            assert out.prompt_token_ids == expect.pop(out.request_id)
            history[cid] = out.prompt_token_ids + out.output_token_ids
            if k + 1 < turns:
                heapq.heappush(heap, (clock.now() + 60.0 + 0.1 * int(cid[1:]), cid, k + 1))
        if sim.sim_disk is not None:
            sim.sim_disk.index.check()
    return history


def test_long_idle_load_hits_the_disk_or_recomputes_by_its_rate() -> None:
    runs = {}
    for name, gbps, prefetch in (
            ("none", None, "all"), ("fast", 100.0, "all"), ("slow", 1.0, "all"),
            ("skip", 1.0, "worth-reading"), ("fast-skip", 100.0, "worth-reading"),
            ("mid", 6.0, "worth-reading")):
        clock = VirtualClock()
        sim = _sim(clock, gbps, prefetch)
        history = _long_idle(sim, clock)
        runs[name] = (sim.cache_stats(), history, clock.now())
    none, fast, slow, skip, fast_skip = (runs[k][0] for k in ("none", "fast", "slow", "skip",
                                                               "fast-skip"))
    assert all(run[1] == runs["none"][1] for run in runs.values())  # the same turns, all done
    assert none["disk_hit_tokens"] == 0 and "disk_read_bytes" not in none
    assert none["recomputed_tokens"] > 0  # the tiers are too small for the load
    for st in (fast, slow):  # chunks leaving the CPU tier went to disk
        assert st["disk_written_tokens"] > 0 and st["disk_write_bytes"] > 0
        assert st["disk_read_bytes"] > 0  # read back when their turns came
    # fast: read back instead of recomputed
    assert fast["disk_hit_tokens"] > 0
    assert fast["disk_restored_chunks"] * CHUNK >= fast["disk_hit_tokens"]
    assert fast["recomputed_tokens"] < none["recomputed_tokens"]
    assert fast["recomputed_tokens"] + fast["disk_hit_tokens"] >= none["recomputed_tokens"] / 2
    # slow (4.2 ms a chunk against 1 ms to recompute it), reading every file (the what-if
    # "all"): the copies read come back, but the steps waited for the slow reads
    assert slow["disk_hit_tokens"] > 0
    assert slow["disk_read_wait_us"] > fast["disk_read_wait_us"] > 0
    # as the engine: a disk too slow to beat recomputation is not read at all
    assert skip["disk_reads_skipped"] > 0 and skip["disk_written_tokens"] > 0
    assert skip["disk_read_bytes"] == skip["disk_read_wait_us"] == skip["disk_hit_tokens"] == 0
    # and a fast one is read as before
    assert fast_skip["disk_reads_skipped"] == 0 and fast_skip["disk_hit_tokens"] > 0
    # at 0.7 ms a chunk against 1 ms every copy is read, and every copy read comes back
    mid = runs["mid"][0]
    assert mid["disk_reads_skipped"] == 0 and mid["disk_hit_tokens"] > 0
    assert mid["disk_restored_chunks"] * CHUNK >= mid["disk_hit_tokens"]
    assert mid["recomputed_tokens"] < none["recomputed_tokens"]


def test_from_options_needs_no_disk_path() -> None:
    opts = {"chunk_size": CHUNK, "num_gpu_blocks": 40, "num_cpu_blocks": 24,
            "cache_policy": "pensieve", "disk_kv_gb": 1.0, "disk_read_gbps": 6.0}
    sim = SimEngine.from_options(opts, STEP, VirtualClock(), lambda _l: RECOMPUTE_S,
                                 block_bytes=BLOCK_BYTES)
    assert sim.sim_disk is not None and sim.disk is sim.sim_disk
    assert sim.cache.disk is sim.sim_disk.index and sim.sim_disk.index.capacity == 256
    assert sim.sim_disk.read_gbps == 6.0 and SIM_DISK_PATH
    none = SimEngine.from_options({**opts, "disk_kv_gb": None}, STEP, VirtualClock(),
                                  lambda _l: RECOMPUTE_S, block_bytes=BLOCK_BYTES)
    assert none.disk is None and none.cache.disk is None
    with pytest.raises(ValueError, match="below the CPU tier"):
        SimEngine.from_options({**opts, "num_cpu_blocks": 0}, STEP, VirtualClock(),
                               lambda _l: RECOMPUTE_S, block_bytes=BLOCK_BYTES)
