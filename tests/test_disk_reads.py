"""The disk tier's reads into reused buffers: a buffer whose payload was restored into a CPU
block is read into again, and neither the block restored before nor the next chunk is
corrupted by that."""

from __future__ import annotations

import torch

from pensieve.core.disk_index import DiskEntry, spilled_key
from pensieve.engine.disk_tier import DiskTier

LAYERS, BLOCKS, CHUNK, HEADS, DIM = 3, 8, 4, 2, 8


def _entry(conv: str, i: int) -> DiskEntry:
    return DiskEntry(conv, i, CHUNK, f"{conv}-{i}", spilled_key((float(i), 0.0, "", 0.0)))


def test_reused_read_buffers_restore_exact_bytes(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    shape = (2, BLOCKS, CHUNK, HEADS, DIM)
    cpu = [torch.randn(shape) for _ in range(LAYERS)]
    path = str(tmp_path / "tier")
    tier = DiskTier(path, 16, CHUNK, "fp", cpu, cpu, read_threads=2)
    want = {}
    for n, (conv, i) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)]):
        entry = _entry(conv, i)
        assert tier.index.add(entry)
        tier.index.plan.writes.append((False, n, entry))
        want[(conv, i)] = torch.stack([c[:, n] for c in cpu]).clone()
        tier.apply()
    tier.close(None)

    for c in cpu:
        c.zero_()
    reader = DiskTier(path, 16, CHUNK, "fp", cpu, cpu, read_threads=2)
    assert reader.found == 4
    restored = {}
    kept: set[int] = set()
    for conv, first_block in (("a", 0), ("b", 2)):
        reader.prefetch(conv)
        reader.collect()
        if kept:  # "b" is read into the buffers "a" was restored from
            assert {id(p.obj) for p in reader._loaded.values()} == kept
        spare_before = len(reader._spare)
        for i in (0, 1):
            entry = reader.index.get(conv, i)
            assert entry is not None and entry.ready
            reader.index.plan.reads.append((entry, first_block + i))
            restored[(conv, i)] = first_block + i
        reader.apply()
        assert len(reader._spare) == spare_before + 2  # both buffers kept for later reads
        kept = {id(b) for b in reader._spare}
    # every block holds its own chunk
    for key, block in restored.items():
        got = torch.stack([c[:, block] for c in cpu])
        assert torch.equal(got, want[key]), key
    reader.close(None)
