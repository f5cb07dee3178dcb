"""Attention at long contexts: our paged kernel against the fastest torch SDPA backend.

    python benchmarks/long_attention.py [--contexts 32768,65536,131072]
        [--kv-dtypes bf16,fp8[,fp8direct][,fp8dot]] [--decode-batches 1,8,32 (empty: none)]
        [--out long_attention.json] [--plot long_attention.png]

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head_dim 128, bf16 queries). Two
cases per context length ``L``:

- ``prefill``: one request's chunk of ``--chunk`` (2,048) new tokens at positions ``L - chunk
  .. L - 1`` over its cached history (a chunked prefill step of a long turn), causal;
- ``decode-B``: ``B`` requests (``--decode-batches``) of one token each after ``L - 1``
  cached tokens (split-KV decode).

``ours``: :func:`~pensieve.kernels.launch.paged_attention_triton` over a cache paged in
32-token chunks whose ids are a random permutation, with the launcher's own choices as the
runner makes them: ``long_context`` per ``launch_policy.is_long_decode`` (decode at contexts
of ``LONG_DECODE_KV`` = 8k or more: 128-position KV tiles, up to 128 KV splits), reported as
``ours_tiles`` and ``ours_splits``; its KV in bf16 or FP8 (e4m3, per-head
scales). FP8 launches take the path the runner would give them
(:func:`~pensieve.kernels.fp8_scratch.plan_fp8_scratch`, planned outside the timing as the
runner plans once per step): a prefill dequantizes the blocks it reads into a bf16 scratch
(timed with it, as every layer pays it) and runs the 16-bit kernel; decodes read FP8
directly. ``ours_fp8_path`` says which (``scratch`` or ``direct``). ``fp8direct`` in
``--kv-dtypes`` times the FP8 cache through the direct kernel whatever the rule says;
``fp8dot`` through the direct kernel with e4m3 operands in both products (``fp8_dot``).
``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over contiguous bf16
KV (the ideal layout, no gather counted), with a bottom-right causal mask for the chunk; each
of the flash, cuDNN and memory-efficient backends is tried (GQA native where it runs, else KV
heads expanded outside the timing) and the fastest is the reference. Times: CUDA events,
median of ``--iters`` after ``--warmup``. The ratio ``ours / sdpa`` is the figure of merit.

``--cuda-graphs``: also time both as CUDA-graph replays (:func:`_time_graph`: ``GRAPH_CALLS``
calls captured in one graph, replayed, CUDA events around each replay, the median divided by
the calls), the way serving's decode steps run, with no host launch overhead (a ~0.1 ms
two-launch decode kernel's eager time counts Triton's launch cost). The JSON keeps the eager
fields (``sdpa_s``, ``ours_{kv}_s``) and adds ``sdpa_graph_s``, ``sdpa_graph_backend`` (the
fastest backend that could be captured; ``sdpa_graph_note`` names those that could not),
``ours_{kv}_graph_s``, ``ratio_{kv}_graph``; with ``--sweep``, the sweep times graph
replays too (``best_{kv}_*`` then from graphs, ``sweep_timing`` says which). A sweep row
keeps every ``[tiles, splits, seconds]`` it timed in ``sweep_{kv}`` (the launch policy's
split rule is read from them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import numpy as np

H, HKV, D, CHUNK = 32, 8, 128, 32


def _time(fn: Any, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


GRAPH_CALLS = 10
"""Calls of the timed function captured in one CUDA graph (:func:`_time_graph`)."""


def _time_graph(fn: Any, warmup: int, iters: int) -> float:
    """Median seconds of one ``fn()`` replayed from a CUDA graph: :data:`GRAPH_CALLS` calls
    captured once (after ``warmup`` eager calls on a side stream, which also compile Triton's
    kernels), the graph replayed ``iters`` times between CUDA events, each replay's time
    divided by the calls. Raises where ``fn`` cannot be captured."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / GRAPH_CALLS)
    del graph
    return statistics.median(times)


def _sdpa_best(q: Any, k: Any, v: Any, lower_right: bool, warmup: int,
               iters: int, graphs: bool = False) -> dict[str, Any]:
    """The fastest SDPA backend that runs: ``sdpa_s``, ``sdpa_backend``, ``out``; with
    ``graphs`` also ``sdpa_graph_s``, ``sdpa_graph_backend`` (the fastest captured as a CUDA
    graph) and ``sdpa_graph_note`` (backends that ran eager but could not be captured).
    q ``[B, H, Q, D]``, k, v ``[B, HKV, L, D]``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2]) if lower_right else None
    best: tuple[float, str, Any] | None = None
    best_graph: tuple[float, str] | None = None
    not_captured: list[str] = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(H // HKV, 1),
                                         v.repeat_interleave(H // HKV, 1))

            def run(kk: Any = kk, vv: Any = vv, gqa: bool = gqa, backend: Any = backend) -> Any:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask,
                                                          enable_gqa=gqa)
            try:
                out = run()
            except RuntimeError:
                continue
            label = f"{name}{'' if gqa else ' (KV expanded)'}"
            t = _time(run, warmup, iters)
            if best is None or t < best[0]:
                best = (t, label, out)
            if graphs:
                try:
                    tg = _time_graph(run, warmup, iters)
                except RuntimeError as e:
                    not_captured.append(f"{label}: {str(e).splitlines()[0][:120]}")
                    torch.cuda.synchronize()
                else:
                    if best_graph is None or tg < best_graph[0]:
                        best_graph = (tg, label)
            break  # GQA native ran: no need to expand
        torch.cuda.empty_cache()
    if best is None:
        raise RuntimeError("no SDPA backend ran")
    res: dict[str, Any] = {"sdpa_s": best[0], "sdpa_backend": best[1], "out": best[2]}
    if graphs:
        res["sdpa_graph_s"] = best_graph[0] if best_graph else None
        res["sdpa_graph_backend"] = best_graph[1] if best_graph else None
        if not_captured:
            res["sdpa_graph_note"] = "not captured: " + "; ".join(not_captured)
    return res


SWEEP_TILES = [(bm, bn, w, st) for bm in (16,) for bn in (32, 64, 128) for w in (4, 8)
               for st in (2, 3, 4)]
"""Decode tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) that ``--sweep`` times."""
SWEEP_SPLITS = (4, 8, 16, 32, 64, 128)
"""KV split counts that ``--sweep`` times with each tile."""


def _sweep(call: Any, timer: Any, iters: int,
           table: list[list[Any]]) -> tuple[float, Any, int] | None:
    """(seconds, tiles, splits) of the fastest ``call(tiles, splits)`` over :data:`SWEEP_TILES`
    x :data:`SWEEP_SPLITS`, each timed by ``timer`` (eager or graph); None if none ran.
    Appends ``[tiles, splits, seconds]`` of each that ran to ``table``."""
    import torch

    best = None
    for tiles in SWEEP_TILES:
        for splits in SWEEP_SPLITS:
            try:
                t = timer(lambda tiles=tiles, splits=splits: call(tiles, splits), 1, iters)
            except Exception:  # a tile the device cannot fit
                torch.cuda.synchronize()
                continue
            table.append([list(tiles), splits, t])
            if best is None or t < best[0]:
                best = (t, tiles, splits)
    return best


def _fp8_plan(ctx: int, q_len: int, tables: Any, elem_bytes: int) -> Any:
    """The runner's FP8 scratch plan of a launch of ``len(tables)`` ranges of ``q_len`` tokens
    ending at ``ctx`` (None: the direct kernel), from host arrays as the runner builds it."""
    from pensieve.kernels.fp8_scratch import plan_fp8_scratch

    batch = tables.shape[0]
    return plan_fp8_scratch(np.full(batch, ctx - q_len), np.full(batch, q_len),
                            np.arange(batch), tables.cpu().numpy(), CHUNK, H, HKV, D,
                            elem_bytes, tables.device)


def _ours(args: tuple[Any, ...], q_len: int, long: bool, scales: dict[str, Any],
          plan: Any, fp8_dot: bool = False) -> Any:
    """The timed call of our kernel: over the scratch of ``plan``, else directly (``fp8_dot``:
    e4m3 operands in both products). ``args``: ``(q, k_cache, v_cache, block_tables,
    query_start_loc, range_start_pos, range_table)``."""
    from pensieve.kernels.fp8_scratch import paged_attention_fp8_scratch
    from pensieve.kernels.launch import paged_attention_triton

    q, kc, vc, tables, qsl, start, rows = args

    def ours() -> Any:
        if plan is not None:
            return paged_attention_fp8_scratch(q, kc, vc, plan, qsl, start, D**-0.5, q_len,
                                               **scales)
        return paged_attention_triton(q, kc, vc, tables, qsl, start, rows, D**-0.5,
                                      max_query_len=q_len, long_context=long,
                                      fp8_dot=fp8_dot, **scales)
    return ours


def case(ctx: int, q_len: int, batch: int, kv_dtypes: list[str], warmup: int,
         iters: int, seed: int = 0, sweep: bool = False,
         graphs: bool = False) -> dict[str, Any]:
    """One configuration: ``batch`` requests of ``q_len`` new tokens ending at ``ctx``;
    ``sweep``: also time every decode tile of :data:`SWEEP_TILES` with each split count of
    :data:`SWEEP_SPLITS`; ``graphs``: also time SDPA and ours as CUDA-graph replays (the sweep
    too)."""
    import torch

    from pensieve.kernels.launch import FP8_KV, attention_choice, paged_attention_triton
    from pensieve.kernels.launch_policy import is_long_decode
    from pensieve.kernels.reference import store_kv_ref

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16
    q4 = torch.randn(batch, H, q_len, D, device=dev, dtype=bf, generator=g)
    k4 = torch.randn(batch, HKV, ctx, D, device=dev, dtype=bf, generator=g)
    v4 = torch.randn(batch, HKV, ctx, D, device=dev, dtype=bf, generator=g)
    sd = _sdpa_best(q4, k4, v4, q_len > 1, warmup, iters, graphs)
    t_sdpa, ref = sd.pop("sdpa_s"), sd.pop("out")
    t_sdpa_graph = sd.get("sdpa_graph_s")
    blocks = ctx // CHUNK
    perm = torch.randperm(batch * blocks, device=dev, generator=g).to(torch.int32)
    tables = perm.view(batch, blocks)
    slots = (tables.long()[:, :, None] * CHUNK + torch.arange(CHUNK, device=dev)).flatten()
    q = q4.permute(0, 2, 1, 3).reshape(batch * q_len, H, D)
    i32 = torch.int32
    qsl = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=i32)
    start = torch.full((batch,), ctx - q_len, device=dev, dtype=i32)
    rows = torch.arange(batch, device=dev, dtype=i32)
    long = q_len == 1 and is_long_decode([ctx] * batch)
    tiles0, splits0 = attention_choice(batch * q_len, H, HKV, D, batch, q_len, dev, long)
    res: dict[str, Any] = {"context": ctx, "query_len": q_len, "batch": batch,
                           "sdpa_s": t_sdpa, **sd, "ours_tiles": tiles0,
                           "ours_splits": splits0}
    if sweep and q_len == 1:
        res["sweep_timing"] = "graph" if graphs else "eager"
    plan = _fp8_plan(ctx, q_len, tables, q.element_size())
    res["ours_fp8_path"] = "direct" if plan is None else "scratch"
    for kv in kv_dtypes:
        fp8 = kv.startswith("fp8")
        dtype = FP8_KV if fp8 else bf
        kc = torch.empty(batch * blocks, CHUNK, HKV, D, device=dev, dtype=dtype)
        vc = torch.empty_like(kc)
        scales = {}
        if fp8:
            one = torch.ones(HKV, device=dev)
            scales = {"k_scale": one, "v_scale": one}
        store_kv_ref(k4.permute(0, 2, 1, 3).reshape(-1, HKV, D),
                     v4.permute(0, 2, 1, 3).reshape(-1, HKV, D), kc, vc, slots,
                     scales.get("k_scale"), scales.get("v_scale"))

        ours = _ours((q, kc, vc, tables, qsl, start, rows), q_len, long, scales,
                     plan if kv == "fp8" else None, fp8_dot=kv == "fp8dot")
        out = ours()
        err = (out.view(batch, q_len, H, D).permute(0, 2, 1, 3).float() - ref.float()).abs()
        res[f"ours_{kv}_s"] = _time(ours, warmup, iters)
        res[f"ratio_{kv}"] = res[f"ours_{kv}_s"] / t_sdpa
        res[f"max_err_{kv}"] = float(err.max())
        if graphs:
            res[f"ours_{kv}_graph_s"] = _time_graph(ours, warmup, iters)
            if t_sdpa_graph:
                res[f"ratio_{kv}_graph"] = res[f"ours_{kv}_graph_s"] / t_sdpa_graph
        base = t_sdpa_graph if graphs and t_sdpa_graph else t_sdpa
        if sweep and q_len == 1:
            def tiled(tiles: Any, splits: int, kc: Any = kc, vc: Any = vc,
                      scales: dict = scales) -> Any:
                return paged_attention_triton(
                    q, kc, vc, tables, qsl, start, rows, D**-0.5, max_query_len=1,
                    tiles=tiles, num_kv_splits=splits, **scales)
            res[f"sweep_{kv}"] = []
            best = _sweep(tiled, _time_graph if graphs else _time, max(3, iters // 2),
                          res[f"sweep_{kv}"])
            if best is not None:
                res[f"best_{kv}_s"], res[f"best_{kv}_tiles"], res[f"best_{kv}_splits"] = best
                res[f"best_ratio_{kv}"] = best[0] / base
        del kc, vc
        torch.cuda.empty_cache()
    return res


def _plot(rows: list[dict[str, Any]], kv_dtypes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def name(r: dict[str, Any]) -> str:
        return "prefill" if r["query_len"] > 1 else f"decode x{r['batch']}"

    names = list(dict.fromkeys(name(r) for r in sorted(
        rows, key=lambda r: (r["query_len"] == 1, r["batch"]))))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4), squeeze=False)
    for ax, title in zip(axes[0], names):
        sel = [r for r in rows if name(r) == title]
        x = [r["context"] // 1024 for r in sel]
        for color, kv in zip(("C0", "C1", "C2"), kv_dtypes):
            ax.plot(x, [r[f"ratio_{kv}"] for r in sel], "o-", color=color,
                    label=f"ours ({kv} KV)")
            if all(f"ratio_{kv}_graph" in r for r in sel):
                ax.plot(x, [r[f"ratio_{kv}_graph"] for r in sel], "s--", color=color,
                        label=f"ours ({kv} KV), CUDA graphs")
            if all(f"best_ratio_{kv}" in r for r in sel):
                ax.plot(x, [r[f"best_ratio_{kv}"] for r in sel], "x:", color=color,
                        label=f"best swept tile ({kv})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(1.1, color="red", lw=0.8, ls="--", label="1.1x")
        ax.set_title(title)
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("time / fastest SDPA")
        ax.set_xscale("log", base=2)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=75)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/long_attention.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="32768,65536,131072")
    p.add_argument("--chunk", type=int, default=2048, help="query tokens of the prefill case")
    p.add_argument("--decode-batches", default="1,8,32", help="empty: no decode cases")
    p.add_argument("--kv-dtypes", default="bf16,fp8",
                   help="bf16, fp8 (the runner's path), fp8direct (the direct FP8 kernel), "
                        "fp8dot (the direct kernel with e4m3 operands in both products)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true",
                   help="decode cases: also time each tile of SWEEP_TILES and 4-128 KV splits")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time SDPA and ours as CUDA-graph replays (*_graph_s fields); "
                        "the sweep then times graph replays")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    import warnings

    import torch

    warnings.simplefilter("ignore", UserWarning)  # SDPA's "kernel not used" for each backend
    if not torch.cuda.is_available():
        print("long-attention needs a CUDA device", file=sys.stderr)
        return 2
    from tqdm import tqdm

    kvs = a.kv_dtypes.split(",")
    todo = [(int(c), a.chunk, 1) for c in a.contexts.split(",")]
    todo += [(int(c), 1, int(b)) for c in a.contexts.split(",")
             for b in a.decode_batches.split(",") if b]
    rows = []
    for ctx, q_len, batch in tqdm(todo, desc="long-attention"):
        r = case(ctx, q_len, batch, kvs, a.warmup, a.iters, sweep=a.sweep, graphs=a.cuda_graphs)
        rows.append(r)
        tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in r.items()))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": {"heads": H, "kv_heads": HKV, "head_dim": D, "chunk": CHUNK}, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.plot:
        _plot(rows, kvs, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
