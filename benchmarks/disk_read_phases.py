"""Where one disk-tier reader thread's time goes, per chunk file: the read into a fresh
buffer (``bytearray``, ``np.empty``, the tier's ``disk_files.new_buffer``) and into a reused
one, ``bytearray(n)`` alone, crc32, and the restore's copy into a CPU tier (per layer into a
layer-major or a chunk-major tier, or one contiguous copy). Files of random bytes in
``--path``, one thread (docs/performance_history.md, "The read path, profiled and changed").

    python benchmarks/disk_read_phases.py --path /tmp/dread_phases --chunks 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pensieve.engine import disk_files

L, SHAPE = 32, (2, 32, 8, 128)  # llama3.1-8b: layers, [2, C, Hkv, D]; bf16: 4 MiB a chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True)
    ap.add_argument("--chunks", type=int, default=64)
    args = ap.parse_args()
    n_chunks, n = args.chunks, L * int(np.prod(SHAPE)) * 2
    os.makedirs(args.path, exist_ok=True)
    files = [os.path.join(args.path, f"{i}.kv") for i in range(n_chunks)]
    for f in files:
        with open(f, "wb") as out:
            out.write(os.urandom(n))

    def timed(label: str, fn: Callable[[int], Any]) -> list[Any]:
        t0 = time.perf_counter()
        kept = [fn(i) for i in range(n_chunks)]
        s = time.perf_counter() - t0
        print(f"{label:44s} {s / n_chunks * 1e3:6.2f} ms/chunk {n_chunks * n / s / 1e9:6.2f} GB/s")
        return kept

    def read_into(make: Callable[[int], Any]) -> Callable[[int], Any]:
        def read(i: int) -> Any:
            buf = make(n)
            with open(files[i], "rb", buffering=0) as f:
                f.readinto(memoryview(buf))
            return buf
        return read

    timed("read into fresh bytearray (kept)", read_into(bytearray))
    timed("read into fresh np.empty (kept)", read_into(lambda k: np.empty(k, np.uint8)))
    bufs = timed("read into fresh disk_files.new_buffer (kept)", read_into(disk_files.new_buffer))
    timed("read into reused buffer", lambda i: disk_files.read_file(files[i], bufs[i]))
    timed("bytearray(n) alone (kept)", lambda i: bytearray(n))
    timed("zlib.crc32", lambda i: zlib.crc32(bufs[i]))
    src = [torch.from_numpy(np.asarray(b)[:n]).view(torch.bfloat16).view(L, *SHAPE)
           for b in bufs]
    blocks = 16
    layer_major = [torch.empty((SHAPE[0], blocks, *SHAPE[1:]), dtype=torch.bfloat16)
                   for _ in range(L)]
    host = torch.empty((blocks, L, *SHAPE), dtype=torch.bfloat16)
    chunk_major = list(host.permute(1, 2, 0, 3, 4, 5).unbind(0))

    def per_layer(caches: list[torch.Tensor]) -> Callable[[int], None]:
        def copy(i: int) -> None:
            for layer, c in enumerate(caches):
                c[:, i % blocks].copy_(src[i][layer])
        return copy

    timed("copy: per layer, layer-major tier", per_layer(layer_major))
    timed("copy: per layer, chunk-major tier", per_layer(chunk_major))
    timed("copy: one contiguous, chunk-major tier",
          lambda i: host[i % blocks].copy_(src[i]))
    shutil.rmtree(args.path, ignore_errors=True)


if __name__ == "__main__":
    main()
