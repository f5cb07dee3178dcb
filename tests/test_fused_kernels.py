"""Fused element-wise Triton kernels (residual add + RMSNorm, rotary, SiLU-and-multiply)
against their pure-torch references, and a Llama forward with every Triton kernel against
the all-reference forward.

Without CUDA the kernels run through Triton's interpreter (this is what CI runs); with CUDA
natively. The residual sum must equal the reference bit for bit in half precision (one
rounding, as torch's add); the others within a few ulps: the RMSNorm sums in another order,
the SiLU's ``exp`` may differ in its last bit, and on the GPU the compiler contracts the
rotary's products and sum into FMAs, skipping the roundings torch does between them (the
H200 run saw one-ulp differences there). Triton's interpreter truncates to bf16 rather than
rounding to nearest, so on the CPU even the bf16 sum is compared within one ulp.
"""

import zlib

import pytest
import torch
import transformers

import pensieve.kernels as kernels
from pensieve.kernels.launch_fused import (
    rms_norm_triton,
    rotary_triton,
    silu_and_mul_triton,
)
from pensieve.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# bf16 has 8 significant bits: one ulp is 2**-7 relative.
TOL = {F32: dict(atol=1e-5, rtol=1e-5), F16: dict(atol=2e-3, rtol=2e-3),
       BF16: dict(atol=2e-2, rtol=1.6e-2)}




def _exact(dtype: torch.dtype) -> bool:
    return dtype == F16 or (dtype == BF16 and HAS_CUDA)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if _exact(dtype):
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 96), (3, 5120), (0, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, rows, cols, with_residual) -> None:  # noqa: ANN001
    x = torch.randn(rows, cols, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, device=DEVICE)).to(dtype)
    res = torch.randn(rows, cols, device=DEVICE).to(dtype) if with_residual else None
    want, want_res = rms_norm_ref(x, w, 1e-5, res)
    got, got_res = rms_norm_triton(x, w, 1e-5, None if res is None else res.clone())
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    if with_residual:
        _check(got_res, want_res, dtype)  # the rounded sum is exact (f32: exact too)
    else:
        assert got_res is None


def test_rms_norm_writes_the_sum_into_residual() -> None:
    x = torch.randn(4, 64, device=DEVICE)
    res = torch.randn(4, 64, device=DEVICE)
    want = x + res
    _, got = rms_norm_triton(x, torch.ones(64, device=DEVICE), 1e-6, res)
    assert got.data_ptr() == res.data_ptr() and torch.equal(res, want)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot", [(4, 2, 64, 64), (5, 1, 32, 32),
                                                         (2, 2, 64, 32), (40, 10, 128, 128)])
def test_rotary_in_place_matches_reference(dtype, heads, kv_heads, head_dim, rot) -> None:  # noqa: ANN001
    t = 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)  # strided views, as in the model
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    freqs = torch.rand(t, rot // 2, device=DEVICE) * 50
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = rotary_ref(q.clone(), cos, sin), rotary_ref(k.clone(), cos, sin)
    got_q, got_k = rotary_triton(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 1408), (2, 13824), (0, 32)])
def test_silu_and_mul_matches_reference(dtype, rows, cols) -> None:  # noqa: ANN001
    x = (3 * torch.randn(rows, 2 * cols, device=DEVICE)).to(dtype)
    got = silu_and_mul_triton(x)
    assert got.shape == (rows, cols) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul_ref(x), **TOL[dtype])


def test_bad_arguments_raise_value_error() -> None:
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(64, device=DEVICE, dtype=F16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, torch.ones(64, device=DEVICE), 1e-6, torch.ones(3, 32, device=DEVICE))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.randn(2, 7, device=DEVICE))
    q, k = torch.randn(2, 4, 64, device=DEVICE), torch.randn(2, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rotary dim"):
        rotary_triton(q, k, torch.ones(2, 48, device=DEVICE), torch.ones(2, 48, device=DEVICE))
    with pytest.raises(ValueError, match="cos"):
        rotary_triton(q, k, torch.ones(3, 64, device=DEVICE), torch.ones(3, 64, device=DEVICE))
    # The dispatcher falls back to the reference for a rotary dim the kernel does not take.
    cos = torch.ones(2, 48, device=DEVICE)
    got_q, _ = kernels.rotary(q.clone(), k.clone(), cos, cos)
    torch.testing.assert_close(got_q, rotary_ref(q, cos, cos))


def _tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    from pensieve.models.llama import LlamaForCausalLM

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEVICE)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_llama_forward_fused_matches_reference(monkeypatch, dtype) -> None:  # noqa: ANN001
    """One prefill of two ranges through the whole decoder: every Triton kernel (attention,
    KV store, norms, rotary, SiLU) against every reference, same inputs and caches."""
    from pensieve.layers.attention import AttentionMetadata

    model = _tiny_llama(dtype)
    lens, chunk = (5, 11), 16
    ids = torch.randint(0, 256, (sum(lens),), device=DEVICE)
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lens])
    slots = torch.cat([torch.arange(n, device=DEVICE) + r * chunk for r, n in enumerate(lens)])
    i32 = dict(device=DEVICE, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, lens[0], sum(lens)], **i32),
        range_start_pos=torch.zeros(2, **i32), range_table=torch.arange(2, **i32),
        block_tables=torch.arange(2, **i32)[:, None], max_query_len=max(lens),
    )

    def run(choice: str) -> torch.Tensor:
        monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice(choice))
        caches = [torch.zeros(2, 2, chunk, 2, 16, device=DEVICE, dtype=dtype) for _ in range(2)]
        with torch.no_grad():
            return model.compute_logits(model(ids, positions, caches, meta))

    torch.testing.assert_close(run("triton"), run("reference"), atol=0.15 if dtype == BF16
                               else 1e-4, rtol=0.05 if dtype == BF16 else 1e-4)


@pytest.mark.slow  # the whole engine on the Triton interpreter, eager and with graphs
def test_engine_graph_paths_with_triton_kernels(monkeypatch) -> None:  # noqa: ANN001
    """The whole engine on the Triton kernels (interpreter here): steps through the mixed- and
    decode-graph static buffers (the attention kernel's work-item grid) give the same greedy
    tokens as the ordinary eager path."""
    from pensieve import LLM, SamplingParams

    monkeypatch.setattr(kernels, "CHOICE", kernels.KernelChoice("triton"))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7, 11, 3] * 3, [4, 8], [6] * 40]

    def run(graphs: bool) -> list[list[int]]:
        llm = LLM(model="llama-tiny", dtype="float32", device=DEVICE, max_model_len=128,
                  chunk_size=16, max_num_batched_tokens=48)
        r = llm.engine.runner
        if graphs:
            r.enable_mixed_graphs(max_tokens=48, max_ranges=4, max_blocks=8, capture=False)
            r.enable_decode_graphs(max_batch=4, max_blocks=8, capture=False)
        outs = [o.output_token_ids for o in llm.generate(prompts, greedy)]
        if graphs:
            assert r.num_mixed_graph_steps > 0 and r.num_graph_steps > 0
        return outs

    assert run(True) == run(False)
