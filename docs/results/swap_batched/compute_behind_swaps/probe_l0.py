import random
import sys

import torch

sys.path.insert(0, "benchmarks")
import swap_bandwidth as bw  # noqa: E402
import swap_timeline as tlm  # noqa: E402

from pensieve.core.outputs import SwapPlan  # noqa: E402
from pensieve.runner.model_runner import allocate_kv_caches  # noqa: E402
from pensieve.runner.swapper import KVSwapper  # noqa: E402

n, num_gpu, num_cpu = 256, 640, 512
caches = allocate_kv_caches(40, num_gpu, 32, 10, 128, torch.bfloat16, torch.device("cuda"))
for c in caches:
    c.normal_()
sw = KVSwapper(caches, num_cpu, "staged")
if "raw" in sys.argv:
    bw.raw_copies(sw, min(256 * 2**20, num_cpu * sw.block_bytes // 2), 3)
elems = min(256 * 2**20, num_cpu * sw.block_bytes // 2) // 2
flat = sw.host_tier.view(-1)
dev, dev2 = sw.gpu_caches[0].reshape(-1)[:elems], sw.gpu_caches[1].reshape(-1)[:elems]
if "rawnull" in sys.argv:
    for _ in range(4):
        dev.copy_(flat[:elems], non_blocking=True)
        flat[:elems].copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
if "rawboth" in sys.argv:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(4):
        with torch.cuda.stream(s1):
            dev.copy_(flat[:elems], non_blocking=True)
        with torch.cuda.stream(s2):
            flat[elems:2 * elems].copy_(dev2, non_blocking=True)
    torch.cuda.synchronize()
p = bw.plans(n, "random", num_gpu, num_cpu, random.Random(f"0{n}random"))
swap_in = [(c, g) for g, c in p["in"]]
plan = SwapPlan(swap_in=swap_in, swap_out=p["out"])
if "dirs" in sys.argv:
    bw.timed(bw.swapper_step(sw, SwapPlan(swap_in=swap_in)), 3)
    bw.timed(bw.swapper_step(sw, SwapPlan(swap_out=p["out"])), 3)
tl = tlm.TimelineStreams(sw._streams)
step = bw.swapper_step(sw, plan)
for it in range(2):
    a = bw.timed(step, 3)["layer0_s"] * 1e3
    b = [tlm.summary(tlm.timeline_step(sw, tl, plan, bare=True, last=False))["layer0_ms"]
         for _ in range(3)]
    sw._streams = tl.inner
    c = []
    for _ in range(3):
        torch.cuda.synchronize()
        c.append(step()["layer0_s"] * 1e3)
    print(f"round {it}: bw timed {a:.2f} | timeline bare {[round(x, 2) for x in b]} | "
          f"bw step direct {[round(x, 2) for x in c]}", flush=True)
