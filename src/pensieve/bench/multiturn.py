"""Multi-turn serving benchmark: systems side by side over a multi-turn trace.

For each system and conversation arrival rate, drive a fresh engine with the load generator
(`pensieve.bench.loadgen`) and record one summary line per point (throughput, P50/P90/P99
latency, normalized latency and TTFT, prompt tokens by source, and the fields of vLLM's
``bench serve --save-result``: ``request_throughput``, ``mean_ttft_ms``, ``p99_tpot_ms``, ...,
from ``pensieve.bench.serve_metrics``) to ``<out>/points.jsonl``,
every request to ``<out>/requests.jsonl``, and for Pensieve engines on a device every step's
features and time to ``<out>/steps.jsonl`` (the simulator is calibrated from those).

Systems: ``pensieve``, ``gpu-only``, ``lru``, ``prefix-lru``, ``stateless`` (Pensieve's engine
under that cache policy) and ``hf`` (HF transformers' continuous batching, stateless).
``--engine sim`` runs the same scheduler and cache on virtual time instead (``--step-cost``).
``--engine http --url URL`` drives a running server over its HTTP API; the server's
``--cache-policy`` is the system, so give one ``--systems`` name to record it. ``--api chat``
is an ordinary OpenAI chat client: streaming ``/v1/chat/completions`` re-sending the whole
message history each turn, tokens counted from ``usage`` (``pensieve.bench.http_engine``;
``--no-ignore-eos`` for servers that reject ``ignore_eos``); ``--api completions`` (default)
is Pensieve's token-id path (streaming ``/v1/completions``, one server conversation per
benchmark conversation). Its point also records the client's ``http_errors``,
``http_throttled`` (turns that waited for one of the ``--max-connections``),
``http_peak_in_flight`` and, for chat, ``http_history_misses`` (turns whose history the server
did not recognise) and ``tokens_per_word`` (``benchmarks/http_point.sh`` runs one completions
point, ``benchmarks/churn_points.sh`` chat points of two servers side by side).

``--workload agentic`` (``pensieve.bench.agentic``): long sessions (8-24 turns) of ~300-token
inputs and ~100-token answers. Steady state: once a second the load generator samples sessions
in flight, KV blocks used per tier and requests running / waiting (in process from the engine,
over HTTP from the server's ``/metrics``); each point's series goes to
``<out>/timeseries.jsonl`` and the point gets ``steady_state`` (True when every one of those
means moved by at most 10% between the window's halves, plus a floor of one request or 1% of a
tier: ``pensieve.bench.run_metrics.steady_state``) and ``steady`` (the halves' means, and
``steady_within_noise``: the same check, also passing a difference within two standard errors
of the window's own scatter -- at a few sessions a second the arrivals alone move the halves by
10-20%). ``--warmup auto`` is 1.5 mean session lifetimes (turns x (think time + ~20 ms a token
of answer)); a shorter warm-up gets a warning. Tiers that are never emptied by an ordinary
client fill at about rate x 5k tokens/s on the agentic load, so at low rates they take longer
than a session lifetime to reach their steady occupancy: the time series shows when.
``--batching separate`` runs Pensieve's engine (real or sim) with separate prefill and decode
steps (vLLM 0.2 style, ``SchedulerConfig.batching``) instead of unified ones; each point
records its ``batching`` (None for ``hf`` and ``http``, whose batching is not ours to set).

    pensieve bench multiturn --systems stateless,gpu-only,pensieve --rates 0.1,0.2,0.3 \
        --model llama2-13b-gqa10 --load-format dummy --dtype bfloat16 --think-time 6 \
        --gpu-kv-gb 4 --cpu-kv-gb 22 --duration 60 --warmup 10 --out results/multiturn

The engine's options are generated from the config (:mod:`pensieve.options`, ``--config FILE``
too), under this benchmark's own defaults (:data:`ENGINE_DEFAULTS`: the paper's setting);
the real engine, the simulator's scheduler and the ``hf`` peer all read them from there.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pensieve.bench.engine_api import VirtualClock, WallClock
from pensieve.bench.loadgen import add_warm_start_arg, run_load, warm_start_from
from pensieve.bench.run_metrics import summarize
from pensieve.bench.serve_metrics import vllm_metrics
from pensieve.bench.sharegpt import sharegpt_workload
from pensieve.bench.workload import load_workload, ultrachat_synthetic
from pensieve.bench.workload_types import DEFAULT_MAX_CONTEXT
from pensieve.options import add_engine_args, default_of, engine_options
from pensieve.sim.disk import (
    PREFETCH,
    SIM_DISK_READ_GBPS,
    SIM_DISK_WRITE_GBPS,
    WAIT,
)

DEFAULT_CACHE = Path(__file__).resolve().parent / "data" / "sharegpt_merged_lengths.json.gz"
"""The packaged ShareGPT file with its split pieces joined back into whole conversations."""

ENGINE_DEFAULTS = {"model": "llama2-13b-gqa10", "load_format": "dummy", "dtype": "bfloat16",
                   "gpu_kv_gb": 40.0, "cpu_kv_gb": 220.0, "max_model_len": 16384,
                   "max_num_batched_tokens": 8192}
"""The benchmark's defaults where they differ from the engine's (the paper's setting: Llama
2-13B with GQA-10 on random weights, 40 GB of GPU KV and 220 GB of CPU KV, a fixed context
limit and step budget whatever the model and device)."""

NOT_ENGINE = ("seed", "cache_policy")
"""Engine options this benchmark does not take: ``--seed`` is the load's own (workload,
shuffle, arrivals), ``--systems`` names the cache policies."""


def workload(args: argparse.Namespace) -> Any:
    """The load's conversations. With ``--shared-prefix-tokens`` S, every conversation's
    context limit (the workload's ``max_context``) is S tokens lower, since its first turn
    carries the prefix too: no turn passes the limit the workload was drawn for."""
    room = args.shared_prefix_tokens
    n = args.num_conversations or 5000
    if args.workload in ("coding-agent", "agent-mix"):
        from pensieve.bench.coding_agent import (
            AGENT_MAX_CONTEXT,
            agent_mix_workload,
            coding_agent_workload,
        )

        make = coding_agent_workload if args.workload == "coding-agent" else agent_mix_workload
        return make(n, seed=args.seed, max_context=AGENT_MAX_CONTEXT - room)
    if args.workload == "agentic":
        from pensieve.bench.agentic import agentic_workload

        return agentic_workload(n, seed=args.seed, max_context=DEFAULT_MAX_CONTEXT - room)
    if args.workload == "ultrachat":
        return ultrachat_synthetic(n, seed=args.seed, max_context=DEFAULT_MAX_CONTEXT - room)
    wl = (sharegpt_workload(args.sharegpt, max_conversations=args.num_conversations)
          if args.sharegpt else load_workload(str(DEFAULT_CACHE)))
    if room:
        wl.conversations = [c for c in wl.conversations
                            if c.total_tokens <= DEFAULT_MAX_CONTEXT - room]
    return wl


class StepLog:
    """Step observer of the shared engine: each step's features and executor time, labelled
    with the system the point runs (the simulator is calibrated from these rows), and under
    ``host`` the step's host times (scheduler, executor wall, the runner's prepare and issue:
    ``benchmarks/step_totals.py`` sums them as it does a server's ``/metrics``)."""

    def __init__(self) -> None:
        self.system = ""
        self.rows: list[dict[str, Any]] = []

    def __call__(self, rec: Any) -> None:
        from pensieve.sim.step_cost import features_of

        self.rows.append({"system": self.system, **features_of(rec.sched).to_dict(),
                          "time_s": rec.step_time_s,
                          "host": {"schedule_s": rec.schedule_s, "update_s": rec.update_s,
                                   "execute_s": rec.execute_s,
                                   "prepare_s": rec.host_prepare_s,
                                   "issue_s": rec.host_issue_s}})


class RealEngines:
    """The systems on the device. All Pensieve systems share one engine (built once with the
    CPU tier, so the model, the KV tensors and the pinned host memory are set up once), reset
    to empty tiers under the system's cache policy and ``--batching`` before each point; its
    steps reach :attr:`steps` through the engine's step observers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine: Any = None
        self.steps = StepLog()

    def build(self, system: str, clock: WallClock) -> tuple[Any, list[dict[str, Any]] | None]:
        """(engine, its step rows for this point; None for the HF peer)."""
        args = self.args
        if system == "hf":
            from pensieve.bench.hf_peer import HFContinuousBatchingEngine

            return HFContinuousBatchingEngine(
                args.model, dtype=args.dtype, device=args.device, clock=clock,
                kv_cache_gb=args.gpu_kv_gb, max_batch_tokens=args.max_num_batched_tokens), None
        from pensieve.engine.llm import build_engine_config
        from pensieve.engine.llm_engine import LLMEngine

        if self.engine is None:
            cfg = build_engine_config(**{**args.engine_options, "cache_policy": "pensieve"})
            # the points run on wall time, as the engine's default clock does
            self.engine = LLMEngine(cfg, clock=clock.now, observers=[self.steps])
        eng = self.engine
        eng.reset(system, dataclasses.replace(eng.scheduler_config, batching=args.batching,
                                              swap_in_ahead_chunks=args.swap_in_ahead_chunks))
        self.steps.system = system
        self.steps.rows.clear()
        return eng, self.steps.rows

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def build_sim(system: str, args: argparse.Namespace, clock: VirtualClock) -> Any:
    from pensieve.core.cost_model import CostModel
    from pensieve.sim.simulator import SimEngine
    from pensieve.sim.step_cost import StepCostModel

    cost = StepCostModel.load(args.step_cost)
    if args.step_cost_set:  # what-if: e.g. per_prefill_step_s=0 (mixed steps as cheap as decode)
        import dataclasses

        sets = dict(kv.split("=", 1) for kv in args.step_cost_set.split(","))
        cost = dataclasses.replace(cost, **{k: float(v) for k, v in sets.items()},
                                   label=f"{cost.label} [what-if {args.step_cost_set}]")
    block_bytes = args.kv_bytes_per_token * args.chunk_size
    chunk_cost = (CostModel.load(args.cost_profile) if args.cost_profile
                  else CostModel.analytic(40, 5120, 40, 10, 128, 13824, args.chunk_size))
    # tiers of --gpu-kv-gb / --cpu-kv-gb over the chunk's bytes, the scheduler and cache
    # options as given: the engine's options, with no device's defaults settled
    return SimEngine.from_options({**args.engine_options, "cache_policy": system}, cost, clock,
                                  chunk_cost, block_bytes=block_bytes,
                                  disk_write_gbps=args.sim_disk_write_gbps,
                                  disk_prefetch=args.sim_disk_prefetch,
                                  disk_wait=args.sim_disk_wait)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``pensieve bench multiturn``."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="stateless,gpu-only,pensieve")
    ap.add_argument("--rates", default="0.1,0.2,0.3", help="conversation arrivals per second")
    ap.add_argument("--engine", choices=["real", "sim", "http"], default="real")
    ap.add_argument("--url", default=None, help="http: the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None, help="http: bearer key (if the server wants one)")
    ap.add_argument("--max-connections", type=int, default=512,
                    help="http: most requests in flight at once (keep above the peak load)")
    ap.add_argument("--api", choices=["completions", "chat"], default="completions",
                    help="http: Pensieve's /v1/completions with token ids and conversation "
                         "ids, or an ordinary OpenAI chat client re-sending the history")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="http: do not send ignore_eos (servers that reject it; answers may "
                         "then end early)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="http chat: one word per prompt token, no tokens-per-word "
                         "calibration against the server")
    ap.add_argument("--http-model", default=None,
                    help="http: the requests' model field (default: the server's first model)")
    ap.add_argument("--keep-conversations", action="store_true",
                    help="http: do not delete the server conversations a point created")
    ap.add_argument("--sample-interval", type=float, default=1.0,
                    help="seconds between samples of the run's state (0: none)")
    ap.add_argument("--workload", choices=["sharegpt", "ultrachat", "agentic", "coding-agent",
                                           "agent-mix"],
                    default="sharegpt")
    ap.add_argument("--sharegpt", default=None, help="a ShareGPT JSON file (default: the "
                    "committed length cache of the packaged file)")
    ap.add_argument("--num-conversations", type=int, default=None)
    ap.add_argument("--length-scale", type=float, default=1.0,
                    help="multiply every turn's input and answer length (>= 1 token): small "
                         "loads for smoke tests on the CPU")
    ap.add_argument("--think-time", type=float, default=60.0, help="mean seconds")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--warmup", default="60",
                    help="seconds before the window, or 'auto' (1.5 mean session lifetimes)")
    ap.add_argument("--drain", type=float, default=None)
    add_warm_start_arg(ap)
    ap.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                    help="every session's first turn opens with the same N tokens (a system "
                         "prompt and tool schema all sessions send), before its own input")
    ap.add_argument("--seed", type=int, default=0,
                    help="the load's seed: workload, shuffle, arrivals and think times")
    ap.add_argument("--step-cost", default=None, help="sim: StepCostModel JSON")
    ap.add_argument("--step-cost-set", default=None, metavar="NAME=VALUE,...",
                    help="sim: override coefficients of --step-cost (a what-if), e.g. "
                         "per_prefill_step_s=0")
    ap.add_argument("--kv-bytes-per-token", type=int, default=2 * 40 * 10 * 128 * 2,
                    help="sim: KV bytes per token (default Llama 2-13B GQA-10 in bf16)")
    ap.add_argument("--sim-disk-write-gbps", type=float, default=SIM_DISK_WRITE_GBPS,
                    help="sim: the disk tier's write rate, GB/s (its read rate is "
                         f"--disk-read-gbps, default {SIM_DISK_READ_GBPS} in the simulator; "
                         "no --disk-kv-path needed there)")
    ap.add_argument("--sim-disk-prefetch", choices=PREFETCH, default="worth-reading",
                    help="sim: which of a conversation's files its turn reads: those the "
                         "read-or-recompute rule could read back (as the engine) or, a "
                         "what-if, all of them (the engine before it weighed them)")
    ap.add_argument("--sim-disk-wait", choices=WAIT, default="running",
                    help="sim: when a step waits for disk reads still running: only when no "
                         "request runs (as the engine) or, a what-if, always (the engine "
                         "before it held back the turns waiting for them)")
    ap.add_argument("--tag", default="", help="label stored with every point")
    ap.add_argument("--out", default="results/multiturn")
    add_engine_args(ap, exclude=NOT_ENGINE, model_flag=True, defaults=ENGINE_DEFAULTS)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked against each other. The engine's are settled
    (:func:`~pensieve.options.engine_options`) into ``args.engine_options``, what the engines
    are built from, and each one's value (the config's default where none is set) into its
    attribute of ``args`` (``args.gpu_kv_gb``), what the points record."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.engine_options = engine_options(args, exclude=NOT_ENGINE)
    except ValueError as e:  # a --config file the options refuse
        ap.error(str(e))
    for name, value in args.engine_options.items():
        setattr(args, name, value)
    if args.engine == "sim" and not args.step_cost:
        ap.error("--engine sim needs --step-cost")
    if args.engine == "http" and not args.url:
        ap.error("--engine http needs --url")
    if args.engine == "http" and len(args.systems.split(",")) != 1:
        ap.error("--engine http runs one system (the server's --cache-policy): give one "
                 "--systems name")
    if args.api == "chat" and args.engine != "http":
        ap.error("--api chat applies to --engine http")
    if args.batching is not None and args.engine == "http":
        ap.error("--batching applies to the real and sim engines, not to a server (--engine "
                 "http)")
    if args.batching == "separate" and "hf" in args.systems.split(","):
        ap.error("--batching separate applies to Pensieve's engine, not to the hf system")
    args.batching = args.batching or default_of("batching")
    for name in ("device", "chunk_size", "max_num_seqs", "swap_in_ahead_chunks"):
        if getattr(args, name) is None:  # what the simulator and the hf peer read
            setattr(args, name, default_of(name))

    return args


def run_point(system: str, rate: float, engine: Any, clock: Any, convs: list[Any],
              args: argparse.Namespace, wl: Any, lifetime: float, t_start: float
              ) -> tuple[dict[str, Any], Any]:
    """Drive ``engine`` with the load at ``rate``: the point's summary line and the run."""
    bar = tqdm(desc=f"{system} @ {rate}/s", unit="req", leave=False)

    def progress(n: int, total: int, bar: Any = bar) -> None:
        bar.total = total
        bar.update(n - bar.n)

    # token ids < 32000 as always, fewer for a model with a smaller vocabulary (tiny
    # presets on the CPU)
    vocab = min(32000, getattr(engine, "vocab_size", None) or 32000)
    res = run_load(engine, clock, convs, rate, args.think_time, args.duration,
                   vocab, seed=args.seed, drain_s=args.drain, progress=progress,
                   sample_interval_s=args.sample_interval or None,
                   warm_start=warm_start_from(args.warm_start),
                   shared_prefix_tokens=args.shared_prefix_tokens)
    bar.close()
    batching = None if args.engine == "http" or system == "hf" else args.batching
    point = {"system": system, "conv_rate": rate, "engine": args.engine,
             "batching": batching, "workload": wl.name,
             "api": args.api if args.engine == "http" else None,
             "session_lifetime_est_s": round(lifetime, 1),
             "length_scale": args.length_scale,
             "model": args.model, "think_time_s": args.think_time,
             "gpu_kv_gb": args.gpu_kv_gb, "cpu_kv_gb": args.cpu_kv_gb,
             "duration_s": args.duration, "warmup_s": args.warmup, "tag": args.tag,
             "warm_start_s_per_token": args.warm_start,
             "shared_prefix_tokens": args.shared_prefix_tokens,
             "unfinished": res.unfinished, "wall_s": round(time.time() - t_start, 1),
             **summarize(res, args.warmup), **vllm_metrics(res, args.warmup)}
    disk = getattr(engine, "disk", None)
    if disk is not None:  # a disk tier: its settings and counters (none: the point as before)
        settings = getattr(disk, "settings", None)
        point["disk_kv_gb"] = args.disk_kv_gb
        point["disk"] = {**(settings() if settings else {}), **disk.stats()}
    if args.engine == "http":  # was the client a bottleneck, did requests fail?
        point.update(http_errors=engine.errors, http_throttled=engine.throttled,
                     http_peak_in_flight=engine.peak_in_flight,
                     max_connections=args.max_connections)
        if args.api == "chat":
            point.update(http_history_misses=engine.history_misses,
                         tokens_per_word=round(engine.tokens_per_word, 4),
                         ignore_eos=args.ignore_eos)
    return point, res


def write_point(out: Path, point: dict[str, Any], res: Any, steps: Any,
                args: argparse.Namespace) -> None:
    """Append the point, its time series, its requests and its steps to ``out``'s files."""
    system, rate, batching = point["system"], point["conv_rate"], point["batching"]
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in point.items()}
    with open(out / "points.jsonl", "a") as f:
        f.write(json.dumps(clean) + "\n")
    if res.samples:
        with open(out / "timeseries.jsonl", "a") as f:
            f.write(json.dumps({k: point[k] for k in (
                "system", "conv_rate", "engine", "api", "workload", "tag",
                "warmup_s", "duration_s")} | {"drain_s": args.drain,
                                              "samples": res.samples}) + "\n")
    with open(out / "requests.jsonl", "a") as f:
        for r in res.records:
            f.write(json.dumps({"system": system, "conv_rate": rate, "tag": args.tag,
                                "batching": batching, **r.as_dict()}) + "\n")
    if steps:
        with open(out / "steps.jsonl", "a") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")


def prepared_load(args: argparse.Namespace) -> tuple[Any, list[Any], float]:
    """The workload, its conversations (scaled, shuffled) and their mean session lifetime;
    ``args.warmup`` settled to seconds."""
    wl = workload(args)
    convs = list(wl.conversations)
    if args.length_scale != 1.0:
        from pensieve.bench.workload import Conversation, Turn

        def scaled(n: int) -> int:
            return max(1, round(n * args.length_scale))

        convs = [Conversation(c.conv_id, [Turn(scaled(t.input_len), scaled(t.output_len))
                                          for t in c.turns]) for c in convs]
    import random

    random.Random(args.seed).shuffle(convs)
    print(f"workload {wl.name}: {len(convs)} conversations", file=sys.stderr)
    from pensieve.bench.agentic import session_lifetime_s

    lifetime = session_lifetime_s(convs, args.think_time)
    if args.warmup == "auto":
        args.warmup = round(1.5 * lifetime, 1)
        print(f"warm-up {args.warmup} s (1.5 x the mean session lifetime, ~{lifetime:.0f} s)",
              file=sys.stderr)
    else:
        args.warmup = float(args.warmup)
        if args.warmup < lifetime:
            print(f"warning: warm-up {args.warmup:g} s is shorter than one mean session "
                  f"lifetime (~{lifetime:.0f} s: turns x (think time + ~20 ms a token of "
                  "answer)); the window may not be at steady state", file=sys.stderr)
    if args.warmup >= args.duration:
        raise SystemExit(f"--warmup {args.warmup} leaves no window in --duration "
                         f"{args.duration}")
    return wl, convs, lifetime


def build_engine(system: str, args: argparse.Namespace, real: RealEngines) -> tuple[Any, Any,
                                                                                     Any]:
    """(engine, clock, step records or None) of one point of ``system``."""
    if args.engine == "sim":
        clock: Any = VirtualClock()
        return build_sim(system, args, clock), clock, None
    if args.engine == "http":
        from pensieve.bench.http_engine import HTTPEngine

        clock = WallClock()
        return HTTPEngine(
            args.url, api_key=args.api_key, model=args.http_model,
            max_workers=args.max_connections, clock=clock,
            delete_conversations=not args.keep_conversations, api=args.api,
            ignore_eos=args.ignore_eos, calibrate=args.calibrate,
            metrics_interval_s=args.sample_interval or None), clock, None
    clock = WallClock()
    engine, steps = real.build(system, clock)
    return engine, clock, steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wl, convs, lifetime = prepared_load(args)
    real = RealEngines(args)
    for system in args.systems.split(","):
        for rate in (float(r) for r in args.rates.split(",")):
            t_start = time.time()
            try:
                engine, clock, steps = build_engine(system, args, real)
            except Exception as e:  # noqa: BLE001 - one system failing must not stop the rest
                print(f"{system}: could not build: {type(e).__name__}: {e}", flush=True)
                break
            point, res = run_point(system, rate, engine, clock, convs, args, wl, lifetime,
                                   t_start)
            write_point(out, point, res, steps, args)
            batching = point["batching"]
            label = system if batching in (None, "unified") else f"{system}/{batching}"
            print(f"{label:>10} rate {rate:5.2f}/s: {point['throughput_rps']:.3f} req/s, "
                  f"P90 norm {point['normalized_latency_s_p90'] * 1e3:.1f} ms/tok, "
                  f"hits gpu {point['gpu_hit_rate']:.2f} cpu {point['cpu_hit_rate']:.2f} "
                  f"disk {point['disk_hit_rate']:.2f} "
                  f"recomputed {point['recomputed_rate']:.2f}, unfinished {res.unfinished}, "
                  f"steady {point.get('steady_state')}, wall {point['wall_s']} s", flush=True)
            if engine is not real.engine:  # the shared engine stops at the end
                shutdown = getattr(engine, "shutdown", None)
                if shutdown:
                    shutdown()
                del engine
                gc.collect()
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except ImportError:
                pass
    real.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
