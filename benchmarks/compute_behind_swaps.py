"""When does compute issued after a swap step's layer-0 wait run, once the compute stream has
done host copies of its own?

A step of 256 swap-ins and 256 background swap-outs (``staged``, random block ids, the 13B
GQA-10 shape) is issued; the compute stream waits for layer 0 (``layer_ready(0)``), records
a mark, runs a 4096^3 bf16 GEMM, records a mark, uploads 8 MB from pinned memory, records a
mark. Before the steps, the compute stream itself copies a quarter of the CPU tier to the GPU
and back four times (``--own-copies``), as ``swap_bandwidth.py``'s raw rows do on the default
stream. Measured on the H200 (``docs/results/swap_batched/compute_behind_swaps/``): with
those copies, the layer-0 mark and the GEMM came at 33-41 ms, the end of the step's copies;
without them (``swap_timeline.py --bare``) layer 0 was usable at ~5.5 ms.

    python benchmarks/compute_behind_swaps.py --own-copies both --compute-stream default

``--own-copies pinned`` copies to and from an ordinary pinned buffer instead of the CPU tier,
``pinned-h2d`` only to the GPU (the runner's kind of upload), ``tolist`` reads a small tensor
back with ``.tolist()`` (the sampler's kind), ``none`` none at all (not yet run on the GPU).
``--all`` runs every variant, each in a process of its own. Every step ends with an 8 MB
pinned upload on the compute stream, so with ``none`` the first step is the only one with no
copy on that stream before it.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from pensieve.core.outputs import SwapPlan
from pensieve.runner.model_runner import allocate_kv_caches
from pensieve.runner.swapper import KVSwapper

sys.path.insert(0, str(Path(__file__).parent))
from swap_bandwidth import plans  # noqa: E402

VARIANTS = ["both", "h2d", "d2h", "pinned", "pinned-h2d", "tolist", "none"]


def run_all(chunks: int, reps: int) -> None:
    """Every variant, with the default stream and a pool stream, each in a fresh process
    (the state under test lives in the process)."""
    import subprocess

    for stream in ("default", "pool"):
        for v in VARIANTS:
            subprocess.run([sys.executable, __file__, "--own-copies", v, "--compute-stream",
                            stream, "--chunks", str(chunks), "--reps", str(reps)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--own-copies", default="both",
                    choices=VARIANTS)
    ap.add_argument("--all", action="store_true",
                    help="every --own-copies variant and both streams, a process each")
    ap.add_argument("--compute-stream", default="default", choices=["default", "pool"],
                    help="the legacy default stream, or a pool stream made current")
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    if args.all:
        run_all(args.chunks, args.reps)
        return
    if args.compute_stream == "pool":
        torch.cuda.set_stream(torch.cuda.Stream())
    n = args.chunks
    num_gpu, num_cpu = 2 * n + n // 2, 2 * n
    caches = allocate_kv_caches(40, num_gpu, 32, 10, 128, torch.bfloat16, torch.device("cuda"))
    sw = KVSwapper(caches, num_cpu, "staged")
    elems = num_cpu * sw.block_bytes // 4
    flat = sw.host_tier.view(-1)
    if args.own_copies.startswith("pinned"):
        flat = torch.empty(elems, dtype=flat.dtype, pin_memory=True)
    dev = caches[0].reshape(-1)[:elems]
    pin = torch.empty(1 << 20, dtype=torch.int64, pin_memory=True)
    for _ in range(4):  # the compute stream's own copies
        if args.own_copies in ("both", "h2d", "pinned", "pinned-h2d"):
            dev.copy_(flat[:elems], non_blocking=True)
        if args.own_copies in ("both", "d2h", "pinned"):
            flat[:elems].copy_(dev, non_blocking=True)
        if args.own_copies == "tolist":
            dev[:64].tolist()
    torch.cuda.synchronize()
    p = plans(n, "random", num_gpu, num_cpu, random.Random(f"0{n}random"))
    plan = SwapPlan(swap_in=[(c, g) for g, c in p["in"]], swap_out=p["out"])
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.reps):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        ready = sw.start_step(plan)
        assert ready is not None
        ready(0)
        ev[1].record()
        a @ a
        ev[2].record()
        pin.to("cuda", non_blocking=True)
        ev[3].record()
        sw.end_step()
        sw.finish_step()
        torch.cuda.synchronize()
        print(f"own copies {args.own_copies}, compute stream {args.compute_stream}: "
              "layer0 mark %.2f, gemm done %.2f, upload done %.2f ms"
              % tuple(ev[0].elapsed_time(e) for e in ev[1:]), flush=True)


if __name__ == "__main__":
    main()
