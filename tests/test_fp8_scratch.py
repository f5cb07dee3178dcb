"""FP8 prefill through a 16-bit scratch (kernels/fp8_scratch.py): the dequantization kernel
against torch, the scratch path against the reference and the direct FP8 kernel, the cost
rule's choice, the size cap and mixed launches (decodes apart on FP8, or in the scratch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pensieve import kernels
from pensieve.kernels import fp8_scratch as fs
from pensieve.kernels.launch import paged_attention_triton
from pensieve.kernels.reference import paged_attention_ref

F8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, C, NB = 4, 2, 32, 16, 24
KS = torch.tensor([0.5, 2.0])
VS = torch.tensor([1.0, 0.25])


def _fp8_cache(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of one ``[2, NB, C, HKV, D]`` FP8 cache of random values."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(2, NB, C, HKV, D, generator=g) * 4).clamp(-440, 440).to(F8).to(DEV)
    return kv[0], kv[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequant_equals_torch(dtype: torch.dtype) -> None:
    kc, vc = _fp8_cache()
    src = torch.tensor([7, 0, 23, 7, 11], dtype=torch.int32, device=DEV)
    ks, vs = KS.to(DEV), VS.to(DEV)
    got = fs.dequant_blocks_triton(kc, vc, src, 5, ks, vs, dtype)
    assert got.shape == (2, 5, C, HKV, D) and got.dtype == dtype
    idx = src.long()
    want_k = (kc[idx].float() * ks[None, None, :, None]).to(dtype)
    want_v = (vc[idx].float() * vs[None, None, :, None]).to(dtype)
    assert torch.equal(got[0], want_k) and torch.equal(got[1], want_v)
    with pytest.raises(ValueError, match="src_blocks has 5 entries for 4"):
        fs.dequant_blocks_triton(kc, vc, src, 4, ks, vs, dtype)
    with pytest.raises(ValueError, match="dequantizes an FP8 cache"):
        fs.dequant_blocks_triton(kc.float(), vc.float(), src, 5, ks, vs, dtype)


def _launch(lens: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
    """(query_start_loc, range_start_pos, range_table) of ranges ``(row, start_pos,
    query_len)``, and the host arrays ``(starts, qlens, rows)``."""
    qsl = np.cumsum([0] + [n for _, _, n in lens])
    rows = np.array([r for r, _, _ in lens])
    starts = np.array([s for _, s, _ in lens])
    qlens = np.array([n for _, _, n in lens])
    i32 = torch.int32
    return (torch.tensor(qsl, dtype=i32, device=DEV), torch.tensor(starts, dtype=i32, device=DEV),
            torch.tensor(rows, dtype=i32, device=DEV), starts, qlens, rows)


TABLES = np.stack([np.random.default_rng(0).permutation(NB)[:12],
                   np.random.default_rng(1).permutation(NB)[:12],
                   np.random.default_rng(2).permutation(NB)[:12]]).astype(np.int32)
"""Three requests' block tables (12 blocks = 192 positions each), shuffled cache blocks."""


@pytest.mark.parametrize("lens", [
    [(0, 0, 70)],  # a prefill
    [(1, 100, 40), (0, 30, 9)],  # continuations over cached history
    [(0, 20, 16), (0, 36, 12)],  # two ranges of one request (the scratch holds its row once)
    [(2, 150, 1), (1, 60, 33), (0, 91, 1)],  # decodes in the launch: all on the scratch
])
def test_scratch_path_equals_reference_and_direct(lens: list[tuple[int, int, int]]) -> None:
    """float32 queries (exact dots): the scratch path equals the reference within the FP8
    tests' tolerance, and the direct FP8 kernel; it reads only the blocks the ranges see."""
    kc, vc = _fp8_cache(1)
    qsl, rsp, rt, starts, qlens, rows = _launch(lens)
    q = torch.randn(int(qsl[-1]), H, D, generator=torch.Generator().manual_seed(3)).to(DEV)
    ks, vs = KS.to(DEV), VS.to(DEV)
    plan = fs.plan_fp8_scratch(starts, qlens, rows, TABLES, C, H, HKV, D, 4,
                               torch.device(DEV), min_rows=0)
    assert plan is not None
    used, inv, need = fs.scratch_blocks(starts, qlens, rows, C)
    assert plan.num_blocks == int(need.sum())
    assert (used[inv] == rows).all() and plan.range_table.tolist() == inv.tolist()
    src = plan.src_blocks.cpu().numpy()
    got_tables = plan.block_tables.cpu().numpy()
    for u, (b, n) in enumerate(zip(used, need)):  # the cache row's first n blocks, in order
        assert n == -(-max(s + q for s, q, r in zip(starts, qlens, rows) if r == b) // C)
        assert (src[got_tables[u, :n]] == TABLES[b, :n]).all()
    bt = torch.from_numpy(TABLES).to(DEV)
    mq = int(qlens.max())
    got = fs.paged_attention_fp8_scratch(q, kc, vc, plan, qsl, rsp, D**-0.5, mq,
                                         k_scale=ks, v_scale=vs)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    direct = paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, max_query_len=mq,
                                    k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, direct, atol=1e-4, rtol=1e-4)


def test_rule_picks_prefill_heavy_launches() -> None:
    """Llama-3.1-8B's shape (group 4, 32-token chunks, bf16 scratch): a 2,048-token prefill
    over 32k cached positions and one from position 0 take the scratch, as does a 300-token
    turn over 32k (1,200 rows per position); decodes, a 16-token turn and a 200-token turn
    (800 rows) read FP8 directly. A mixed launch takes it while its prefill outweighs its
    decodes' KV: with 4 decodes at 32k, not with 8 (under the 2 GiB cap either way)."""
    dev = torch.device("cpu")

    def plan(lens: list[tuple[int, int]]) -> fs.Fp8Scratch | None:
        starts = np.array([s for s, _ in lens])
        qlens = np.array([n for _, n in lens])
        ends = starts + qlens
        tables = np.zeros((len(lens), int(-(-ends.max() // 32))), dtype=np.int32)
        return fs.plan_fp8_scratch(starts, qlens, np.arange(len(lens)), tables, 32, 32, 8,
                                   128, 2, dev)

    got = plan([(32768 - 2048, 2048)])
    assert got is not None and got.num_blocks == 1024
    assert plan([(32767, 1)] * 8) is None  # decode
    assert plan([(32768, 16)]) is None  # a short turn
    assert plan([(32768, 300)]) is not None
    assert plan([(32768, 200)]) is None
    assert plan([(0, 2048)]) is not None  # causal from 0: ~4,100 rows per position
    assert plan([(30720, 2048)] + [(32767, 1)] * 4) is not None
    assert plan([(30720, 2048)] + [(32767, 1)] * 8) is None


def test_rule_threshold() -> None:
    """:func:`scratch_pays` at its boundary: attended rows x positions against min_rows x the
    positions dequantized."""
    starts, qlens, blocks = np.array([96]), np.array([32]), np.array([4])  # 128 positions
    attended = (32 * 96 + 32 * 33 // 2) * 2  # group 2
    assert fs.scratch_pays(starts, qlens, blocks, 32, 2, attended // 128)
    assert not fs.scratch_pays(starts, qlens, blocks, 32, 2, attended // 128 + 1)
    assert not fs.scratch_pays(starts, qlens, np.array([0]), 32, 2, 0)  # nothing to copy


def test_cap_falls_back_to_direct() -> None:
    starts, qlens, rows = np.array([0]), np.array([64]), np.array([0])
    tables = np.arange(4, dtype=np.int32)[None]
    one = fs.scratch_bytes(4, 16, HKV, D, 4)
    dev = torch.device("cpu")
    assert one == 2 * 4 * 16 * HKV * D * 4
    args = (starts, qlens, rows, tables, 16, H, HKV, D, 4, dev)
    assert fs.plan_fp8_scratch(*args, cap_bytes=one, min_rows=0) is not None
    assert fs.plan_fp8_scratch(*args, cap_bytes=one - 1, min_rows=0) is None
    assert fs.plan_fp8_scratch(starts, qlens, rows, tables, 24, H, HKV, D, 4, dev,
                               min_rows=0) is None  # chunk not a power of two


def test_layer_mixed_launch_decodes_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose decodes attend in a launch of their own (``AttentionMetadata.decode``,
    direct FP8) and whose prefill ranges attend over the scratch: each writes its own rows,
    and together they equal the reference layer."""
    from pensieve.layers.attention import AttentionMetadata, PagedAttention

    layer = PagedAttention(H, HKV, D, D**-0.5)
    layer.kv_scale = torch.stack([KS, VS]).to(DEV)
    kc, vc = _fp8_cache(2)
    cache = torch.stack([kc, vc])
    dec = [(0, 150, 1), (2, 99, 1)]
    pre = [(1, 64, 40), (2, 40, 20)]  # row 2 is read by a decode too: not dequantized for it
    n_dec = len(dec)
    qsl_d, rsp_d, rt_d, *_ = _launch(dec)
    qsl_p, rsp_p, rt_p, starts, qlens, rows = _launch(pre)
    qsl_p = qsl_p + n_dec  # the prefill tokens come after the decodes
    total = n_dec + int(qlens.sum())
    g = torch.Generator().manual_seed(4)
    q = torch.randn(total, H * D, generator=g).to(DEV)
    k = torch.randn(total, HKV * D, generator=g).to(DEV)
    v = torch.randn(total, HKV * D, generator=g).to(DEV)
    slots = torch.full((total,), -1, dtype=torch.int64, device=DEV)  # nothing stored
    bt = torch.from_numpy(TABLES).to(DEV)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl_p, range_start_pos=rsp_p,
                             range_table=rt_p, block_tables=bt, max_query_len=int(qlens.max()))
    meta.decode = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl_d,
                                    range_start_pos=rsp_d, range_table=rt_d, block_tables=bt,
                                    max_query_len=1)
    meta.fp8_scratch = fs.plan_fp8_scratch(starts, qlens, rows, TABLES, C, H, HKV, D, 4,
                                           torch.device(DEV), min_rows=0)
    assert meta.fp8_scratch is not None
    assert meta.fp8_scratch.num_blocks == 7 + 4  # rows 1 and 2, to the prefill ranges' ends
    calls: list[int] = []
    dequant = fs.dequant_blocks_triton

    def spy(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(a[3])
        return dequant(*a, **kw)

    monkeypatch.setattr(fs, "dequant_blocks_triton", spy)
    monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice("triton"))
    got = layer(q, k, v, cache, meta)
    assert calls == [11]  # the prefill launch went through the scratch
    monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice("reference"))
    want = layer(q, k, v, cache, meta)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("span_mode", ["1", "0"])
def test_runner_plans_the_scratch_for_its_prefill_launch(tmp_path, monkeypatch,  # noqa: ANN001
                                                         span_mode: str) -> None:
    """The runner (FP8 cache, Triton kernels) plans the scratch for a step's main launch:
    without its decodes where they attend apart (``span_mode`` 1: split by span), with them
    where they share it (0); nothing where the rule says no. The model's hidden states over
    the scratch equal those of the direct FP8 kernel."""
    import random

    import transformers

    from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput
    from pensieve.core.sampling_params import SamplingParams
    from pensieve.engine.kv_layout import KVLayout
    from pensieve.layers.attention import init_kv_scales
    from pensieve.models.loader import load_model
    from pensieve.runner.model_runner import ModelRunner

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    dev = torch.device(DEV)
    model, _ = load_model(str(tmp_path), dtype=torch.float32, device=dev)
    init_kv_scales(model, dev)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=16, dtype=F8)
    kv = layout.allocate(32, dev)
    for c in kv:
        c.copy_((torch.randn(c.shape, generator=torch.Generator().manual_seed(5))).to(F8)
                .to(dev))
    runner = ModelRunner(model, layout, kv)
    runner.decode_span_mode = span_mode
    monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice("triton"))
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0)

    def req(rid: str, table: tuple[int, ...], start: int, n: int) -> ScheduledRequest:
        return ScheduledRequest(rid, table, [QueryRange(start, [rng.randrange(128)
                                                               for _ in range(n)])],
                                True, greedy, 0)

    sched = SchedulerOutput(requests=[req("d1", (3, 4, 5, 6), 60, 1),
                                      req("p", (10, 11, 12, 13, 14), 30, 40),
                                      req("d2", (20, 21), 17, 1)])
    assert runner.prepare_inputs(sched).attn.fp8_scratch is None  # 40 x 2 rows: too few
    monkeypatch.setattr(fs, "SCRATCH_MIN_ROWS", 0)
    inp = runner.prepare_inputs(sched)
    plan = inp.attn.fp8_scratch
    assert plan is not None
    if span_mode == "1":
        assert inp.attn.decode is not None and inp.attn.decode.fp8_scratch is None
        assert plan.src_blocks.tolist() == [10, 11, 12, 13, 14]  # request p's 70 positions
        assert plan.block_tables.tolist() == [[0, 1, 2, 3, 4]]
        assert plan.range_table.tolist() == [0]
    else:  # the decodes' 61 and 18 positions too
        assert inp.attn.decode is None
        assert plan.src_blocks.tolist() == [3, 4, 5, 6, 10, 11, 12, 13, 14, 20, 21]
        assert plan.block_tables.tolist() == [[0, 1, 2, 3, 0], [4, 5, 6, 7, 8],
                                              [9, 10, 0, 0, 0]]
        assert plan.range_table.tolist() == [0, 1, 2]
    saved = [c.clone() for c in kv]
    got = model(inp.input_ids, inp.positions, kv, inp.attn)
    for c, s in zip(kv, saved):
        c.copy_(s)
    inp.attn.fp8_scratch = None
    want = model(inp.input_ids, inp.positions, kv, inp.attn)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: bf16 queries take the "
                    "tensor-core path only on the GPU")
@pytest.mark.parametrize("lens", [[(0, 0, 130)], [(1, 60, 120), (2, 150, 1), (0, 30, 64)]])
def test_scratch_bf16_queries_on_gpu(lens: list[tuple[int, int, int]]) -> None:
    """bf16 queries over a bf16 scratch (the GPU's 128-row prefill tiles) against the
    reference, at the FP8 GPU test's tolerance, and against the direct FP8 kernel."""
    kc, vc = _fp8_cache(5)
    qsl, rsp, rt, starts, qlens, rows = _launch(lens)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(int(qsl[-1]), H, D, generator=g).to(DEV, torch.bfloat16)
    ks, vs = KS.to(DEV), VS.to(DEV)
    plan = fs.plan_fp8_scratch(starts, qlens, rows, TABLES, C, H, HKV, D, 2,
                               torch.device(DEV), min_rows=0)
    assert plan is not None
    bt = torch.from_numpy(TABLES).to(DEV)
    mq = int(qlens.max())
    got = fs.paged_attention_fp8_scratch(q, kc, vc, plan, qsl, rsp, D**-0.5, mq,
                                         k_scale=ks, v_scale=vs)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    direct = paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, max_query_len=mq,
                                    k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), direct.float(), atol=2e-2, rtol=2e-2)
