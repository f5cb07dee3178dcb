"""``python benchmarks/grammar_cost.py``: what grammar-constrained decoding costs.

Two numbers, as JSON:

* ``compile_s``: compiling a JSON schema of about ``--schema-tokens`` tokens (an object of
  many typed, described properties) with a fresh compiler, no cache (median of
  ``--compiles``), and ``cached_compile_s``, the same through the server's LRU.
* per sampling step of a batch of ``--batch`` rows of which ``--constrained`` carry a grammar:
  ``sample_ms`` without grammars, ``constrained_sample_ms`` with them (bitmask fill on the host,
  copy, ``apply_token_bitmask_inplace``, sampling, matchers advanced), and ``added_ms``, their
  difference; the bitmask fill is also timed alone (``fill_ms``: the part the runner issues
  while the forward runs, so on a GPU it overlaps it). With ``--forward-ms`` (a decode step's
  forward at that batch, measured elsewhere) it reports ``step_ratio``:
  ``(forward + constrained sample) / (forward + sample)``.

Logits are random ``[batch, vocab]`` float32 on ``--device``; each constrained row follows a
different schema from the random-schema family the tests use and restarts when it completes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pensieve.core.sampling_params import GrammarSpec, SamplingParams


def big_schema(tokenizer: Any, tokens: int) -> dict[str, Any]:
    """An object schema whose JSON text is at least ``tokens`` tokens long."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0},
        {"type": "number"}, {"type": "boolean"}, {"enum": ["red", "green", "blue", "cyan"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 4}]
    props: dict[str, Any] = {}
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": []}
    while len(tokenizer.encode(json.dumps(schema))) < tokens:
        i = len(props)
        props[f"field_{i}"] = {**kinds[i % len(kinds)],
                               "description": f"Property number {i} of the record"}
        if i % 2 == 0:
            schema["required"].append(f"field_{i}")
    return schema


def _small_schema(i: int) -> dict[str, Any]:
    return {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8 + i}, "n": {"type": "integer"},
        "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name", "n"]}


def measure(tokenizer: Any, device: str, batch: int, constrained: int, steps: int,
            schema_tokens: int, compiles: int) -> dict[str, Any]:
    import torch

    from pensieve.runner.grammar import GrammarCompiler, GrammarSampling
    from pensieve.runner.sampler import sample_tensor

    schema = json.dumps(big_schema(tokenizer, schema_tokens))
    spec = GrammarSpec("json_schema", schema)
    times = []
    for _ in range(compiles):
        fresh = GrammarCompiler(tokenizer)
        t0 = time.perf_counter()
        fresh.compile(spec)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    fresh.compile(spec)
    cached = time.perf_counter() - t0

    vocab = fresh.vocab_size
    gs = GrammarSampling(fresh)
    reqs = _requests(batch, constrained)
    logits = torch.randn(batch, vocab, device=device)
    free = [r.sampling_params for r in reqs]
    plain = _time_steps(device, steps, lambda: sample_tensor(logits.clone(), free,
                                                             [0] * batch).tolist())
    fill_times: list[float] = []

    def constrained_step() -> None:
        gs.prepare(reqs, [])
        t = time.perf_counter()
        gs.fill(reqs)
        fill_times.append(time.perf_counter() - t)
        lg = logits.clone()
        gs.apply(lg)
        tokens = sample_tensor(lg, free, [0] * batch).tolist()
        gs.accept(reqs, tokens)
        for r in reqs:  # a completed grammar starts over (a new request)
            if r.sampling_params.grammar is not None and r.request_id not in gs.matchers:
                gs.start(r.request_id, r.sampling_params.grammar)

    gs.prepare(reqs, [])
    masked = _time_steps(device, steps, constrained_step)
    return {"device": device, "vocab": vocab, "schema_tokens":
            len(tokenizer.encode(schema)), "compile_s": statistics.median(times),
            "cached_compile_s": cached, "batch": batch, "constrained": constrained,
            "sample_ms": plain * 1e3, "constrained_sample_ms": masked * 1e3,
            "added_ms": (masked - plain) * 1e3,
            "fill_ms": statistics.median(fill_times) * 1e3}


def _requests(batch: int, constrained: int) -> list[Any]:
    from pensieve.core.outputs import ScheduledRequest

    out = []
    for i in range(batch):
        g = GrammarSpec("json_schema", json.dumps(_small_schema(i))) if i < constrained else None
        out.append(ScheduledRequest(f"r{i}", (), [], True,
                                    SamplingParams(temperature=0.0, grammar=g), 0))
    return out


def _time_steps(device: str, steps: int, fn: Any) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls (after 3 warm-ups)."""
    import torch

    times = []
    for i in range(steps + 3):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="whose tokenizer (a checkpoint directory or built-in name)")
    p.add_argument("--device", default=None,
                   help="cuda or cpu (default: cuda when present, else cpu)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--constrained", type=int, default=8)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--schema-tokens", type=int, default=2000)
    p.add_argument("--compiles", type=int, default=3)
    p.add_argument("--forward-ms", type=float, default=None,
                   help="a decode step's forward at this batch (ms): adds step_ratio")
    p.add_argument("--output", default=None, help="also write the JSON here")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def grammar_cmd(args: argparse.Namespace) -> int:
    from pensieve.models.tokenizer import load_tokenizer

    device = args.device or ("cuda" if _has_cuda() else "cpu")
    res = measure(load_tokenizer(args.model), device, args.batch, args.constrained,
                  args.steps, args.schema_tokens, args.compiles)
    if args.forward_ms is not None:
        res["forward_ms"] = args.forward_ms
        res["step_ratio"] = ((args.forward_ms + res["constrained_sample_ms"])
                             / (args.forward_ms + res["sample_ms"]))
    text = json.dumps(res, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grammar_args(p)
    return grammar_cmd(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
