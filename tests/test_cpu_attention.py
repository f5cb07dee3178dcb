"""The CPU path's attention (:mod:`pensieve.kernels.cpu_attention`) against the float32 oracle.

Every case reads a paged cache whose unused slots and unreferenced blocks hold NaN, so a read
outside a range's context shows in the output; the output is poisoned with NaN first, so a
row left unwritten shows too.
"""

import math

import pytest
import torch

import pensieve.kernels as kernels
from pensieve.kernels import cpu_attention
from pensieve.kernels.cpu_attention import paged_attention_cpu
from pensieve.kernels.reference import paged_attention_ref, read_kv


def _batch(ranges: list[tuple[int, int, int]], *, heads: int, kv_heads: int, head_dim: int = 16,
           chunk: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0,
           consecutive: bool = False) -> tuple:
    """Arguments of the attention call for ranges ``(start_pos, query_len, table_row)``;
    ``consecutive``: each row's blocks have consecutive ids (else shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    rows = 1 + max(t for _, _, t in ranges)
    ctx = [max((s + n for s, n, t in ranges if t == row), default=0) for row in range(rows)]
    need = [math.ceil(c / chunk) for c in ctx]
    num_blocks = sum(need) + 3
    shape = (num_blocks, chunk, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    ids = torch.arange(num_blocks) if consecutive else torch.randperm(num_blocks, generator=gen)
    table = torch.full((rows, max(need) + 2), int(ids[-1]), dtype=torch.int32)  # NaN padding
    used = 0
    for row, (c, n) in enumerate(zip(ctx, need, strict=True)):
        blocks = ids[used:used + n]
        used += n
        table[row, :n] = blocks
        flat_k = k_cache[blocks].reshape(-1, kv_heads, head_dim)
        flat_v = v_cache[blocks].reshape(-1, kv_heads, head_dim)
        flat_k[:c] = torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype)
        flat_v[:c] = torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype)
        k_cache[blocks] = flat_k.reshape(n, chunk, kv_heads, head_dim)
        v_cache[blocks] = flat_v.reshape(n, chunk, kv_heads, head_dim)
    qsl = [0]
    for _, n, _ in ranges:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, head_dim, generator=gen).to(dtype)
    return (q, k_cache, v_cache, table, torch.tensor(qsl, dtype=torch.int32),
            torch.tensor([s for s, _, _ in ranges], dtype=torch.int32),
            torch.tensor([t for _, _, t in ranges], dtype=torch.int32), head_dim**-0.5)


CASES = {
    "prefill": [(0, 13, 0)],
    "decode": [(20, 1, 0), (0, 1, 1), (6, 1, 2)],
    "continuation": [(9, 7, 0)],
    "one_token_prefix": [(1, 5, 0)],
    "mixed": [(11, 1, 0), (0, 9, 1), (17, 6, 2), (3, 1, 3)],
    "shared_table": [(0, 5, 0), (5, 4, 0)],
    "empty_range": [(4, 3, 0), (2, 0, 1), (0, 2, 1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("consecutive", [False, True])
def test_matches_the_float32_oracle(case: str, heads: int, kv_heads: int,
                                    consecutive: bool) -> None:
    args = _batch(CASES[case], heads=heads, kv_heads=kv_heads, consecutive=consecutive)
    got = paged_attention_cpu(*args, out=torch.full_like(args[0], float("nan")))
    want = paged_attention_ref(*args)
    assert not torch.isnan(got).any(), "a row unwritten or a read outside the context"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_long_prefix_with_a_chunk_of_queries() -> None:
    """The shape of a chunked prefill: a chunk of queries over a long cached prefix."""
    args = _batch([(200, 37, 0), (150, 1, 1)], heads=9, kv_heads=3, head_dim=64, chunk=32)
    torch.testing.assert_close(paged_attention_cpu(*args), paged_attention_ref(*args),
                               rtol=1e-5, atol=2e-6)


def test_read_kv_views_consecutive_blocks() -> None:
    """Consecutive block ids are read as a view of the cache; others are gathered."""
    k_cache, v_cache = torch.randn(8, 4, 2, 3), torch.randn(8, 4, 2, 3)
    k, v = read_kv(k_cache, v_cache, torch.tensor([3, 4, 5, 0]), 10, torch.float32)
    assert k.data_ptr() == k_cache[3].data_ptr() and v.data_ptr() == v_cache[3].data_ptr()
    torch.testing.assert_close(k, k_cache[3:6].reshape(-1, 2, 3)[:10], rtol=0, atol=0)
    k, v = read_kv(k_cache, v_cache, torch.tensor([5, 3, 4]), 9, torch.float32)
    want = torch.cat([k_cache[5], k_cache[3], k_cache[4]])[:9]
    torch.testing.assert_close(k, want, rtol=0, atol=0)
    assert k.shape == v.shape == (9, 2, 3)


def test_masked_fallback_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the CPU flash op a range with a prefix attends through a mask, same result."""
    monkeypatch.setattr(cpu_attention, "_FLASH_CPU", None)
    args = _batch(CASES["mixed"], heads=6, kv_heads=2)
    torch.testing.assert_close(paged_attention_cpu(*args), paged_attention_ref(*args),
                               rtol=1e-5, atol=2e-6)


def test_bfloat16_close_to_the_oracle() -> None:
    args = _batch(CASES["mixed"], heads=6, kv_heads=2, dtype=torch.bfloat16)
    got = paged_attention_cpu(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), paged_attention_ref(*args).float(), rtol=2e-2,
                               atol=2e-2)


def test_dispatch_picks_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` and ``sdpa`` run the fused path on the CPU, ``reference`` the oracle."""
    args = _batch(CASES["continuation"], heads=4, kv_heads=2)
    calls: list[str] = []
    monkeypatch.setattr(kernels, "paged_attention_cpu",
                        lambda *a, **k: calls.append("sdpa") or paged_attention_cpu(*a, **k))
    monkeypatch.setattr(kernels, "paged_attention_ref",
                        lambda *a, **k: calls.append("ref") or paged_attention_ref(*a, **k))
    for choice in ("auto", "sdpa", "reference"):
        monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice(choice))
        kernels.paged_attention(*args, max_query_len=7)
    assert calls == ["sdpa", "sdpa", "ref"]
    with pytest.raises(ValueError, match="kernel choice must be"):
        kernels.KernelChoice("fast")
