"""The offline API end to end against HF transformers' own generate (CPU, float32)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pensieve import LLM, SamplingParams
from pensieve.engine.step_record import StepRecord, StepTotals

PROMPT_LENS = [1, 5, 33, 64, 150, 301]
MAX_NEW = 32


def _hf_model(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "opt":
        cfg = transformers.OPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                     ffn_dim=128, num_attention_heads=4,
                                     max_position_embeddings=512, word_embed_proj_dim=64)
        model = transformers.OPTForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2 if kind == "llama-gqa" else 8,
            max_position_embeddings=1024)
        model = transformers.LlamaForCausalLM(cfg)
    return model.eval()


@pytest.fixture(scope="module", params=["llama-mha", "llama-gqa", "opt"])
def checkpoint(request, tmp_path_factory):  # noqa: ANN001, ANN201
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                 eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    return str(path), prompts, expected


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_greedy_matches_hf_generate(checkpoint) -> None:  # noqa: ANN001
    path, prompts, expected = checkpoint
    llm = LLM(model=path, dtype="float32", device="cpu")
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected


def test_greedy_matches_hf_under_pressure(checkpoint) -> None:  # noqa: ANN001
    """A small token budget (chunked prefill mixed with decodes) and a KV cache too small for
    all requests at once (preemption and recomputation) must not change greedy outputs."""
    path, prompts, expected = checkpoint
    llm = LLM(model=path, dtype="float32", device="cpu", chunk_size=16,
              max_num_batched_tokens=96, num_gpu_blocks=36)
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_suspended > 0
    assert llm.engine.cache.gpu.num_free_blocks == 36


@pytest.mark.parametrize("pressure,span", [(False, "auto"), (True, "auto"), (False, "0"),
                                           (False, "1")])
def test_padded_decode_graph_path_matches_hf(checkpoint, pressure: bool, span: str,
                                             monkeypatch) -> None:  # noqa: ANN001
    """The decode-graph path (static buffers, batch padded to a bucket; run eagerly here, as
    CUDA graphs need a GPU) gives the same greedy tokens as HF, suspensions included. With
    the runner's span mode ``auto`` (its default) the ragged decode steps (prompts of 1-301
    tokens) take the graphs split by span, the others the plain ones; ``0`` and ``1``: only
    one set."""
    path, prompts, expected = checkpoint
    extra = dict(chunk_size=16, max_num_batched_tokens=96, num_gpu_blocks=36) if pressure else {}
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=512, **extra)
    runner = llm.engine.runner
    assert runner.decode_span_mode == "auto"
    runner.decode_span_mode = span
    runner.enable_decode_graphs(max_batch=8, max_blocks=512 // runner.chunk_size, capture=False)
    assert runner.decode_graphs is not None and runner.decode_graphs.buckets == [1, 2, 4, 8]
    # auto: both attention variants over the same buffers; 0 / 1: one
    assert runner.decode_graphs.variants == {"0": (False,), "1": (True,),
                                             "auto": (False, True)}[span]
    totals = StepTotals()
    llm.engine.step_observers.append(totals)
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert runner.num_graph_steps > 0
    # every bucket's logits, of either variant, are views of one [max_batch, vocab] buffer
    assert runner.decode_graphs.logits_out is not None
    assert tuple(runner.decode_graphs.logits_out.shape) == (8, 512)
    if span == "auto":  # these decode steps are ragged (max > 2x mean): split by span
        assert runner.num_span_graph_steps > 0
    else:
        assert runner.num_span_graph_steps == (runner.num_graph_steps if span == "1" else 0)
    # what /metrics counts: the graph steps split by span, and eager decode steps that split
    assert totals.split_span_steps >= runner.num_span_graph_steps
    assert (totals.split_span_steps == 0) == (span == "0")


def test_eager_decode_steps_split_by_span_are_counted(checkpoint, monkeypatch) -> None:  # noqa: ANN001
    """Without graphs, span mode ``1`` splits every decode-only step (and no step with
    prefill); the step records say which, for ``/metrics``."""
    path, prompts, expected = checkpoint
    llm = LLM(model=path, dtype="float32", device="cpu")
    llm.engine.runner.decode_span_mode = "1"
    seen: list[StepRecord] = []
    llm.engine.step_observers.append(seen.append)
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert seen and all(r.decode_split_span == (r.prefill_tokens == 0) for r in seen)
    assert any(r.decode_split_span for r in seen)


@pytest.mark.parametrize("span", ["0", "1"])
def test_eager_mixed_steps_with_decodes_split_match_hf(checkpoint, monkeypatch,
                                                       span: str) -> None:  # noqa: ANN001
    """Mixed decodes ``split`` (the default) without graphs: a mixed step's decodes go first,
    in a decode launch of their own split by span, where they are to be split (span mode
    ``1``: always; ``0``: never, so they stay with the other ranges); same greedy tokens as
    HF, with chunked prefill and recomputation under pressure."""
    path, prompts, expected = checkpoint
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=512, chunk_size=16,
              max_num_batched_tokens=96, num_gpu_blocks=36)
    runner = llm.engine.runner
    assert runner.mixed_decodes == "split"
    runner.decode_span_mode = span
    seen = []
    prepare = runner.prepare_inputs

    def spy(sched):  # noqa: ANN001, ANN202
        inp = prepare(sched)
        qlens = [r.query_len for s in sched.requests for r in s.ranges]
        seen.append((min(qlens) == 1 < max(qlens), inp.attn.decode))
        return inp

    runner.prepare_inputs = spy
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    mixed = [d for with_decodes, d in seen if with_decodes]
    assert mixed, "no step had decodes and longer ranges together"
    if span == "1":
        assert all(d is not None and d.kv_split_span is not None for d in mixed)
    else:
        assert all(d is None for d in mixed)
    assert all(d is None for with_decodes, d in seen if not with_decodes)


@pytest.mark.parametrize("decodes", ["together", "split"])
@pytest.mark.parametrize("pressure", [False, True])
def test_mixed_graph_path_matches_hf(checkpoint, pressure: bool, decodes: str,
                                     monkeypatch) -> None:  # noqa: ANN001
    """Every step through the static-buffer graph paths (run eagerly here): prefill and mixed
    steps padded to token buckets with empty range slots, decode steps to batch buckets; same
    greedy tokens as HF, with chunked prefill, suspensions and recomputation under pressure.
    ``split``: a mixed step's decodes first, in a decode launch of their own."""
    path, prompts, expected = checkpoint
    extra = dict(chunk_size=16, max_num_batched_tokens=96, num_gpu_blocks=36) if pressure else {}
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=512, **extra)
    runner = llm.engine.runner
    runner.mixed_decodes = decodes
    max_blocks = 512 // runner.chunk_size
    runner.enable_mixed_graphs(max_tokens=llm.engine.config.scheduler.max_num_batched_tokens,
                               max_ranges=8, max_blocks=max_blocks, capture=False)
    if pressure:
        runner.enable_decode_graphs(max_batch=8, max_blocks=max_blocks, capture=False)
    mixed = runner.mixed_graphs
    assert mixed is not None and mixed.buckets[0] == 16
    assert mixed.split_decodes == (decodes == "split")
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert runner.num_mixed_graph_steps > 0
    assert runner.num_graph_steps > 0 if pressure else runner.num_graph_steps == 0


def test_token_buckets_and_mixed_graph_shape() -> None:
    from pensieve.config import EngineConfig, ModelConfig
    from pensieve.core.scheduling_config import SchedulerConfig
    from pensieve.runner.mixed_graphs import token_buckets

    assert token_buckets(100) == [16, 32, 64, 96, 100]
    b = token_buckets(8192)
    assert b[:13] == [16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert b[-1] == 8192 and all(y - x <= max(32, x // 2) for x, y in zip(b, b[1:]))
    cfg = EngineConfig(model=ModelConfig(cuda_graph_mixed=True),
                       scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64,
                                                 max_model_len=2048))
    assert cfg.mixed_graph_shape("cuda") == (4096, 64, 64)
    assert cfg.mixed_graph_shape("cpu") is None
    off = EngineConfig(model=ModelConfig(cuda_graph_mixed=False))  # decode-only graphs
    assert off.mixed_graph_shape("cuda") is None and off.decode_graph_shape("cuda") is not None
    eager = EngineConfig(model=ModelConfig(cuda_graph_mixed=True, enforce_eager=True))
    assert eager.mixed_graph_shape("cuda") is None and eager.decode_graph_shape("cuda") is None


def test_serve_mixed_graph_flags() -> None:
    """``--mixed-graphs`` / ``--no-mixed-graphs`` set it; neither leaves the config default;
    ``--enforce-eager`` turns every graph off whatever the mixed flag says."""
    import argparse

    from pensieve.config import ModelConfig
    from pensieve.engine.llm import build_engine_config
    from pensieve.options import engine_options
    from pensieve.server.main import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)

    def cfg(*argv: str):  # noqa: ANN202
        return build_engine_config(**engine_options(p.parse_args(list(argv))))

    default = ModelConfig().cuda_graph_mixed
    assert default is True  # on by default on CUDA (the CPU never captures)
    assert cfg().model.cuda_graph_mixed is default
    assert cfg("--mixed-graphs").model.cuda_graph_mixed is True
    assert cfg("--no-mixed-graphs").model.cuda_graph_mixed is False
    assert cfg("--no-mixed-graphs").mixed_graph_shape("cuda") is None
    assert cfg("--mixed-graphs").mixed_graph_shape("cuda") is not None
    assert cfg("--no-cuda-graph-mixed").model.cuda_graph_mixed is False  # the field's own name
    eager = cfg("--enforce-eager", "--mixed-graphs")
    assert eager.mixed_graph_shape("cuda") is None and eager.decode_graph_shape("cuda") is None


def test_generate_validates_input(checkpoint) -> None:  # noqa: ANN001
    path, prompts, _ = checkpoint
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=256)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10_000]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 300], GREEDY)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[1], [2]], [GREEDY])
    with pytest.raises(TypeError):
        llm.generate([1, 2, 3], GREEDY)  # type: ignore[list-item]
    # the engine is left clean and still works
    assert not llm.engine.has_unfinished()
    assert llm.generate(prompts[:2], GREEDY)[0].output_token_ids
    with pytest.raises(TypeError, match="unknown option"):
        LLM(model=path, device="cpu", bogus=1)


def test_per_prompt_params_and_seeds(checkpoint) -> None:  # noqa: ANN001
    path, prompts, expected = checkpoint
    llm = LLM(model=path, dtype="float32", device="cpu")
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a = llm.generate([prompts[2], prompts[3]], [GREEDY, seeded])
    b = llm.generate([prompts[3]], seeded)
    assert a[0].output_token_ids == expected[2]
    assert a[1].output_token_ids == b[0].output_token_ids
    assert len(b[0].output_token_ids) == 8 and b[0].finish_reason == "length"


def test_decode_graph_shape_follows_config() -> None:
    """Graphs only on CUDA and not under enforce_eager; batch capped by max_num_seqs, tables
    wide enough for max_model_len."""
    from pensieve.config import CacheConfig, EngineConfig, ModelConfig
    from pensieve.core.scheduling_config import SchedulerConfig

    cfg = EngineConfig(model=ModelConfig(cuda_graph_max_batch=64),
                       cache=CacheConfig(chunk_size=32),
                       scheduler=SchedulerConfig(max_num_seqs=48, max_model_len=1000))
    assert cfg.decode_graph_shape("cuda") == (48, 32)  # ceil(1000 / 32)
    assert cfg.decode_graph_shape("cpu") is None
    eager = EngineConfig(model=ModelConfig(enforce_eager=True))
    assert eager.decode_graph_shape("cuda") is None
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        ModelConfig(cuda_graph_max_batch=0)
    llm = LLM(model="llama-tiny", dtype="float32", device="cpu", num_gpu_blocks=16)
    assert llm.engine.runner.decode_graphs is None  # the CPU never captures


def test_step_log_writes_every_step_as_the_totals_count_them(checkpoint, tmp_path) -> None:  # noqa: ANN001
    """``StepLog`` (``PENSIEVE_STEP_LOG``) writes one JSON line per step; summed, the lines
    give the totals ``/metrics`` exports, and each carries the plan's split of swap-ins and
    its prefill ranges."""
    import json

    from pensieve.engine.step_record import StepLog

    path, prompts, expected = checkpoint
    llm = LLM(model=path, dtype="float32", device="cpu")
    totals, log = StepTotals(), StepLog(str(tmp_path / "steps.jsonl"))
    llm.engine.step_observers += [totals, log]
    outs = llm.generate(prompts, GREEDY)
    log.close()
    assert [o.output_token_ids for o in outs] == expected
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(rows) == totals.steps > 0
    assert sum(r["prefill_tokens"] for r in rows) == totals.prefill_tokens
    assert sum(r["decode_tokens"] for r in rows) == totals.decode_tokens
    assert sum(r["prefill_tokens"] > 0 for r in rows) == totals.prefill_steps
    ts = [r["t"] for r in rows]
    assert ts == sorted(ts)
    for r in rows:
        assert r["swap_in_step"] + r["swap_in_ahead"] == r["swap_in_chunks"]
        assert (r["prefill_ranges"] > 0) == (r["prefill_tokens"] > 0)
        assert r["prefill_kv"] >= r["prefill_tokens"]
