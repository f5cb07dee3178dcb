"""The real churn points and the step-cost recalibration behind
``benchmarks/sim_validate_churn.py`` (which explains the method): each point's set-up and
its servers' end totals from ``real_points.tgz``, the simulated jobs of those points, and the
fit of the step cost to them."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from sim_churn_jobs import (
    RESULTS,
    run_jobs,
    step_means,
)
from step_totals import archive_files
from step_totals import parse as parse_metrics_text

from pensieve.sim.step_cost import StepCostModel, nnls

CHURN = RESULTS / "churn"
DEFAULT_PAIRS = ("stateless_pensieve_0.45_0.85", "stateless_pensieve_0.55_1.0",
                 "prefixlru_pensieve_1.2")
"""The pairs of the current engine (directories of ``docs/results/churn``)."""
AHEAD_OFF = {"swap_in_ahead_chunks": 0}
SCHEDULER: dict[str, dict[str, dict[str, Any]]] = {
    # measured before swap-ins ahead existed (the engine had no ahead path): off
    "stateless_pensieve_0.7": {"A": AHEAD_OFF, "B": AHEAD_OFF},
    "stateless_pensieve_0.45_0.85": {"A": AHEAD_OFF, "B": AHEAD_OFF},
    "stateless_pensieve_0.55_1.0": {"A": AHEAD_OFF, "B": AHEAD_OFF},
    "prefixlru_pensieve_1.2": {"A": AHEAD_OFF, "B": AHEAD_OFF},
    # A: --swap-in-ahead-chunks 0; B: the default (on)
    "pensieve_ahead_off_on_0.9": {"A": AHEAD_OFF, "B": {}},
}
"""(pair, side) -> the ``SchedulerConfig`` fields its server ran with beyond the simulator's
defaults, for points whose ``points.jsonl`` does not record them; a pair not listed runs
with the defaults (the current engine's)."""
DEFERRED: dict[str, int] = {
    # servers run with --defer-admission 3; every other recorded point was taken before
    # deferred admission existed or was the default (0: urgent evictions)
    "agentic_words_overload_defer3_1.3": 3,
    "sharegpt_40_60_defer3_pensieve_1.25": 3,
    # deferred admission the default from here on (docs/benchmarks_history.md, "Admissions that wait
    # for background swap-outs, on the GPU")
    "agentic_words_overload_defer3_1.3_again": 3,
    "sharegpt_40_60_defer3_pensieve_1.45": 3,
    "sharegpt_40_60_groups_pensieve_1.25": 3,  # the runner with per-group graph waits
    "sharegpt_40_60_groups_pensieve_1.45": 3,
    "sharegpt_40_60_split_pensieve_1.25": 3,  # the decodes of steps with prefill split
    "sharegpt_40_60_split_pensieve_1.45": 3,
    "agentic_words_overload_split_1.3": 3,
}
"""Steps a turn short of GPU blocks waited for background swap-outs, per pair (default 0), for
points whose servers did not export it yet (``pensieve_defer_admission_steps`` in their saved
``/metrics``, which takes precedence over this table)."""
FUSED = RESULTS / "multiturn_fused" / "step_cost_h200_fused.json"
SCALED = ("base_s", "per_request_s", "per_kv_read_token_s", "per_decode_token_s")
METRICS = (  # (key, label, scale)
    ("throughput_rps", "throughput (req/s)", 1.0),
    ("normalized_latency_s_p50", "P50 norm. latency (ms/tok)", 1e3),
    ("normalized_latency_s_p90", "P90 norm. latency (ms/tok)", 1e3),
    ("ttft_s_p50", "P50 TTFT (s)", 1.0),
    ("prefill_computed_tokens", "prefill computed (window)", 1.0),
    ("prefill_step_s", "prefill-step s (run)", 1.0),
    ("prefill_step_mean_s", "prefill step mean (ms)", 1e3),
    ("decode_step_mean_s", "decode step mean (ms)", 1e3),
    ("prefill_token_net_s", "us/prefill token, net", 1e6),
    ("prefill_copy_wait_per_token_s", "of it copy wait (sim)", 1e6),
    ("swap_in_chunks", "swap-in chunks (run)", 1.0),
    ("decode_step_s", "decode-step s (run)", 1.0),
    ("prefill_steps", "prefill steps (run)", 1.0),
    ("decode_steps", "decode steps (run)", 1.0),
    ("steps", "steps (run)", 1.0),
    ("prefill_tokens_run", "prefill tokens (run)", 1.0),
)


# ------------------------------------------------------------------------ real points
def load_real(pairs: tuple[str, ...] = DEFAULT_PAIRS) -> list[dict[str, Any]]:
    """The real points of the given pairs (directory names under ``docs/results/churn``)
    with their servers' end totals."""
    real = []
    for pair in pairs:
        files = {k.removeprefix("./"): v
                 for k, v in archive_files(CHURN / pair / "real_points.tgz").items()}
        for side in [s for s in ("A", "B")  # a one-server run has side A only
                     if f"{s}/points.jsonl" in files]:
            def member(name: str, side: str = side,
                       files: dict[str, bytes] = files) -> str:
                return files[f"{side}/{name}"].decode()
            p = json.loads(member("points.jsonl").splitlines()[0])
            m = parse_metrics_text(member("metrics_end.txt"))
            def g(k: str, m: dict[str, float] = m) -> float:
                return m.get(k, 0.0)
            p.update(
                pair=pair, side=side, scheduler=scheduler_overrides(pair, side, p),
                prefill_step_s=g('pensieve_step_execute_seconds_total:prefill'),
                decode_step_s=g('pensieve_step_execute_seconds_total:decode'),
                prefill_steps=g('pensieve_steps_total:prefill'),
                decode_steps=g('pensieve_steps_total:decode'),
                prefill_tokens_run=g('pensieve_computed_tokens_total:prefill'),
                decode_tokens_run=g('pensieve_computed_tokens_total:decode'),
                scheduler_s=g('pensieve_scheduler_seconds_total:schedule')
                + g('pensieve_scheduler_seconds_total:update'),
                swap_in_chunks=g('pensieve_swap_chunks_total:in'),
                swap_out_chunks=g('pensieve_swap_chunks_total:out')
                + g('pensieve_swap_chunks_total:out_urgent'),
                urgent_swap_out_chunks=g('pensieve_swap_chunks_total:out_urgent'))
            if "pensieve_defer_admission_steps" in m:  # servers that export their setting
                p.setdefault("defer_admission", int(m["pensieve_defer_admission_steps"]))
            p["steps"] = p["prefill_steps"] + p["decode_steps"]
            step_means(p)
            real.append(p)
    return real


def scheduler_overrides(pair: str, side: str, point: dict[str, Any]) -> dict[str, Any]:
    """The scheduler settings a side ran with beyond the defaults: recorded in its point, else
    :data:`SCHEDULER`'s."""
    if "swap_in_ahead_chunks" in point:
        return {"swap_in_ahead_chunks": int(point["swap_in_ahead_chunks"])}
    return dict(SCHEDULER.get(pair, {}).get(side, {}))


def same_point(s: dict[str, Any], r: dict[str, Any]) -> bool:
    """Whether simulated point ``s`` is real point ``r``'s (same pair and side)."""
    return s["pair"] == r["pair"] and s.get("side", r["side"]) == r["side"]


def point_name(r: dict[str, Any], real: list[dict[str, Any]]) -> str:
    """``system@rate``, with the side when the other side of its pair is the same."""
    name = f"{r['system']}@{r['conv_rate']}"
    twin = any(x is not r and x["pair"] == r["pair"] and x["system"] == r["system"]
               and x["conv_rate"] == r["conv_rate"] for x in real)
    return f"{name} ({r['side']})" if twin else name


def real_jobs(real: list[dict[str, Any]], cost: StepCostModel, name: str,
              args: argparse.Namespace, pairs: tuple[str, ...]) -> list[dict[str, Any]]:
    jobs = []
    for r in real:
        if r["pair"] not in pairs:
            continue
        duration, warmup = r["duration_s"], r["warmup_s"]
        if args.tiny:  # a smoke test: short run, small load
            duration, warmup = 40.0, 20.0
        jobs.append({"system": r["system"], "rate": r["conv_rate"], "pair": r["pair"],
                     "side": r["side"], "scheduler": r["scheduler"],
                     "think": r["think_time_s"], "gpu_kv_gb": r["gpu_kv_gb"],
                     "cpu_kv_gb": r["cpu_kv_gb"], "duration": duration, "warmup": warmup,
                     "drain": 25.0 if not args.tiny else 10.0, "seed": args.seed,
                     "workload": "agentic" if r.get("workload", "Agentic") == "Agentic"
                     else "sharegpt", "template_tokens": args.template_tokens,
                     "length_scale": 0.2 if args.tiny else 1.0,
                     "warm_start": r.get("warm_start_s_per_token"),
                     "defer_admission": r.get("defer_admission", DEFERRED.get(r["pair"], 0)),
                     "graph_swap_in_rule": getattr(args, "graph_swap_in_rule", False),
                     "eager_launch_s": getattr(args, "eager_launch_ms", 0.0) / 1e3,
                     "graph_group_waits": getattr(args, "graph_group_waits", False),
                     "ahead_layered": getattr(args, "ahead_layered", False),
                     "issue_costs": getattr(args, "issue_costs", False),
                     "background_after_launch": getattr(args, "background_after_launch",
                                                        False),
                     "cost": cost.to_dict(), "model_name": name})
    return jobs


# ------------------------------------------------------------------------ recalibration
def calibrate(base: StepCostModel, sims: list[dict[str, Any]], real: list[dict[str, Any]],
              label: str) -> tuple[StepCostModel, dict[str, Any]]:
    """Fit (alpha, per_prefill_step_s, per_prefill_token_s) to the real servers' *mean*
    executor seconds per step of each kind (decode-only, with prefill) of the points in
    ``sims`` (matched by pair and side). Per step, not in total: both engines are busy
    almost all the time, so their total step seconds are ~the run's length whatever a step
    costs; what a step costs shows in how many steps fit in it. A decode step's predicted mean
    is ``alpha x`` the base fit's per-step terms of the simulated decode steps (mean requests,
    KV reads) plus their attention and exposed copy time; a prefill step's also has
    ``per_prefill_step_s + per_prefill_token_s x`` the *real* prefill tokens per prefill step
    (the simulator computes 10-25% more prefill tokens than the servers did), with the
    simulated attention pairs per prefill token. When the fit points' prefill tokens per step
    differ by less than 2x (the 1.2 pair: 770 and 800), the two prefill terms cannot be told
    apart and ``per_prefill_token_s`` is held at the base fit's value. The servers' scheduler
    seconds per step (host time outside the executor) are added to ``base_s``."""
    import numpy as np

    from pensieve.sim.step_cost import COEFFICIENTS

    ix = {c: i for i, c in enumerate(COEFFICIENTS)}
    rows, ys, tok_per_step = [], [], []
    host_s = host_n = 0.0
    for s in sims:
        r = next(x for x in real if same_point(s, x))
        host_s += r["scheduler_s"]
        host_n += r["steps"]
        for kind in ("prefill", "decode"):
            k = s["kinds"][kind]
            d = k["design"]
            n = k["n"]
            if n == 0 or not r[f"{kind}_steps"]:
                continue
            shared = sum(getattr(base, c) * d[ix[c]] for c in SCALED) / n
            tok = r["prefill_tokens_run"] / r["prefill_steps"] if kind == "prefill" else 0.0
            sim_tok = d[ix["per_prefill_token_s"]]
            attn_per_tok = d[ix["per_attn_pair_s"]] / sim_tok if sim_tok else 0.0
            fixed = base.per_attn_pair_s * attn_per_tok * tok + k["exposed_s"] / n
            y = r[f"{kind}_step_s"] / r[f"{kind}_steps"]
            rows.append([shared, 1.0 if kind == "prefill" else 0.0, tok])
            ys.append((y, fixed))
            if kind == "prefill":
                tok_per_step.append(tok)
    a = np.array(rows)
    y = np.array([v - f for v, f in ys])
    tot = np.array([v for v, _ in ys])
    w = 1.0 / tot
    hold = max(tok_per_step) < 2 * min(tok_per_step)
    if hold:  # the prefill terms are not identifiable: keep the base per-token cost
        y = y - a[:, 2] * base.per_prefill_token_s
        coef2 = nnls(a[:, :2] * w[:, None], y * w)
        coef = np.array([coef2[0], coef2[1], base.per_prefill_token_s])
        pred = a[:, :2] @ coef2 + a[:, 2] * base.per_prefill_token_s
        y = y + a[:, 2] * base.per_prefill_token_s
    else:
        coef = nnls(a * w[:, None], y * w)
        pred = a @ coef
    alpha, pps, ppt = (float(c) for c in coef)
    host = host_s / host_n if host_n else 0.0
    scaled = {c: getattr(base, c) * alpha for c in SCALED}
    scaled["base_s"] += host
    model = dataclasses.replace(
        base, **scaled, per_prefill_step_s=pps, per_prefill_token_s=ppt, source="fit",
        label=f"{base.label} -> recalibrated on churn server totals ({label})",
        fit_num_records=len(ys), fit_median_rel_err=None, fit_p90_rel_err=None)
    return model, {"alpha": alpha, "per_prefill_step_s": pps, "per_prefill_token_s": ppt,
                   "per_prefill_token_held": hold, "host_s_per_step": host,
                   "residual_rel": [float(v) for v in (pred - y) / tot]}


def fit_loop(base: StepCostModel, real: list[dict[str, Any]], pairs: tuple[str, ...],
             args: argparse.Namespace, name: str, first: list[dict[str, Any]],
             log: list[str]) -> tuple[StepCostModel, list[dict[str, Any]], list[dict]]:
    sims = [s for s in first if s["pair"] in pairs]
    model, info = calibrate(base, sims, real, name)
    infos = [info]
    for it in range(1, args.calib_iters):
        sims = run_jobs(real_jobs(real, model, f"{name} iter {it}", args, pairs), args.workers)
        model, info = calibrate(base, sims, real, name)
        infos.append(info)
    msg = (f"{name}: alpha {info['alpha']:.3f}, per_prefill_step "
           f"{info['per_prefill_step_s'] * 1e3:.2f} ms, per_prefill_token "
           f"{info['per_prefill_token_s'] * 1e6:.2f} us"
           f"{' (held)' if info['per_prefill_token_held'] else ''}, host "
           f"{info['host_s_per_step'] * 1e3:.3f} ms/step "
           f"(residuals {', '.join(f'{v:+.1%}' for v in info['residual_rel'])})")
    print(msg, flush=True)
    log.append(msg)
    return model, sims, infos


