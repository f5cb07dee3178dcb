"""``python benchmarks/cpu_prefill.py``: prefill time on the CPU, Pensieve against HF transformers.

For each prompt length, one prompt of random token ids is prefilled (one output token) by

- ``hf``: ``AutoModelForCausalLM`` from the same checkpoint, SDPA attention, one forward under
  ``torch.inference_mode`` (the logits of the last position only);
- ``pensieve``: the engine at its default step budget (chunked prefill: the prompt spread over
  steps of at most ``max_num_batched_tokens`` tokens);
- ``pensieve-one-step`` (``--one-step``): the engine with a budget that holds the whole prompt.

Both run in this process on the same thread count, in float32; each time is the best of
``--repeats`` runs, the systems taking turns within a repeat. Each run's process CPU time is
kept beside its wall time: on a shared host, with ``--threads 1``, the CPU time is the work
done whatever else runs (the wall time then includes the waits for a core). The engine's
step times are kept too: the longest step is what every other stream waits at most.
Prints a table and writes the JSON result (``--output``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)


@dataclass
class Point:
    """One prompt length: best times (seconds) per system and the engine's step times."""

    prompt_len: int
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    """Process CPU time of the run with the least of it, per system."""
    max_step_s: dict[str, float] = field(default_factory=dict)
    """Longest engine step of the best run, per engine system."""
    steps: dict[str, int] = field(default_factory=dict)

    def rate(self, system: str) -> float:
        return self.prompt_len / self.seconds[system]


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` token ids drawn uniformly from ``[100, vocab)`` (no special ids)."""
    rng = random.Random(seed + n)
    return [rng.randrange(100, vocab) for _ in range(n)]


def timed(run: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall seconds, process CPU seconds, result)`` of one call of ``run``."""
    t, c = time.perf_counter(), time.process_time()
    res = run()
    return time.perf_counter() - t, time.process_time() - c, res


class EnginePrefill:
    """A Pensieve engine that prefills one prompt at a time and records its steps."""

    def __init__(self, model: str, budget: int | None, max_model_len: int) -> None:
        from pensieve import LLM

        self.llm = LLM(model=model, device="cpu", dtype="float32", max_model_len=max_model_len,
                       max_num_batched_tokens=budget)
        self.budget = self.llm.engine.scheduler_config.max_num_batched_tokens
        self.step_s: list[float] = []
        self.llm.engine.step_observers.append(lambda rec: self.step_s.append(rec.execute_s))

    def __call__(self, ids: list[int]) -> tuple[float, int]:
        """Prefill ``ids`` (one sampled token); ``(longest step s, steps)``. The engine is
        reset first, so no earlier prompt's KV is reused."""
        from pensieve import SamplingParams

        self.llm.engine.reset()
        self.step_s.clear()
        self.llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        return max(self.step_s), len(self.step_s)


def hf_prefill(path: str) -> Callable[[list[int]], None]:
    """One HF forward over a prompt (SDPA, float32, the last position's logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()

    def run(ids: list[int]) -> None:
        with torch.inference_mode():
            model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)

    return run


def measure(args: argparse.Namespace) -> tuple[list[Point], dict[str, Any]]:
    import torch
    from tqdm import tqdm

    from pensieve.models.loader import resolve_config

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_config, path = resolve_config(args.model)
    if path is None:
        raise SystemExit(f"{args.model!r} has no checkpoint for HF transformers to load")
    longest = max(args.lengths)
    hf = hf_prefill(path)
    engines = {"pensieve": EnginePrefill(args.model, None, longest + 1)}
    if args.one_step:
        engines["pensieve-one-step"] = EnginePrefill(args.model, longest + 1, longest + 1)
    meta = {"model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "repeats": args.repeats,
            "budgets": {name: e.budget for name, e in engines.items()}}
    for eng in engines.values():  # warm up: first calls allocate and pick kernels
        eng(prompt_ids(64, hf_config.vocab_size, args.seed))
    hf(prompt_ids(64, hf_config.vocab_size, args.seed))
    points = [Point(n) for n in args.lengths]
    bar = tqdm(total=len(points) * args.repeats, desc="cpu-prefill", disable=args.no_progress)
    for p in points:
        ids = prompt_ids(p.prompt_len, hf_config.vocab_size, args.seed)
        for _ in range(args.repeats):
            dt, ct, _ = timed(partial(hf, ids))
            p.seconds["hf"] = min(dt, p.seconds.get("hf", dt))
            p.cpu_seconds["hf"] = min(ct, p.cpu_seconds.get("hf", ct))
            for name, eng in engines.items():
                dt, ct, (max_step, steps) = timed(partial(eng, ids))
                p.cpu_seconds[name] = min(ct, p.cpu_seconds.get(name, ct))
                if dt <= p.seconds.get(name, dt):
                    p.seconds[name], p.max_step_s[name], p.steps[name] = dt, max_step, steps
            bar.update()
    bar.close()
    return points, meta


def table(points: list[Point]) -> str:
    systems = list(points[0].seconds)
    head = ["prompt"] + [f"{s} tok/s" for s in systems]
    head += [f"{s} / hf" for s in systems[1:]] + [f"{s} / hf cpu" for s in systems[1:]]
    head += [f"{s} max step ms" for s in systems[1:]]
    rows = [head]
    for p in points:
        row = [str(p.prompt_len)] + [f"{p.rate(s):.0f}" for s in systems]
        row += [f"{p.seconds[s] / p.seconds['hf']:.2f}" for s in systems[1:]]
        row += [f"{p.cpu_seconds[s] / p.cpu_seconds['hf']:.2f}" for s in systems[1:]]
        row += [f"{p.max_step_s[s] * 1e3:.0f} ({p.steps[s]} steps)" for s in systems[1:]]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
                     for r in rows)


def add_cpu_prefill_args(p: argparse.ArgumentParser) -> None:
    from pensieve.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or built-in name")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                   help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the best is kept")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--one-step", action="store_true",
                   help="also the engine with a budget that holds the whole prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="cpu_prefill.json", help="JSON result file")
    p.add_argument("--no-progress", action="store_true")


def cpu_prefill_cmd(args: argparse.Namespace) -> int:
    points, meta = measure(args)
    print(table(points))
    with open(args.output, "w") as f:
        json.dump({"meta": meta, "points": [asdict(p) for p in points]}, f, indent=1)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cpu_prefill_args(p)
    return cpu_prefill_cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
