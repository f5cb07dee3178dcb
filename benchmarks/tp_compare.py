"""Tensor parallelism against one GPU on the same prompts: greedy tokens by the top-k rule.

Runs ``--model`` (default the Llama 2-13B GQA-10 shape, dummy weights, bf16) first with
``tensor_parallel_size=1``, keeping each output token's ``--top-k`` most likely tokens, then with
``--tp``. bf16 rounding differs between the two (the all-reduce sums the partial products in
another order), so exact equality is not expected. As in tests/test_gpu_models.py (vLLM's
``check_logprobs_close``): the outputs must agree up to the first position where they differ,
and there the TP token must be among TP=1's top-k. Prints one line per prompt and a verdict;
``--out`` writes them as JSON. Exit status 1 when a prompt breaks the rule.

    python benchmarks/tp_compare.py --tp 2 --out tp_compare.json      # needs 2 GPUs
    python benchmarks/tp_compare.py --model demo --device cpu --dtype float32   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time

sys.path.insert(0, "src")

import torch  # noqa: E402

from pensieve import LLM, SamplingParams  # noqa: E402
from pensieve.options import add_engine_args, engine_options  # noqa: E402


def _run(args: argparse.Namespace, tp: int, prompts: list[list[int]]) -> tuple[list, float]:
    t0 = time.perf_counter()
    llm = LLM(**{**engine_options(args), "tensor_parallel_size": tp})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=args.top_k if tp == 1 else None)
    outs = llm.generate(prompts, params)
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outs, time.perf_counter() - t0


def compare(ref: list, other: list) -> list[dict]:
    """Per prompt: tokens agreeing before the first difference, and the TP token's rank there
    among the reference's top alternatives (None: agreed to the end; -1: not among them)."""
    rows = []
    for r, o in zip(ref, other):
        agreed, rank = 0, None
        for i, (a, b) in enumerate(zip(r.output_token_ids, o.output_token_ids)):
            if a != b:
                top = [t for t, _ in r.logprobs[i].top]
                rank = top.index(b) if b in top else -1
                break
            agreed += 1
        rows.append({"prompt_len": len(r.prompt_token_ids), "agreed": agreed,
                     "of": len(r.output_token_ids), "rank_at_difference": rank})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    ap.add_argument("--prompt-lens", default="1,17,100,513,1500,3000")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--out", default=None)
    # the engine's options from its config (pensieve.options), under this script's defaults
    add_engine_args(ap, exclude=("tensor_parallel_size",), model_flag=True, defaults={
        "model": "llama2-13b-gqa10", "load_format": "dummy", "dtype": "bfloat16",
        "gpu_kv_gb": 4.0})
    args = ap.parse_args()
    model = engine_options(args)["model"]
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 30000) for _ in range(int(n))]
               for n in args.prompt_lens.split(",")]
    if model == "demo":  # the demo model's vocabulary is small
        prompts = [[t % 250 + 4 for t in p] for p in prompts]
    ref, t1 = _run(args, 1, prompts)
    other, t2 = _run(args, args.tp, prompts)
    rows = compare(ref, other)
    ok = all(r["rank_at_difference"] != -1 for r in rows)
    for r in rows:
        print(f"prompt {r['prompt_len']:5d}: {r['agreed']:3d}/{r['of']} tokens agree, "
              f"TP={args.tp} token's rank at the first difference: {r['rank_at_difference']}")
    verdict = (f"TP={args.tp} vs TP=1 ({model}, {engine_options(args).get('dtype')}): "
               f"{'within' if ok else 'OUTSIDE'} the top-{args.top_k} rule; "
               f"{sum(r['agreed'] for r in rows)} of {sum(r['of'] for r in rows)} tokens agreed "
               f"before the first difference (runs {t1:.0f} s and {t2:.0f} s with start-up)")
    print(verdict)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "ok": ok, "verdict": verdict}, f,
                      indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
