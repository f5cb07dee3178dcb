"""FP8 KV cache against a 16/32-bit one: greedy-token agreement and log-probability error.

    python benchmarks/kv_accuracy.py --model llama3.1-8b --load-format dummy --prompts 16 \
        --prompt-len 2048 --new-tokens 64 [--base-dtype auto] [--out kv_accuracy.json]

Both engines run the same model on the same device. Each prompt is generated greedily under
the base KV dtype and under ``fp8_e4m3``; reported per prompt and overall:

- ``prefix_agreement``: the share of generated tokens before the first one that differs;
- ``token_agreement``: the share of positions whose tokens are equal;
- ``max_logprob_diff`` / ``mean_logprob_diff``: over the positions before the first
  difference (both engines saw the same context there), the absolute difference of the
  chosen token's log-probability.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

from json_out import emit_result

from pensieve.options import add_engine_args, default_of, engine_options


@dataclass
class KVAccuracy:
    """How closely greedy generation over an FP8 KV cache follows the base one."""

    prompts: int
    new_tokens: int
    prefix_agreement: float
    token_agreement: float
    first_token_agreement: float
    max_logprob_diff: float
    mean_logprob_diff: float
    per_prompt: list[dict[str, float]]


def compare_outputs(base: list[Any], fp8: list[Any]) -> KVAccuracy:
    """Agreement of two lists of
    :class:`~pensieve.engine.request_output.RequestOutput` (greedy, with ``logprobs``) of the
    same prompts."""
    per, diffs = [], []
    for a, b in zip(base, fp8, strict=True):
        ta, tb = a.output_token_ids, b.output_token_ids
        n = min(len(ta), len(tb))
        first = next((i for i in range(n) if ta[i] != tb[i]), n)
        d = [abs(a.logprobs[i].logprob - b.logprobs[i].logprob) for i in range(first)
             if a.logprobs and b.logprobs and a.logprobs[i] and b.logprobs[i]]
        diffs += d
        per.append({"prefix_agreement": first / max(1, len(ta)),
                    "token_agreement": sum(x == y for x, y in zip(ta, tb)) / max(1, len(ta)),
                    "max_logprob_diff": max(d, default=0.0)})
    return KVAccuracy(
        prompts=len(per), new_tokens=max((len(o.output_token_ids) for o in base), default=0),
        prefix_agreement=statistics.fmean(p["prefix_agreement"] for p in per),
        token_agreement=statistics.fmean(p["token_agreement"] for p in per),
        first_token_agreement=statistics.fmean(p["prefix_agreement"] > 0 for p in per),
        max_logprob_diff=max(diffs, default=0.0),
        mean_logprob_diff=statistics.fmean(diffs) if diffs else 0.0, per_prompt=per)


def run(model: str, prompts: list[list[int]], new_tokens: int, base_dtype: str = "auto",
        **engine_kw: Any) -> tuple[KVAccuracy, dict[str, int]]:
    """Generate ``prompts`` greedily under ``base_dtype`` then ``fp8_e4m3`` KV caches;
    returns the agreement and each engine's bytes per KV chunk."""
    from pensieve import LLM, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outs, chunk_bytes = {}, {}
    for kv in (base_dtype, "fp8_e4m3"):
        llm = LLM(model, kv_cache_dtype=kv, **engine_kw)
        outs[kv] = llm.generate(prompts, params)
        chunk_bytes[kv] = llm.engine.block_bytes
        del llm
    return compare_outputs(outs[base_dtype], outs["fp8_e4m3"]), chunk_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/kv_accuracy.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, exclude=("kv_cache_dtype",), model_flag=True)
    p.add_argument("--base-dtype", default="auto", help="the KV dtype compared against")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    import random

    from pensieve.models.loader import resolve_config

    kw = engine_options(a, exclude=("kv_cache_dtype",))
    model = kw.pop("model", default_of("model"))
    kw.setdefault("max_model_len", a.prompt_len + a.new_tokens)
    rng = random.Random(kw.get("seed", default_of("seed")))
    vocab = int(resolve_config(model)[0].vocab_size)
    prompts = [[rng.randrange(100, vocab) for _ in range(a.prompt_len)]
               for _ in range(a.prompts)]
    acc, chunk_bytes = run(model, prompts, a.new_tokens, a.base_dtype, **kw)
    res = {"model": model, "load_format": kw.get("load_format", default_of("load_format")),
           "prompt_len": a.prompt_len,
           "chunk_bytes": chunk_bytes,
           "tokens_per_gb_ratio": chunk_bytes[a.base_dtype] / chunk_bytes["fp8_e4m3"],
           **{k: v for k, v in asdict(acc).items() if k != "per_prompt"},
           "per_prompt": acc.per_prompt}
    emit_result(res, a.out, brief=("per_prompt",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
