"""Host cost of the scheduler and the tiered cache per step, against the number of sessions
held.

    python benchmarks/scheduler_cost.py [--sessions 100,300,1000,3000] [--steps 300]
        [--out docs/results/scheduler_cost/after.json] [--plot .../after.png]
    python benchmarks/scheduler_cost.py --preset long --sessions 100,300      # 128k contexts

Drives :class:`~pensieve.core.scheduler.Scheduler` over a
:class:`~pensieve.core.tiered_cache.TieredKVCache` directly (no torch, no engine) with a fake
runner whose every sampled token is a constant, and times ``schedule()`` +
``update_from_output()`` of each step on the host: the thread's CPU time
(``time.thread_time``, so other processes sharing the cores do not count; reported) and the
wall time (``time.perf_counter``; ``wall_*`` in the JSON).

The workload, per size ``N`` (sessions held):

* Seeding (not timed): every session gets a first turn of ``U(--seed-tokens)`` tokens
  (default 2,000-8,000) through the cache's own admit / end path, its last activity spread
  over the last 10 minutes, so every session holds KV (on the GPU, on the CPU, or dropped)
  before the first timed step.
* Steps: idle sessions are picked uniformly at random for a next turn (new input
  ``U(--turn-tokens)``, default ``U(50, 400)`` tokens; ``U(--output-tokens)`` generated,
  ``ignore_eos``) so that ``--waiting`` turns (at most what the idle sessions allow) wait
  at the start of every step; a session whose context passes ``--restart-tokens`` is
  deleted and starts over under a new id. Contexts thus
  grow past 4k tokens and average ~5k (``--mean-context``, which sizes the tiers).
  ``--preset long``: 128k contexts (seeds of 64k-122k tokens, restart past 122k, turns of
  200-8,000 new tokens, ``max_model_len`` 131,072): block tables 2k-4k entries long.
  ``--preset pressure``: the GPU tier holds 1.2 running batches' KV and nothing more
  (``--gpu-frac 0 --gpu-batch 1.2``), turns of 200-2,000 new tokens and 500 waiting: chunks
  move between the tiers in a fifth of the steps, hundreds at a time.
* Limits: ``--budget`` tokens per step, at most ``--max-num-seqs`` running (and at most half
  the sessions, so that small sizes also queue and evict).
* Tiers: chunk 32 tokens; the GPU holds ``--gpu-batch`` running batches' KV (``max_num_seqs``
  sessions of the mean context) plus ``--gpu-frac`` of all sessions' expected KV, the CPU
  ``--cpu-frac`` of it: the running batch alone nearly fills the GPU, so urgent evictions,
  ahead-of-time swap-outs, drops, swap-ins and suspensions happen every few steps.
* Time: a virtual clock advances by a simple step-time model
  (``15 ms + 3 us/token + 50 us/request``) so idle times, and the pensieve retention value,
  move as they would in serving. The retention value's Cost(l) is the analytic H200 roofline
  of Llama-3-8B.

``--profile PATH`` runs the timed steps under cProfile (their times then include its
overhead), writes the stats to PATH and prints the top functions by own time.

``--warmup-steps`` steps run untimed first; then ``--steps`` timed steps. Reported per size:
median / p90 / mean host ms per step; the median of *quiet* steps (no chunk swapped or
dropped: the floor set by the running batch, one ``ScheduledRequest`` per running request);
chunks held (GPU + CPU blocks in use, mean over timed steps), waiting turns (mean at step
start), running, and per-step rates of swapped / dropped chunks. A table goes to stdout, JSON to
``--out``, a PNG (cost vs sessions held) to ``--plot``. Host timings are of one thread on
whatever else the machine runs (a shared VM's timings move by tens of percent between runs):
compare runs made side by side, and use ``--repeat`` (``min_step_median_ms``: each step's least
time over the runs, then their median).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pensieve.core.cache_config import CacheConfig
from pensieve.core.cost_model import CostModel
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache

CHUNK = 32
TOKEN = 7
"""The fake runner's sampled token (no EOS: turns run to max_tokens)."""


def _cost_model() -> CostModel:
    return CostModel.analytic(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                              head_dim=128, intermediate_size=14336, chunk_size=CHUNK)


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "pressure": {"gpu_frac": 0.0, "gpu_batch": 1.2, "turn_tokens": (200, 2000),
                 "waiting": 500},
    "long": {"seed_tokens": (65536, 122000), "turn_tokens": (200, 8000),
             "restart_tokens": 122000, "mean_context": 98304, "max_model_len": 131072,
             "max_num_seqs": 32, "output_tokens": (30, 300)},
}
"""Option values each ``--preset`` sets (options given on the command line win)."""


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Bench:
    """One size: a scheduler, its cache, and the sessions that feed it."""

    def __init__(self, n: int, args: argparse.Namespace, seed: int) -> None:
        self.args = args
        self.rng = random.Random(seed)
        mean_chunks = args.mean_context // CHUNK
        self.max_num_seqs = max(1, min(args.max_num_seqs, n // 2))
        gpu = int((args.gpu_frac * n + args.gpu_batch * self.max_num_seqs) * mean_chunks)
        cpu = int(args.cpu_frac * n * mean_chunks)
        self.cache = TieredKVCache(gpu, cpu, _cost_model().chunk_cost,
                                   CacheConfig(chunk_size=CHUNK, share_prefixes=args.share_prefixes,
                                               defer_admission=0),
                                   policy=get_policy(args.policy),
                                   key_refresh_s=args.key_refresh_s)
        cfg = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=self.max_num_seqs,
                              max_model_len=args.max_model_len)
        self.sched = Scheduler(cfg, self.cache)
        self.now = 0.0
        self.idle: list[str] = []  # sessions with no turn in flight
        self.generation: dict[str, int] = {}  # session -> restarts (the conversation id suffix)
        self.num_requests = 0
        self.prefix = [1] * args.shared_prefix_tokens
        """What every session's first turn opens with (token 1: no session's own)."""
        self._seed_sessions(n)

    def cid(self, session: str) -> str:
        return f"{session}.{self.generation[session]}"

    def _seed_sessions(self, n: int) -> None:
        """A first turn per session through the cache's admit / end path (not timed)."""
        cache = self.cache
        for k in range(n):
            s = f"s{k}"
            self.generation[s] = 0
            t = -600.0 + 600.0 * k / n
            conv = cache.conversation(self.cid(s))
            ids = self.prefix + [self._token(s)] * self.rng.randint(*self.args.seed_tokens)
            req = Request(f"seed{k}", ids, SamplingParams(max_tokens=1),
                          conversation_id=conv.conversation_id)
            cache.begin_step()
            req.pending = cache.pending_for(req, conv)
            if not cache.admit(req, conv, req.num_tokens, t):
                raise RuntimeError("seeding: the GPU tier cannot hold one session")
            cache.take_swap_plan()
            req.take(req.num_pending)
            req.append_output(TOKEN)
            cache.end_turn(req, conv, t)
            self.idle.append(s)
        reclaim = getattr(cache, "reclaim_swap_outs", None)
        if reclaim is not None:  # no background swap-outs were planned; harmless
            reclaim(0)
        self.rng.shuffle(self.idle)

    def _token(self, session: str) -> int:
        """The token every input of ``session`` repeats: 1, or with ``--share-prefixes`` one
        of its own (no two sessions share a chunk: sharing's costs without its savings)."""
        return 2 + int(session[1:]) if self.args.share_prefixes else 1

    def _top_up(self) -> None:
        """New turns from idle sessions until ``--waiting`` turns wait."""
        sched, cache = self.sched, self.cache
        while len(sched.waiting) < self.args.waiting and self.idle:
            i = self.rng.randrange(len(self.idle))
            self.idle[i], self.idle[-1] = self.idle[-1], self.idle[i]
            s = self.idle.pop()
            conv = cache.conversations.get(self.cid(s))
            history = conv.token_ids if conv is not None else []
            if len(history) > self.args.restart_tokens:
                cache.delete(self.cid(s))
                self.generation[s] += 1
                history = self.prefix  # a new conversation opens with the prefix too
            new = [self._token(s)] * self.rng.randint(*self.args.turn_tokens)
            self.num_requests += 1
            params = SamplingParams(max_tokens=self.rng.randint(*self.args.output_tokens),
                                    ignore_eos=True)
            req = Request(f"r{self.num_requests}", history + new, params,
                          arrival_time=self.now, conversation_id=self.cid(s))
            sched.add_request(req)

    def step(self) -> tuple[float, float, int, int]:
        """One step; returns (CPU seconds and wall seconds of schedule + update, waiting at
        start, tokens)."""
        self._top_up()
        waiting = len(self.sched.waiting)
        c0, w0 = time.thread_time(), time.perf_counter()
        out = self.sched.schedule(self.now)
        c1, w1 = time.thread_time(), time.perf_counter()
        result = RunnerOutput({r.request_id: TOKEN for r in out.requests if r.sample})
        tokens = out.num_scheduled_tokens
        self.now += 0.015 + 3e-6 * tokens + 5e-5 * len(out.requests)
        c2, w2 = time.thread_time(), time.perf_counter()
        finished = self.sched.update_from_output(out, result, self.now)
        c3, w3 = time.thread_time(), time.perf_counter()
        for req in finished:
            assert req.conversation_id is not None
            self.idle.append(req.conversation_id.rsplit(".", 1)[0])
        return (c1 - c0) + (c3 - c2), (w1 - w0) + (w3 - w2), waiting, tokens

    def chunks_held(self) -> int:
        c = self.cache
        held = c.gpu.num_blocks - c.gpu.num_free_blocks
        if c.cpu is not None:
            held += c.cpu.num_blocks - c.cpu.num_free_blocks
        return held


def run_size(n: int, args: argparse.Namespace, bar: Any = None,
             profiler: Any = None) -> dict[str, Any]:
    """One size's run: ``--warmup-steps`` untimed steps, then ``--steps`` timed ones (under
    ``profiler``, a ``cProfile.Profile``, if given); ``bar`` (tqdm) counts the steps."""
    t_start = time.perf_counter()
    b = Bench(n, args, seed=args.seed + n)
    seed_s = time.perf_counter() - t_start
    for _ in range(args.warmup_steps):
        b.step()
        if bar is not None:
            bar.update()
    before = b.cache.stats.as_dict()
    times: list[float] = []
    walls: list[float] = []
    waiting: list[int] = []
    held: list[int] = []
    running: list[int] = []
    quiet: list[float] = []
    tokens = 0
    for _ in range(args.steps):
        st = b.cache.stats
        moves = st.swapped_out_tokens + st.swapped_in_tokens + st.dropped_tokens
        if profiler is not None:
            profiler.enable()
        dt, wall, w, tok = b.step()
        if profiler is not None:
            profiler.disable()
        if bar is not None:
            bar.update()
        if st.swapped_out_tokens + st.swapped_in_tokens + st.dropped_tokens == moves:
            quiet.append(dt)
        times.append(dt)
        walls.append(wall)
        waiting.append(w)
        running.append(len(b.sched.running))
        held.append(b.chunks_held())
        tokens += tok
    after = b.cache.stats.as_dict()
    d = {k: after[k] - before[k] for k in after}
    per_step = {k: d[k] / CHUNK / args.steps for k in
                ("swapped_out_tokens", "swapped_in_tokens", "dropped_tokens")}
    return {
        "sessions": n,
        "steps": args.steps,
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": _pct(times, 0.9) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "wall_median_ms": statistics.median(walls) * 1e3,
        "wall_p90_ms": _pct(walls, 0.9) * 1e3,
        "quiet_steps": len(quiet),
        "quiet_median_ms": statistics.median(quiet) * 1e3 if quiet else None,
        "chunks_held": statistics.fmean(held),
        "waiting_mean": statistics.fmean(waiting),
        "running_mean": statistics.fmean(running),
        "tokens_per_step": tokens / args.steps,
        "mean_context_tokens": statistics.fmean(
            len(c.token_ids) for c in b.cache.conversations.values()),
        "longest_block_table": max(len(c.chunks) for c in b.cache.conversations.values()),
        "gpu_blocks": b.cache.gpu.num_blocks,
        "cpu_blocks": b.cache.cpu.num_blocks if b.cache.cpu is not None else 0,
        "swapped_out_chunks_per_step": per_step["swapped_out_tokens"],
        "swapped_in_chunks_per_step": per_step["swapped_in_tokens"],
        "dropped_chunks_per_step": per_step["dropped_tokens"],
        "suspended": d["suspended_requests"],
        "seed_s": seed_s,
        "wall_s": time.perf_counter() - t_start,
        "_times": times,
    }


def plot(rows: list[dict[str, Any]], path: Path, title: str, label: str = "",
         compare: dict[str, Any] | None = None) -> None:
    """Median and p90 per step against sessions held; ``compare``: another run's JSON, drawn
    in grey (e.g. before a change)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    runs = [(compare["rows"], compare.get("label") or "compare", "grey")] if compare else []
    runs.append((rows, label, "C0"))
    for rs, name, color in runs:
        x = [r["sessions"] for r in rs]
        prefix = f"{name}: " if name else ""
        ax.plot(x, [r["median_ms"] for r in rs], "o-", color=color, label=prefix + "median")
        ax.plot(x, [r["p90_ms"] for r in rs], "s--", color=color, label=prefix + "p90")
    ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="0.5 ms target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("sessions held")
    ax.set_ylabel("schedule() + update_from_output(): CPU ms per step")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def min_step_median_ms(runs: list[list[float]]) -> float:
    """Runs of the same work step by step (seconds per step): each step's least time over the
    runs, then their median, in ms. Other load on the machine only adds time, so this is
    steadier than any one run's median."""
    return statistics.median(min(ts) for ts in zip(*runs)) * 1e3


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (``python benchmarks/scheduler_cost.py --help``)."""
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default",
                    help="pressure: the GPU tier holds 1.2 running batches and nothing more, "
                         "turns of 200-2,000 new tokens, 500 waiting (eviction every few "
                         "steps); long: 128k contexts (block tables up to 4k entries)")
    ap.add_argument("--sessions", default="100,300,1000,3000",
                    help="comma-separated numbers of sessions held (default %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per size")
    ap.add_argument("--warmup-steps", type=int, default=100, help="untimed steps first")
    ap.add_argument("--waiting", type=int, default=None,
                    help="turns waiting at each step start (default 300)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="running cap (at most half the sessions; default 128)")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--gpu-frac", type=float, default=None,
                    help="GPU tier: this fraction of the sessions' KV, plus --gpu-batch "
                         "(default 0.02)")
    ap.add_argument("--gpu-batch", type=float, default=None,
                    help="GPU tier: plus this many running batches' KV (max_num_seqs "
                         "sessions; default 1.5)")
    ap.add_argument("--cpu-frac", type=float, default=0.6,
                    help="CPU tier: this fraction of the sessions' KV")
    ap.add_argument("--restart-tokens", type=int, default=None,
                    help="a session whose history passes this starts over (default 8000)")
    ap.add_argument("--output-tokens", type=_pair, default=None,
                    help="generated tokens per turn: uniform in LO,HI (default 50,500)")
    ap.add_argument("--seed-tokens", type=_pair, default=None,
                    help="each session's first turn: uniform in LO,HI (default 2000,8000)")
    ap.add_argument("--turn-tokens", type=_pair, default=None,
                    help="new tokens of a later turn: uniform in LO,HI (default 50,400)")
    ap.add_argument("--mean-context", type=int, default=None,
                    help="a session's rough mean context, sizes the tiers (default 5000)")
    ap.add_argument("--max-model-len", type=int, default=None, help="(default 16384)")
    ap.add_argument("--policy", default="pensieve")
    ap.add_argument("--key-refresh-s", type=float, default=0.5,
                    help="TieredKVCache key_refresh_s (the engine's default: 0.5)")
    ap.add_argument("--share-prefixes", action="store_true",
                    help="the cache shares prefixes; each session's tokens are its own, so "
                         "nothing is shared (the bookkeeping's cost alone)")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                    help="every session's first turn opens with the same N tokens (with "
                         "--share-prefixes: a prompt all of them share)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each size this many times (same work) and report the run of "
                         "median cost; every run's median and p90 go to the JSON, and the "
                         "median over steps of each step's least time over the runs "
                         "(min_step_median_ms: what the work costs with other load mostly "
                         "filtered out, on a shared machine)")
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. before)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    ap.add_argument("--compare", type=Path, default=None,
                    help="another run's JSON to draw in the plot too (e.g. before a change)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="cProfile the timed steps: stats to this file, top functions printed")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


DEFAULTS: dict[str, Any] = {"restart_tokens": 8000, "output_tokens": (50, 500),
                            "seed_tokens": (2000, 8000), "turn_tokens": (50, 400),
                            "mean_context": 5000, "max_model_len": 16384, "max_num_seqs": 128,
                            "waiting": 300, "gpu_frac": 0.02, "gpu_batch": 1.5}
"""Values of the options left unset by both the command line and the preset."""


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset from ``--preset``, then from :data:`DEFAULTS`."""
    for k, v in {**DEFAULTS, **PRESETS[args.preset]}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="benchmarks/scheduler_cost.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.plot:  # before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.exit(2, "benchmarks/scheduler_cost.py: error: --plot needs matplotlib, which is "
                       "not installed: pip install 'pensieve[bench]' (or pip install "
                       "matplotlib)\n")
    return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every size of ``--sessions``; print the table, write the JSON and PNG asked for."""
    import cProfile

    from tqdm import tqdm

    resolve(args)
    sizes = [int(x) for x in args.sessions.split(",") if x]
    rows = []
    print(f"{'sessions':>8} {'median ms':>9} {'p90 ms':>8} {'mean ms':>8} {'quiet ms':>8} "
          f"{'chunks held':>11} {'waiting':>7} {'running':>7} {'out/step':>8} {'in/step':>7} "
          f"{'drop/step':>9} {'wall s':>6}", flush=True)
    profiler = cProfile.Profile() if args.profile is not None else None
    bar = tqdm(total=len(sizes) * args.repeat * (args.warmup_steps + args.steps), unit="step",
               disable=args.no_progress, file=sys.stderr)
    for n in sizes:
        runs = sorted((run_size(n, args, bar, profiler) for _ in range(args.repeat)),
                      key=lambda r: r["median_ms"])
        r = runs[len(runs) // 2]  # the run of median cost (all runs are the same work)
        r["repeat_median_ms"] = [x["median_ms"] for x in runs]
        r["repeat_p90_ms"] = [x["p90_ms"] for x in runs]
        r["min_step_median_ms"] = min_step_median_ms([x.pop("_times") for x in runs])
        rows.append(r)
        quiet = r["quiet_median_ms"]
        print(f"{n:>8} {r['median_ms']:>9.3f} {r['p90_ms']:>8.3f} {r['mean_ms']:>8.3f} "
              f"{quiet if quiet is not None else float('nan'):>8.3f} "
              f"{r['chunks_held']:>11.0f} {r['waiting_mean']:>7.1f} {r['running_mean']:>7.1f} "
              f"{r['swapped_out_chunks_per_step']:>8.1f} {r['swapped_in_chunks_per_step']:>7.1f} "
              f"{r['dropped_chunks_per_step']:>9.1f} {r['wall_s']:>6.1f}", flush=True)
    bar.close()
    if profiler is not None:
        import pstats

        args.profile.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(args.profile))
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    result = {
        "benchmark": "scheduler_cost",
        "label": args.label,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if not callable(v)},  # the CLI's namespace also holds its handler
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "processor": platform.processor(),
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot is not None:
        compare = json.loads(args.compare.read_text()) if args.compare is not None else None
        plot(rows, args.plot, f"scheduler + cache host time per step ({args.policy}, "
                              f"{args.steps} steps per size)", args.label, compare)
    return result


if __name__ == "__main__":
    main()
