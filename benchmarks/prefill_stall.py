"""How long a long prompt entering a running batch stalls its decodes.

    python benchmarks/prefill_stall.py --model llama3.1-8b --load-format dummy --gpu-kv-gb 40 \
        --decodes 32 --decode-context 2048 --prompt 60000 [--kv-cache-dtype auto] [--out F]

``--decodes`` requests (``--decode-context`` prompt tokens each) are brought to decoding,
then one prompt of ``--prompt`` tokens arrives. With chunked prefill each step takes at most
``--max-num-batched-tokens`` tokens, the running decodes included, so the long prompt is
prefilled over several steps that each also give every decode its next token. Every step is
timed on the host (a step returns only after its sampled tokens reached the host). Reported:
the decode-only steps' median before the prompt, each step that carried a piece of the
prompt (its tokens and time), and the longest gap between two tokens of a running decode
while the prompt was prefilled: by construction one step, so the figure to compare is that
gap against the step time of one full chunk.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from json_out import emit_result

from pensieve.options import ENGINE_DEFAULTS, add_engine_args, engine_options


def measure(llm: Any, decodes: int, decode_context: int, prompt: int, seed: int = 0,
            vocab: int = 32000) -> dict[str, Any]:
    """Run the scenario on ``llm`` (a :class:`~pensieve.LLM`); returns the step timings."""
    from pensieve import SamplingParams

    eng = llm.engine
    rng = random.Random(seed)
    long_params = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
    for i in range(decodes):
        eng.add_request(f"d{i}", [rng.randrange(100, vocab) for _ in range(decode_context)],
                        long_params)
    before: list[float] = []
    while len(before) < 20:  # until every decode runs, then 20 decode-only steps
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        sch = eng.scheduler
        if not sch.waiting and len(sch.running) == decodes and all(
                r.output_token_ids and r.num_pending <= 1 for r in sch.running):
            before.append(dt)
    eng.add_request("long", [rng.randrange(100, vocab) for _ in range(prompt)],
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    steps = []
    done = False
    while not done:
        computed0 = _computed(eng, "long")
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        done = any(o.request_id == "long" and o.finish_reason for o in outs)
        steps.append({"time_s": dt, "prompt_tokens": (prompt if done else _computed(eng, "long"))
                      - computed0})
    for i in range(decodes):
        eng.abort_request(f"d{i}")
    while eng.has_unfinished():
        eng.step()
    chunk_steps = [s["time_s"] for s in steps if s["prompt_tokens"] > 0]
    return {"decode_step_median_s": statistics.median(before), "steps": steps,
            "prefill_steps": len(chunk_steps), "max_gap_s": max(s["time_s"] for s in steps),
            "max_chunk_step_s": max(chunk_steps, default=0.0),
            "prefill_total_s": sum(s["time_s"] for s in steps)}


def _computed(eng: Any, rid: str) -> int:
    """Prompt tokens of ``rid`` whose KV is computed (none while it waits)."""
    req = eng.scheduler.requests.get(rid)
    if req is None or req not in eng.scheduler.running:
        return 0
    return req.num_prompt_tokens - req.num_pending


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/prefill_stall.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, model_flag=True, defaults={"model": "llama3.1-8b",
                                                  "load_format": "dummy"})
    p.add_argument("--decodes", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=60000)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from pensieve import LLM
    from pensieve.models.loader import resolve_config

    kw = engine_options(a)
    kw.setdefault("max_model_len", max(a.prompt + 8, a.decode_context + 4096))
    llm = LLM(**kw)
    res = measure(llm, a.decodes, a.decode_context, a.prompt,
                  vocab=int(resolve_config(kw["model"])[0].vocab_size))
    sc = llm.engine.scheduler_config
    res["config"] = {**{k: v for k, v in vars(a).items()
                        if v is not None and k != ENGINE_DEFAULTS}, **kw,
                     "max_num_batched_tokens": sc.max_num_batched_tokens,
                     "max_model_len": sc.max_model_len}
    emit_result(res, a.out, brief=("steps",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
