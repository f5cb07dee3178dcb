"""The simulated churn runs behind ``benchmarks/sim_validate_churn.py`` and
``benchmarks/sim_churn_capacity.py``: the real servers' set-up in the simulator (tiers, policy,
retention cost profile, measured copy rates, scheduler settings), the workloads as
:mod:`pensieve.bench.multiturn` draws them, one point per job (a dict, so jobs run in worker
processes) and the options a simulated sweep shares."""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pensieve.bench.engine_api import VirtualClock
from pensieve.bench.loadgen import add_warm_start_arg, run_load, warm_start_from
from pensieve.bench.run_metrics import summarize
from pensieve.bench.workload_types import DEFAULT_SHAREGPT_MERGED_CACHE
from pensieve.sim.step_cost import StepCostModel, TransferModel

RESULTS = Path("docs") / "results"
"""The repository's recorded results, relative to the working directory: the simulated churn
sweeps run from a source checkout, whose recorded fits and real points they read."""
FIT_ALL = RESULTS / "sim_churn_process" / "step_cost_churn_fit_all.json"
"""The default step cost of ``benchmarks/sim_churn_capacity.py``: the fit on the
engine-process servers' points (``sim_validate_churn.py --out docs/results/sim_churn_process
...``). The thread servers' fit, which the older tables used, is
``docs/results/sim_churn/step_cost_churn_fit_all.json``."""
SWAP = RESULTS / "swap" / "swap_bandwidth.json"
KV_BYTES_PER_TOKEN = 2 * 40 * 10 * 128 * 2  # Llama 2-13B GQA-10, bf16
CHUNK = 32
GRAPH_MAX_TOKENS = 512
GRAPH_MAX_SWAP_IN = 21
"""The runner's ``graph_max_swap_in`` for this shape (``model_runner.graph_max_swap_in`` of
one chunk's bytes; a test keeps the two equal): steps with more of their own swap-in chunks
run eagerly."""
STAGED_GROUPS = 8
"""The ``staged`` swapper's groups of layers (``KVSwapper.in_groups``, its default)."""
PROFILE = (Path(__file__).resolve().parents[1] / "src" / "pensieve" / "profiles"
           / "llama-L40-H5120-q40-kv10-d128-i13824__NVIDIA_H200.json")
"""The retention cost profile the real servers used (the engine picks it by shape and GPU)."""


ISSUE_GROUP_S, ISSUE_CHUNK_S = 0.149e-3, 0.0062e-3
"""Host time to issue staged copies, per group of layers and per chunk: a least-squares fit
(no intercept) of measured issue times (docs/performance_history.md, "Host time of steps with
prefill, and what the server's step log shows", the simulator with the issue modelled)."""


def transfer_model(gbps: list[float] | None = None, graph_rule: bool = False,
                   eager_launch_s: float = 0.0, group_waits: bool = False,
                   ahead_layered: bool = False, issue_costs: bool = False,
                   background_after_launch: bool = False) -> TransferModel:
    """The measured copies (``hybrid``'s one-way rates on random block ids; ``staged``'s,
    the default now, are within 1% of them), or what-if
    rates ``gbps`` = ``[in, out]`` GB/s with the same layer pipelining. ``graph_rule``: steps
    of up to ``GRAPH_MAX_TOKENS`` tokens with more than ``GRAPH_MAX_SWAP_IN`` swap-in chunks of
    their own run pipelined, as in the runner before per-group waits (else every such step
    waits for all its swap-ins, as the validated fits assumed), each ``eager_launch_s`` longer.
    ``group_waits``: the runner now (``runner/graph_waits.py``): every step, graph or eager,
    pipelined by the ``staged`` swapper's 8 groups of layers. ``ahead_layered``: what-if,
    the next step waits for the copies ahead layer by layer (the runner's
    ``ahead_waits="layers"``; :attr:`TransferModel.ahead_layered`). ``issue_costs``: the
    host's issue of the copies before the forward (:data:`ISSUE_GROUP_S`,
    :data:`ISSUE_CHUNK_S`); with ``background_after_launch`` (the runner's way) a graph step
    issues its ahead copies and background swap-outs after its launch."""
    swap_in = GRAPH_MAX_SWAP_IN if graph_rule else None
    eager = eager_launch_s if graph_rule else 0.0
    shape: dict[str, Any] = ({"num_layers": STAGED_GROUPS, "graph_max_tokens": 0} if group_waits
                             else {"num_layers": 40, "graph_max_tokens": GRAPH_MAX_TOKENS})
    shape["ahead_layered"] = ahead_layered
    shape.update(background_after_launch=background_after_launch,
                 defer_max_tokens=GRAPH_MAX_TOKENS)
    if issue_costs:
        shape.update(issue_group_s=ISSUE_GROUP_S, issue_chunk_s=ISSUE_CHUNK_S,
                     in_groups=STAGED_GROUPS)
    if gbps is not None:
        return TransferModel(swap_in_gbps=gbps[0], swap_out_gbps=gbps[1], **shape,
                             graph_max_swap_in=swap_in, eager_launch_s=eager,
                             source=f"what-if {gbps[0]:g}/{gbps[1]:g} GB/s")
    return TransferModel.load(SWAP, case="hybrid", **shape, graph_max_swap_in=swap_in,
                              eager_launch_s=eager)


def conversations(workload: str, seed: int, template_tokens: int, length_scale: float,
                  ) -> list[Any]:
    from pensieve.bench.workload import Conversation, Turn, load_workload

    if workload == "agentic":
        from pensieve.bench.agentic import agentic_workload

        convs = list(agentic_workload(5000, seed=seed).conversations)
    else:
        convs = list(load_workload(str(DEFAULT_SHAREGPT_MERGED_CACHE)).conversations)
    if template_tokens or length_scale != 1.0:
        def sc(n: int) -> int:
            return max(1, round(n * length_scale))
        convs = [Conversation(c.conv_id, [Turn(sc(t.input_len) + template_tokens,
                                               sc(t.output_len)) for t in c.turns])
                 for c in convs]
    random.Random(seed).shuffle(convs)  # as pensieve.bench.multiturn
    return convs


def make_sim(job: dict[str, Any], cost: StepCostModel, clock: VirtualClock,
             chunk_cost: Any = None, transfer: TransferModel | None = None) -> Any:
    """A :class:`~pensieve.sim.simulator.SimEngine` with the real servers' set-up: the
    job's tiers (``gpu_kv_gb``, ``cpu_kv_gb``) and policy (``system``), the retention cost
    profile they used, the measured copies (``chunk_cost`` / ``transfer``: already loaded
    ones, to share between replicas) and the job's ``scheduler`` settings (``SchedulerConfig``
    fields beyond the defaults, if any), ``swap_gbps`` (what-if copy rates ``[in, out]``;
    the measured ones if absent or None), ``decode_reserve`` (the share of the GPU tier
    admission keeps free for decode growth) and ``defer_admission`` (steps a turn short of GPU
    blocks may wait for background swap-outs); each the engine's default if absent or None."""
    from pensieve.core.cost_model import CostModel
    from pensieve.core.scheduling_config import SchedulerConfig
    from pensieve.sim.simulator import SimEngine

    block_bytes = KV_BYTES_PER_TOKEN * CHUNK
    gpu = int(job["gpu_kv_gb"] * 2**30 // block_bytes)
    cpu = int(job["cpu_kv_gb"] * 2**30 // block_bytes)
    reserve = job.get("decode_reserve")
    cache: dict[str, Any] = {} if reserve is None else {"decode_reserve": reserve}
    if job.get("defer_admission") is not None:
        cache["defer_admission"] = job["defer_admission"]
    rule = job.get("recompute_rule") or "step"
    if rule == "off":
        cache["swap_bandwidth_gbps"] = "off"
    eng = SimEngine(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256,
                                    max_model_len=16384, **job.get("scheduler", {})),
                    gpu, cpu, cost, clock,
                    chunk_cost if chunk_cost is not None else CostModel.load(PROFILE),
                    chunk_size=CHUNK, cache_policy=job["system"], block_bytes=block_bytes,
                    share_prefixes=bool(job.get("share_prefixes", False)),
                    transfer=transfer if transfer is not None else transfer_model(
                        job.get("swap_gbps"), bool(job.get("graph_swap_in_rule")),
                        float(job.get("eager_launch_s") or 0.0),
                        bool(job.get("graph_group_waits")),
                        bool(job.get("ahead_layered")), bool(job.get("issue_costs")),
                        bool(job.get("background_after_launch"))), **cache)
    if rule == "bare":  # the earlier rule, without the step's own compute (docs/performance.md,
        # "Swap or recompute: the step's own compute")
        eng.track_step_overlap = False
    return eng


STEADY_SHOWN = ("sessions_in_flight", "gpu_blocks_used", "cpu_blocks_used", "requests_running",
                "requests_waiting")
"""What a simulated point keeps of its steady-state check (the halves' means): the issue's
definition of steady state is sessions in flight and tier occupancy flat over the window."""


def sim_point(job: dict[str, Any]) -> dict[str, Any]:
    """One simulated point: summary over the window plus run totals by step kind (and the
    aggregated design of each kind, for the recalibration)."""
    from pensieve.sim.step_cost import _design_row

    t0 = time.time()
    cost = StepCostModel.from_dict(job["cost"])
    clock = VirtualClock()
    eng = make_sim(job, cost, clock)
    convs = conversations(job["workload"], job["seed"], job["template_tokens"],
                          job.get("length_scale", 1.0))
    res = run_load(eng, clock, convs, job["rate"], job["think"], job["duration"], 32000,
                   seed=job["seed"], drain_s=job["drain"], sample_interval_s=1.0,
                   warm_start=warm_start_from(job.get("warm_start")))
    p = {"system": job["system"], "conv_rate": job["rate"], "pair": job.get("pair"),
         "side": job.get("side"), "scheduler": job.get("scheduler", {}),
         "warm_start_s_per_token": job.get("warm_start"),
         "recompute_rule": job.get("recompute_rule") or "step",
         "model": job.get("model_name"), "unfinished": res.unfinished,
         **summarize(res, job["warmup"])}
    st = p.pop("steady", None) or {}
    halves = st.get("halves") or {}
    p.update(steady_unsteady=st.get("unsteady"), steady_within_noise=st.get("steady_within_noise"),
             steady_halves={k: halves[k] for k in STEADY_SHOWN if k in halves},
             ramp=ramp(res.samples))
    kinds: dict[str, dict[str, Any]] = {
        k: {"n": 0, "s": 0.0, "exposed_s": 0.0, "design": [0.0] * 8, "prefill_tokens": 0}
        for k in ("prefill", "decode")}
    for f, dt in eng.executor.step_log:
        k = kinds["prefill" if f.num_prefill_tokens > 0 else "decode"]
        k["n"] += 1
        k["s"] += dt
        k["exposed_s"] += (f.exposed_copy_s if f.exposed_copy_s is not None
                           else dt - cost.compute_time(f))
        k["prefill_tokens"] += f.num_prefill_tokens
        k["design"] = [a + b for a, b in zip(k["design"], _design_row(f))]
    p.update(prefill_step_s=kinds["prefill"]["s"], decode_step_s=kinds["decode"]["s"],
             prefill_steps=kinds["prefill"]["n"], decode_steps=kinds["decode"]["n"],
             steps=kinds["prefill"]["n"] + kinds["decode"]["n"],
             prefill_tokens_run=kinds["prefill"]["prefill_tokens"],
             swap_in_chunks=eng.executor.swap_in_chunks,
             swap_out_chunks=eng.executor.swap_out_chunks,
             exposed_copy_s=eng.executor.exposed_copy_s, kinds=kinds,
             sim_wall_s=round(time.time() - t0, 1))
    step_means(p)
    return p


def ramp(samples: list[dict[str, Any]], every_s: float = 50.0) -> list[dict[str, float]]:
    """The run's state over time: the means of the samples' ``STEADY_SHOWN`` counts over each
    ``every_s`` seconds (from the first arrival), to see when the population levels off."""
    bins: dict[int, list[dict[str, Any]]] = {}
    for smp in samples:
        bins.setdefault(int(smp["t"] // every_s), []).append(smp)
    return [{"t": i * every_s, **{k: round(sum(x.get(k, 0.0) for x in b) / len(b), 1)
                                  for k in STEADY_SHOWN}}
            for i, b in sorted(bins.items())]


def add_sweep_args(ap: argparse.ArgumentParser, targets: str) -> None:
    """The options a simulated sweep shares (``benchmarks/sim_churn_capacity.py``)."""
    ap.add_argument("--step-cost", default=str(FIT_ALL))
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    ap.add_argument("--warmup", type=float, default=300.0)
    ap.add_argument("--drain", type=float, default=60.0)
    add_warm_start_arg(ap)
    ap.add_argument("--recompute-rule", choices=["step", "bare", "off"], default="step",
                    help="how a CPU chunk comes back: swap or recompute by cost with the step's "
                         "own compute counted (step, the engine's), without it (bare, the "
                         "engine's earlier rule), or always swapped in (off)")
    ap.add_argument("--targets", default=targets, help="P90 ms/token")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="smoke test: short runs, small lengths")


def sweep_times(args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(duration, warm-up, drain, length scale) of a sweep's runs (``--tiny``: short ones)."""
    if args.tiny:
        return 40.0, 20.0, 10.0, 0.2
    return args.duration, args.warmup, args.drain, 1.0


def run_jobs(jobs: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    if workers <= 1 or len(jobs) <= 1:
        return [sim_point(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(sim_point, jobs))


def step_means(p: dict[str, Any]) -> None:
    """Mean seconds of a prefill / decode step and executor seconds per computed prefill token
    net of the decodes riding along (``benchmarks/step_totals.py``), from run totals."""
    n_p, n_d, tok = p["prefill_steps"], p["decode_steps"], p["prefill_tokens_run"]
    p["prefill_step_mean_s"] = p["prefill_step_s"] / n_p if n_p else None
    p["decode_step_mean_s"] = d = p["decode_step_s"] / n_d if n_d else 0.0
    p["prefill_token_net_s"] = (p["prefill_step_s"] - n_p * d) / tok if tok else None
    kinds = p.get("kinds")
    if kinds:  # simulated points: the copy wait of the steps with prefill, per token
        p["prefill_copy_wait_per_token_s"] = kinds["prefill"]["exposed_s"] / tok if tok else None
