"""Do a step's own small host copies (input uploads, the sampled tokens' read-back) make
its compute or its swaps wait behind other swap copies?

The runner's step (:meth:`ModelRunner.execute`, eager path) issues its swaps
(:meth:`KVSwapper.start_step`: an event on the compute stream that the copy streams wait for,
the wait for the last step's ``swap_in_ahead``), uploads its inputs on the compute stream
(``torch.tensor(..., pin_memory=True).to(device, non_blocking=True)``, six arrays), runs the
embedding and the layers (layer i after ``layer_ready(i)``) and reads the sampled tokens back
with ``.tolist()``. Steps here do the same, back to back as in serving (background swap-outs
of a step still in flight when the next starts), with a bf16 GEMM per layer (``--tokens`` x
5120 x 5120) on 40 layers, under four swap loads per step:

- ``quiet``: no swaps;
- ``out``: ``--chunks`` background swap-outs (what decode steps run beside under churn);
- ``ahead``: ``--chunks`` ``swap_in_ahead`` and background swap-outs;
- ``in``: ``--chunks`` swap-ins (pipelined by layer) and background swap-outs.

Host copies (``--io``): ``copy`` (the runner's: pinned uploads, ``.tolist()``), ``mapped``
(kernels read the inputs from, and write the tokens to, page-locked device-mapped host
buffers: no copy engine on the compute stream; the host waits for an event), ``none``.
``--fence`` launches a one-element kernel on the compute stream at the step's start, so its
last operation before ``start_step``'s event and waits is a kernel, not a copy. Each
combination runs in a process of its own (``--all``); the first two steps of each load are
dropped. Printed per load (medians): the step's host time (start to tokens on the host), and
from the step's start event: uploads done, layer 0's compute start, compute end, the in
stream's end (every swap-in of the step, ``swap_in_ahead`` included).

    python benchmarks/step_copies_behind_swaps.py --all --out step_copies.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pensieve.core.outputs import SwapPlan
from pensieve.kernels.launch_swap import copy_words, register_host
from pensieve.runner.model_runner import allocate_kv_caches
from pensieve.runner.swapper import KVSwapper

sys.path.insert(0, str(Path(__file__).parent))
from swap_bandwidth import plans  # noqa: E402

COMBOS = [("none", False), ("copy", False), ("copy", True), ("mapped", False),
          ("mapped", True)]
LOADS = ["quiet", "out", "ahead", "in"]


class Step:
    """One runner-like step's host copies, in the chosen way."""

    def __init__(self, io: str, tokens: int) -> None:
        self.io = io
        # the runner's six input arrays for a step of ``tokens`` tokens in 64 requests
        self.sizes = [tokens, tokens, tokens, 65, 64, 64 * 64]
        total = sum(self.sizes)
        self.dev_in = torch.zeros(total, dtype=torch.int64, device="cuda")
        self.host_in = torch.arange(total, dtype=torch.int64) % tokens
        self.mapped_in = register_host(self.host_in, torch.device("cuda"))
        self.host_out = torch.zeros(64, dtype=torch.int64)
        self.mapped_out = register_host(self.host_out, torch.device("cuda"))
        self.tokens = torch.arange(64, dtype=torch.int64, device="cuda")

    def upload(self) -> torch.Tensor:
        if self.io == "copy":
            off = 0
            for k in self.sizes:
                t = torch.tensor(self.host_in[off:off + k].tolist(), dtype=torch.int64,
                                 pin_memory=True)
                self.dev_in[off:off + k].copy_(t, non_blocking=True)
                off += k
        elif self.io == "mapped":
            copy_words(self.mapped_in, self.dev_in, self.dev_in.numel())
        return self.dev_in[:self.sizes[0]]

    def readback(self) -> list[int]:
        if self.io == "copy":
            return self.tokens.tolist()
        ev = torch.cuda.Event()
        if self.io == "mapped":
            copy_words(self.tokens, self.mapped_out, 64)
        ev.record()
        ev.synchronize()
        return self.host_out.tolist()


def run_one(io: str, fence: bool, chunks: int, tokens: int, reps: int) -> dict:
    n = chunks
    num_gpu, num_cpu = 8 * n, 8 * n
    caches = allocate_kv_caches(40, num_gpu, 32, 10, 128, torch.bfloat16, torch.device("cuda"))
    sw = KVSwapper(caches, num_cpu, "staged")
    step = Step(io, tokens)
    emb = torch.randn(tokens, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5120, 5120, device="cuda", dtype=torch.bfloat16)
    one = torch.zeros(1, device="cuda")
    rng = random.Random(f"step{n}")
    out: dict[str, dict] = {}
    names = ["host_step", "uploaded", "layer0", "compute_end", "in_stream_end"]
    for load in LOADS:
        rows = []
        for r in range(reps + 2):
            # fresh disjoint blocks each step: half the tiers, alternating, so a step's
            # blocks are not those of the step before (still in flight)
            p = plans(n, "random", num_gpu // 2, num_cpu // 2, rng)
            off = (r % 2) * (num_gpu // 2)
            ins = [(c + off, g + off) for g, c in p["in"]]
            outs = [(g + off, c + off) for g, c in p["out"]]
            plan = {"quiet": SwapPlan(), "out": SwapPlan(swap_out=outs),
                    "ahead": SwapPlan(swap_in_ahead=ins, swap_out=outs),
                    "in": SwapPlan(swap_in=ins, swap_out=outs)}[load]
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
            t0 = time.perf_counter()
            if fence:
                one.add_(1)
            ev[0].record()
            ready = sw.start_step(plan)
            ids = step.upload()
            ev[1].record()
            x = emb.index_select(0, ids)  # the embedding: a kernel before layer 0's wait
            for i in range(40):
                if ready is not None:
                    ready(i)
                if i == 0:
                    ev[2].record()
                x = torch.matmul(x, w)
            ev[3].record()
            ev[4].record(sw._streams.in_stream)
            step.readback()
            host_ms = (time.perf_counter() - t0) * 1e3
            sw.end_step()
            if r >= 2:
                rows.append((host_ms, ev))
        sw.finish_step()
        torch.cuda.synchronize()
        cols = [[h] + [e[0].elapsed_time(x) for x in e[1:]] for h, e in rows]
        med = [statistics.median(c) for c in zip(*cols)]
        out[load] = dict(zip(names, med))
        print(f"io {io:6s} fence {fence!s:5s} {load:5s}: step on host %.2f | from the start "
              "event: uploaded %.2f, layer 0 %.2f, compute end %.2f, in stream end %.2f ms"
              % tuple(med), flush=True)
    return {"io": io, "fence": fence, "chunks": n, "tokens": tokens, "loads": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--io", default="copy", choices=["copy", "mapped", "none"])
    ap.add_argument("--fence", action="store_true",
                    help="a one-element kernel on the compute stream at each step's start")
    ap.add_argument("--all", action="store_true", help="every combination, a process each")
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON of the rows (with --all: all of them)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    if args.all:
        rows = []
        for io, fence in COMBOS:
            res = subprocess.run(
                [sys.executable, __file__, "--io", io, *(["--fence"] if fence else []),
                 "--chunks",
                 str(args.chunks), "--tokens", str(args.tokens), "--reps", str(args.reps),
                 "--out", "/dev/stdout"], check=True, capture_output=True, text=True)
            lines = res.stdout.splitlines()
            print("\n".join(lines[:-1]), flush=True)
            rows.append(json.loads(lines[-1]))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return
    row = run_one(args.io, args.fence, args.chunks, args.tokens, args.reps)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
