"""Capacity against the ideal bound, simulated: how close each configuration comes to the
sessions/s the hardware allows (issue 59).

    python benchmarks/sim_ideal.py --out docs/results/sim_ideal
    python benchmarks/sim_ideal.py --tiny --out /tmp/sim_ideal      # a smoke test

The set-up of ``benchmarks/sim_agent.py`` (llama3.1-8b shape, 40 GB GPU / 60 GB CPU tiers,
8,192 tokens a step, think time 6 s, the scheduler and cache of the engine over simulated
time), on four loads (``agentic``, ``coding-agent``, ``agent-mix``, ``sharegpt``: the packaged
ShareGPT turn lengths), each point started warm (``--warm-start``: the sessions a steady state
holds are in flight at time 0), for five systems:

- ``prefix-lru``, ``pensieve`` (bf16 KV) and ``pensieve-fp8`` (FP8 KV): the cache policies over
  the step cost of the measured forward pass (below) with ``sim_agent.py``'s decode, host and
  copy terms (the copy model's 45 GB/s each way);
- ``ideal`` and ``ideal-fp8``: :mod:`pensieve.sim.ideal`, a GPU tier nothing leaves (only each
  turn's new tokens computed, no copy waits, no host time), prefill at the best measured rate
  (the faster of Pensieve's kernel and SDPA at the context), decode at the HBM floor (the KV in
  bf16 or FP8).

The measured rates (H200, llama3.1-8b shape), all from recorded results:

- the forward pass: ``docs/results/long_context/prefill_stall_auto_8192.json`` (a 60k-token
  prompt in 8,160-token chunks beside 32 decodes, Pensieve's kernel, bf16), fitted as
  ``weights / HBM + a * tokens + b * pairs`` (:func:`pensieve.sim.ideal.fit_forward`);
- the kernels: ``docs/results/long_context/fp8_prefill_scratch.json``
  (``benchmarks/long_attention.py --cuda-graphs``, 2,048-token prefill at 32k / 64k / 128k):
  SDPA against ours in bf16 (the ideal's ``best``), ours over FP8 (the scratch path) against
  ours over bf16 (the factor on ``b`` of ``pensieve-fp8``);
- HBM 4.3 TB/s (docs/performance.md's measured ceiling).

Per load and system: capacity at each ``--ttft-targets`` P90 (interpolated between rates,
``pensieve.bench.run_metrics.capacity_at``) and capacity / ideal (each KV dtype against its own
ideal; also against the better ideal), and where a turn's simulated GPU time goes at each
point (``breakdown``: new-token prefill, recomputed prefill, decode and the rest of compute,
copy waits, host time per request). Writes ``<out>/sim_ideal.json``, ``<out>/sim_ideal.png``
(capacity / ideal per load and target) and ``<out>/sim_ideal.md`` (the tables); each point
also as it finishes to ``<out>/points.jsonl``, from which a stopped run resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import sim_agent

from pensieve.core.cost_model import H200_HBM_BYTES_PER_S
from pensieve.sim.ideal import (
    ForwardRates,
    attention_factor,
    attention_ratios,
    fit_forward,
    prefill_stall_steps,
)

ROOT = sim_agent.ROOT
STEPS_JSON = ROOT / "docs" / "results" / "long_context" / "prefill_stall_auto_8192.json"
ATTN_JSON = ROOT / "docs" / "results" / "long_context" / "fp8_prefill_scratch.json"
WEIGHTS_BYTES = sim_agent.PARAMS_8B * 2
SYSTEMS = {"prefix-lru": ("prefix-lru", "bf16"), "pensieve": ("pensieve", "bf16"),
           "pensieve-fp8": ("pensieve", "fp8_e4m3"), "ideal": ("ideal", "bf16"),
           "ideal-fp8": ("ideal", "fp8_e4m3")}
"""Name -> (cache policy or ``ideal``, KV dtype)."""
RATES = {"agentic": "0.8,1.3,2,3",
         "coding-agent": "0.04,0.07,0.1,0.14",
         "agent-mix": "0.1,0.16,0.24,0.34",
         "sharegpt": "0.8,1.3,2,3"}
"""Sessions/s of the configurations' sweeps."""
IDEAL_RATES = {"agentic": "1.3,2,3,4.5,6.5",
               "coding-agent": "0.07,0.14,0.2,0.28,0.4",
               "agent-mix": "0.16,0.34,0.48,0.65,0.9",
               "sharegpt": "1.3,2,3,4.5,6.5"}
"""Sessions/s of the ideals' sweeps (``WORKLOAD:ideal=...`` in ``--rates``)."""


def measured() -> dict[str, Any]:
    """The measured rates (module docstring): ``a``, ``b``, the kernels' contexts, SDPA / ours
    (min 1) and ours FP8 / ours bf16 at each."""
    weights_s = WEIGHTS_BYTES / H200_HBM_BYTES_PER_S
    a, b = fit_forward(prefill_stall_steps(json.loads(STEPS_JSON.read_text())), weights_s)
    rows = json.loads(ATTN_JSON.read_text())["rows"]
    ctx, best = attention_ratios(rows, "bf16")
    _, fp8 = attention_factor(rows, "fp8", "bf16")
    return {"a": a, "b": b, "contexts": ctx, "best": best, "fp8_over_bf16": fp8,
            "weights_s": weights_s, "steps_json": str(STEPS_JSON.relative_to(ROOT)),
            "attn_json": str(ATTN_JSON.relative_to(ROOT))}


def ideal_rates(m: dict[str, Any], kv_dtype: str) -> ForwardRates:
    kv = sim_agent.KV_BYTES_PER_TOKEN * sim_agent.KV_DTYPE_BYTES[kv_dtype] / 2
    return ForwardRates(WEIGHTS_BYTES, kv, H200_HBM_BYTES_PER_S, m["a"], m["b"],
                        tuple(m["contexts"]), tuple(m["best"]),
                        source=f"{m['steps_json']}, {m['attn_json']}, HBM 4.3 TB/s; KV "
                               f"{kv_dtype}")


def system_cost(m: dict[str, Any], kv_dtype: str) -> Any:
    """``sim_agent.step_cost`` with its prefill terms replaced by the measured forward pass
    (``b`` times the FP8 path's mean factor for FP8 KV)."""
    fp8 = sum(m["fp8_over_bf16"]) / len(m["fp8_over_bf16"]) if kv_dtype != "bf16" else 1.0
    base = sim_agent.step_cost(0.5, kv_dtype)
    return dataclasses.replace(
        base, per_prefill_token_s=m["a"], per_attn_pair_s=m["b"] * fp8,
        label=base.label + f"; prefill as measured on llama3.1-8b (a {m['a'] * 1e6:.2f} us, "
                           f"b {m['b']:.4g} s x {fp8:.3f})")


def breakdown(p: dict[str, Any], cost: dict[str, float] | None) -> dict[str, float]:
    """Seconds of GPU time per finished turn by what it went to (whole run): prefill of new
    tokens, prefill of recomputed history, the rest of compute (weights' reads, decode, KV
    reads), copy waits and host time per request (``cost`` None: the ideal, all compute)."""
    st = p["steps"]
    n = max(st["turns_finished"], 1)
    out = {"busy": st["busy_s"] / n, "copy_wait": st["exposed_copy_s"] / n}
    if cost is None:
        out.update(prefill=0.0, recompute=0.0, host=0.0,
                   other=(st["busy_s"] - st["exposed_copy_s"]) / n)
        return out
    prefill = (cost["per_prefill_token_s"] * st.get("num_prefill_tokens", 0)
               + cost["per_attn_pair_s"] * st.get("attn_pairs", 0))
    comp = p.get("prefill_computed_tokens") or 0
    share = min(1.0, p.get("recomputed_tokens", 0) / comp) if comp else 0.0
    host = cost["per_request_s"] * st.get("num_requests", 0)
    compute = st["busy_s"] - st["exposed_copy_s"]
    out.update(prefill=prefill * (1 - share) / n, recompute=prefill * share / n,
               host=host / n, other=(compute - prefill - host) / n)
    return out


def _point_id(p: dict[str, Any]) -> tuple[str, str, float]:
    return (p["workload"], p["system"], float(p["conv_rate"]))


def run_points(jobs: list[dict[str, Any]], cache: Path, workers: int) -> list[dict[str, Any]]:
    """Each job's point, simulated unless ``cache`` (JSON lines, appended as points finish,
    so that a stopped run resumes) has it; the points of ``jobs`` in their order."""
    done: dict[tuple[str, str, float], dict[str, Any]] = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            if line.strip():
                p = json.loads(line)
                done[_point_id(p)] = p
    todo = [j for j in jobs if (j["workload"], j["name"], j["rate"]) not in done]
    todo.sort(key=lambda j: -j["rate"] * (10 if j["workload"] in ("coding-agent", "agent-mix")
                                          else 1))  # the longest first
    with ProcessPoolExecutor(max_workers=max(1, workers)) as ex:
        futures = {ex.submit(sim_agent.sim_point, j): j for j in todo}
        for f in as_completed(futures):
            j = futures[f]
            p = f.result()
            p["system"] = j["name"]
            p["breakdown"] = breakdown(p, None if j["system"] == "ideal" else j["cost"])
            done[_point_id(p)] = p
            with cache.open("a") as fh:
                fh.write(json.dumps(p, default=lambda o: None) + "\n")
            print(f"{j['workload']} {j['name']} {j['rate']}: P90 TTFT {p['ttft_s_p90']:.2f} s, "
                  f"{p['sim_wall_s']} s", flush=True)
    return [done[(j["workload"], j["name"], j["rate"])] for j in jobs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/sim_ideal")
    ap.add_argument("--workloads", default="agentic,coding-agent,agent-mix,sharegpt")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=", ".join(SYSTEMS))
    ap.add_argument("--rates", default=None,
                    help="WORKLOAD=R1,R2;WORKLOAD:ideal=R1,R2;... (default: " + "; ".join(
                        [f"{k}={v}" for k, v in RATES.items()]
                        + [f"{k}:ideal={v}" for k, v in IDEAL_RATES.items()]) + ")")
    ap.add_argument("--duration", type=float, default=200.0, help="seconds of arrivals")
    ap.add_argument("--warmup", type=float, default=80.0)
    ap.add_argument("--drain", type=float, default=40.0)
    ap.add_argument("--warm-start", type=float, default=0.05,
                    help="s per answer token of the warm start (0: a cold start)")
    ap.add_argument("--ttft-targets", default="1,2,5")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="smoke test: short runs, short turns")
    ap.add_argument("--report-only", action="store_true",
                    help="simulate nothing: the tables and plot of every point of "
                         "<out>/points.jsonl of the --workloads and --systems")
    args = ap.parse_args(argv)
    rates = dict(RATES) | {f"{k}:ideal": v for k, v in IDEAL_RATES.items()}
    for part in (args.rates or "").split(";"):
        if part:
            k, v = part.split("=")
            rates[k] = v
    duration, warmup, drain, scale = ((40.0, 10.0, 20.0, 0.05) if args.tiny else
                                      (args.duration, args.warmup, args.drain, 1.0))
    m = measured()
    costs = {kv: system_cost(m, kv).to_dict() for kv in ("bf16", "fp8_e4m3")}
    jobs = []
    for wl in args.workloads.split(","):
        for name in args.systems.split(","):
            system, kv = SYSTEMS[name]
            for r in rates[f"{wl}:ideal" if system == "ideal" else wl].split(","):
                jobs.append({"workload": wl, "system": system, "name": name, "rate": float(r),
                             "think": 6.0, "gpu_gb": 40.0, "cpu_gb": 60.0,
                             "duration": duration, "warmup": warmup, "drain": drain,
                             "seed": args.seed, "scale": scale, "cost": costs[kv],
                             "kv_dtype": kv, "copy_gbps": None,
                             "warm_start": args.warm_start,
                             "ideal_rates": dataclasses.asdict(ideal_rates(m, kv))})
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        wls, names = set(args.workloads.split(",")), set(args.systems.split(","))
        points = [p for p in (json.loads(ln) for ln in
                              (out / "points.jsonl").read_text().splitlines() if ln.strip())
                  if p["workload"] in wls and p["system"] in names]
    else:
        points = run_points(jobs, out / "points.jsonl", args.workers)
    targets = [float(x) for x in args.ttft_targets.split(",")]
    caps = sim_agent.capacities(points, targets)
    from sim_ideal_report import markdown, plot, ratios

    rat = ratios(caps)
    doc = {"args": vars(args), "measured": m, "step_cost": costs, "points": points,
           "capacity_at_p90_ttft": caps, "capacity_over_ideal": rat,
           "wall_s": round(time.time() - t0, 1)}
    (out / "sim_ideal.json").write_text(json.dumps(
        doc, indent=1, default=lambda o: None if isinstance(o, float) else str(o)) + "\n")
    md = markdown(doc)
    (out / "sim_ideal.md").write_text(md)
    print(md)
    plot(rat, out / "sim_ideal.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
