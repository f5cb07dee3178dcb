"""FP8 (e4m3) KV cache: the store and attention kernels against their references, the
references against full precision, and the bytes per chunk."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pensieve import LLM, SamplingParams
from pensieve.engine.kv_layout import KVLayout
from pensieve.kernels.launch import paged_attention_triton, store_kv_triton
from pensieve.kernels.reference import paged_attention_ref, store_kv_ref

F8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
"""The kernels run on the GPU where there is one, else in Triton's interpreter."""
H, HKV, D, C, NB = 4, 2, 32, 16, 8
KS = torch.tensor([0.5, 2.0])
VS = torch.tensor([1.0, 0.25])


def _filled(t: int, device: str = DEV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor]:
    """An FP8 cache holding ``t`` random tokens (stored by the reference) and the same in
    float32."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(t, HKV, D, generator=g) * 3
    v = torch.randn(t, HKV, D, generator=g)
    kc, vc = (torch.zeros(NB, C, HKV, D, dtype=F8) for _ in range(2))
    kf, vf = (torch.zeros(NB, C, HKV, D) for _ in range(2))
    slots = torch.randperm(NB * C, generator=g)[:t]
    store_kv_ref(k, v, kc, vc, slots, KS, VS)
    store_kv_ref(k, v, kf, vf, slots)
    # a block table in the order the slots were given, so positions follow the tokens
    return tuple(x.to(device) for x in (kc, vc, kf, vf))  # type: ignore[return-value]


def test_store_ref_scales_and_saturates() -> None:
    kc, vc = (torch.zeros(1, C, HKV, D, dtype=F8) for _ in range(2))
    k = torch.full((1, HKV, D), 1000.0)
    v = torch.full((1, HKV, D), 0.75)
    store_kv_ref(k, v, kc, vc, torch.tensor([3]), KS, VS)
    assert kc[0, 3].float().unique().tolist() == [448.0]  # 1000 / 0.5 saturates
    assert vc[0, 3, 0].float().unique().tolist() == [0.75]  # scale 1: exact
    assert vc[0, 3, 1].float().unique().tolist() == [3.0]  # 0.75 / 0.25
    assert kc[0, 2].float().abs().sum() == 0  # other slots untouched


def test_fp8_bytes_per_chunk_are_half_of_bf16() -> None:
    # llama3.1-8b: 32 layers, 8 KV heads, head_dim 128
    bf16 = KVLayout(32, 8, 128, 32, torch.bfloat16)
    f8 = KVLayout(32, 8, 128, 32, F8)
    assert bf16.block_bytes == 4 * 2**20 and f8.block_bytes * 2 == bf16.block_bytes
    assert f8.fp8 and not bf16.fp8


def _ranges(lens: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """(query_start_loc, range_start_pos, range_table) of ranges ``(start_pos, query_len)``,
    all over block-table row 0."""
    qsl = [0]
    for _, n in lens:
        qsl.append(qsl[-1] + n)
    i32 = torch.int32
    return (torch.tensor(qsl, dtype=i32, device=DEV),
            torch.tensor([s for s, _ in lens], dtype=i32, device=DEV),
            torch.zeros(len(lens), dtype=i32, device=DEV))


@pytest.mark.parametrize("lens,splits,long", [
    ([(0, 40)], None, False),  # a prefill
    ([(30, 10), (5, 3)], None, False),  # continuations over cached history
    ([(90, 1), (12, 1), (60, 1)], 4, False),  # split-KV decode
    ([(90, 1), (12, 1), (127, 1)], 128, True),  # long-context tiles, 128 splits
])
def test_triton_attention_reads_fp8(lens: list[tuple[int, int]], splits: int | None,
                                    long: bool) -> None:
    """The kernel (Triton's interpreter here) over an FP8 cache equals the reference with the
    same scales; the reference is close to float32 attention over the unquantized KV."""
    kc, vc, kf, vf = _filled(NB * C)
    qsl, rsp, rt = _ranges(lens)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(int(qsl[-1]), H, D, generator=g).to(DEV)
    bt = torch.arange(NB, dtype=torch.int32, device=DEV)[None]
    mq = max(n for _, n in lens)
    ks, vs = KS.to(DEV), VS.to(DEV)
    got = paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, max_query_len=mq,
                                 num_kv_splits=splits, k_scale=ks, v_scale=vs,
                                 long_context=long)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, k_scale=ks, v_scale=vs)
    # float32 queries: the kernel's dots are exact float32 ("ieee") on both devices
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    exact = paged_attention_ref(q, kf, vf, bt, qsl, rsp, rt, D**-0.5)
    assert ((ref - exact).norm() / exact.norm()) < 0.2  # e4m3: 3 mantissa bits
    # without the scales the same bytes mean something else: the scales are applied
    wrong = paged_attention_ref(q, kc, vc, bt, qsl, rsp, rt, D**-0.5)
    assert (wrong - ref).abs().max() > 0.1


def test_launcher_checks_scales() -> None:
    kc, vc, kf, _ = _filled(4)
    qsl, rsp, rt = _ranges([(0, 4)])
    q = torch.zeros(4, H, D, device=DEV)
    bt = torch.zeros(1, NB, dtype=torch.int32, device=DEV)
    ks, vs = KS.to(DEV), VS.to(DEV)
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, 1.0, max_query_len=4)
    with pytest.raises(ValueError, match="v_scale must be"):
        paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, 1.0, max_query_len=4,
                               k_scale=ks, v_scale=torch.ones(3, device=DEV))
    with pytest.raises(ValueError, match="for an FP8 cache"):
        paged_attention_triton(q, kf, kf, bt, qsl, rsp, rt, 1.0, max_query_len=4,
                               k_scale=ks, v_scale=vs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: Triton's interpreter "
                    "casts to float8 by truncation, the GPU rounds to nearest as torch does")
def test_triton_store_fp8_equals_reference_on_gpu() -> None:
    g = torch.Generator().manual_seed(2)
    k = (torch.randn(100, HKV, D, generator=g) * 50).cuda().bfloat16()
    v = torch.randn(100, HKV, D, generator=g).cuda().bfloat16()
    slots = torch.randperm(NB * C, generator=g)[:100].cuda()
    got = [torch.zeros(NB, C, HKV, D, dtype=F8, device="cuda") for _ in range(2)]
    want = [torch.zeros(NB, C, HKV, D, dtype=F8, device="cuda") for _ in range(2)]
    store_kv_triton(k, v, *got, slots, KS.cuda(), VS.cuda())
    store_kv_ref(k, v, *want, slots, KS.cuda(), VS.cuda())
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: bf16 queries take the "
                    "tensor-core path (fp16 over an FP8 cache) only on the GPU")
@pytest.mark.parametrize("lens,splits,long", [([(0, 100)], None, False),
                                             ([(90, 1), (12, 1)], 4, False),
                                             ([(90, 1), (127, 1)], 128, True)])
def test_triton_attention_fp8_bf16_queries_on_gpu(lens: list[tuple[int, int]],
                                                  splits: int | None, long: bool) -> None:
    kc, vc, _, _ = _filled(NB * C)
    qsl, rsp, rt = _ranges(lens)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(int(qsl[-1]), H, D, generator=g).to(DEV, torch.bfloat16)
    bt = torch.arange(NB, dtype=torch.int32, device=DEV)[None]
    ks, vs = KS.to(DEV), VS.to(DEV)
    got = paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, D**-0.5,
                                 max_query_len=max(n for _, n in lens), num_kv_splits=splits,
                                 k_scale=ks, v_scale=vs, long_context=long)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _with_tensors(src: str, dst: Path, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint directory ``src`` whose safetensors file also holds ``extra``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    save_file({**load_file(f), **extra}, f, metadata={"format": "pt"})
    return str(dst)


def _scales(llm: LLM) -> dict[int, torch.Tensor]:
    from pensieve.layers.attention import PagedAttention

    return {m.layer_idx: m.kv_scale for m in llm.engine.model.modules()
            if isinstance(m, PagedAttention)}


def test_checkpoint_kv_scales_reach_the_fp8_cache(tiny_llama, tmp_path: Path) -> None:  # noqa: ANN001
    """A checkpoint's calibrated scales (vLLM's names: a scalar, or one per KV head) become
    the FP8 cache's per layer and head, a missing one is 1; a 16/32-bit cache ignores them
    and its tokens are those of the checkpoint without them; a scale <= 0 is refused."""
    path, _ = tiny_llama
    extra = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
             "model.layers.0.self_attn.v_scale": torch.tensor([2.0, 4.0]),
             "model.layers.1.self_attn.k_scale": torch.tensor([0.25])}
    scaled = _with_tensors(path, tmp_path / "scaled", extra)
    kw = dict(dtype="float32", device="cpu", num_gpu_blocks=64, num_cpu_blocks=0,
              max_num_batched_tokens=64, max_model_len=256)
    fp8 = LLM(model=scaled, kv_cache_dtype="fp8_e4m3", **kw)
    got = _scales(fp8)
    assert torch.equal(got[0].cpu(), torch.tensor([[0.5, 0.5], [2.0, 4.0]]))
    assert torch.equal(got[1].cpu(), torch.tensor([[0.25, 0.25], [1.0, 1.0]]))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [[5, 9, 14, 200, 3, 77, 31]]
    assert len(fp8.generate(prompt, params, use_tqdm=False)[0].output_token_ids) == 8
    plain = LLM(model=path, **kw).generate(prompt, params, use_tqdm=False)
    ignored = LLM(model=scaled, **kw)
    assert all(s is None for s in _scales(ignored).values())
    again = ignored.generate(prompt, params, use_tqdm=False)
    assert again[0].output_token_ids == plain[0].output_token_ids
    bad = _with_tensors(path, tmp_path / "bad", {"model.layers.0.self_attn.v_scale":
                                                 torch.tensor(-1.0)})
    with pytest.raises(ValueError, match="v_scale must be finite and > 0"):
        LLM(model=bad, kv_cache_dtype="fp8_e4m3", **kw)
