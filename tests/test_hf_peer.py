"""The HF transformers continuous-batching peer on the CPU with a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from pensieve.bench.engine_api import WallClock  # noqa: E402
from pensieve.bench.hf_peer import HFContinuousBatchingEngine, build_hf_model  # noqa: E402
from pensieve.core.sampling_params import SamplingParams  # noqa: E402
from pensieve.core.scheduler import ConversationBusyError  # noqa: E402

VOCAB = 256
ENGINE_KW = dict(dtype="float32", device="cpu", max_batch_tokens=64, num_blocks=48,
                 block_size=16)


def _make_engine(model, **kw) -> HFContinuousBatchingEngine:
    try:
        return HFContinuousBatchingEngine(model, clock=WallClock(), **{**ENGINE_KW, **kw})
    except MemoryError as e:
        # transformers 5.17 sizes the CPU "device" memory with psutil and sees 0 bytes without it
        if "available memory 0" in str(e):
            pytest.skip(f"HF continuous batching on CPU (transformers {transformers.__version__}) "
                        f"needs psutil to size its cache: MemoryError: {e}")
        raise


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny Llama with HF's normal(0, 0.02) init, saved as a checkpoint."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = _make_engine(str(ckpt))
    yield eng
    eng.shutdown()


def _drain(eng, timeout_s: float = 60.0):
    clock, outs = WallClock(), []
    t_end = clock.now() + timeout_s
    while eng.has_unfinished():
        assert clock.now() < t_end, "requests did not finish"
        outs.extend(eng.step())
    return {o.request_id: o for o in outs}


def _greedy_reference(ckpt, context: list[int], n: int) -> list[int]:
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([context]), attention_mask=torch.ones(1, len(context),
                       dtype=torch.long), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0, len(context):].tolist()


def test_exact_lengths_with_and_without_conversations(engine):
    g = torch.Generator().manual_seed(1)
    lens = {"s0": (7, 5), "s1": (30, 9), "c0": (12, 6), "c1": (3, 11), "s2": (90, 4)}
    for rid, (n_in, n_out) in lens.items():
        ids = torch.randint(3, VOCAB, (n_in,), generator=g).tolist()
        conv = f"conv-{rid}" if rid.startswith("c") else None
        engine.add_request(rid, ids, SamplingParams(max_tokens=n_out, temperature=0.0,
                                                    ignore_eos=True), conversation_id=conv)
    assert engine.has_unfinished()
    outs = _drain(engine)
    assert set(outs) == set(lens)
    for rid, (n_in, n_out) in lens.items():
        o = outs[rid]
        assert len(o.output_token_ids) == n_out
        assert o.finish_reason == "length"
        assert len(o.prompt_token_ids) == n_in
        assert o.arrival_time <= o.first_token_time <= o.finish_time
        assert o.conversation_id == (f"conv-{rid}" if rid.startswith("c") else None)
        assert o.cache_stats["new_prompt_tokens"] == n_in  # first turn: nothing cached
        assert o.cache_stats["recomputed_tokens"] == 0
    assert not engine.has_unfinished()
    assert engine.step() == []
    # the conversations remember prompt + answer; the stateless requests are forgotten
    assert engine.conversation_history("conv-c0") == (outs["c0"].prompt_token_ids
                                                      + outs["c0"].output_token_ids)
    assert engine.conversation_history("conv-s0") == []


def test_two_turns_match_hf_generate(engine, ckpt):
    before = engine.cache_stats()
    p1 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    turn1 = [5, 17, 42, 99, 100, 7, 8, 9, 200, 3]
    engine.add_request("t1", turn1, p1, arrival_time=WallClock().now() - 0.5,
                       conversation_id="two-turn")
    engine.add_request("other", [4, 4, 4, 4], p1)
    o1 = _drain(engine)["t1"]
    assert o1.first_token_time - o1.arrival_time >= 0.5  # the given arrival time is kept
    turn2 = [11, 12, 13, 14, 15]
    p2 = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    engine.add_request("t2", turn2, p2, conversation_id="two-turn")
    with pytest.raises(ConversationBusyError):
        engine.add_request("t2b", [1], p2, conversation_id="two-turn")
    o2 = _drain(engine)["t2"]
    context2 = turn1 + o1.output_token_ids + turn2
    assert o2.prompt_token_ids == context2
    # stateless: the whole history is prefilled again (its last token counts as new)
    hist = len(turn1) + len(o1.output_token_ids)
    assert o2.cache_stats["recomputed_tokens"] == hist - 1
    assert o2.cache_stats["new_prompt_tokens"] == len(turn2) + 1
    assert o2.cache_stats["gpu_hit_tokens"] == 0
    after = engine.cache_stats()
    assert after["finished_requests"] - before["finished_requests"] == 3
    assert after["recomputed_tokens"] - before["recomputed_tokens"] == hist - 1
    assert o1.output_token_ids == _greedy_reference(ckpt, turn1, 8)
    assert o2.output_token_ids == _greedy_reference(ckpt, context2, 7)


def test_preset_random_weights_and_prefix_sharing():
    cfg_model = build_hf_model("llama-tiny", dtype="float32", device="cpu")
    # built without HF's init, but the rotary buffers are the real ones
    torch.manual_seed(0)
    normal = AutoModelForCausalLM.from_config(cfg_model.config, dtype=torch.float32)
    for (name, buf), (_, ref) in zip(cfg_model.named_buffers(), normal.named_buffers()):
        assert torch.equal(buf, ref), name
    assert all(p.abs().max() <= 1.0 for p in cfg_model.parameters())
    eng = _make_engine("llama-tiny", prefix_sharing=True)
    try:
        p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        eng.add_request("a0", list(range(20, 60)), p, conversation_id="A")
        o0 = _drain(eng)["a0"]
        eng.add_request("a1", list(range(100, 140)), p, conversation_id="A")
        o1 = _drain(eng)["a1"]
        assert len(o0.output_token_ids) == len(o1.output_token_ids) == 10
        # HF block sharing (block_size 16) finds the history's full blocks: 50 tokens -> 48
        assert o1.cache_stats["gpu_hit_tokens"] == 48
        assert o1.cache_stats["recomputed_tokens"] == 1
        assert o1.cache_stats["new_prompt_tokens"] == 41
    finally:
        eng.shutdown()
    assert eng.model.config._attn_implementation == "sdpa"  # restored by the manager's stop


def test_model_eos_does_not_stop_generation():
    model = build_hf_model("llama-tiny", dtype="float32", device="cpu")
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    eng = _make_engine(model)
    try:
        eng.add_request("r", prompt, p)
        first = _drain(eng)["r"].output_token_ids
    finally:
        eng.shutdown()
    assert len(first) == 6
    # make the model's EOS the second token it answers: the answer must not stop there
    model.config.eos_token_id = first[1]
    model.generation_config.eos_token_id = first[1]
    eng = _make_engine(model)
    try:
        eng.add_request("r", prompt, p)
        again = _drain(eng)["r"]
    finally:
        eng.shutdown()
    assert again.output_token_ids == first
    assert again.finish_reason == "length"
