"""FP8 prefill attention with e4m3 operands in both products (``fp8_dot``: Hopper's wgmma
takes FP8 inputs), under Triton's interpreter against the pure-torch reference over the same
FP8 cache: e4m3 queries and probabilities add an error of the order of e4m3's rounding, no
more; the scales still apply; and only an FP8 cache takes it."""

from __future__ import annotations

import pytest
import torch

from pensieve.kernels.launch import _fp8_queries, paged_attention_triton
from pensieve.kernels.reference import paged_attention_ref, store_kv_ref

F8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, C, NB = 4, 2, 32, 16, 8
KS = torch.tensor([0.5, 2.0])
VS = torch.tensor([1.0, 0.25])


def _cache() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(NB * C, HKV, D, generator=g) * 3
    v = torch.randn(NB * C, HKV, D, generator=g)
    kc, vc = (torch.zeros(NB, C, HKV, D, dtype=F8) for _ in range(2))
    store_kv_ref(k, v, kc, vc, torch.arange(NB * C), KS, VS)
    return kc.to(DEV), vc.to(DEV)


def _ranges(lens: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    qsl = [0]
    for _, n in lens:
        qsl.append(qsl[-1] + n)
    i32 = torch.int32
    return (torch.tensor(qsl, dtype=i32, device=DEV),
            torch.tensor([s for s, _ in lens], dtype=i32, device=DEV),
            torch.zeros(len(lens), dtype=i32, device=DEV))


@pytest.mark.parametrize("lens,splits", [
    ([(0, 48)], None),              # a prefill from position 0
    ([(70, 40), (5, 9)], None),     # continuations over cached history
    ([(64, 32)], 2),                # split KV
    ([(100, 20), (90, 1)], None),   # a prefill with a decode
])
def test_fp8_dot_matches_the_reference(lens: list[tuple[int, int]], splits: int | None) -> None:
    kc, vc = _cache()
    qsl, rsp, rt = _ranges(lens)
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(int(qsl[-1]), H, D, generator=g) * 2).to(torch.bfloat16).to(DEV)
    bt = torch.arange(NB, dtype=torch.int32, device=DEV)[None]
    mq = max(n for _, n in lens)
    ks, vs = KS.to(DEV), VS.to(DEV)
    got = paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, max_query_len=mq,
                                 num_kv_splits=splits, k_scale=ks, v_scale=vs, fp8_dot=True)
    ref = paged_attention_ref(q.float(), kc, vc, bt, qsl, rsp, rt, D**-0.5, k_scale=ks,
                              v_scale=vs)
    # the reference over the very e4m3 queries the kernel multiplies (row scales applied):
    # what is left is the probabilities' e4m3 rounding, and the kernel's fp32 sums
    q8, qs = _fp8_queries(q, F8)
    ref8 = paged_attention_ref(q8.float() * qs[..., None], kc, vc, bt, qsl, rsp, rt, D**-0.5,
                               k_scale=ks, v_scale=vs)
    err8 = ((got.float() - ref8).norm() / ref8.norm()).item()
    assert err8 < 0.04, err8  # e4m3 probabilities (x P_SCALE): ~2%
    # against full-precision queries: e4m3's rounding of the queries (3 mantissa bits) over
    # this test's peaked scores (K up to ~20 over the scales), a few percent
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < 0.1, err
    # the 16-bit path on the same cache is closer: the e4m3 products are what differs
    upcast = paged_attention_triton(q, kc, vc, bt, qsl, rsp, rt, D**-0.5, max_query_len=mq,
                                    num_kv_splits=splits, k_scale=ks, v_scale=vs)
    assert ((upcast.float() - ref).norm() / ref.norm()).item() <= err
    # without the K scale folded in, the scores (and so the output) would be other ones
    plain = paged_attention_ref(q.float(), kc, vc, bt, qsl, rsp, rt, D**-0.5,
                                k_scale=torch.ones_like(ks), v_scale=vs)
    assert ((plain - ref).norm() / ref.norm()).item() > 3 * err


def test_fp8_dot_needs_an_fp8_cache() -> None:
    q = torch.zeros(1, H, D, device=DEV)
    cache = torch.zeros(1, C, HKV, D, device=DEV)
    z = torch.zeros(1, dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="fp8_dot is for an FP8 cache"):
        paged_attention_triton(q, cache, cache, z.view(1, 1), qsl, z, z, 0.1, max_query_len=1,
                               fp8_dot=True)
