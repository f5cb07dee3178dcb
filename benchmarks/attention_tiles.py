"""Tile sweep of the paged attention kernel: which (BLOCK_M, BLOCK_N, warps, stages) is fastest
per query length, against SDPA (flash) on contiguous KV. Feeds ``launch._attention_tiles``.

    python benchmarks/attention_tiles.py --out tiles.json
    python benchmarks/attention_tiles.py --decode-batches 32,64,128,256 \
        --contexts 512,2048,8192 --out decode_splits.json   # decode: KV splits x tiles

Shapes as in kernel_compare.py (Llama 2-13B GQA: 40/10 heads x 128, bf16, chunk 32, random
block ids); the batch keeps ~8k query tokens per call (64 requests for decode).
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pensieve.kernels.launch import _attention_tiles, paged_attention_triton

H, HKV, D, C = 40, 10, 128, 32


def case(q_len: int, ctx: int, dev: torch.device, gen: torch.Generator,  # noqa: ANN201
         batch: int | None = None):
    if batch is None:
        batch = 64 if q_len == 1 else max(1, min(64, 8192 // q_len))
    per = (ctx + q_len + C - 1) // C
    nblocks = batch * per
    kc = torch.randn(nblocks, C, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    perm = torch.randperm(nblocks, device=dev, generator=gen)
    tables = perm.view(batch, per).to(torch.int32)
    q = torch.randn(batch * q_len, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    qsl = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
    start = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    rt = torch.arange(batch, device=dev, dtype=torch.int32)
    # contiguous copy for SDPA: [B, HKV, L, D]
    L = ctx + q_len
    kk = kc[tables.long()].reshape(batch, per * C, HKV, D)[:, :L].transpose(1, 2).contiguous()
    vv = vc[tables.long()].reshape(batch, per * C, HKV, D)[:, :L].transpose(1, 2).contiguous()
    qq = q.view(batch, q_len, H, D).transpose(1, 2).contiguous()
    return batch, (q, kc, vc, tables, qsl, start, rt), (qq, kk, vv)


def bench(fn, iters: int = 20) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return sorted(ts)[len(ts) // 2]


def decode_sweep(batches: list[int], contexts: list[int], out: str | None,
                 dev: torch.device, gen: torch.Generator) -> None:
    """Decode (one query token per request): KV splits x KV tile sizes, against the KV bytes'
    HBM floor (4.3 TB/s). The launcher's choice (``num_kv_splits=None``) is timed too."""
    tiles = [(16, 32, 4, 2), (16, 32, 4, 3), (16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 2),
             (16, 64, 8, 2)]
    rows = []
    for batch, ctx in itertools.product(batches, contexts):
        _, pa, _ = case(1, ctx, dev, gen, batch=batch)
        floor_us = batch * (ctx + 1) * HKV * D * 2 * 2 / 4.3e12 * 1e6
        auto = bench(partial(paged_attention_triton, *pa, D**-0.5, max_query_len=1))
        times = {}
        for t, sp in itertools.product(tiles, (1, 2, 4, 8, 16)):
            times[(t, sp)] = bench(partial(paged_attention_triton, *pa, D**-0.5, max_query_len=1,
                                           tiles=t, num_kv_splits=sp))
        best = min(times, key=times.get)
        row = {"batch": batch, "ctx": ctx, "floor_us": round(floor_us, 1),
               "auto_us": round(auto, 1), "best_tiles": list(best[0]), "best_splits": best[1],
               "best_us": round(times[best], 1),
               "all": {f"{','.join(map(str, t))}|{sp}": round(v, 1)
                       for (t, sp), v in times.items()}}
        rows.append(row)
        print(f"decode B{batch} ctx{ctx}: floor {floor_us:.1f} us, auto {auto:.1f} "
              f"({auto / floor_us:.2f}x), best {best[0]} splits {best[1]} {times[best]:.1f} us "
              f"({times[best] / floor_us:.2f}x)", flush=True)
        del pa
        torch.cuda.empty_cache()
        if out:
            with open(out, "w") as f:
                json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qlens", default="1,16,64,128,256,512")
    ap.add_argument("--contexts", default="0,4096,16384")
    ap.add_argument("--decode-batches", default=None,
                    help="instead of the tile sweep: decode at these batch sizes, sweeping KV "
                         "splits and tiles")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.decode_batches:
        decode_sweep([int(b) for b in args.decode_batches.split(",")],
                     [int(c) for c in args.contexts.split(",")], args.out, dev, gen)
        return
    options = [t for t in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8), (2, 3))
               if t[0] * t[1] <= 128 * 64]
    rows = []
    for q_len, ctx in itertools.product(map(int, args.qlens.split(",")),
                                        map(int, args.contexts.split(","))):
        batch, pa, sd = case(q_len, ctx, dev, gen)
        qq, kk, vv = sd
        mask_kw = {"is_causal": True} if ctx == 0 and q_len > 1 else {}
        if ctx and q_len > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask_kw = {"attn_mask": causal_lower_right(q_len, ctx + q_len)}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ideal = bench(partial(F.scaled_dot_product_attention, qq, kk, vv, enable_gqa=True,
                                  **mask_kw))
        default = _attention_tiles(q_len * (H // HKV), q_len * (H // HKV), D, True)
        times = {}
        for t in options:
            try:
                times[t] = bench(partial(paged_attention_triton, *pa, D**-0.5,
                                         max_query_len=q_len, tiles=t))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                times[t] = float("inf")
                print(f"  {t}: {type(e).__name__}")
        best = min(times, key=times.get)
        row = {"q_len": q_len, "ctx": ctx, "batch": batch, "ideal_us": round(ideal, 1),
               "default": list(default), "default_us": round(times.get(default, float("nan")), 1),
               "best": list(best), "best_us": round(times[best], 1),
               "all": {",".join(map(str, t)): round(v, 1) for t, v in times.items()}}
        rows.append(row)
        print(f"q{q_len} ctx{ctx} B{batch}: ideal {ideal:.1f} us, default {default} "
              f"{row['default_us']} us ({row['default_us'] / ideal:.2f}x), best {best} "
              f"{times[best]:.1f} us ({times[best] / ideal:.2f}x)", flush=True)
        torch.cuda.empty_cache()
        if args.out:  # after every config: a timeout keeps what ran
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
