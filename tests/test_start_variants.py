"""Start-up cost counted, not timed: the Triton kernel variants the server's warm-up compiles
(``ModelRunner._compile_attention``), counted on the CPU with
:func:`pensieve.kernels.variants.recording`, for the llama3.1-8b shape as a GPU would pick its
tiles; and that the warm-up still covers what serving launches, so nothing it left out is
compiled in the middle of a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pensieve.kernels import launch
from pensieve.kernels.fp8_scratch import compile_fp8_scratch
from pensieve.kernels.launch import compile_attention_kernels, paged_attention_triton
from pensieve.kernels.launch_policy import decode_kv_splits, decode_split_span, is_long_decode
from pensieve.kernels.variants import recording, variant_key

CPU, BF16, FP8 = torch.device("cpu"), torch.bfloat16, torch.float8_e4m3fn
H, HKV, D, CHUNK = 32, 8, 128, 32  # llama3.1-8b


def _warmup(kv: str, is_cuda: bool | None = True) -> tuple[int, object]:
    """The runner's warm-up for a bf16 or FP8 cache (as ``_compile_attention``), dry."""
    with recording(launch=False) as log:
        if kv == "bf16":
            n = compile_attention_kernels(H, HKV, D, CHUNK, BF16, CPU, is_cuda=is_cuda)
        else:
            n = compile_attention_kernels(H, HKV, D, CHUNK, BF16, CPU, kv_dtype=FP8,
                                          is_cuda=is_cuda)
            n += compile_fp8_scratch(HKV, D, CHUNK, BF16, CPU)
            n += compile_attention_kernels(H, HKV, D, CHUNK, BF16, CPU, is_cuda=is_cuda,
                                           spans=False)
    return n, log


def test_warmup_variant_counts() -> None:
    """bf16: 14 attention variants and 5 split combiners (before: every tile choice thrice,
    24 + 6 = 30); FP8 KV: 26 + 5 + the dequantization kernel (before: 48 + 6 + 1 = 55)."""
    n, log = _warmup("bf16")
    assert n == 14 and log.count() == 19
    assert log.by_kernel() == {"_combine_splits_kernel": 5, "_paged_attention_kernel": 14}
    n, log = _warmup("fp8")
    assert n == 27 and log.count() == 32
    assert log.by_kernel() == {"_combine_splits_kernel": 5, "_dequant_blocks_kernel": 1,
                               "_paged_attention_kernel": 26}
    # what the warm-up compiled before: every tile choice, unsplit, split and split by span
    every = launch.attention_tile_choices(D, True)
    assert len(every) == 8 and 3 * len(every) == 24


def test_variant_key_follows_specialization() -> None:
    """Keys differ where Triton's would: a constexpr, an option, an integer's divisibility;
    not where the kernel declines to specialize (``num_splits``)."""
    from pensieve.kernels import triton_attention as k

    kern = k._combine_splits_kernel
    out = torch.zeros(4, H, D, dtype=BF16)
    ws = (torch.zeros(4, H, 2, D), torch.zeros(4, H, 2), torch.zeros(4, H, 2))
    i32 = torch.zeros(2, dtype=torch.int32)

    def key(num_heads: int, splits: int, block_n: int) -> tuple:
        return variant_key(kern, "c", (out, *ws, i32, i32, i32, out.stride(0), out.stride(1),
                                       num_heads, splits),
                           {"HEAD_DIM": D, "BLOCK_S": 128, "BLOCK_N": block_n, "SPAN": False,
                            "num_warps": 4})
    assert key(32, 2, 32) == key(32, 64, 32)  # num_splits: do_not_specialize
    assert key(32, 2, 32) != key(32, 2, 64)  # a constexpr
    assert key(32, 2, 32) != key(17, 2, 32)  # 32 divisible by 16, 17 not


def _launch(q_lens: list[int], starts: list[int], long: bool, span: bool) -> None:
    """One eager attention launch as the runner makes it for these ranges (CPU tiles)."""
    n = sum(q_lens)
    blocks = (max(starts) + max(q_lens)) // CHUNK + 1
    q = torch.zeros(n, H, D, dtype=BF16)
    cache = torch.zeros(blocks + 1, CHUNK, HKV, D, dtype=BF16)
    tables = torch.arange(blocks, dtype=torch.int32).repeat(len(q_lens), 1)
    qsl = torch.tensor(np.concatenate(([0], np.cumsum(q_lens))), dtype=torch.int32)
    pos = torch.tensor(starts, dtype=torch.int32)
    rt = torch.arange(len(q_lens), dtype=torch.int32)
    kw: dict = {"long_context": long}
    if span:
        lens = [s + 1 for s in starts]
        kw["num_kv_splits"] = decode_kv_splits(len(lens), HKV, CPU, long)
        kw["kv_split_span"] = torch.tensor([decode_split_span(lens, HKV, CPU)],
                                           dtype=torch.int32)
    paged_attention_triton(q, cache, cache, tables, qsl, pos, rt, D**-0.5, max(q_lens), **kw)


@pytest.mark.parametrize("q_lens,starts,span", [
    ([1] * 8, [40_000 + 97 * i for i in range(8)], False),   # long decodes, auto splits
    ([1] * 8, [40_000 + 97 * i for i in range(8)], True),    # long and ragged: by span
    ([1] * 32, [2_000 + 33 * i for i in range(32)], True),   # short decodes by span
    ([1] * 3, [700, 900, 5_000], False),
    ([512], [10_000], False),                                # a prefill chunk
    ([2048, 1, 1], [30_000, 3_000, 7_000], False),           # prefill with decodes
    ([12, 1], [100, 6_000], False),                          # a short prefill
    ([8160], [0], False),
])
def test_warmup_covers_serving_launches(q_lens: list[int], starts: list[int],
                                        span: bool) -> None:
    """Every variant an eager step launches was compiled by the warm-up (CPU tiles here, as
    the interpreter's launcher picks them; the GPU's follow the same plan)."""
    _, warm = _warmup("bf16", is_cuda=None)
    long = q_lens == [1] * len(q_lens) and is_long_decode([s + 1 for s in starts])
    with recording(launch=False) as log:
        _launch(q_lens, starts, long, span)
    assert log.launches > 0
    assert log.keys <= warm.keys, sorted(log.keys - warm.keys)
