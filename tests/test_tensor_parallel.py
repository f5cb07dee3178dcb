"""Tensor parallelism on the CPU: 2 rank processes over gloo give the same tokens as one process.

Tiny random HF checkpoints (Llama GQA with 2 KV heads, Llama with 1 KV head replicated on both
ranks, OPT; vocab 257 so the vocab-parallel layers pad) run in float32 under tiny KV tiers.
For each, a TP=1 and a TP=2 engine go through the same calls in the same order (tests run in
file order; each test compares the two after its own calls): batched prompts of different
lengths, then a multi-turn workload whose tiers force swaps, drops, recomputation and
suspensions. The scheduler is the same code in both, so even the cache counters must agree.

``PENSIEVE_TEST_DEVICE=cuda`` runs the same tests on GPUs (ranks on cuda:0 and cuda:1 over
NCCL, decode steps from CUDA graphs with the all-reduces captured inside them).
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import time

import pytest
import torch
import transformers

from pensieve import LLM, SamplingParams

VOCAB = 257  # odd: 129 rows per rank, the last one padding
CHUNK = 8
TIERS = {"num_gpu_blocks": 30, "num_cpu_blocks": 8}  # 240 GPU-tier tokens, 64 CPU-tier
KINDS = ["llama-gqa", "llama-kv1", "opt"]
DEVICE = os.environ.get("PENSIEVE_TEST_DEVICE", "cpu")


def _hf_model(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "opt":
        cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                     ffn_dim=128, num_attention_heads=4, init_std=0.1,
                                     max_position_embeddings=512, word_embed_proj_dim=64)
        return transformers.OPTForCausalLM(cfg).eval()
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2 if kind == "llama-gqa" else 1,
        max_position_embeddings=512, initializer_range=0.1)
    return transformers.LlamaForCausalLM(cfg).eval()


def _llm(path: str, tp: int) -> LLM:
    llm = LLM(model=path, dtype="float32", device=DEVICE, chunk_size=CHUNK,
              max_num_batched_tokens=64, tensor_parallel_size=tp, **TIERS)
    llm.engine.audit = True
    # A clock that advances by the same tick at every reading: the retention value divides by
    # idle time, so on the wall clock a slower TP=2 step can change which chunk is evicted
    # (on the H200 the counters once differed by two chunks, with the same tokens). The
    # engines make the same calls in the same order, so they read the same times.
    ticks = itertools.count()
    llm.engine.now = lambda: next(ticks) * 0.01
    return llm


@pytest.fixture(scope="module", params=KINDS)
def engines(request, tmp_path_factory):  # noqa: ANN001, ANN201
    """``{"path", "tp1", "tp2"}`` for one model; a test may take ``tp2`` away (and stop it)."""
    path = tmp_path_factory.mktemp(request.param)
    _hf_model(request.param).save_pretrained(path, safe_serialization=True)
    pair = {"kind": request.param, "path": str(path), "tp1": _llm(str(path), 1),
            "tp2": _llm(str(path), 2)}
    yield pair
    if "tp2" in pair:
        pair["tp2"].shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # zombie: exited, not reaped
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _both(engines: dict, prompts: list, params: object, conversation_ids: list | None = None):  # noqa: ANN202
    outs = [engines[k].generate(prompts, params, conversation_ids=conversation_ids)
            for k in ("tp1", "tp2")]
    return [[o.output_token_ids for o in out] for out in outs]


def test_batched_greedy_and_seeded_match_tp1(engines) -> None:  # noqa: ANN001
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 9, 23, 40, 57)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want, got = _both(engines, prompts, greedy)
    assert got == want
    assert all(len(t) == 24 for t in got)
    assert len({tuple(t) for t in got}) == len(got)  # the model is not degenerate
    assert max(len(set(t)) for t in got) > 4
    # seeded sampling: the plan carries the params; rank 0 samples
    seeded = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    want, got = _both(engines, prompts, seeded)
    assert got == want


def test_multiturn_invariant_under_tiny_tiers(engines) -> None:  # noqa: ANN001
    """Five conversations, three rounds; later rounds come back to conversations whose leading
    chunks went to the CPU tier or were dropped, the last round's answers outgrow the GPU tier
    (suspensions). Same tokens and same cache counters at TP=2 as at TP=1."""
    rng = random.Random(3)
    before = {k: engines[k].cache_stats() for k in ("tp1", "tp2")}
    for r in range(3):
        convs = list(range(5)) if r != 1 else list(range(5))[::-1]
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(18, 30))] for _ in convs]
        params = SamplingParams(max_tokens=40 if r == 2 else 10, temperature=0.0,
                                ignore_eos=True)
        want, got = _both(engines, prompts, params, [f"c{c}" for c in convs])
        assert got == want, f"round {r} diverged"
    for c in range(5):
        assert (engines["tp2"].conversation_history(f"c{c}")
                == engines["tp1"].conversation_history(f"c{c}"))
    s1, s2 = engines["tp1"].cache_stats(), engines["tp2"].cache_stats()
    moved = {k: s2[k] - before["tp2"][k] for k in s2 if k in before["tp2"]}
    for counter in ("cpu_hit_tokens", "recomputed_tokens", "swapped_out_tokens",
                    "swapped_in_tokens", "dropped_tokens", "suspended_requests",
                    "split_range_requests"):
        assert moved[counter] > 0, (counter, moved)
    for k in s1:
        if not k.endswith("_bytes"):
            assert s2[k] == s1[k], k
    # each rank copies its own KV heads: 2 ranks x (1 or 2 of 2 heads) per token moved
    assert s2["swap_in_bytes"] >= s1["swap_in_bytes"] > 0


def test_shutdown_stops_every_worker(engines) -> None:  # noqa: ANN001
    """llama-gqa: LLM.shutdown(); llama-kv1: dropping the last reference; opt: a rank killed
    mid-session makes the next call raise instead of hanging, and no rank is left over."""
    llm = engines.pop("tp2")
    pids = llm.engine.runner.pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    prompt = [[1, 2, 3]]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    if engines["kind"] == "llama-gqa":
        llm.shutdown()
        llm.shutdown()  # idempotent
        assert _wait_gone(pids, 0.1)
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(prompt, greedy)
    elif engines["kind"] == "llama-kv1":
        del llm
        gc.collect()
        assert _wait_gone(pids)
    else:
        os.kill(pids[1], 9)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate(prompt, greedy)
        assert time.monotonic() - t0 < 30
        assert _wait_gone(pids)
        llm.shutdown()


def test_bad_configs_raise_before_spawning(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=6,
                                   num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="does not divide num_attention_heads 6"):
        LLM(model=str(tmp_path), device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="num_key_value_heads 2 < tensor_parallel_size 3"):
        LLM(model=str(tmp_path), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        LLM(model=str(tmp_path), device="cpu", tensor_parallel_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            LLM(model=str(tmp_path), device="cuda", tensor_parallel_size=2)


def test_worker_error_comes_back_with_its_traceback() -> None:
    """A rank that raises sends its traceback; the call raises, and every rank is stopped."""
    from pensieve.core.outputs import SchedulerOutput, SwapPlan

    llm = LLM(model="llama-tiny", dtype="float32", device="cpu", tensor_parallel_size=2,
              num_gpu_blocks=8, num_cpu_blocks=4)
    pids = llm.engine.runner.pids
    bad = SchedulerOutput(requests=[], swaps=SwapPlan(swap_in=[(99, 0)]))  # no CPU block 99
    with pytest.raises(RuntimeError, match=r"(?s)a worker failed.*CPU block out of range"):
        llm.engine.runner.execute(bad)
    assert _wait_gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1))
