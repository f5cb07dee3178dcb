"""Files and bytes the disk tier holds after a shutdown, when N conversations of one tenant
open with one system prompt: a random tiny Llama (2 layers, 2 KV heads of 16: 16 KiB a
32-token chunk in float32) on the CPU, one turn per conversation, then ``engine.shutdown()``,
which writes every idle chunk; then a restarted engine continues every conversation (one
turn each, all queued at once) and reports where their context came from (docs/performance.md,
"Disk tier: a shared prompt written once"). Prints JSON.

    python benchmarks/disk_shared_flush.py --conversations 32 --prefix-chunks 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--prefix-chunks", type=int, default=8,
                    help="full 32-token chunks of the shared system prompt")
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--no-share-prefixes", action="store_true")
    args = ap.parse_args()

    import torch
    import transformers

    from pensieve import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=1024)
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        transformers.LlamaForCausalLM(cfg).save_pretrained(model, safe_serialization=True)
        disk = os.path.join(tmp, "disk")
        n, c = args.conversations, 32
        llm = LLM(model=model, dtype="float32", device="cpu", chunk_size=c,
                  max_num_batched_tokens=512, max_model_len=1024,
                  num_gpu_blocks=n * 4 + args.prefix_chunks + 16, num_cpu_blocks=n * 4,
                  disk_kv_gb=0.5, disk_kv_path=disk,
                  share_prefixes=not args.no_share_prefixes)
        rng = random.Random(0)
        system = [rng.randrange(3, 256) for _ in range(args.prefix_chunks * c)]
        prompts = [system + [rng.randrange(3, 256) for _ in range(args.question_tokens)]
                   for _ in range(n)]
        llm.generate(prompts, [SamplingParams(max_tokens=4, ignore_eos=True)] * n,
                     conversation_ids=[f"c{i}" for i in range(n)])
        ids = [f"c{i}" for i in range(n)]
        histories = [llm.engine.conversation_history(cid) for cid in ids]
        llm.engine.shutdown()  # writes every idle chunk not on disk yet
        files = [f for f in os.listdir(disk) if f.endswith(".kv")]
        nbytes = sum(os.path.getsize(os.path.join(disk, f)) for f in files)
        chunks = sum(-(-(len(p) + 3) // c) for p in prompts)  # kv_end: all but the last token
        out = {"conversations": n, "prefix_chunks": args.prefix_chunks,
               "share_prefixes": not args.no_share_prefixes,
               "chunks_held": chunks, "files": len(files), "bytes": nbytes}
        # a restarted engine continues every conversation (histories from the store)
        again = LLM(model=model, dtype="float32", device="cpu", chunk_size=c,
                    max_num_batched_tokens=512, max_model_len=1024,
                    num_gpu_blocks=n * 4 + args.prefix_chunks + 16,
                    num_cpu_blocks=n * (args.prefix_chunks + 2),
                    disk_kv_gb=0.5, disk_kv_path=disk,
                    share_prefixes=not args.no_share_prefixes)
        for cid, hist in zip(ids, histories):
            again.engine.restore_conversation(cid, hist)
        again.generate([[5, 6, 7]] * n, [SamplingParams(max_tokens=2, ignore_eos=True)] * n,
                       conversation_ids=ids)
        st = again.cache_stats()
        again.engine.shutdown()
        out["resume"] = {k: st[k] for k in ("disk_hit_tokens", "shared_hit_tokens",
                                            "recomputed_tokens", "disk_read_bytes")}
        out["resume"]["context_tokens"] = sum(len(h) - 1 for h in histories)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
