"""The disk tier's reads into reused buffers: a buffer whose payload was restored into a CPU
block is read into again, and neither the block restored before nor the next chunk is
corrupted by that."""

from __future__ import annotations

import hashlib

import pytest
import torch

from pensieve.core.disk_index import DiskEntry, spilled_key
from pensieve.engine.disk_files import ReadBuffer
from pensieve.engine.disk_tier import DiskTier
from pensieve.engine.disk_writes import AheadCopies, chunk_major_blocks, copy_out, copy_pool
from pensieve.engine.kv_layout import KVLayout

LAYERS, BLOCKS, CHUNK, HEADS, DIM = 3, 8, 4, 2, 8
LAYOUT = KVLayout(LAYERS, HEADS, DIM, CHUNK, torch.float32)
"""The caches' layout (float32, as ``torch.randn`` makes them)."""


def _entry(conv: str, i: int) -> DiskEntry:
    """A full chunk's entry (named by its hash: here one per conversation and index)."""
    h = hashlib.blake2b(f"{conv}-{i}".encode(), digest_size=16).hexdigest()
    return DiskEntry("", i, CHUNK, h, spilled_key((float(i), 0.0, "", 0.0)))


def _cpu_tier(layout: str) -> list[torch.Tensor]:
    """Per-layer ``[2, BLOCKS, CHUNK, HEADS, DIM]`` views, random, of one chunk-major tensor
    (as the engine's CPU tier on CUDA) or one tensor per layer (layer-major)."""
    if layout == "chunk-major":
        host = torch.randn(BLOCKS, LAYERS, 2, CHUNK, HEADS, DIM)
        return list(host.permute(1, 2, 0, 3, 4, 5).unbind(0))
    return [torch.randn(2, BLOCKS, CHUNK, HEADS, DIM) for _ in range(LAYERS)]


def test_chunk_major_blocks_only_for_one_chunk_major_tensor() -> None:
    cpu = _cpu_tier("chunk-major")
    rows = chunk_major_blocks(cpu)
    assert rows is not None and rows.shape == (BLOCKS, LAYERS * 2 * CHUNK * HEADS * DIM)
    for b in (0, 5, BLOCKS - 1):  # row b is block b's KV over all layers, [L, 2, C, Hkv, D]
        assert torch.equal(rows[b].view(LAYERS, 2, CHUNK, HEADS, DIM),
                           torch.stack([c[:, b] for c in cpu]))
    assert chunk_major_blocks(_cpu_tier("layer-major")) is None
    assert chunk_major_blocks(cpu[::-1]) is None  # layers out of order
    assert chunk_major_blocks(cpu[1:]) is None  # not from the tensor's first layer on
    assert chunk_major_blocks([]) is None


@pytest.mark.parametrize("layout", ["chunk-major", "layer-major"])
def test_reused_read_buffers_restore_exact_bytes(tmp_path, layout: str,  # noqa: ANN001
                                               monkeypatch) -> None:  # noqa: ANN001
    import pensieve.engine.disk_tier as disk_tier

    monkeypatch.setattr(disk_tier, "RESTORED_LOADED_BYTES", 0)  # restored: buffers reused
    torch.manual_seed(0)
    cpu = _cpu_tier(layout)
    path = str(tmp_path / "tier")
    tier = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=2)
    assert (tier._cpu_blocks is not None) == (layout == "chunk-major")
    want = {}
    for n, (conv, i) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)]):
        entry = _entry(conv, i)
        assert tier.index.store(conv, entry, n, False)
        tier.index.plan.writes.clear()
        tier.index.plan.writes.append((False, n, entry))
        want[(conv, i)] = torch.stack([c[:, n] for c in cpu]).clone()
        tier.apply(tier.index.take_plan())
    tier.close(None)

    for c in cpu:
        c.zero_()
    reader = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=2)
    assert reader.found == 4
    restored = {}
    kept: set[int] = set()
    for conv, first_block in (("a", 0), ("b", 2)):
        # a turn of ``conv`` reads its two chunks (by hash: after a restart no one holds them)
        reader.start_reads([reader.index.files[_entry(conv, i).name] for i in (0, 1)])
        reader.collect()
        if kept:  # "b" is read into the buffers "a" was restored from
            assert {id(p.obj) for p in reader._loaded.values()} == kept
        spare_before = len(reader._spare)
        for i in (0, 1):
            entry = reader.index.files.get(_entry(conv, i).name)
            assert entry is not None and entry.ready
            reader.index.plan.reads.append((entry, first_block + i))
            restored[(conv, i)] = first_block + i
        reader.apply(reader.index.take_plan())
        assert len(reader._spare) == spare_before + 2  # both buffers kept for later reads
        assert all(isinstance(b, ReadBuffer) for b in reader._spare)
        kept = {id(b) for b in reader._spare}
    # every block holds its own chunk
    for key, block in restored.items():
        got = torch.stack([c[:, block] for c in cpu])
        assert torch.equal(got, want[key]), key
    untouched = set(range(BLOCKS)) - set(restored.values())  # no copy spilled past its block
    assert all(not c[:, b].any() for c in cpu for b in untouched)
    reader.close(None)


def test_slow_disk_reads_nothing_back_and_the_writer_backlog_is_bounded(
        tiny_llama, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A disk slower than recomputation is not read (the prefetch skips every file, so no step
    waits for reads the admission would not use), the tokens are still HF's; and spills past
    the writer's backlog bound are dropped instead of queued."""
    from test_disk_tier import make_llm
    from test_stateful_invariant import Reference, every_path_workload, expected, run

    import pensieve.engine.disk_tier as disk_tier

    path, model = tiny_llama
    workload = every_path_workload()
    want = expected(Reference(model), workload)
    slow = make_llm(path, str(tmp_path / "slow"), disk_read_gbps=1e-9)
    assert run(slow, workload) == want
    st = slow.cache_stats()
    assert st["disk_written_tokens"] > 0 and st["disk_hit_tokens"] == 0, st
    tier = slow.engine.disk_tier
    assert tier.reads_skipped > 0 and tier.bytes_read == 0
    slow.engine.shutdown()

    monkeypatch.setattr(disk_tier, "WRITE_BACKLOG_BYTES", 0)  # every write over the bound
    full = make_llm(path, str(tmp_path / "full"))
    assert run(full, workload) == want
    assert full.engine.disk_tier.writes_skipped > 0
    assert full.engine.disk_tier.bytes_written == 0
    full.engine.shutdown()


@pytest.mark.parametrize("layout", ["chunk-major", "layer-major"])
def test_spilled_blocks_are_copied_out_in_plan_order(layout: str) -> None:
    """A step's spills from both tiers, gathered per tier at once, give each entry its own
    block's bytes, ``[L, 2, C, Hkv, D]``, in the plan's order; so do the copies of chunks
    written ahead (``AheadCopies``, on the pool beside the step), handed on in order."""
    torch.manual_seed(1)
    cpu = _cpu_tier(layout)
    gpu = _cpu_tier("layer-major")  # the device cache's layout (here on the CPU)
    block_bytes = LAYOUT.block_bytes
    spills = [(False, 5, _entry("a", 0)), (True, 2, _entry("a", 1)), (False, 1, _entry("b", 0)),
              (True, 7, _entry("b", 1)), (False, 6, _entry("c", 0))]
    bufs = [torch.empty(block_bytes, dtype=torch.uint8) for _ in spills]
    pool = copy_pool(3)
    copy_out(spills, bufs, cpu, gpu, chunk_major_blocks(cpu), pool)
    ahead = [(b, e) for g, b, e in spills if not g] + [(3, _entry("d", 0)), (0, _entry("e", 0))]
    ahead_bufs = [torch.empty(block_bytes, dtype=torch.uint8) for _ in ahead]
    copies = AheadCopies(pool, cpu, chunk_major_blocks(cpu), threads=2)
    copies.start(ahead, ahead_bufs)
    assert len(copies) == len(ahead)
    handed: list[tuple[DiskEntry, torch.Tensor]] = []
    copies.wait(lambda e, buf: handed.append((e, buf)))
    assert len(copies) == 0 and [e for e, _ in handed] == [e for _, e in ahead]
    got = list(zip([s[:2] for s in spills], bufs)) + [((False, b), buf) for (b, _), (_, buf)
                                                      in zip(ahead, handed)]
    for (on_gpu, block), buf in got:
        want = torch.stack([c[:, block] for c in (gpu if on_gpu else cpu)])
        assert buf.dtype == torch.uint8 and buf.numel() == block_bytes
        assert torch.equal(buf.view(torch.float32).view(want.shape), want), (on_gpu, block)
    for c in cpu:  # copies, not views of the tier: a block reused after the step is safe
        c.zero_()
    assert all(buf.any() for _, buf in got)
    pool.shutdown()


def test_a_restored_payload_is_kept_for_other_turns(tmp_path) -> None:  # noqa: ANN001
    """A chunk restored into one block stays ready (its bytes in memory, under
    RESTORED_LOADED_BYTES): a second turn restores it into another block without a read."""
    torch.manual_seed(2)
    cpu = _cpu_tier("chunk-major")
    path = str(tmp_path / "tier")
    tier = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=1)
    entry = _entry("a", 0)
    assert tier.index.store("a", entry, 0, False)
    want = torch.stack([c[:, 0] for c in cpu]).clone()
    tier.apply(tier.index.take_plan())
    tier.close(None)
    reader = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=1)
    found = reader.index.files[entry.name]
    reader.start_reads([found])
    reader.collect()
    read = reader.bytes_read
    assert found.ready and read > 0
    for block in (3, 5):  # two turns, in two steps
        reader.index.plan.reads.append((found, block))
        reader.apply(reader.index.take_plan())
        assert found.ready and reader.bytes_read == read
        assert torch.equal(torch.stack([c[:, block] for c in cpu]), want)
    reader.close(None)


def test_a_step_does_not_wait_for_reads_still_running(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """``collect(wait=False)`` takes only the reads that are done: a read still running stays,
    and the conversations whose turn waits for it stay in ``DiskIndex.reading`` (one count
    per file, however many times a turn asks for it) until it is taken; ``collect()`` waits."""
    import threading

    import pensieve.engine.disk_files as disk_files

    cpu = _cpu_tier("chunk-major")
    path = str(tmp_path / "tier")
    tier = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=2)
    for n in (0, 1):
        entry = _entry("a", n)
        assert tier.index.store("a", entry, n, False)
        tier.index.plan.writes.clear()
        tier.index.plan.writes.append((False, n, entry))
        tier.apply(tier.index.take_plan())
    tier.close(None)

    reader = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=2)
    gate = threading.Event()
    slow_name = _entry("a", 1).name
    read_file = disk_files.read_file

    def gated(p: str, spare: object) -> object:
        if p.endswith(slow_name):
            assert gate.wait(60), "the test never opened the gate"
        return read_file(p, spare)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_files, "read_file", gated)
    entries = [reader.index.files[_entry("a", i).name] for i in (0, 1)]
    reader.start_reads(entries, "conv-x")
    reader.start_reads(entries[1:], "conv-x")  # asked again: still one count
    reader.start_reads(entries[1:], "conv-y")  # another turn waits for the same file
    assert reader.index.reading == {"conv-x": 2, "conv-y": 1}
    fast = reader._reads[entries[0].name][1]
    fast.result(timeout=60)  # the ungated read is done
    reader.collect(wait=False)
    assert entries[0].ready and not entries[1].ready
    assert reader.index.reading == {"conv-x": 1, "conv-y": 1}
    gate.set()
    reader.collect()  # waits for the rest
    assert entries[1].ready and reader.index.reading == {}
    reader.close(None)


def test_a_turn_whose_reads_still_run_waits_while_others_run(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """The scheduler admits no turn whose conversation is in ``DiskIndex.reading`` while
    other requests run: it passes over it (in its place in the queue) to the turns behind,
    and admits it once the reads are taken."""
    from test_disk_tier import make_llm

    from pensieve import SamplingParams

    path, _ = tiny_llama
    llm = make_llm(path, str(tmp_path))
    eng = llm.engine
    eng.add_request("r1", list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True),
                    conversation_id="c1")
    eng.step()  # r1 runs
    assert [r.request_id for r in eng.scheduler.running] == ["r1"]
    disk = eng.cache.disk
    assert disk is not None
    disk.reading["c2"] = 1  # as if c2's turn waited for a read still running
    eng.add_request("r2", list(range(40, 50)), SamplingParams(max_tokens=2, ignore_eos=True),
                    conversation_id="c2")
    disk.reading["c2"] = 1  # add_request's prefetch found nothing to read: keep it waiting
    eng.add_request("r3", list(range(60, 70)), SamplingParams(max_tokens=30, ignore_eos=True),
                    conversation_id="c3")
    eng.add_request("r4", list(range(80, 90)), SamplingParams(max_tokens=30, ignore_eos=True),
                    conversation_id="c4")
    eng.step()  # r2 is passed over, r3 and r4 behind it are admitted
    assert [r.request_id for r in eng.scheduler.running] == ["r1", "r3", "r4"]
    assert [r.request_id for r in eng.scheduler.waiting] == ["r2"]
    eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == ["r2"]
    del disk.reading["c2"]  # its reads were taken
    eng.step()
    assert {r.request_id for r in eng.scheduler.running} == {"r1", "r2", "r3", "r4"}
    assert not eng.scheduler.waiting
    while eng.scheduler.has_unfinished():
        eng.step()
    llm.engine.shutdown()


def test_a_queued_turn_s_wait_for_its_reads_is_counted_once(tmp_path) -> None:  # noqa: ANN001
    """A turn that waits for two reads counts one wait, from its first read started to its
    last collected; the readers' busy time and the wait appear in the tier's stats (the
    server's ``pensieve_disk_read_*`` metrics)."""
    torch.manual_seed(3)
    cpu = _cpu_tier("chunk-major")
    path = str(tmp_path / "tier")
    tier = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=2)
    for n, i in enumerate((0, 1)):
        entry = _entry("a", i)
        assert tier.index.store("a", entry, n, False)
        tier.apply(tier.index.take_plan())
    tier.close(None)
    reader = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=2)
    entries = [reader.index.files[_entry("a", i).name] for i in (0, 1)]
    reader.start_reads(entries[:1], waiter="t")
    reader.start_reads(entries[1:], waiter="t")  # the same turn: still one wait
    assert reader.index.reading == {"t": 2}
    reader.collect()
    assert reader.index.reading == {} and reader.read_waits == 1 and reader.read_wait_s > 0
    st = reader.stats()
    assert st["disk_read_waits"] == 1 and st["disk_read_wait_us"] > 0
    assert st["disk_read_busy_us"] > 0 and st["disk_read_bytes"] >= 2 * reader.block_bytes
    reader.start_reads(entries, waiter="u")  # ready now: nothing to wait for
    assert "u" not in reader.index.reading and reader.read_waits == 1
    reader.close(None)
