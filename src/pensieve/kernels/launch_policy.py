"""Launch choices the runner makes per step, apart from the kernels (no Triton import: the
runner imports this on any device, and Triton's interpreter must be set up before the kernels
are imported).

Decode KV splits by span. A decode step of ragged contexts (ShareGPT near saturation: a few
requests far longer than the batch's mean; docs/performance.md, "Decode over ragged contexts:
KV splits by span") has enough programs to fill the GPU unsplit, and unsplit the longest
request's programs run alone long after the rest. With
a span, every range is cut into pieces of at least ``span`` positions (the kernel covers a range
with ``max(equal part, span)``-position splits), ``span`` near the batch's mean, and each range
uses only the splits its length needs: the longest one ends about with the others.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

MAX_SPLITS = 32
"""Most KV splits of one range in the static-grid mode (a work item keeps its split in 5 bits)
and of a decode step whose contexts are short (:func:`decode_kv_splits`)."""
DECODE_MAX_SPLITS = 128
"""Most KV splits of one range of a long decode step (:func:`is_long_decode`): one 32k
request's KV of one layer (8 KV heads x 32k x 128 x 2 x 2 B = 134 MB) is ~31 us at ~4.3 TB/s,
and its 8 programs need 64-128 splits each to give an H200's 132 SMs a few programs each."""
LONG_DECODE_KV = 8192
"""A decode step is *long* when its longest context reaches this many positions: its KV tiles
are 128 positions (``launch._attention_tiles``) and its ranges may split up to
:data:`DECODE_MAX_SPLITS` ways (:func:`auto_kv_splits`: one program per SM). The H200 sweep
(docs/long_context.md) measured 32-position tiles best at 8k contexts and 128-position tiles
best at 32k and beyond."""
LONG_DECODE_MIN_SPLITS = 4
"""Fewest KV splits of a long decode step's grid that does not fill the GPU
(:func:`auto_kv_splits`)."""
DECODE_MIN_SPLITS = 8
"""Decode steps with a span get at least this many splits of grid
(:func:`decode_kv_splits`): a range up to 8x the span still ends with the others."""
SPAN_ALIGN = 256
"""Split spans are multiples of this (a multiple of every ``BLOCK_N`` the tiles pick)."""


RAGGED_RATIO = 2.0
"""A decode step is ragged when its longest context exceeds this many times the mean."""


DECODE_SPAN_MODE = "auto"
"""When the runner splits a decode step's KV by span: ``auto``, the decode steps that are
ragged (:func:`decode_is_ragged`). The runner's components also take ``1`` (every decode
step) and ``0`` (none: the launcher's equal splits), which tests compare against it. Chosen
by measurement: the span speeds up ragged decode steps and costs uniform ones
(docs/performance.md, "Decode over ragged contexts: KV splits by span")."""

MIXED_DECODES = "split"
"""How a step with prefill tokens attends for its one-token ranges (its decodes): where the
decodes are ragged (:func:`use_split_span`), in a decode launch of their own, KV split by
span, before the launch of the other ranges; where they are not, in the same launch as the
other ranges, unsplit (``together``, which the runner's components also take). Chosen by
measurement through the mixed-step CUDA graphs and serving ShareGPT on the H200
(docs/performance.md, "Steps with prefill over ragged decodes")."""


def decode_is_ragged(kv_lens: Sequence[int]) -> bool:
    """Whether the longest context exceeds :data:`RAGGED_RATIO` times the mean."""
    return bool(kv_lens) and max(kv_lens) * len(kv_lens) > RAGGED_RATIO * sum(kv_lens)


def use_split_span(kv_lens: Sequence[int], mode: str) -> bool:
    """Whether this decode step's attention splits KV by span under ``mode``
    (:data:`DECODE_SPAN_MODE`)."""
    return mode == "1" or (mode == "auto" and decode_is_ragged(kv_lens))


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (Triton's interpreter: small,
    so that tests cover the split paths)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def is_long_decode(kv_lens: Sequence[int]) -> bool:
    """Whether a decode step's longest context reaches :data:`LONG_DECODE_KV`."""
    return bool(kv_lens) and max(kv_lens) >= LONG_DECODE_KV


def max_decode_splits(long_context: bool) -> int:
    """The most KV splits of one range of a decode step: :data:`DECODE_MAX_SPLITS` when it is
    long (:func:`is_long_decode`), else :data:`MAX_SPLITS`."""
    return DECODE_MAX_SPLITS if long_context else MAX_SPLITS


def decode_kv_splits(batch: int, num_kv_heads: int, device: torch.device,
                     long_context: bool = False) -> int:
    """The KV split count (grid) of a decode step of ``batch`` requests with a span: enough
    programs to fill the GPU (4 per SM) for small batches, and at least
    :data:`DECODE_MIN_SPLITS`, at most :func:`max_decode_splits`. Depends only on the batch
    and the step's length class, so a CUDA graph captured for a batch bucket and class stays
    right for any contexts of that class (the span, set per step, keeps short ranges from
    using more splits than their length needs)."""
    target = 4 * num_sms(device)
    programs = max(1, batch * num_kv_heads)
    fill = 1 if programs >= target else _next_pow2(-(-target // programs))
    return min(max_decode_splits(long_context), max(DECODE_MIN_SPLITS, fill))


def mixed_kv_splits(tokens: int, group: int, block_m: int, num_kv_heads: int,
                    device: torch.device) -> int:
    """The KV split count (grid) of a static-grid launch of up to ``tokens`` query tokens
    (a mixed-step graph's bucket): enough programs to fill the GPU (4 per SM) if every
    ``block_m``-row tile were one work item, at most :data:`MAX_SPLITS`. Depends only on the
    bucket, so the captured grid stays right for any ranges."""
    programs = max(1, -(-tokens * group // block_m)) * num_kv_heads
    target = 4 * num_sms(device)
    return 1 if programs >= target else min(MAX_SPLITS, _next_pow2(-(-target // programs)))


def mixed_split_span(qlens: np.ndarray, starts: np.ndarray, group: int, block_m: int,
                     num_kv_heads: int, device: torch.device) -> int:
    """The fewest KV positions a split of a static-grid launch covers, per step: the KV
    positions its tiles read (each tile up to its range's end), spread over 4 programs per
    SM, never below :data:`SPAN_ALIGN`, rounded up to a multiple of it. A step of short
    ranges thus keeps one split a tile; a few tokens after a long history get many."""
    tiles = (np.asarray(qlens, dtype=np.int64) * group + block_m - 1) // block_m
    work = int((tiles * (np.asarray(starts, dtype=np.int64) + qlens)).sum()) * num_kv_heads
    span = max(SPAN_ALIGN, -(-work // (4 * num_sms(device))))
    return -(-span // SPAN_ALIGN) * SPAN_ALIGN


def mixed_split_items(num_kv_heads: int, device: torch.device) -> int:
    """The most work items the splits of :func:`mixed_split_span` add to a step's unsplit
    ones: a tile of ``kv_len`` positions comes ``cdiv(kv_len, per_split)`` times, and
    ``per_split >= span >= sum(kv_len) * num_kv_heads / (4 * SMs)``, so at most
    ``4 * SMs / num_kv_heads`` more in all."""
    return 4 * num_sms(device) // num_kv_heads


def decode_split_span(kv_lens: Sequence[int], num_kv_heads: int, device: torch.device) -> int:
    """The fewest KV positions a split of a decode step covers: the batch's mean length (no
    program has much more KV than an average request), less where the batch has too few
    programs to fill the GPU (4 per SM), never below :data:`SPAN_ALIGN`, rounded up to a
    multiple of it."""
    n = len(kv_lens)
    if n == 0:
        return SPAN_ALIGN
    total = int(sum(kv_lens))
    fill = total * num_kv_heads // (4 * num_sms(device))
    span = max(SPAN_ALIGN, min(total // n, fill))
    return -(-span // SPAN_ALIGN) * SPAN_ALIGN


WORKSPACE_BYTES = 256 << 20
"""Most bytes of a launch's split-KV workspaces (:func:`auto_kv_splits` splits less beyond)."""


@functools.cache
def auto_kv_splits(programs: int, num_tokens: int, num_heads: int, head_dim: int,
                   device: torch.device, long_context: bool = False) -> int:
    """The launcher's KV splits of a grid of ``programs``: unsplit when the grid has four
    programs per SM or more; else, for a short step, enough splits for four programs per SM,
    at most :data:`MAX_SPLITS`; for a long one (:func:`is_long_decode`), enough for one
    program per SM, at least :data:`LONG_DECODE_MIN_SPLITS`, at most
    :data:`DECODE_MAX_SPLITS`.

    Chosen by measurement. Short steps (docs/performance.md, "KV splits for decode"): a decode
    grid of fewer programs split its KV faster, larger ones ran best unsplit. Long steps
    (``python benchmarks/long_attention.py --sweep`` on the H200, 32k-128k, 8 KV heads,
    docs/results/long_context/long_attention.json): every split of a long context still
    streams thousands of KV positions, so one wave of programs has no tail to hide, and more
    splits only add partial outputs to combine. The fastest split count was 32 for one
    request (8 programs; 132 SMs / 8 -> 32) at every context and KV dtype, where four programs
    per SM gave 128 and ran 1.33-1.92x SDPA against the sweep's best 1.05-1.65x; 4 for 8
    requests at 128k (and at 64k in bf16), 4 for 32 requests in FP8 at every context (bf16:
    8-16 best, 4 within 1-9% of it in long_attention_rule.json). Where no split count in the sweep
    won for every cell (8 requests at 32k: 8-16), the rule keeps the one-wave count.

    Splits depend on the batch and length class, not the context length, so a CUDA graph
    captured for a batch bucket and class stays right for any context of that class."""
    sms = num_sms(device)
    if programs >= 4 * sms:
        return 1
    if long_context:
        splits = min(DECODE_MAX_SPLITS,
                     max(LONG_DECODE_MIN_SPLITS, _next_pow2(-(-sms // programs))))
    else:
        splits = min(MAX_SPLITS, _next_pow2(-(-4 * sms // programs)))
    while splits > 1 and num_tokens * num_heads * splits * (head_dim + 2) * 4 > WORKSPACE_BYTES:
        splits //= 2
    return splits


def launch_kv_splits(block_m: int, num_tokens: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, num_ranges: int, max_query_len: int, device: torch.device,
                     long_context: bool = False) -> int:
    """:func:`auto_kv_splits` of an attention launch's grid: ranges x ``block_m``-row tiles
    x KV heads."""
    rows = max_query_len * (num_heads // num_kv_heads)
    programs = num_ranges * -(-rows // block_m) * num_kv_heads
    return auto_kv_splits(programs, num_tokens, num_heads, head_dim, device, long_context)
