"""Held once: N conversations of one tenant open with the same long system prompt and then sit
idle; how many blocks each tier uses with prefix sharing on and off, and the disk tier's files
and the blocks read back after a restart.

The real engine on the CPU over a small random Llama (built here, saved to a temp dir: nothing
is fetched), chunks of 32 tokens, a GPU tier too small for the conversations so that most of
them go to the CPU tier, a CPU tier large enough to hold all of them unshared::

    python benchmarks/held_once.py                       # 200 conversations, 4,000-token prompt
    python benchmarks/held_once.py --conversations 20 --prompt-tokens 400 --json out.json

For each of sharing off / on: (1) every conversation's first turn (the system prompt and a
question of its own), (2) the blocks used per tier once all are idle, (3) a stop (the disk
tier writes every idle chunk), a restart on the same disk path, every conversation continued
by one turn (the history given back as the conversation store does), and the blocks used and
the disk hits then.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from typing import Any

from tqdm import tqdm

CHUNK = 32


def tiny_llama(path: str, max_len: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=max_len)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def used(stats: dict[str, int], tier: str) -> int:
    return stats[f"{tier}_blocks_total"] - stats[f"{tier}_blocks_free"]


def run(model: str, disk: str, share: bool, n: int, prompt: int, gpu_blocks: int,
        cpu_blocks: int) -> dict[str, Any]:
    from pensieve import LLM, SamplingParams

    rng = random.Random(0)
    system = [rng.randrange(3, 256) for _ in range(prompt)]
    questions = [[rng.randrange(3, 256) for _ in range(20)] for _ in range(n)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = {"dtype": "float32", "device": "cpu", "chunk_size": CHUNK,
                          "num_gpu_blocks": gpu_blocks, "num_cpu_blocks": cpu_blocks,
                          "max_num_batched_tokens": 4096, "max_model_len": prompt + 256,
                          "share_prefixes": share, "disk_kv_gb": 4.0, "disk_kv_path": disk,
                          "disk_read_gbps": 1e9}
    out: dict[str, Any] = {"sharing": share}
    llm = LLM(model=model, **kw)
    t0 = time.perf_counter()
    for i in tqdm(range(n), desc=f"first turns, sharing {'on' if share else 'off'}"):
        llm.generate([system + questions[i]], [params], conversation_ids=[f"c{i}"])
    st = llm.cache_stats()
    out["first_turns_s"] = round(time.perf_counter() - t0, 1)
    out["idle"] = {"gpu_blocks": used(st, "gpu"), "cpu_blocks": used(st, "cpu"),
                   "prompt_tokens_computed": st["new_prompt_tokens"] + st["recomputed_tokens"],
                   "shared_hit_tokens": st["shared_hit_tokens"]}
    histories = {f"c{i}": llm.engine.conversation_history(f"c{i}") for i in range(n)}
    llm.engine.shutdown()  # writes every idle chunk not on disk yet
    import os

    out["disk_files"] = len([f for f in os.listdir(disk) if f.endswith(".kv")])
    llm = LLM(model=model, **kw)
    for cid, hist in histories.items():
        llm.engine.restore_conversation(cid, hist)
    for i in tqdm(range(n), desc="after the restart"):
        llm.generate([[5, 6, 7]], [params], conversation_ids=[f"c{i}"])
    st = llm.cache_stats()
    out["after_restart"] = {"gpu_blocks": used(st, "gpu"), "cpu_blocks": used(st, "cpu"),
                            "disk_hit_tokens": st["disk_hit_tokens"],
                            "recomputed_tokens": st["recomputed_tokens"],
                            "context_tokens": sum(len(h) for h in histories.values())}
    llm.engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--gpu-blocks", type=int, default=None,
                    help="GPU tier (default: room for 3 conversations)")
    ap.add_argument("--json", default=None, help="write the results here too")
    a = ap.parse_args()
    per_conv = -(-(a.prompt_tokens + 24) // CHUNK) + 1
    gpu = a.gpu_blocks or 3 * per_conv
    cpu = a.conversations * per_conv + 64  # room for all of them unshared
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(f"{tmp}/model", a.prompt_tokens + 256)
        for share in (False, True):
            rows.append(run(f"{tmp}/model", f"{tmp}/disk-{share}", share, a.conversations,
                            a.prompt_tokens, gpu, cpu))
    result = {"conversations": a.conversations, "prompt_tokens": a.prompt_tokens,
              "chunk_size": CHUNK, "gpu_blocks": gpu, "cpu_blocks": cpu, "runs": rows}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
