"""Where urgent swap-outs come from, and whether the cache's settings change them (simulator).

An urgent swap-out (``SwapPlan.swap_out_first``) is a GPU chunk sent to the CPU tier whose block
the same step reuses, so the step waits for its copy. Issue 13 wants them under 2% of all
swap-outs at steady state; the ShareGPT points with the decode split by span had 34-44%
(docs/benchmarks.md). This runs one pensieve point in the simulator (the same scheduler and
cache as the engine, with the given step-cost model and the measured copy rates) per variant of
the cache's settings, and counts the urgent chunks by the cache call that planned them:
``admit`` (a turn's admission makes room for its history and the decode reserve), ``grow`` (a
running turn needs a block) or ``suspend`` (a running turn is taken off the GPU): what they
planned, so a chunk swapped out and back in within one step's plan (the plan cancels the
pair) counts here but not in the steps' total. Each row also
gives throughput, P50 / P90 normalized latency and the simulated time steps waited on copies.

    python benchmarks/sim_urgent_swapouts.py --rate 1.25 \\
        --variants 'default;swap_out_threshold=0.35;swap_out_batch=0.15;decode_reserve=0.05'

A variant is ``default`` or ``name=share[,name=share]`` with names among
``swap_out_threshold``, ``swap_out_batch`` and ``decode_reserve`` (shares of the GPU tier, as
in ``TieredKVCache``), and may include the word ``urgent_pipelined``: the copy model's what-if
of urgent swap-outs issued layer by layer with the swap-ins, so that only what exceeds the
step's compute is waited for (``TransferModel.urgent_pipelined``), and ``defer_admission=N``
(a turn short of GPU blocks waits up to N steps for background swap-outs instead of
urgent ones, ``TieredKVCache.defer_admission``). Defaults: ShareGPT, 40 / 60 GB, think 6 s,
warm start 0.03, 400 s of arrivals, window 200-400 s (the real points' set-up) and the
step-cost model refitted on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_churn_jobs as jobs  # noqa: E402

from pensieve.bench.engine_api import VirtualClock  # noqa: E402
from pensieve.bench.loadgen import run_load, warm_start_from  # noqa: E402
from pensieve.bench.metrics import summarize  # noqa: E402
from pensieve.bench.step_cost import StepCostModel  # noqa: E402
from pensieve.core.tiered_cache import TieredKVCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIT = ROOT / "docs/results/sim_sharegpt_span_refit/step_cost_churn_fit_one.json"
SETTINGS = {"swap_out_threshold": "swap_out_threshold_blocks",
            "swap_out_batch": "swap_out_batch_blocks",
            "decode_reserve": "decode_reserve_blocks"}
CAUSES = ("admit", "grow", "suspend")
PIPELINED = "urgent_pipelined"
DEFER = "defer_admission"
"""``defer_admission=N``: a turn short of blocks waits up to N steps for background swap-outs
(``TieredKVCache.defer_admission``)."""


def parse_variant(text: str) -> dict[str, float]:
    """``default`` -> {}; ``a=0.3,b=0.1`` -> {a: 0.3, b: 0.1} (names checked, shares in [0, 1))."""
    if text.strip() == "default":
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        if part.strip() == PIPELINED:
            out[PIPELINED] = 1.0
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        if name == DEFER:
            out[DEFER] = float(int(value))
            continue
        if name not in SETTINGS:
            raise ValueError(f"unknown setting {name!r}; one of {', '.join(SETTINGS)}")
        share = float(value)
        if not 0.0 <= share < 1.0:
            raise ValueError(f"{name} must be a share in [0, 1), got {share}")
        out[name] = share
    return out


def count_urgent(counts: Counter[str]) -> list[tuple[str, Any]]:
    """Wrap the cache calls that plan urgent swap-outs so that each one adds the chunks it
    planned to ``counts[cause]``; returns what to restore."""
    saved = []
    for cause in CAUSES:
        orig = getattr(TieredKVCache, cause)

        def wrapped(self: TieredKVCache, *a: Any, _orig: Any = orig, _cause: str = cause,
                    **k: Any) -> Any:
            before = len(self._plan.swap_out_first)
            result = _orig(self, *a, **k)
            counts[_cause] += len(self._plan.swap_out_first) - before
            return result

        saved.append((cause, orig))
        setattr(TieredKVCache, cause, wrapped)
    return saved


def run_variant(variant: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    cost = StepCostModel.load(args.step_cost)
    job = {"system": "pensieve", "rate": args.rate, "think": args.think,
           "gpu_kv_gb": args.gpu_kv_gb, "cpu_kv_gb": args.cpu_kv_gb}
    clock = VirtualClock()
    transfer = jobs.transfer_model()
    if variant.get(PIPELINED):
        transfer = dataclasses.replace(transfer, urgent_pipelined=True)
    eng = jobs.make_sim(job, cost, clock, transfer=transfer)
    for name, share in variant.items():
        if name == DEFER:
            eng.cache.defer_admission = int(share)
        elif name != PIPELINED:
            setattr(eng.cache, SETTINGS[name], int(share * eng.cache.gpu.num_blocks))
    counts: Counter[str] = Counter()
    saved = count_urgent(counts)
    try:
        convs = jobs.conversations(args.workload, args.seed, 8, args.length_scale)
        res = run_load(eng, clock, convs, args.rate, args.think, args.duration, 32000,
                       seed=args.seed, drain_s=25.0, sample_interval_s=1.0,
                       warm_start=warm_start_from(args.warm_start))
    finally:
        for cause, orig in saved:
            setattr(TieredKVCache, cause, orig)
    s = summarize(res, args.warmup)
    ex = eng.executor
    urgent = sum(r.urgent_swap_out_chunks for r in ex.step_records)
    return {"variant": variant, "throughput_rps": s["throughput_rps"],
            "p50_ms": (s["normalized_latency_s_p50"] or 0.0) * 1e3,
            "p90_ms": (s["normalized_latency_s_p90"] or 0.0) * 1e3,
            "swap_out_chunks": ex.swap_out_chunks, "urgent_chunks": urgent,
            "urgent_share": urgent / ex.swap_out_chunks if ex.swap_out_chunks else 0.0,
            "urgent_by_cause": {c: counts[c] for c in CAUSES},
            "exposed_copy_s": ex.exposed_copy_s, "busy_s": ex.busy_time_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1.25)
    ap.add_argument("--variants", default="default",
                    help="';'-separated: default or name=share[,name=share]")
    ap.add_argument("--workload", default="sharegpt", choices=("sharegpt", "agentic"))
    ap.add_argument("--gpu-kv-gb", type=float, default=40.0)
    ap.add_argument("--cpu-kv-gb", type=float, default=60.0)
    ap.add_argument("--think", type=float, default=6.0)
    ap.add_argument("--duration", type=float, default=400.0)
    ap.add_argument("--warmup", type=float, default=200.0)
    ap.add_argument("--warm-start", type=float, default=0.03)
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-cost", default=str(FIT))
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variants.split(";")]
    except ValueError as e:
        ap.error(str(e))
    rows = []
    print(f"{'variant':<36} {'req/s':>6} {'P50':>6} {'P90':>6} {'urgent':>14} "
          f"{'admit/grow/suspend':>20} {'copy wait s':>11}", flush=True)
    for v in variants:
        r = run_variant(v, args)
        rows.append(r)
        name = ",".join(k if k == PIPELINED else f"{k}={x}" for k, x in v.items()) or "default"
        by = r["urgent_by_cause"]
        print(f"{name:<36} {r['throughput_rps']:>6.2f} {r['p50_ms']:>6.1f} {r['p90_ms']:>6.1f} "
              f"{r['urgent_chunks']:>7}/{r['urgent_share']:>6.1%} "
              f"{by['admit']:>8}/{by['grow']}/{by['suspend']:<6} "
              f"{r['exposed_copy_s']:>6.1f}/{r['busy_s']:.0f}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
