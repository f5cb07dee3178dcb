"""Re-validate the simulator against the real H200 churn points, with the transfer cost as measured.

Real points (``benchmarks/churn_points.sh``: two ``pensieve serve`` servers side by side on
H200s, an OpenAI chat client over HTTP, agentic workload, seed 0, think time 5 s, Llama 2-13B
shape with 10 KV heads in bf16, GPU tier 40 GB, CPU tier 60 GB):

* ``docs/results/churn/stateless_pensieve_0.45_0.85`` -- stateless at 0.45 and pensieve at
  0.85 sessions/s;
* ``docs/results/churn/stateless_pensieve_0.55_1.0`` -- stateless at 0.55 and pensieve at 1.0;
* ``docs/results/churn/prefixlru_pensieve_1.2`` -- prefix-lru and pensieve at 1.2
  (``--pairs`` picks others, e.g. the older ``stateless_pensieve_0.7``).

Each point's set-up (rate, think time, tiers, warm-up, duration) is read from its
``points.jsonl``; each server's own totals at the end (steps and executor seconds by step kind,
computed tokens, swap chunks) from ``metrics_end.txt`` inside ``real_points.tgz`` (the
servers' ``points.jsonl`` and ``metrics_end.txt`` of a run's ``churn.tgz``).

The simulator (:class:`~pensieve.sim.simulator.SimEngine`, the same scheduler and tiered
cache) runs the same load through ``pensieve.bench.loadgen.run_load`` (the load generator of
``src/pensieve/bench/multiturn.py``: same workload, shuffle, seed, arrivals and think times), with

* copies: ``TransferModel.load(swap_bandwidth.json, case="hybrid")`` -- the byte-weighted
  one-way rates of ``hybrid`` on random block ids (the default before ``staged``, whose
  one-way rates were within 1% of them in the same run,
  ``docs/results/swap_batched/head_53dac50/``; the model has no in + out slowdown), swap-ins
  pipelined over the 40 layers, and steps of <= 512 tokens (mixed-step CUDA graphs, on by
  default) waiting for all their swap-ins;
* the chat template: each turn's input gets ``--template-tokens`` (8) more tokens, as the
  server's chat template adds (the real ``context_len`` grows ~8 tokens a turn over the
  workload's lengths);
* step cost: (a) the fused-era fit (``docs/results/multiturn_fused/step_cost_h200_fused.json``,
  fitted on steps measured before mixed-step graphs and the swap kernel), as is; (b) that fit
  recalibrated on the real servers' aggregate totals (below).

Recalibration (``calibrate``): three numbers are fitted, by non-negative least squares on
relative errors, to the real servers' *mean executor seconds per step* of each kind
(decode-only steps; steps with prefill tokens) of the *fit* points (``metrics_end.txt``:
seconds / steps), given the simulated steps' features: a factor ``alpha`` on the fused fit's
per-step terms (``base_s``, ``per_request_s``, ``per_kv_read_token_s``,
``per_decode_token_s``), and new ``per_prefill_step_s`` and ``per_prefill_token_s`` (on the
real prefill tokens per prefill step); ``per_attn_pair_s`` and the copies stay as they are,
and the servers' scheduler seconds per step are added to ``base_s`` (host time). Per step, not
in total, because both engines are busy almost all the time (total step seconds ~ the run's
length whatever a step costs). The simulated features depend on the model (batch sizes follow
step times), so the fit alternates with simulator runs (``--calib-iters``, default 2).
Held-out check: a model fitted on one pair (``--fit-pair``, default the first) is run on the
others (when a fit pair's prefill steps carry about the same tokens, ``per_prefill_token_s``
is held at the fused fit's value). A model fitted on all pairs is the one the what-if and
``benchmarks/sim_churn_capacity.py`` use (``step_cost_churn_fit_all.json``; its
errors are in-sample and are labelled so).

What-if (``--whatif``): the ShareGPT set-up of ``benchmarks/sim_fused_whatif.sh`` at
``0811955`` ("both costs removed", docs/benchmarks.md): 8 GB GPU / 22 GB CPU tiers, think
time 6 s, 360 s of arrivals, window 120-360 s, 60 s drain, stateless / prefix-lru / pensieve
at a few rates, with the recalibrated model and the measured copies; capacity at P90 100 and
150 ms/token.

    python benchmarks/sim_validate_churn.py --out docs/results/sim_churn          # ~10 min
    python benchmarks/sim_validate_churn.py --out /tmp/x --tiny                   # a smoke test

Writes ``<out>/sim_validate_churn.json`` (every real and simulated number, the fitted models,
the what-if points), ``<out>/step_cost_churn_*.json`` (the recalibrated models),
``<out>/sim_validate_churn.png`` and prints the tables.

Each side is simulated with its server's scheduler settings: ``swap_in_ahead_chunks`` from its
``points.jsonl`` if recorded there, else from :data:`SCHEDULER` (by pair and side; the pairs
measured before swap-ins ahead existed run with it off, as their engine had no ahead path).
Points are matched by pair and side (A, B), so a pair of one system twice (ahead off / on)
stays apart.

``--fitted MODEL``: no fit and no what-if; every point of ``--pairs`` is simulated with an
already fitted model, as is -- a held-out check on pairs the model was not fitted on::

    python benchmarks/sim_validate_churn.py --out docs/results/sim_churn_ahead \
        --fitted docs/results/sim_churn/step_cost_churn_fit_all.json \
        --pairs pensieve_ahead_off_on_0.9
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from sim_churn_jobs import FIT_ALL, GRAPH_MAX_TOKENS, run_jobs, transfer_model
from sim_validate import (
    DEFAULT_PAIRS,
    FUSED,
    METRICS,
    fit_loop,
    load_real,
    point_name,
    real_jobs,
    same_point,
)

from pensieve.bench.run_metrics import capacity_at
from pensieve.sim.step_cost import StepCostModel


# ------------------------------------------------------------------------ output
def rel(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or not real or not math.isfinite(sim):
        return None
    return (sim - real) / real


def table(real: list[dict[str, Any]], sims: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for r in real:
        sched = ", ".join(f"{k}={v}" for k, v in r["scheduler"].items()) or "defaults"
        head = (f"{r['system']} @ {r['conv_rate']}/s (pair {r['pair']}, side {r['side']}; "
                f"scheduler {sched})")
        cols = list(sims)
        lines.append(f"\n{head}\n{'metric':<28}{'real':>12}" + "".join(
            f"{c[:22]:>24}" for c in cols))
        for key, lab, sc in METRICS:
            rv = r.get(key)
            row = f"{lab:<28}{_fmt(rv, sc):>12}"
            for c in cols:
                s = next((x for x in sims[c] if same_point(x, r)), None)
                sv = s.get(key) if s else None
                e = rel(sv, rv)
                row += f"{_fmt(sv, sc):>14} {'' if e is None else f'{e:+.1%}':>9}"
            lines.append(row)
    return "\n".join(lines)


def errors_of(real: list[dict[str, Any]], sims: dict[str, list[dict[str, Any]]],
              ) -> dict[str, dict[str, dict[str, float | None]]]:
    """(sim - real) / real of every metric: model -> point name -> metric."""
    errors: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, pts in sims.items():
        errors[name] = {}
        for r in real:
            s = next((x for x in pts if same_point(x, r)), None)
            errors[name][point_name(r, real)] = {
                k: rel(s.get(k) if s else None, r.get(k)) for k, _, _ in METRICS}
    return errors


def strip(ps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points without the per-kind designs (large, only for the recalibration)."""
    return [{k: v for k, v in p.items() if k != "kinds"}
            | {"kinds": {kk: {x: y for x, y in kv.items() if x != "design"}
                         for kk, kv in p.get("kinds", {}).items()}} for p in ps]


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(
        result, indent=1, default=lambda o: None if isinstance(o, float) else str(o)))


def run_fitted(args: argparse.Namespace, pairs: tuple[str, ...], out: Path) -> int:
    """``--fitted``: every point of ``pairs`` simulated with an already fitted model, as is."""
    t0 = time.time()
    real = load_real(pairs)
    model = StepCostModel.load(args.fitted)
    name = "fitted model as is"
    tm = transfer_model(graph_rule=args.graph_swap_in_rule,
                        eager_launch_s=args.eager_launch_ms / 1e3,
                        group_waits=args.graph_group_waits, ahead_layered=args.ahead_layered,
                        issue_costs=args.issue_costs,
                        background_after_launch=args.background_after_launch)
    print(f"model: {args.fitted}\ncopies: {tm.source}; steps waiting for all swap-ins: <= "
          f"{tm.graph_max_tokens} tokens, <= {tm.graph_max_swap_in} swap-in chunks of their "
          f"own (else pipelined over {tm.num_layers}, +{tm.eager_launch_s * 1e3:g} ms)",
          flush=True)
    sims = {name: run_jobs(real_jobs(real, model, name, args, pairs), args.workers)}
    tab = table(real, sims)
    print(tab, flush=True)
    plot(real, sims, out / "sim_validate_churn.png")
    write_json(out / "sim_validate_churn.json", {
        "real": real, "copies": {"source": tm.source, "swap_in_gbps": tm.swap_in_gbps,
                                 "swap_out_gbps": tm.swap_out_gbps,
                                 "num_layers": tm.num_layers,
                                 "graph_max_tokens": tm.graph_max_tokens,
                                 "graph_max_swap_in": tm.graph_max_swap_in,
                                 "eager_launch_s": tm.eager_launch_s},
        "fitted": str(args.fitted), "model": model.to_dict(),
        "sim": {k: strip(v) for k, v in sims.items()}, "errors": errors_of(real, sims),
        "args": vars(args), "wall_s": round(time.time() - t0, 1)})
    (out / "table.txt").write_text(tab + "\n")
    print(f"\nwrote {out}/sim_validate_churn.json, .png, table.txt; wall {time.time() - t0:.0f} s")
    return 0


def _fmt(v: float | None, sc: float) -> str:
    if v is None:
        return "-"
    v = v * sc
    if not math.isfinite(v):
        return "inf"
    if abs(v) >= 1e4:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"


def plot(real: list[dict[str, Any]], sims: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("throughput_rps", "throughput (req/s)"),
            ("normalized_latency_s_p50", "P50 norm. latency"),
            ("normalized_latency_s_p90", "P90 norm. latency"), ("ttft_s_p50", "P50 TTFT"),
            ("prefill_step_mean_s", "prefill step mean"),
            ("decode_step_mean_s", "decode step mean")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    labels = [point_name(r, real).replace("@", "\n@", 1) for r in real]
    width = 0.8 / max(1, len(sims))
    for ax, (k, t) in zip(axes.flat, keys):
        for j, (name, pts) in enumerate(sims.items()):
            errs = []
            for r in real:
                s = next((x for x in pts if same_point(x, r)), None)
                e = rel(s.get(k) if s else None, r.get(k))
                errs.append(100 * e if e is not None else float("nan"))
            ax.bar([i + j * width for i in range(len(real))], errs, width, label=name)
        ax.axhline(0, color="k", lw=0.8)
        for y in (-10, 10):
            ax.axhline(y, color="grey", ls=":", lw=0.8)
        ax.set_xticks([i + width * (len(sims) - 1) / 2 for i in range(len(real))], labels,
                      fontsize=8)
        ax.set_title(f"{t}: sim vs real (%)")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Simulator vs real H200 churn points (agentic, HTTP chat, 40/60 GB tiers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------ main
def run_whatif(args: argparse.Namespace, m_all: StepCostModel
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The ShareGPT what-if with the all-pairs model: its points and each system's capacity
    at 100 and 150 ms/token."""
    caps: dict[str, Any] = {}
    jobs = []
    for system in args.whatif_systems.split(","):
        for rate in (float(x) for x in args.whatif_rates.split(",")):
            jobs.append({"system": system, "rate": rate, "pair": "sharegpt-whatif",
                         "think": 6.0, "gpu_kv_gb": 8.0, "cpu_kv_gb": 22.0,
                         "duration": 60.0 if args.tiny else 360.0,
                         "warmup": 20.0 if args.tiny else 120.0,
                         "drain": 10.0 if args.tiny else 60.0, "seed": args.seed,
                         "workload": "sharegpt", "template_tokens": 0,
                         "length_scale": 0.2 if args.tiny else 1.0,
                         "cost": m_all.to_dict(), "model_name": "all-pairs fit"})
    whatif = run_jobs(jobs, args.workers)
    for p in whatif:
        if p.get("normalized_latency_s_p90") is None:
            p["normalized_latency_s_p90"] = math.inf
    for target in (0.100, 0.150):
        by = {s: [p for p in whatif if p["system"] == s]
              for s in args.whatif_systems.split(",")}
        c = {s: capacity_at(pts, target) for s, pts in by.items()}
        caps[f"{target * 1e3:.0f}ms"] = c
    print("\nShareGPT what-if (8/22 GB tiers, think 6 s, 360 s arrivals, window 120-360 s):")
    for p in sorted(whatif, key=lambda p: (p["system"], p["conv_rate"])):
        print(f"  {p['system']:>10} @ {p['conv_rate']}: {p['throughput_rps']:.2f} req/s, "
              f"P90 {p['normalized_latency_s_p90'] * 1e3:.0f} ms/tok, "
              f"gpu/cpu/recomputed {p['gpu_hit_rate']:.2f}/{p['cpu_hit_rate']:.2f}/"
              f"{p['recomputed_rate']:.2f}")
    for t, c in caps.items():
        st = c.get("stateless")
        print(f"  capacity at {t}: " + ", ".join(f"{s} {v:.2f}" for s, v in c.items())
              + (f"; pensieve/stateless {c['pensieve'] / st:.2f}x" if st else "")
              + (f", pensieve/prefix-lru {c['pensieve'] / c['prefix-lru']:.2f}x"
                 if c.get("prefix-lru") else ""))
    return whatif, caps


def build_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/sim_churn")
    ap.add_argument("--step-cost", default=str(FUSED), help="the step-cost fit to start from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--template-tokens", type=int, default=8)
    ap.add_argument("--calib-iters", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--whatif-rates", default="0.5,0.6,0.8,1.0,1.2")
    ap.add_argument("--whatif-systems", default="stateless,prefix-lru,pensieve")
    ap.add_argument("--no-whatif", dest="whatif", action="store_false")
    ap.add_argument("--pairs", default=",".join(DEFAULT_PAIRS),
                    help="real pairs (directories under docs/results/churn)")
    ap.add_argument("--fit-pair", default=None,
                    help="the pair the cross-validated model is fitted on (default: the "
                         "first); the others are its held-out points")
    ap.add_argument("--fitted", default=None,
                    help="a fitted step-cost model: simulate every point of --pairs with it "
                         "as is (no fit, no what-if), e.g. " + str(FIT_ALL))
    ap.add_argument("--graph-swap-in-rule", action="store_true",
                    help="steps of <= 512 tokens with more than the runner's graph_max_swap_in "
                         "swap-in chunks of their own run pipelined, as in the runner (the "
                         "eager launch time is not modelled); default: every such step waits "
                         "for all its swap-ins, as the fits assumed")
    ap.add_argument("--eager-launch-ms", type=float, default=0.0,
                    help="with --graph-swap-in-rule: extra time of each step the rule makes run "
                         "eagerly (default 0: not modelled)")
    ap.add_argument("--graph-group-waits", action="store_true",
                    help="the runner since per-group graph waits (runner/graph_waits.py): every "
                         "step's swap-ins pipelined by the staged swapper's 8 groups of layers, "
                         "graph or eager")
    ap.add_argument("--ahead-layered", action="store_true",
                    help="what-if: each step waits for the copies ahead layer by layer "
                         "(the swapper's ahead_waits=\"layers\"), not before its compute")
    ap.add_argument("--issue-costs", action="store_true",
                    help="model the host's issue of the copies before each forward (measured "
                         "per group of layers and per chunk, sim_churn_jobs.ISSUE_*); fit "
                         "with it before comparing what-ifs with it")
    ap.add_argument("--background-after-launch", action="store_true",
                    help="what-if: graph steps issue their ahead copies and background "
                         "swap-outs after the launch (the runner's way now); "
                         "with --issue-costs")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test: 40 s runs at 1/5 of the lengths, one calibration pass, "
                         "one what-if rate")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.tiny:
        args.calib_iters = 1
        args.whatif_rates = "1.0"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log: list[str] = []
    pairs = tuple(args.pairs.split(","))
    if args.fitted:
        return run_fitted(args, pairs, out)
    fit_pair = args.fit_pair or pairs[0]
    if fit_pair not in pairs:
        ap.error(f"--fit-pair {fit_pair} is not one of --pairs")
    held_out = tuple(p for p in pairs if p != fit_pair)
    real = load_real(pairs)
    base = StepCostModel.load(args.step_cost)
    tm = transfer_model()
    msg = (f"copies: {tm.source}: in {tm.swap_in_gbps:.1f} GB/s, out {tm.swap_out_gbps:.1f} "
           f"GB/s, 40 layers pipelined, steps <= {GRAPH_MAX_TOKENS} tokens wait for swap-ins")
    print(msg, flush=True)
    log.append(msg)

    # (a) the old fit as is, every point
    as_is = run_jobs(real_jobs(real, base, "fused fit as is", args, pairs), args.workers)
    print(table(real, {"fused fit as is": as_is}), flush=True)

    # (b) fitted on one pair, checked on the others (held out); (c) fitted on all
    m_one, _, info_one = fit_loop(base, real, (fit_pair,), args, f"fit on {fit_pair}", as_is,
                                  log)
    m_all, _, info_all = fit_loop(base, real, pairs, args, "fit on all", as_is, log)
    # the final models on every point (the fit loop's own last runs used the model before its
    # last recalibration); the fit pair's row of the first is in-sample
    cross = run_jobs(real_jobs(real, m_one, f"fit on {fit_pair} -> held out", args, pairs),
                     args.workers)
    allfit = run_jobs(real_jobs(real, m_all, "fit on all (in-sample)", args, pairs),
                      args.workers)
    sims = {"fused fit as is": as_is, "held out (fit on one pair)": cross,
            "all-pairs fit (in-sample)": allfit}
    tab = table(real, sims)
    print(tab, flush=True)
    for name, m in (("one", m_one), ("all", m_all)):
        m.save(out / f"step_cost_churn_fit_{name}.json")
    plot(real, sims, out / "sim_validate_churn.png")

    errors = errors_of(real, sims)

    # (d) the ShareGPT what-if with the all-pairs model
    whatif, caps = run_whatif(args, m_all) if args.whatif else ([], {})

    result = {
        "real": real, "copies": {"source": tm.source, "swap_in_gbps": tm.swap_in_gbps,
                                 "swap_out_gbps": tm.swap_out_gbps, "num_layers": 40,
                                 "graph_max_tokens": GRAPH_MAX_TOKENS,
                                 "graph_max_swap_in": tm.graph_max_swap_in,
                                 "eager_launch_s": tm.eager_launch_s},
        "base_step_cost": base.to_dict(),
        "fit_pair": fit_pair, "held_out": list(held_out),
        "models": {"fit_one": m_one.to_dict(), "fit_all": m_all.to_dict()},
        "fit_info": {"fit_one": info_one, "fit_all": info_all},
        "sim": {k: strip(v) for k, v in sims.items()}, "errors": errors,
        "whatif": strip(whatif), "whatif_capacity": caps, "log": log,
        "args": vars(args), "wall_s": round(time.time() - t0, 1),
    }
    write_json(out / "sim_validate_churn.json", result)
    (out / "table.txt").write_text(tab + "\n")
    print(f"\nwrote {out}/sim_validate_churn.json, .png, table.txt; wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
