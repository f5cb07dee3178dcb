"""When each copy of a swap step runs on the device: a timeline of the swapper's streams.

``benchmarks/swap_bandwidth.py`` times a swap step as a whole; this says where the time goes
inside one. The swapper's :class:`~pensieve.runner.swap_streams.Streams` are wrapped so that
every operation issued through them (index uploads, copy-engine calls, gather and scatter
launches) gets a timing event before and after it on its own stream. A bar's start is when
its stream reached it (earlier work and waits done), its end when it finished. The compute
stream gets a mark when layer 0's swap-ins are usable and one when the last layer's are.

    python benchmarks/swap_timeline.py --chunks 64 --reps 3 --out timeline.json \\
        --plot timeline.png

Run it with ``PYTHONPATH`` at another source tree to compare engines (the wrapper uses only
the swapper's ``_streams`` attribute and the ``Streams`` protocol).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pensieve.core.outputs import SwapPlan
from pensieve.runner.model_runner import allocate_kv_caches
from pensieve.runner.swapper import KVSwapper

sys.path.insert(0, str(Path(__file__).parent))
from host_profile import profile_calls  # noqa: E402
from swap_bandwidth import add_shape_args, plans  # noqa: E402


def op_label(fn: Callable[[], None]) -> str:
    """``_dma_group 0 5`` for ``partial(self._dma_group, stage, cpu, 0, 5)``: the function's
    name and its int and str arguments."""
    if not isinstance(fn, functools.partial):
        return getattr(fn, "__name__", "op")
    f = fn.func
    name = getattr(f, "__name__", "op")
    args = [str(a) for a in fn.args if isinstance(a, int | str) and not isinstance(a, bool)]
    return " ".join([name.lstrip("_"), *args])


class TimelineStreams:
    """A :class:`~pensieve.runner.swap_streams.Streams` that brackets every ``run`` and
    ``upload`` with timing events on its stream (``marks``: stream name, label, start and end
    events), and otherwise does what ``inner`` does."""

    def __init__(self, inner: Any, event: Callable[[], Any] | None = None) -> None:
        """``event``: makes a timing event (default: a CUDA one; the tests pass a clock)."""
        self.inner = inner
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._cuda = event is None
        self.in_stream = inner.in_stream
        self.out_stream = inner.out_stream
        self.dma_stream = inner.dma_stream
        self.in_dma_stream = getattr(inner, "in_dma_stream", None)  # older engines: none
        self.marks: list[tuple[str, str, Any, Any]] = []

    def stream_name(self, stream: Any) -> str:
        for name in ("in_dma_stream", "in_stream", "out_stream", "dma_stream"):
            if stream is not None and stream is getattr(self.inner, name, None):
                return name.removesuffix("_stream")
        return "compute"

    def _bracket(self, stream: Any, label: str, fn: Callable[[], Any]) -> Any:
        s = torch.cuda.current_stream() if stream is None and self._cuda else stream
        a, b = self._event(), self._event()
        a.record(s)
        out = fn()
        b.record(s)
        self.marks.append((self.stream_name(stream), label, a, b))
        return out

    def record(self, stream: Any) -> Any:
        return self.inner.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        self.inner.wait(stream, event)

    def upload(self, stream: Any, pairs: list[tuple[int, int]]) -> torch.Tensor:
        return self._bracket(stream, "upload", lambda: self.inner.upload(stream, pairs))

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        self._bracket(stream, op_label(fn), lambda: self.inner.run(stream, fn))

    def query(self, event: Any) -> bool:
        return self.inner.query(event)

    def synchronize(self, event: Any) -> None:
        self.inner.synchronize(event)


def timeline_step(sw: KVSwapper, tl: TimelineStreams, plan: SwapPlan, bare: bool = False,
                  last: bool = True) -> list[dict]:
    """Run one swap step; returns its operations as ``{stream, op, start_ms, end_ms}`` from
    a mark on the compute stream just before ``start_step`` (sorted by start). ``bare``: on
    the swapper's own streams, only the compute stream's marks; ``last``: mark the last
    layer too (else layer 0 only, as ``swap_bandwidth.py`` does)."""
    tl.marks.clear()
    if bare:
        sw._streams = tl.inner
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    ready = sw.start_step(plan)
    if ready is not None and plan.swap_in:
        marks = ((0, "layer 0 ready"), (sw.num_layers - 1, "last layer ready"))
        for i, name in marks if last else marks[:1]:
            ready(i)
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            tl.marks.append(("compute", name, e, e))
    sw.end_step()
    sw.finish_step()
    torch.cuda.synchronize()
    sw._streams = tl
    ops = [{"stream": s, "op": label, "start_ms": start.elapsed_time(a),
            "end_ms": start.elapsed_time(b)} for s, label, a, b in tl.marks]
    return sorted(ops, key=lambda o: (o["start_ms"], o["end_ms"]))


def summary(ops: list[dict]) -> dict[str, float]:
    """When the step's parts finished (ms): layer 0 and the last layer usable, the last
    swap-in copy, the last swap-out copy, everything."""
    def last(pred: Callable[[dict], bool]) -> float:
        return max((o["end_ms"] for o in ops if pred(o)), default=float("nan"))

    return {"layer0_ms": last(lambda o: o["op"] == "layer 0 ready"),
            "last_layer_ms": last(lambda o: o["op"] == "last layer ready"),
            "in_done_ms": last(lambda o: o["stream"] == "in"),
            "out_done_ms": last(lambda o: o["stream"] in ("out", "dma")),
            "all_done_ms": last(lambda o: True)}


def fmt_ops(ops: list[dict]) -> str:
    lines = [f"{'stream':<9}{'op':<28}{'start':>9}{'end':>9}{'ms':>8}"]
    lines += [f"{o['stream']:<9}{o['op'][:27]:<28}{o['start_ms']:>9.3f}{o['end_ms']:>9.3f}"
              f"{o['end_ms'] - o['start_ms']:>8.3f}" for o in ops]
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: str) -> None:
    """One panel per variant: a row per stream, a bar per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = ["compute", "in_dma", "in", "out", "dma"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.2 * len(runs) + 0.6), squeeze=False)
    colors = {"dma_group": "tab:blue", "scatter": "tab:orange", "kernel": "tab:green",
              "gather": "tab:olive", "dma_rows": "tab:red", "dma_out_group": "tab:pink",
              "upload": "tab:gray"}
    for ax, (name, ops) in zip(axes[:, 0], runs.items(), strict=True):
        for o in ops:
            y = streams.index(o["stream"]) if o["stream"] in streams else len(streams)
            kind = o["op"].split(" ")[0]
            if o["stream"] == "compute":
                ax.plot([o["end_ms"]], [y], "kv")
                ax.annotate(o["op"], (o["end_ms"], y), fontsize=6, xytext=(2, 4),
                            textcoords="offset points")
                continue
            ax.barh(y, max(o["end_ms"] - o["start_ms"], 0.01), left=o["start_ms"],
                    height=0.6, color=colors.get(kind, "tab:purple"), edgecolor="k", lw=0.3)
        ax.set_yticks(range(len(streams)), streams)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("ms from the step's start (device time)")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(colors))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile_enqueue(sw: KVSwapper, plan: SwapPlan, steps: int, top: int = 25) -> str:
    """cProfile of ``steps`` calls of ``start_step`` (the host's enqueue) on the plain
    streams, each after a device sync (the step then finished untimed): the functions by
    their own time, driver calls included."""
    return profile_calls(lambda: sw.start_step(plan), steps, "tottime", top, sw.finish_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64])
    ap.add_argument("--method", default="staged")
    ap.add_argument("--dirs", nargs="+", default=["in", "out", "in+out"],
                    choices=["in", "out", "in+out"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also print a cProfile of STEPS enqueues per size and direction "
                         "(without the timing events)")
    ap.add_argument("--bare", action="store_true",
                    help="also time each step without the brackets: the compute stream's marks "
                         "only, both and layer 0 alone")
    ap.add_argument("--label", default="", help="prefix of the variants' names")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--plot", default=None, help="write the PNG figure here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    biggest = max(args.chunks)
    num_gpu, num_cpu = 2 * biggest + biggest // 2, 2 * biggest
    caches = allocate_kv_caches(args.layers, num_gpu, args.chunk, args.kv_heads,
                                args.head_dim, torch.bfloat16, torch.device("cuda"))
    for c in caches:
        c.normal_()
    sw = KVSwapper(caches, num_cpu, args.method)
    tl = TimelineStreams(sw._streams)
    sw._streams = tl
    runs: dict[str, list[dict]] = {}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "config": vars(args),
                              "runs": {}}
    for n in args.chunks:
        p = plans(n, "random", num_gpu, num_cpu, random.Random(f"{args.seed}{n}random"))
        swap_in = [(c, g) for g, c in p["in"]]
        for d in args.dirs:
            plan = SwapPlan(swap_in=swap_in if "in" in d.split("+") else [],
                            swap_out=p["out"] if "out" in d.split("+") else [])
            timeline_step(sw, tl, plan)  # warm-up
            reps = [timeline_step(sw, tl, plan) for _ in range(args.reps)]
            sums = [summary(r) for r in reps]
            mid = sorted(range(len(reps)), key=lambda i: sums[i]["all_done_ms"])[len(reps) // 2]
            name = f"{args.label}{args.method} {d}, {n} chunks"
            runs[name] = reps[mid]
            med = {k: statistics.median(s[k] for s in sums) for k in sums[0]}
            result["runs"][name] = {"median": med, "reps": sums, "ops": reps[mid]}
            print(f"\n== {name}: median of {args.reps} " + ", ".join(
                f"{k} {v:.2f}" for k, v in med.items()))
            print(fmt_ops(reps[mid]), flush=True)
            if args.bare:
                for last in (True, False):
                    timeline_step(sw, tl, plan, bare=True, last=last)
                    bare = [summary(timeline_step(sw, tl, plan, bare=True, last=last))
                            for _ in range(args.reps)]
                    key = f"bare, {'both marks' if last else 'layer 0 mark only'}"
                    result["runs"][name][key] = bare
                    print(f"-- {key}: " + "; ".join(
                        f"layer 0 {b['layer0_ms']:.2f}, last {b['last_layer_ms']:.2f}"
                        for b in bare), flush=True)
            if args.profile:
                sw._streams = tl.inner
                print(f"-- cProfile of {args.profile} enqueues ({name})\n"
                      + profile_enqueue(sw, plan, args.profile), flush=True)
                sw._streams = tl
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
