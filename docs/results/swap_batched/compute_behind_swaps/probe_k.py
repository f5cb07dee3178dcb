import random
import sys

import torch

sys.path.insert(0, "benchmarks")
import swap_bandwidth as bw  # noqa: E402

from pensieve.core.outputs import SwapPlan  # noqa: E402
from pensieve.runner.model_runner import allocate_kv_caches  # noqa: E402
from pensieve.runner.swapper import KVSwapper  # noqa: E402

if "side" in sys.argv:  # the compute stream a pool stream, not the legacy default one
    torch.cuda.set_stream(torch.cuda.Stream())
n, num_gpu, num_cpu = 256, 640, 512
caches = allocate_kv_caches(40, num_gpu, 32, 10, 128, torch.bfloat16, torch.device("cuda"))
sw = KVSwapper(caches, num_cpu, "staged")
elems = num_cpu * sw.block_bytes // 4
flat = sw.host_tier.view(-1)
dev = caches[0].reshape(-1)[:elems]
pin = torch.empty(1 << 20, dtype=torch.int64, pin_memory=True)
for _ in range(4):  # the compute stream's own copies, as the runner's uploads
    if "d2h" not in sys.argv:
        dev.copy_(flat[:elems], non_blocking=True)
    if "h2d" not in sys.argv:
        flat[:elems].copy_(dev, non_blocking=True)
torch.cuda.synchronize()
p = bw.plans(n, "random", num_gpu, num_cpu, random.Random(f"0{n}random"))
plan = SwapPlan(swap_in=[(c, g) for g, c in p["in"]], swap_out=p["out"])
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(4):
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    ready = sw.start_step(plan)
    ready(0)
    ev[1].record()
    a @ a
    ev[2].record()
    pin.to("cuda", non_blocking=True)
    ev[3].record()
    sw.end_step()
    sw.finish_step()
    torch.cuda.synchronize()
    print(sys.argv[1:], "layer0 mark %.2f, gemm done %.2f, upload done %.2f ms" % tuple(
        ev[0].elapsed_time(e) for e in ev[1:]), flush=True)
