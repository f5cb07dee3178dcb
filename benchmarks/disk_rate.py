"""The disk tier's write and read rates against the raw rate of the same disk (``dd``).

Writes ``--chunks`` chunks of one model shape's KV (all layers, ``[L, 2, C, Hkv, D]``) through
:class:`~pensieve.engine.disk_tier.DiskTier` (the engine's writer thread, one file per chunk,
header and crc32 included), then reads them back as a restarted engine does (a new tier scans
the directory; the files are read and checked in its thread pool, 16 a turn): all at
once (``read``), and one conversation at a time with each chunk copied into a CPU-tier block
before the next conversation is read (``restore``: what a server does turn by turn; buffers of
restored chunks are read into again; ``restore_copy_s`` is the part of it spent copying payloads
into the blocks). The CPU tier is chunk-major (``--layout``), one block's KV over all layers
contiguous, as the engine's on CUDA; ``layer-major`` is the engine's on the CPU. The raw
rate is ``dd`` of the same number of bytes in 1 MiB blocks, written with ``conv=fdatasync``
and without, then read. The tier's writes do not fsync (a crash loses at most the files not yet
flushed by the OS, never a half file under its name: writes go through a rename). Reads of
files just written come from the page cache unless the caches are dropped; both the tier's
and dd's reads here are of files just written, so they compare alike.

    python benchmarks/disk_rate.py --path /tmp/pensieve-disk-bench --chunks 128 \\
        --layers 32 --kv-heads 8 --head-dim 128 --chunk-size 32 --out disk_rate.json

``--measure copies`` times the host copies alone (a chunk between a chunk-major CPU tier and a
pageable buffer, both ways, on the copy pool) by torch's ``copy_`` and by
``disk_writes.host_copy``:

    python benchmarks/disk_rate.py --path /tmp/pensieve-disk-bench --measure copies \\
        --spill-chunks 200 --spill-repeat 5 --layers 32 --kv-heads 8 --head-dim 128 --chunk-size 32

``--measure spill`` times instead what a step with spills waits for: ``DiskTier.apply()`` of a
plan writing ``--spill-chunks`` chunks out of as many CPU-tier blocks (their bytes copied out
of the tier; the writes are queued, not waited for), ``--spill-repeat`` times with the writer
idle before each call (its earlier writes done), then as many times back to back (the writer
still busy with the calls before). Each call's chunks replace the previous call's on disk
(the tier holds ``--spill-chunks``).

    python benchmarks/disk_rate.py --path /tmp/pensieve-disk-bench --measure spill \\
        --spill-chunks 150 --blocks 150 --layers 32 --kv-heads 8 --head-dim 128 --chunk-size 32
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time

import torch
from json_out import emit_result
from tqdm import tqdm

from pensieve.core.disk_index import DiskEntry, spilled_key
from pensieve.engine.disk_tier import DiskTier
from pensieve.engine.kv_layout import KVLayout

_FP = "bench"


def _tier(path: str, args: argparse.Namespace, cpu: list[torch.Tensor]) -> DiskTier:
    return DiskTier(path, args.chunks, layout_of(args), _FP, cpu, cpu, read_gbps=None,
                    measure=True, read_threads=args.read_threads)


def layout_of(args: argparse.Namespace) -> KVLayout:
    """The KV layout of the options: bf16 chunks of ``--layers`` x ``--kv-heads`` x
    ``--head-dim`` x ``--chunk-size``."""
    return KVLayout(args.layers, args.kv_heads, args.head_dim, args.chunk_size, torch.bfloat16)


def cpu_tier(args: argparse.Namespace) -> list[torch.Tensor]:
    """The CPU tier's per-layer ``[2, blocks, C, Hkv, D]`` views, random bf16, of one
    ``[blocks, L, 2, C, Hkv, D]`` tensor (chunk-major) or one per layer (layer-major)."""
    block = (args.chunk_size, args.kv_heads, args.head_dim)
    if args.layout == "chunk-major":
        host = torch.randn((args.blocks, args.layers, 2, *block)).to(torch.bfloat16)
        return list(host.permute(1, 2, 0, 3, 4, 5).unbind(0))
    return [torch.randn((2, args.blocks, *block)).to(torch.bfloat16)
            for _ in range(args.layers)]


def _batches(tier: DiskTier) -> list[list[DiskEntry]]:
    """The tier's entries in the order written, 16 at a time (a conversation's turn)."""
    entries = sorted(tier.index.files.values(), key=lambda e: e.prefix_hash)
    return [entries[i:i + 16] for i in range(0, len(entries), 16)]


def tier_rates(args: argparse.Namespace) -> dict[str, float]:
    """Seconds and GB/s of the tier's writes (until its writer is idle) and reads."""
    cpu = cpu_tier(args)
    path = os.path.join(args.path, "tier")
    shutil.rmtree(path, ignore_errors=True)
    tier = _tier(path, args, cpu)
    t0 = time.perf_counter()
    for i in tqdm(range(args.chunks), desc="write", unit="chunk"):
        entry = DiskEntry("", i % 16, args.chunk_size, f"{i:032x}",
                          spilled_key((float(i), 0.0, "", 0.0)))
        assert tier.index.add(entry)
        tier.index.plan.writes.append((False, i % args.blocks, entry))
        tier.apply(tier.index.take_plan())
    tier.close(None)
    write_s = time.perf_counter() - t0
    nbytes = tier.bytes_written
    reader = _tier(path, args, cpu)
    assert reader.found == args.chunks, reader.found
    t0 = time.perf_counter()
    for batch in tqdm(_batches(reader), desc="read", unit="conversation"):
        reader.start_reads(batch)
    reader.collect()
    read_s = time.perf_counter() - t0
    ready = sum(e.ready for e in reader.index.files.values())
    assert ready == args.chunks, ready
    read_bytes = reader.bytes_read
    reader.close(None)
    # as a server restores: one conversation's turn at a time, read, checked and copied into
    # CPU-tier blocks, so later reads reuse the buffers of restored chunks
    reader = _tier(path, args, cpu)
    t0 = time.perf_counter()
    block = 0
    copy_s = 0.0
    for batch in tqdm(_batches(reader), desc="restore", unit="conversation"):
        reader.start_reads(batch)
        reader.collect()
        for entry in batch:
            assert entry.ready, entry.name
            reader.index.plan.reads.append((entry, block % args.blocks))
            block += 1
        t1 = time.perf_counter()
        reader.apply(reader.index.take_plan())
        copy_s += time.perf_counter() - t1
    restore_s = time.perf_counter() - t0
    reader.close(None)
    shutil.rmtree(path, ignore_errors=True)
    return {"chunk_bytes": tier.block_bytes, "bytes": nbytes, "write_s": write_s,
            "write_gbps": nbytes / write_s / 1e9, "read_s": read_s,
            "read_gbps": read_bytes / read_s / 1e9, "restore_s": restore_s,
            "restore_gbps": reader.bytes_read / restore_s / 1e9, "restore_copy_s": copy_s}


def spill_times(args: argparse.Namespace) -> dict[str, object]:
    """Milliseconds of each ``apply()`` spilling ``--spill-chunks`` CPU-tier blocks: with the
    writer idle before each (``spill_ms``), then back to back (``spill_busy_ms``)."""
    cpu = cpu_tier(args)
    n = args.spill_chunks
    path = os.path.join(args.path, "spill")
    shutil.rmtree(path, ignore_errors=True)
    tier = DiskTier(path, n, layout_of(args), _FP, cpu, cpu, read_gbps=None, measure=False)
    out: dict[str, list[float]] = {"spill_ms": [], "spill_busy_ms": []}
    calls = [("spill_ms", True)] * args.spill_repeat + [("spill_busy_ms", False)] * \
        args.spill_repeat
    for r, (series, idle) in enumerate(tqdm(calls, desc="spill", unit="apply")):
        for j in range(n):  # keys above the previous call's: they make room on disk
            entry = DiskEntry("", j, args.chunk_size, f"{r:08x}{j:024x}",
                              spilled_key((float(r * n + j), 0.0, "", 0.0)))
            assert tier.index.add(entry)
            tier.index.plan.writes.append((False, j % args.blocks, entry))
        if idle:
            tier.wait_writes()
        t0 = time.perf_counter()
        tier.apply(tier.index.take_plan())
        out[series].append((time.perf_counter() - t0) * 1e3)
    tier.close(None)
    shutil.rmtree(path, ignore_errors=True)
    assert tier.bytes_written == len(calls) * n * tier.block_bytes, tier.bytes_written
    return {"chunk_bytes": tier.block_bytes, "spill_chunks": n, **out}


def copy_times(args: argparse.Namespace) -> dict[str, object]:
    """Milliseconds of ``--spill-chunks`` host copies of one chunk each between a chunk-major
    CPU tier (pinned on CUDA, as the engine's) and pageable buffers, both ways, on the disk
    tier's copy pool (``disk_writes.COPY_THREADS`` threads), by torch's ``copy_`` (which
    splits a large copy over torch's intra-op threads) and by ``disk_writes.host_copy`` (one
    memmove per copy), ``--spill-repeat`` times each, alternated."""
    from pensieve.engine import disk_writes

    n, reps = args.spill_chunks, args.spill_repeat
    lay = layout_of(args)
    pin = torch.cuda.is_available()
    rows = torch.empty(n, lay.block_bytes, dtype=torch.uint8, pin_memory=pin).fill_(1)
    bufs = [torch.empty(lay.block_bytes, dtype=torch.uint8).fill_(2) for _ in range(n)]
    pool = disk_writes.copy_pool()
    ways = {"torch": lambda d, s: d.copy_(s), "host_copy": disk_writes.host_copy}
    out: dict[str, object] = {"chunk_bytes": lay.block_bytes, "chunks": n, "pinned": pin,
                              "torch_threads": torch.get_num_threads(),
                              "copy_threads": disk_writes.COPY_THREADS}
    for _ in tqdm(range(reps), desc="copies", unit="round"):
        for name, copy in ways.items():
            for way, pairs in (("out", [(bufs[i], rows[i]) for i in range(n)]),
                               ("in", [(rows[i], bufs[i]) for i in range(n)])):
                t0 = time.perf_counter()
                disk_writes.each(pool, lambda p, c=copy: c(*p), pairs)
                ms = (time.perf_counter() - t0) * 1e3
                out.setdefault(f"{name}_{way}_ms", []).append(ms)  # type: ignore[union-attr]
    pool.shutdown()
    for key in [k for k in out if k.endswith("_ms")]:
        best = min(out[key])  # type: ignore[type-var]
        out[key.replace("_ms", "_gbps")] = round(n * lay.block_bytes / (best / 1e3) / 1e9, 3)
    return out


def dd_rates(path: str, nbytes: int) -> dict[str, float]:
    """``dd`` of ``nbytes`` (in MiB blocks): written with and without fdatasync, then read."""
    f = os.path.join(path, "dd.bin")
    count = max(1, nbytes // 2**20)
    out: dict[str, float] = {}
    for name, extra in (("dd_write_fdatasync", ["conv=fdatasync"]), ("dd_write", [])):
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={count}", *extra],
                       check=True, capture_output=True)
        out[f"{name}_gbps"] = count * 2**20 / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    out["dd_read_gbps"] = count * 2**20 / (time.perf_counter() - t0) / 1e9
    os.remove(f)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True, help="a directory on the disk to measure")
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=16, help="CPU-tier blocks written from")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--read-threads", type=int, default=4)
    ap.add_argument("--layout", choices=("chunk-major", "layer-major"), default="chunk-major",
                    help="the CPU tier's layout (the engine's on CUDA / on the CPU)")
    ap.add_argument("--measure", choices=("rates", "spill", "copies"), default="rates",
                    help="the tier's rates against dd's, the time of a step's spills, or "
                    "host copies of chunks by torch and by host_copy")
    ap.add_argument("--spill-chunks", type=int, default=150,
                    help="chunks spilled per apply() (--measure spill)")
    ap.add_argument("--spill-repeat", type=int, default=5,
                    help="apply() calls with the writer idle, then as many back to back")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.makedirs(args.path, exist_ok=True)
    if args.measure in ("spill", "copies"):
        fn = spill_times if args.measure == "spill" else copy_times
        emit_result({"args": vars(args), **fn(args)}, args.out)
        return
    rates = tier_rates(args)
    result: dict[str, object] = {"args": vars(args), **rates, **dd_rates(args.path,
                                                                        int(rates["bytes"]))}
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
