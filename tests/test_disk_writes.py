"""The disk tier's pooled write buffers: a buffer whose write is done is filled again by a later
spill, but never one whose bytes were lent to a read (or a restore) while its write was
queued; files written from reused buffers hold their own chunks."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import pytest
import torch

import pensieve.engine.disk_files as disk_files
import pensieve.engine.disk_tier as disk_tier
import pensieve.engine.disk_writes as disk_writes
from pensieve.core.disk_index import DiskEntry, spilled_key
from pensieve.engine.disk_tier import DiskTier
from pensieve.engine.kv_layout import KVLayout

LAYERS, BLOCKS, CHUNK, HEADS, DIM = 3, 8, 4, 2, 8
LAYOUT = KVLayout(LAYERS, HEADS, DIM, CHUNK, torch.float32)
"""The caches' layout (float32, as ``torch.randn`` makes them)."""


def _entry(conv: str, i: int) -> DiskEntry:
    h = hashlib.blake2b(f"{conv}-{i}".encode(), digest_size=16).hexdigest()
    return DiskEntry("", i, CHUNK, h, spilled_key((float(i), 0.0, "", 0.0)))


def _cpu_tier(layout: str) -> list[torch.Tensor]:
    """Per-layer ``[2, BLOCKS, CHUNK, HEADS, DIM]`` views of one chunk-major tensor, or one
    tensor per layer."""
    if layout == "chunk-major":
        host = torch.randn(BLOCKS, LAYERS, 2, CHUNK, HEADS, DIM)
        return list(host.permute(1, 2, 0, 3, 4, 5).unbind(0))
    return [torch.randn(2, BLOCKS, CHUNK, HEADS, DIM) for _ in range(LAYERS)]


def _kv(cpu: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.stack([c[:, block] for c in cpu]).clone()  # [L, 2, C, Hkv, D]


@pytest.fixture(autouse=True)
def no_refill(monkeypatch: pytest.MonkeyPatch) -> None:
    """No buffers made ahead: these tests count the pool's buffers as the steps take and give
    them (the refill thread has its own test)."""
    monkeypatch.setattr(disk_writes, "WRITE_READY_BYTES", 0)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The writer waits for this event before each file it writes (a write stays queued)."""
    event = threading.Event()
    event.set()
    write_atomic = disk_files.write_atomic

    def gated(path: str, head: bytes, payload: memoryview) -> None:
        assert event.wait(30)
        write_atomic(path, head, payload)

    monkeypatch.setattr(disk_files, "write_atomic", gated)
    yield event
    event.set()


def _spill(tier: DiskTier, conv: str, block: int) -> DiskEntry:
    entry = _entry(conv, 0)
    assert tier.index.store(conv, entry, block, False)
    tier.apply(tier.index.take_plan())
    return entry


@pytest.mark.parametrize("layout", ["chunk-major", "layer-major"])
def test_a_write_buffer_lent_to_a_read_is_never_reused(tmp_path, layout: str,  # noqa: ANN001
                                                       gate: threading.Event) -> None:
    """A read of a file whose write is still queued takes the write's bytes; once the write is
    done its buffer stays the read's: later spills (which reuse every pooled buffer) do not
    overwrite it, and the chunk restored from it later is the chunk spilled."""
    torch.manual_seed(0)
    cpu = _cpu_tier(layout)
    tier = DiskTier(str(tmp_path / "tier"), 16, LAYOUT, "fp", cpu, cpu, read_threads=1)
    want = _kv(cpu, 0)
    gate.clear()
    a = _spill(tier, "a", 0)  # queued: the writer waits
    tier.start_reads([a])  # a prefetch of it takes the queued write's bytes
    tier.collect()
    assert a.ready and tier.bytes_read == 0
    gate.set()
    tier.wait_writes()
    assert tier.bytes_written == tier.block_bytes
    assert tier._writes.idle == 0  # lent: not back in the pool
    for c in cpu:  # block 0 is reused by other chunks
        c[:, 0].zero_()
    made = tier._writes.allocated
    for n, conv in enumerate("bcdef"):
        _spill(tier, conv, 1 + n)
        tier.wait_writes()
        assert tier._writes.idle == 1  # written: back in the pool, taken by the next spill
    assert tier._writes.allocated == made + 1  # one buffer, reused four times
    tier.index.plan.reads.append((a, 7))
    tier.apply(tier.index.take_plan())
    assert torch.equal(_kv(cpu, 7), want)
    tier.close(None)


def test_a_restore_from_a_queued_write_and_files_from_reused_buffers(
        tmp_path, gate: threading.Event) -> None:  # noqa: ANN001
    """A chunk restored while its write is queued gets the spilled bytes; every file, written
    from buffers reused across steps, reads back as its own chunk after a restart."""
    torch.manual_seed(1)
    cpu = _cpu_tier("chunk-major")
    path = str(tmp_path / "tier")
    tier = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=1)
    want = {conv: _kv(cpu, n) for n, conv in enumerate("abcd")}
    gate.clear()
    a = _spill(tier, "a", 0)
    tier.index.plan.reads.append((a, 6))  # restored in the next step, its write still queued
    b = _entry("b", 0)
    assert tier.index.store("b", b, 1, False)
    tier.apply(tier.index.take_plan())
    assert torch.equal(_kv(cpu, 6), want["a"])
    gate.set()
    tier.wait_writes()
    assert tier._writes.idle == 1  # b's buffer; a's was lent to the restore
    for n, conv in ((2, "c"), (3, "d")):
        _spill(tier, conv, n)
        tier.wait_writes()
    assert tier._writes.allocated == 2
    tier.close(None)
    for c in cpu:
        c.zero_()
    reader = DiskTier(path, 16, LAYOUT, "fp", cpu, cpu, read_threads=1)
    assert reader.found == 4
    entries = {conv: reader.index.files[_entry(conv, 0).name] for conv in "abcd"}
    reader.start_reads(list(entries.values()))
    reader.collect()
    for block, conv in enumerate("abcd"):
        assert entries[conv].ready, conv
        reader.index.plan.reads.append((entries[conv], block))
    reader.apply(reader.index.take_plan())
    for block, conv in enumerate("abcd"):
        assert torch.equal(_kv(cpu, block), want[conv]), conv
    reader.close(None)


def test_the_pool_is_bounded_and_skipped_writes_return_their_buffers(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    cpu = _cpu_tier("chunk-major")
    block_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 4
    monkeypatch.setattr(disk_writes, "WRITE_SPARE_BYTES", 2 * block_bytes)
    tier = DiskTier(str(tmp_path / "tier"), 16, LAYOUT, "fp", cpu, cpu, read_threads=1)
    for n in range(4):
        assert tier.index.store("a", _entry("a", n), n, False)
    tier.apply(tier.index.take_plan())
    tier.wait_writes()
    assert tier.bytes_written == 4 * block_bytes
    assert tier._writes.allocated == 4 and tier._writes.idle == 2  # two let go
    monkeypatch.setattr(disk_tier, "WRITE_BACKLOG_BYTES", 0)  # every write over the bound
    assert tier.index.store("b", _entry("b", 0), 5, False)
    tier.apply(tier.index.take_plan())
    assert tier.writes_skipped == 1 and tier._writes.idle == 2  # taken, and given back
    assert tier._writes.allocated == 4
    tier.collect()
    assert _entry("b", 0).name not in tier.index.files  # dropped, as a failed write
    tier.close(None)


def test_disk_rate_spill_measures_every_apply(tmp_path) -> None:  # noqa: ANN001
    """``disk_rate --measure spill``: one time per apply() with the writer idle and one per
    apply() back to back (the bench itself checks every chunk was written)."""
    import json

    import disk_rate

    out = tmp_path / "spill.json"
    disk_rate.main(["--path", str(tmp_path / "bench"), "--measure", "spill",
                    "--spill-chunks", "6", "--spill-repeat", "2", "--blocks", "4",
                    "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--chunk-size", "4",
                    "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["chunk_bytes"] == 2 * 2 * 4 * 2 * 8 * 2  # L * 2 * C * Hkv * D * bf16
    assert len(got["spill_ms"]) == 2 and len(got["spill_busy_ms"]) == 2
    assert all(t > 0 for t in got["spill_ms"] + got["spill_busy_ms"])


def test_disk_rate_copies_times_both_ways_of_copying(tmp_path) -> None:  # noqa: ANN001
    """``disk_rate --measure copies``: each way (torch's copy, host_copy) each direction,
    once a round, and a rate from the best round."""
    import json

    import disk_rate

    out = tmp_path / "copies.json"
    disk_rate.main(["--path", str(tmp_path / "bench"), "--measure", "copies",
                    "--spill-chunks", "6", "--spill-repeat", "2", "--layers", "2",
                    "--kv-heads", "2", "--head-dim", "8", "--chunk-size", "4",
                    "--out", str(out)])
    got = json.loads(out.read_text())
    for way in ("torch_out", "torch_in", "host_copy_out", "host_copy_in"):
        assert len(got[f"{way}_ms"]) == 2 and all(t > 0 for t in got[f"{way}_ms"])
        assert got[f"{way}_gbps"] > 0


def test_host_copy_copies_whole_contiguous_tensors_only() -> None:
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.zeros(256, dtype=torch.uint8)
    disk_writes.host_copy(dst, src)
    assert torch.equal(dst.view(torch.float32), src)
    for bad_dst, bad_src in ((dst[:128], src), (torch.zeros(64, 2)[:, 0], src),
                             (dst, src.view(8, 8).t())):
        with pytest.raises(ValueError):
            disk_writes.host_copy(bad_dst, bad_src)


@pytest.mark.parametrize("layout", ["chunk-major", "layer-major"])
@pytest.mark.parametrize("threads", [None, 3])
def test_a_steps_copies_on_the_copy_pool_move_every_chunk_whole(layout: str,
                                                                threads: int | None) -> None:
    """``copy_out`` and ``copy_in`` on the copy pool (enough chunks to use it) put each block's
    bytes where one thread would: every spilled block's KV in its buffer, every payload in its
    CPU block, the other blocks untouched."""
    cpu = _cpu_tier(layout)
    major = disk_writes.chunk_major_blocks(cpu)
    assert (major is not None) == (layout == "chunk-major")
    pool = disk_writes.copy_pool(threads) if threads else None
    n = disk_writes.PARALLEL_COPIES + 1
    spills = [(False, b, _entry("c", b)) for b in range(n)]
    bufs = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8) for _ in spills]
    before = [_kv(cpu, b) for b in range(BLOCKS)]
    disk_writes.copy_out(spills, bufs, cpu, [], major, pool)
    for b, buf in enumerate(bufs):
        assert torch.equal(buf.view(torch.float32).view(LAYOUT.chunk_shape), before[b])
    # restore block b's bytes into block (b + 1) % n: a rotation of the first n blocks
    restores = [(memoryview(bufs[b].numpy()), (b + 1) % n) for b in range(n)]
    disk_writes.copy_in(restores, cpu, major, LAYOUT.chunk_shape, torch.float32, pool)
    for b in range(BLOCKS):
        want = before[(b - 1) % n] if b < n else before[b]
        assert torch.equal(_kv(cpu, b), want)
    if pool is not None:
        pool.shutdown()


def test_the_refill_thread_keeps_buffers_ready_off_the_step() -> None:
    """With ``ready`` buffers to keep, the pool is filled ahead (no buffer made by ``take``
    while the pool has them) and filled again after steps take from it; a take past the
    pool makes the rest on the step; ``clear`` stops the thread."""
    import time

    pool = disk_writes.WriteBuffers(64, False, ready=3)

    def settle(n: int) -> None:
        deadline = time.monotonic() + 30
        while pool.idle < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.idle == n

    settle(3)
    assert pool.made_ahead == 3 and pool.allocated == 0
    bufs = pool.take(2)
    assert len(bufs) == 2 and pool.allocated == 0
    settle(3)  # refilled
    assert pool.made_ahead == 5
    more = pool.take(5)  # three idle, two made here
    assert len(more) == 5 and pool.allocated == 2
    assert all(b.numel() == 64 and b.dtype == torch.uint8 for b in bufs + more)
    settle(3)
    pool.clear()
    assert pool.idle == 0
    pool.take(1)  # closed: made on the step, the refill not started again
    assert pool.allocated == 3 and pool.idle == 0
