"""Triton attention kernels against the pure-torch references.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (small shapes; this
is what CI runs). With CUDA the same small cases run natively on the GPU, and the ``gpu``
cases add real shapes (40 query heads, 10 KV heads, head_dim 128, contexts of thousands).

Every run poisons its output with NaN and checks that every element was written; unused cache
slots and block-table padding point at NaN too, so any read outside a range's context shows.
"""

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

import pensieve.kernels as kernels
from pensieve.kernels import launch, launch_policy
from pensieve.kernels.launch import paged_attention_triton, store_kv_triton
from pensieve.kernels.reference import paged_attention_ref, store_kv_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Fresh, reproducible random inputs per test and parameter set."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    range_start_pos: torch.Tensor
    range_table: torch.Tensor
    max_query_len: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.range_start_pos, self.range_table, self.scale)


def make_batch(
    tables: list[list[tuple[int, int]]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    chunk: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    num_blocks: int | None = None,
    tail_blocks: bool = False,
) -> Batch:
    """A batch of query ranges over a randomly filled paged cache.

    ``tables``: one list per block-table row of ``(start_pos, query_len)`` ranges reading it;
    the row holds positions ``0 .. max(start_pos + query_len) - 1``. Block ids are shuffled
    (``tail_blocks``: drawn from the top of a ``num_blocks`` cache, which then is allocated
    without being touched, as two separate tensors). Unused slots, the padding block and
    table padding hold NaN. Ranges are shuffled so ``range_table`` is not monotonic.
    """
    ctx = [max(s + n for s, n in rs) for rs in tables]
    nblk = [math.ceil(c / chunk) for c in ctx]
    need = sum(nblk) + 1  # + the NaN padding block
    n_total = num_blocks if num_blocks is not None else need + 3
    lo = max(0, n_total - 4 * need) if tail_blocks else 0
    ids = lo + torch.randperm(n_total - lo)[:need]
    pad_block = int(ids[0])
    shape = (n_total, chunk, kv_heads, head_dim)
    if tail_blocks:  # huge: leave it untouched except for the blocks in use
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
        k_cache[ids.to(device)] = float("nan")
        v_cache[ids.to(device)] = float("nan")
    else:  # the engine's layout: views of one [2, N, C, Hkv, D] tensor
        kv = torch.full((2, *shape), float("nan"), dtype=dtype, device=device)
        k_cache, v_cache = kv[0], kv[1]

    max_blocks = max(nblk) + 2
    block_tables = torch.full((len(tables), max_blocks), pad_block, dtype=torch.int32)
    k_flat = k_cache.view(n_total * chunk, kv_heads, head_dim)
    v_flat = v_cache.view(n_total * chunk, kv_heads, head_dim)
    next_id = 1
    for t, (c, nb) in enumerate(zip(ctx, nblk, strict=True)):
        row = ids[next_id:next_id + nb]
        next_id += nb
        block_tables[t, :nb] = row.to(torch.int32)
        pos = torch.arange(c)
        slots = (row[pos // chunk] * chunk + pos % chunk).to(device)
        k_flat[slots] = torch.randn(c, kv_heads, head_dim, device=device).to(dtype)
        v_flat[slots] = torch.randn(c, kv_heads, head_dim, device=device).to(dtype)

    ranges = [(t, s, n) for t, rs in enumerate(tables) for s, n in rs]
    ranges = [ranges[i] for i in torch.randperm(len(ranges)).tolist()]
    qlens = [n for _, _, n in ranges]
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return Batch(
        q=torch.randn(qsl[-1], heads, head_dim, device=device).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        range_start_pos=torch.tensor([s for _, s, _ in ranges], dtype=torch.int32, device=device),
        range_table=torch.tensor([t for t, _, _ in ranges], dtype=torch.int32, device=device),
        max_query_len=max(qlens),
        scale=head_dim**-0.5,
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "output not fully written (NaN poison left) or NaN read"
    out, ref = out.float(), ref.float()
    if dtype == torch.float32:
        err = (out - ref).abs().max().item()
        assert err < 1e-4, f"max abs error {err:.3g}"
    else:
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"relative error {rel:.3g}"


def run_attention(b: Batch, splits: int | None = None) -> None:
    """Kernel (into a NaN-poisoned out) against the float32 reference."""
    out = torch.full_like(b.q, float("nan"))
    ret = paged_attention_triton(*b.args(), max_query_len=b.max_query_len, out=out,
                                 num_kv_splits=splits)
    assert ret is out
    ref = paged_attention_ref(*b.args(), out=torch.empty(b.q.shape, device=b.q.device))
    assert_close(out, ref, b.q.dtype)


# Shapes: (heads, kv_heads, head_dim). Small ones for the interpreter, real ones on the GPU.
SMALL = {1: (2, 2, 32), 4: (4, 1, 32), 8: (8, 1, 16)}
REAL = {1: (8, 8, 128), 4: (40, 10, 128), 8: (64, 8, 128)}


def shape_kw(group: int, real: bool) -> dict:
    heads, kv_heads, head_dim = (REAL if real else SMALL)[group]
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}


# ---------------------------------------------------------------------------------------
# store


@pytest.mark.parametrize(
    "dtype,chunk,kv_heads,head_dim,num_tokens",
    [
        (F32, 16, 2, 16, 20),
        (BF16, 32, 3, 32, 20),
        (F16, 16, 1, 64, 9),
        pytest.param(BF16, 16, 10, 128, 3000, marks=gpu),
        pytest.param(F16, 32, 8, 128, 3000, marks=gpu),
    ],
)
def test_store_kv(dtype, chunk, kv_heads, head_dim, num_tokens) -> None:
    num_blocks = math.ceil(num_tokens / chunk) + 4
    kv = torch.randn(2, num_blocks, chunk, kv_heads, head_dim, device=DEVICE).to(dtype)
    expected = kv.clone()
    key = torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE).to(dtype)
    slots = torch.randperm(num_blocks * chunk, device=DEVICE)[:num_tokens]
    slots[torch.rand(num_tokens, device=DEVICE) < 0.25] = -1  # skipped tokens
    slots[0] = -1
    store_kv_triton(key, value, kv[0], kv[1], slots)
    store_kv_ref(key, value, expected[0], expected[1], slots)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("cache_dtype", [F16, BF16])
def test_store_kv_casts_and_strided_key(cache_dtype) -> None:
    """fp32 K/V into a 16-bit cache, K/V as strided views of a fused qkv-like tensor."""
    fused = torch.randn(7, 3, 2, 16, device=DEVICE)
    key, value = fused[:, 1], fused[:, 2]
    kv = torch.zeros(2, 3, 16, 2, 16, dtype=cache_dtype, device=DEVICE)
    expected = kv.clone()
    slots = torch.tensor([0, 17, -1, 47, 5, -3, 30], device=DEVICE)
    store_kv_triton(key, value, kv[0], kv[1], slots)
    store_kv_ref(key, value, expected[0], expected[1], slots)
    if cache_dtype == BF16 and not HAS_CUDA:
        # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): 1 ulp.
        torch.testing.assert_close(kv, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(kv, expected)


# ---------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize(
    "group,chunk,dtype,real",
    [
        (1, 16, F32, False),
        (4, 32, BF16, False),
        (8, 16, F16, False),
        pytest.param(4, 16, BF16, True, marks=gpu),
        pytest.param(4, 32, F16, True, marks=gpu),
        pytest.param(1, 16, BF16, True, marks=gpu),
        pytest.param(8, 32, BF16, True, marks=gpu),
    ],
)
def test_decode(group, chunk, dtype, real) -> None:
    if real:
        ctxs = [1, 2, 15, 16, 17, 63, 64, 100, 4000, 2500]
    else:
        ctxs = [1, 2, 15, 17, 63, 64, 65, 90, 129]
    b = make_batch([[(c - 1, 1)] for c in ctxs], chunk=chunk, dtype=dtype, **shape_kw(group, real))
    run_attention(b)


@pytest.mark.parametrize(
    "group,chunk,dtype,real",
    [
        (1, 32, BF16, False),
        (4, 16, F32, False),
        (8, 32, F16, False),
        pytest.param(4, 16, BF16, True, marks=gpu),
        pytest.param(4, 32, F32, True, marks=gpu),
        pytest.param(8, 16, F16, True, marks=gpu),
    ],
)
def test_prefill(group, chunk, dtype, real) -> None:
    qlens = [1, 100, 2000, 513] if real else [1, 5, 16, 45, 70]
    b = make_batch([[(0, n)] for n in qlens], chunk=chunk, dtype=dtype, **shape_kw(group, real))
    run_attention(b)


@pytest.mark.parametrize(
    "group,chunk,dtype,real",
    [
        (4, 16, F32, False),
        (1, 32, BF16, False),
        (8, 32, F16, False),
        pytest.param(4, 16, BF16, True, marks=gpu),
        pytest.param(4, 32, F16, True, marks=gpu),
        pytest.param(8, 16, BF16, True, marks=gpu),
    ],
)
def test_mixed_batch(group, chunk, dtype, real) -> None:
    """A grid of (query_len, context before) pairs in one batch, plus an empty range."""
    if real:
        qlens, ctxs = [1, 2, 31, 200, 1024], [0, 1, 17, 62, 1000, 3000]
    else:
        qlens, ctxs = [1, 3, 20], [0, 1, 16, 37, 62]
    tables = [[(c, n)] for n in qlens for c in ctxs] + [[(5, 0)]]
    b = make_batch(tables, chunk=chunk, dtype=dtype, **shape_kw(group, real))
    run_attention(b)


@pytest.mark.parametrize(
    "group,chunk,dtype,d,n,new,real",
    [
        (4, 16, BF16, 5, 40, 3, False),
        (8, 32, F32, 33, 64, 1, False),
        (1, 16, F16, 16, 17, 20, False),
        pytest.param(4, 16, BF16, 700, 2500, 300, True, marks=gpu),
        pytest.param(4, 32, F16, 1, 3000, 1, True, marks=gpu),
    ],
)
def test_two_ranges_share_a_table(group, chunk, dtype, d, n, new, real) -> None:
    """Range 0 recomputes positions 0..d-1, range 1 adds n..n+new-1, d..n-1 are cached."""
    other = [(0, 9)] if not real else [(0, 64)]
    b = make_batch([[(0, d), (n, new)], other, [(30, 1)]], chunk=chunk, dtype=dtype,
                   **shape_kw(group, real))
    run_attention(b)


@pytest.mark.parametrize(
    "group,chunk,dtype,splits,real",
    [
        (4, 16, BF16, 4, False),
        (1, 32, F32, 32, False),
        (8, 16, F16, 2, False),
        (4, 16, BF16, 64, False),
        (1, 16, F32, 128, False),
        pytest.param(4, 16, BF16, None, True, marks=gpu),
        pytest.param(1, 32, BF16, 128, True, marks=gpu),
        pytest.param(4, 32, F16, 16, True, marks=gpu),
        pytest.param(8, 16, BF16, 8, True, marks=gpu),
    ],
)
def test_split_kv(group, chunk, dtype, splits, real) -> None:
    """KV ranges split over several programs, partials merged by the combine kernel."""
    if splits is None:  # the launcher's own choice: few decode requests, long contexts
        tables = [[(c - 1, 1)] for c in (1, 100, 4000)]
        assert launch_policy.auto_kv_splits(3 * 10, 3, 40, 128, torch.device(DEVICE)) > 1
    elif real:
        tables = [[(c - 1, 1)] for c in (1, 100, 4000, 2500, 40000)]
        tables += [[(0, 300), (3000, 1)], [(1000, 33)]]
    elif splits > 32:  # beyond the combiner's block: it merges 32 splits at a time
        tables = [[(c - 1, 1)] for c in (1, 150, 2100, 9000)] + [[(0, 5), (40, 3)]]
    else:
        tables = [[(c - 1, 1)] for c in (1, 17, 64, 150)] + [[(0, 5), (40, 3)], [(20, 9)]]
    b = make_batch(tables, chunk=chunk, dtype=dtype, **shape_kw(group, real))
    run_attention(b, splits)


@pytest.mark.parametrize(
    "group,chunk,dtype,splits,span,real",
    [
        (4, 16, BF16, 8, 256, False),   # a 900-position range needs 4 of the 8 splits
        (1, 32, F32, 2, 256, False),    # more than 2 x span: the equal part wins
        (8, 16, F16, 32, 512, False),
        (4, 16, BF16, 128, 256, False),  # 64 splits of 256 for a 16k range, 6 for 1500
        pytest.param(4, 16, BF16, 8, 1024, True, marks=gpu),
        pytest.param(1, 32, BF16, 128, 512, True, marks=gpu),
        pytest.param(4, 32, BF16, 16, 256, True, marks=gpu),
    ],
)
def test_split_kv_by_span(group, chunk, dtype, splits, span, real) -> None:
    """Decode with a split span (ragged contexts): each range uses only the splits its
    length needs; the programs of the others exit without writing, and the combiner leaves
    them out."""
    lens = (1, 17, 255, 256, 257, 900, 1500) if not real else (1, 300, 2500, 13000, 4096)
    if splits > 32:
        lens = (1, 257, 1500, 16000) if not real else (1, 2500, 65536)
    b = make_batch([[(c - 1, 1)] for c in lens], chunk=chunk, dtype=dtype,
                   **shape_kw(group, real))
    out = torch.full_like(b.q, float("nan"))
    span_t = torch.tensor([span], dtype=torch.int32, device=DEVICE)
    paged_attention_triton(*b.args(), max_query_len=1, out=out, num_kv_splits=splits,
                           kv_split_span=span_t)
    ref = paged_attention_ref(*b.args(), out=torch.empty(b.q.shape, device=b.q.device))
    assert_close(out, ref, b.q.dtype)


def test_split_span_needs_a_split_decode_step() -> None:
    b = make_batch([[(0, 3)], [(5, 1)]], chunk=16, dtype=F32, **shape_kw(4, False))
    span_t = torch.tensor([256], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_split_span"):
        paged_attention_triton(*b.args(), max_query_len=3, num_kv_splits=4,
                               kv_split_span=span_t)
    with pytest.raises(ValueError, match="kv_split_span"):
        paged_attention_triton(*b.args(), max_query_len=1, num_kv_splits=1,
                               kv_split_span=span_t)


def test_decode_split_span_rule() -> None:
    """Near the batch's mean, smaller where the grid would not fill the GPU, aligned."""
    from pensieve.kernels.launch_policy import (
        DECODE_MIN_SPLITS,
        SPAN_ALIGN,
        decode_kv_splits,
        decode_split_span,
    )

    dev = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
    target = 4 * launch_policy.num_sms(dev)
    ragged = [500] * 50 + [13000] * 2
    span = decode_split_span(ragged, target, dev)  # programs plentiful: the mean decides
    mean = sum(ragged) // len(ragged)
    assert span % SPAN_ALIGN == 0 and mean <= span < mean + SPAN_ALIGN
    assert decode_split_span([8192], 1, dev) < 8192  # one range: split to fill the GPU
    assert decode_split_span([1, 2], 10, dev) == SPAN_ALIGN
    assert decode_split_span([], 10, dev) == SPAN_ALIGN
    assert decode_kv_splits(10_000, 10, dev) == DECODE_MIN_SPLITS
    assert decode_kv_splits(1, 1, dev) >= min(32, target)


def test_decode_split_span_is_for_ragged_steps() -> None:
    from pensieve.kernels.launch_policy import DECODE_SPAN_MODE, decode_is_ragged, use_split_span

    ragged, uniform = [500] * 50 + [13000] * 2, [3000] * 56
    assert decode_is_ragged(ragged) and not decode_is_ragged(uniform)
    assert not decode_is_ragged([]) and not decode_is_ragged([9000])
    for mode, want in (("auto", (True, False)), ("1", (True, True)), ("0", (False, False))):
        assert (use_split_span(ragged, mode), use_split_span(uniform, mode)) == want
    assert DECODE_SPAN_MODE == "auto"


def _overflow_case(real: bool) -> None:
    heads, kv_heads, head_dim = (40, 10, 128) if real else (4, 1, 16)
    chunk = 16
    per_block = chunk * kv_heads * head_dim
    num_blocks = 2**31 // per_block + 64  # cache of more than 2**31 elements
    dtype = BF16 if real else F16
    try:
        b = make_batch([[(0, 3), (70, 5)], [(130, 1)]], heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, chunk=chunk, dtype=dtype, num_blocks=num_blocks,
                       tail_blocks=True)
    except (RuntimeError, MemoryError) as e:  # e.g. a host without memory overcommit
        pytest.skip(f"cannot reserve a {2 * num_blocks * per_block * 2 / 2**30:.1f} GiB cache: {e}")
    assert int(b.block_tables.min()) * per_block >= 2**31  # every block past int32 offsets
    assert b.k_cache.numel() > 2**31
    run_attention(b)

    # store into the top blocks of the same cache
    k_cache, v_cache = b.k_cache, b.v_cache
    top = torch.tensor([num_blocks - 1, num_blocks - 2], device=k_cache.device)
    saved_k, saved_v = k_cache[top].clone(), v_cache[top].clone()
    slots = torch.tensor([(num_blocks - 1) * chunk + 3, -1, (num_blocks - 2) * chunk + 15],
                         device=k_cache.device)
    key = torch.randn(3, kv_heads, head_dim, device=k_cache.device).to(dtype)
    value = torch.randn(3, kv_heads, head_dim, device=k_cache.device).to(dtype)
    store_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[num_blocks - 1, 3], key[0])
    assert torch.equal(v_cache[num_blocks - 2, 15], value[2])
    assert torch.equal(k_cache[num_blocks - 2, 15], key[2])
    assert torch.equal(v_cache[num_blocks - 1, 3], value[0])
    for cache, saved in ((k_cache, saved_k), (v_cache, saved_v)):
        cache[num_blocks - 1, 3] = saved[0, 3]
        cache[num_blocks - 2, 15] = saved[1, 15]
    assert torch.equal(torch.nan_to_num(k_cache[top]), torch.nan_to_num(saved_k))
    assert torch.equal(torch.nan_to_num(v_cache[top]), torch.nan_to_num(saved_v))


def test_int32_overflowing_cache() -> None:
    """Block ids near the top of a cache of more than 2**31 elements (int64 addressing).

    On the CPU the 2 x 4 GiB cache is only reserved (``torch.empty`` maps it lazily) and the
    test touches a few of its blocks, so it stays light; it is skipped where the host refuses
    to reserve that much address space.
    """
    _overflow_case(real=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_int32_overflowing_cache_real_shapes() -> None:
    _overflow_case(real=True)


# ---------------------------------------------------------------------------------------
# launcher checks and dispatch


def _small_batch() -> Batch:
    return make_batch([[(3, 2)], [(0, 4)]], heads=4, kv_heads=2, head_dim=16, chunk=16,
                      dtype=F32)


def test_empty_inputs() -> None:
    b = _small_batch()
    out = torch.full_like(b.q, float("nan"))
    paged_attention_triton(*b.args(), max_query_len=0, out=out)
    assert torch.isnan(out).all()
    empty_q = b.q[:0]
    res = paged_attention_triton(empty_q, *b.args()[1:4], b.query_start_loc[:1],
                                 b.range_start_pos[:0], b.range_table[:0], b.scale,
                                 max_query_len=0)
    assert res.shape == empty_q.shape
    key = torch.empty(0, 2, 16, device=DEVICE)
    store_kv_triton(key, key, b.k_cache, b.v_cache, torch.empty(0, dtype=torch.long,
                                                                device=DEVICE))


def test_launcher_rejects_bad_arguments() -> None:
    b = _small_batch()
    kw = {"max_query_len": b.max_query_len}
    args = list(b.args())

    def bad(i: int, value, match: str, **extra) -> None:  # noqa: ANN001
        a = list(args)
        if i >= 0:
            a[i] = value
        with pytest.raises(ValueError, match=match):
            paged_attention_triton(*a, **{**kw, **extra})

    bad(0, b.q.to(F16), "dtype")  # q vs cache dtype
    bad(0, b.q[:, :3], "multiple")  # 3 heads over 2 kv heads
    bad(0, b.q.transpose(1, 2).contiguous().transpose(1, 2), "contiguous")
    bad(0, b.q[..., :8], "head_dim")
    bad(0, b.q.to(torch.int32), "float16")
    bad(1, b.k_cache[..., :8].contiguous(), "differ")
    bad(3, b.block_tables.float(), "int32")
    bad(4, b.query_start_loc[:-1], "num_ranges")
    bad(6, b.range_table[:1], "range_table")
    bad(-1, None, "max_query_len", max_query_len=-1)
    bad(-1, None, "num_kv_splits", num_kv_splits=3)
    bad(-1, None, "out", out=torch.empty(1, 4, 16, device=DEVICE))
    if HAS_CUDA:
        bad(4, b.query_start_loc.cpu(), "device")
    key = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="match"):
        store_kv_triton(key[:, :1], key[:, :1], b.k_cache, b.v_cache, slots)
    with pytest.raises(ValueError, match="entries"):
        store_kv_triton(key, key, b.k_cache, b.v_cache, slots[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        store_kv_triton(key, key, b.k_cache, b.v_cache, slots.float())
    cache16 = torch.zeros(2, 16, 2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        store_kv_triton(key[..., :12], key[..., :12], cache16, cache16, slots)


def test_dispatch_through_pensieve_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KernelChoice("triton")`` routes the public entry points to these kernels."""
    monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice("triton"))
    from pensieve.layers.attention import AttentionMetadata, PagedAttention

    heads, kv_heads, head_dim, chunk = 4, 2, 16, 16
    b = make_batch([[(0, 18)], [(20, 3)]], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   chunk=chunk, dtype=BF16)
    out = kernels.paged_attention(*b.args(), max_query_len=b.max_query_len)
    ref = paged_attention_ref(*b.args(), out=torch.empty(b.q.shape, device=b.q.device))
    assert_close(out, ref, BF16)

    # The layer: store this step's K/V, then attend (kv_cache[0], kv_cache[1] are views).
    kv_cache = torch.stack([b.k_cache, b.v_cache])
    expected = kv_cache.clone()
    n = b.q.shape[0]
    k = torch.randn(n, kv_heads * head_dim, device=DEVICE).to(BF16)
    v = torch.randn(n, kv_heads * head_dim, device=DEVICE).to(BF16)
    # each token writes the slot of its own position, as the engine does
    qsl = b.query_start_loc.tolist()
    slot_list = []
    for r in range(len(qsl) - 1):
        table = b.block_tables[int(b.range_table[r])].long()
        for i in range(qsl[r + 1] - qsl[r]):
            p = int(b.range_start_pos[r]) + i
            slot_list.append(int(table[p // chunk]) * chunk + p % chunk)
    slots = torch.tensor(slot_list, device=DEVICE)
    meta = AttentionMetadata(slots, b.query_start_loc, b.range_start_pos, b.range_table,
                             b.block_tables, b.max_query_len)
    layer = PagedAttention(heads, kv_heads, head_dim, b.scale)
    got = layer(b.q.reshape(n, -1), k, v, kv_cache, meta)
    store_kv_ref(k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim), expected[0],
                 expected[1], slots)
    assert torch.equal(torch.nan_to_num(kv_cache), torch.nan_to_num(expected))
    ref = paged_attention_ref(b.q, expected[0], expected[1], *b.args()[3:],
                              out=torch.empty(b.q.shape, device=b.q.device))
    assert_close(got.view_as(b.q), ref, BF16)


def test_compile_attention_kernels_runs_its_plan() -> None:
    """The serving warm-up runs each variant of its plan: tiles the launcher can pick, split
    and unsplit, decode tiles also split by span."""
    tiles = launch.attention_tile_choices(32, HAS_CUDA)
    plan = launch.attention_warmup_plan(4, 2, 32, HAS_CUDA)
    assert {t for t, _, _ in plan} <= tiles
    assert (launch._attention_tiles(2, 2, 32, HAS_CUDA), 2, True) in plan  # a decode's
    assert (launch._attention_tiles(4096, 4096, 32, HAS_CUDA), 2, False) in plan
    n = launch.compile_attention_kernels(4, 2, 32, 16, F32, torch.device(DEVICE))
    assert n == len(plan)


def test_split_count_beyond_the_combiner_raises() -> None:
    q = torch.zeros(1, 4, 32, device=DEVICE)
    cache = torch.zeros(1, 16, 2, 32, device=DEVICE)
    z = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"num_kv_splits must be a power of two in \[1, 128\]"):
        paged_attention_triton(q, cache, cache, z.view(1, 1), qsl, z, z, 0.1, max_query_len=1,
                               num_kv_splits=256)
    # work items keep their split in 5 bits: at most 32 there
    work = torch.tensor(launch.work_items_for([1], 2, 16, [0], 2, 16, 64), device=DEVICE)
    num = torch.tensor([len(work)], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"num_kv_splits must be a power of two in \[1, 32\]"):
        paged_attention_triton(q, cache, cache, z.view(1, 1), qsl, z, z, 0.1, max_query_len=1,
                               work_items=work, num_work_items=num, tiles=(16, 64, 4, 1),
                               num_kv_splits=64, kv_split_span=qsl[1:])


@pytest.mark.parametrize("batch,q_len,long", [(1, 1, True), (8, 1, True), (2, 1, False),
                                             (3, 40, False)])
def test_attention_choice_is_the_launch_plan(batch: int, q_len: int, long: bool) -> None:
    """``attention_choice`` (what the long-attention benchmark reports) equals the tiles and
    split count a launch with neither given picks."""
    dev = torch.device(DEVICE)
    heads, kv_heads, head_dim = 32, 8, 128
    q = torch.empty(batch * q_len, heads, head_dim, device=dev)
    tiles, splits, _ = launch._launch_plan(q, q, kv_heads, batch, q_len, None, None, None, None,
                                           None, long)
    assert launch.attention_choice(batch * q_len, heads, kv_heads, head_dim, batch, q_len, dev,
                                   long) == (tiles, splits)


def test_long_decode_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step is long from LONG_DECODE_KV on: 128-position KV tiles (decode rows
    only) and up to 128 KV splits; short steps keep the measured tiles and 32 splits."""
    import pensieve.kernels.launch_policy as lp
    from pensieve.kernels.launch_policy import (
        DECODE_MAX_SPLITS,
        LONG_DECODE_KV,
        LONG_DECODE_MIN_SPLITS,
        MAX_SPLITS,
        auto_kv_splits,
        decode_kv_splits,
        is_long_decode,
    )

    assert not is_long_decode([]) and not is_long_decode([LONG_DECODE_KV - 1] * 4)
    assert is_long_decode([10, LONG_DECODE_KV])
    for cuda in (False, True):
        assert launch._attention_tiles(4, 4, 128, cuda, True) == (16, 128, 4, 2)
        assert launch._attention_tiles(64, 64, 128, cuda, True)[1] == 128
        # prefill rows, or head_dim 256, keep their tiles whatever the context
        assert launch._attention_tiles(4096, 4096, 128, cuda, True) == \
            launch._attention_tiles(4096, 4096, 128, cuda)
        assert launch._attention_tiles(4, 4, 256, cuda, True) == \
            launch._attention_tiles(4, 4, 256, cuda)
    assert launch._attention_tiles(4, 4, 128, True) == (16, 32, 4, 2)  # short: as measured
    assert (16, 128, 4, 2) in launch.attention_tile_choices(128, True)
    # an H200-like device: 132 SMs, 528 programs wanted; one request of 8 KV heads
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(lp, "num_sms", lambda d: 132)
    auto_kv_splits.cache_clear()
    try:
        assert auto_kv_splits(8, 1, 32, 128, cuda) == MAX_SPLITS
        # long: one program per SM (the H200 sweep's best), at least LONG_DECODE_MIN_SPLITS
        assert auto_kv_splits(8, 1, 32, 128, cuda, True) == 32  # 1 request: 132 / 8 -> 32
        assert auto_kv_splits(64, 8, 32, 128, cuda, True) == LONG_DECODE_MIN_SPLITS == 4
        assert auto_kv_splits(256, 32, 32, 128, cuda, True) == 4  # 32 requests: the floor
        assert auto_kv_splits(1, 1, 32, 128, cuda, True) == DECODE_MAX_SPLITS == 128
        assert auto_kv_splits(1024, 128, 32, 128, cuda, True) == 1  # the grid fills the GPU
        assert decode_kv_splits(1, 8, cuda) == MAX_SPLITS
        assert decode_kv_splits(1, 8, cuda, True) == 128
        assert decode_kv_splits(8, 8, cuda, True) == 16
    finally:
        auto_kv_splits.cache_clear()


@pytest.mark.parametrize("group,dtype,splits,span", [
    (4, BF16, None, None),   # the launcher's splits (interpreter: 4 SMs)
    (1, F32, 128, None),
    (8, F16, 64, 256),
])
def test_long_context_decode_matches_reference(group, dtype, splits, span) -> None:
    """``long_context``: 128-position KV tiles (also under the interpreter) and up to 128
    splits, equal parts or by span, against the reference."""
    lens = (1, 100, 3000, 9000)
    b = make_batch([[(c - 1, 1)] for c in lens], chunk=16, dtype=dtype, **shape_kw(group, False))
    out = torch.full_like(b.q, float("nan"))
    span_t = None if span is None else torch.tensor([span], dtype=torch.int32, device=DEVICE)
    paged_attention_triton(*b.args(), max_query_len=1, out=out, num_kv_splits=splits,
                           kv_split_span=span_t, long_context=True)
    ref = paged_attention_ref(*b.args(), out=torch.empty(b.q.shape, device=b.q.device))
    assert_close(out, ref, b.q.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch,ctx", [(1, 32768), (8, 16384)])
def test_long_context_decode_real_shapes(batch: int, ctx: int) -> None:
    """Llama-3.1-8B's attention shape at long contexts with the launcher's own long-decode
    choices (128-position tiles, up to 128 splits)."""
    b = make_batch([[(ctx - 1 - 37 * i, 1)] for i in range(batch)], chunk=32, dtype=BF16,
                   heads=32, kv_heads=8, head_dim=128)
    out = torch.full_like(b.q, float("nan"))
    paged_attention_triton(*b.args(), max_query_len=1, out=out, long_context=True)
    ref = paged_attention_ref(*b.args(), out=torch.empty(b.q.shape, device=b.q.device))
    assert_close(out, ref, BF16)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("splits,span", [(None, None), (4, 32), (8, 16), (32, 16)])
def test_worklist_mode_matches_reference(group: int, dtype: torch.dtype, splits, span) -> None:
    """The static-grid mode of CUDA graphs: a grid sized for a bound on the work items (the
    rest exit), items cut for fixed tiles; prefill, decode and prefix ranges mixed, a short
    turn after a long history among them. With KV splits (equal parts, or by span, where a
    range uses only the splits its length needs and the item-major combiner reads only
    those), every token still equals the reference."""
    b = make_batch([[(0, 37)], [(40, 1)], [(5, 20), (25, 3)], [(0, 1)], [(150, 6)]],
                   **shape_kw(group, False), chunk=16, dtype=dtype)
    tiles = (16, 16, 4, 2)
    qsl = b.query_start_loc.tolist()
    qlens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    items = launch.work_items_for(qlens, group, tiles[0], b.range_start_pos.tolist(),
                                  splits or 1, span or 0, tiles[1])
    # a tile of kv_len positions comes cdiv(kv_len, per_split) <= 1 + kv_len // span times
    kv = sum(-(-n * group // tiles[0]) * (int(s) + n)
             for s, n in zip(b.range_start_pos.tolist(), qlens))
    bound = -(-sum(qlens) * group // tiles[0]) + len(qlens) + (kv // span if span else 0)
    assert len(items) <= bound
    work = torch.zeros(bound + 5, dtype=torch.int32, device=DEVICE)  # padded past the bound
    work[: len(items)] = torch.tensor(items, dtype=torch.int32)
    num = torch.tensor([len(items)], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(b.q, float("nan"))
    span_t = None if span is None else torch.tensor([span], dtype=torch.int32, device=DEVICE)
    paged_attention_triton(*b.args(), max_query_len=b.max_query_len, out=out, tiles=tiles,
                           work_items=work, num_work_items=num, num_kv_splits=splits,
                           kv_split_span=span_t)
    ref = paged_attention_ref(*b.args(), out=torch.empty(b.q.shape, device=b.q.device))
    assert_close(out, ref, dtype)
    with pytest.raises(ValueError, match="tiles"):
        paged_attention_triton(*b.args(), max_query_len=b.max_query_len, work_items=work,
                               num_work_items=num)
    with pytest.raises(ValueError, match="kv_split_span"):
        paged_attention_triton(*b.args(), max_query_len=b.max_query_len, work_items=work,
                               num_work_items=num, tiles=tiles, num_kv_splits=4)


def test_split_work_items_follow_the_kernels_cut() -> None:
    """Each tile once per KV split it uses: ``max(equal part, span)``-position pieces of the
    positions up to the tile's last query token, as a loop over tiles lists them."""
    qlens, starts, group, bm, bn = [37, 1, 6, 200], [0, 900, 150, 3000], 4, 16, 16
    for splits, span in ((4, 32), (8, 256), (32, 16)):
        want = []
        for r, (n, s0) in enumerate(zip(qlens, starts)):
            for tile in range(-(-n * group // bm)):
                kv = s0 + min(((tile + 1) * bm - 1) // group, n - 1) + 1
                per = max(math.ceil(math.ceil(kv / splits) / bn) * bn, span)
                want += [r * 65536 + tile * 32 + k for k in range(min(-(-kv // per), splits))]
        got = launch.work_items_for(qlens, group, bm, starts, splits, span, bn).tolist()
        assert got == want
    assert launch.work_items_for(qlens, group, bm).tolist() == [
        r * 65536 + t * 32 for r, n in enumerate(qlens) for t in range(-(-n * group // bm))]
    with pytest.raises(ValueError, match="tiles"):
        launch.work_items_for([4096], 8, 16)


@pytest.mark.parametrize("group,dtype,span", [(4, F32, 32), (1, BF16, None), (8, F16, 64)])
def test_decodes_in_a_launch_of_their_own(group, dtype, span) -> None:
    """Mixed decodes ``split``: a mixed step's one-token ranges (its first tokens)
    attend in a decode launch with KV splits (by span, or equal parts), its other ranges in a
    second launch whose ``query_start_loc`` starts past them; together every token equals
    the reference."""
    tables = [[(c, 1)] for c in (0, 5, 40, 130)] + [[(0, 20)], [(37, 9)], [(3, 1), (70, 12)]]
    b = make_batch(tables, chunk=16, dtype=dtype, **shape_kw(group, False))
    qsl = b.query_start_loc.tolist()
    ranges = [(qsl[r], qsl[r + 1] - qsl[r], int(b.range_start_pos[r]), int(b.range_table[r]))
              for r in range(len(qsl) - 1)]
    ranges = [x for x in ranges if x[1] == 1] + [x for x in ranges if x[1] > 1]
    rows = torch.cat([torch.arange(lo, lo + n) for lo, n, _, _ in ranges])
    q = b.q[rows.to(b.q.device)].contiguous()
    offs = [0]
    for _, n, _, _ in ranges:
        offs.append(offs[-1] + n)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    qsl_t = torch.tensor(offs, **i32)
    start_t = torch.tensor([s for *_, s, _ in ranges], **i32)
    table_t = torch.tensor([t for *_, t in ranges], **i32)
    d = sum(1 for _, n, _, _ in ranges if n == 1)
    common = (b.k_cache, b.v_cache, b.block_tables)
    ref = paged_attention_ref(q, *common, qsl_t, start_t, table_t, b.scale,
                              out=torch.empty(q.shape, device=q.device))
    out = torch.full_like(q, float("nan"))
    span_t = None if span is None else torch.tensor([span], **i32)
    paged_attention_triton(q, *common, qsl_t[: d + 1], start_t[:d], table_t[:d], b.scale,
                           max_query_len=1, out=out, num_kv_splits=4, kv_split_span=span_t)
    assert torch.isnan(out[d:]).all()  # the decode launch writes its own rows only
    paged_attention_triton(q, *common, qsl_t[d:], start_t[d:], table_t[d:], b.scale,
                           max_query_len=max(n for _, n, _, _ in ranges), out=out)
    assert_close(out, ref, dtype)
