"""benchmarks/profile_step.py: the kernel categoriser, the aggregation, and one CPU run.

Without CUDA the script profiles CPU operators (self time) of a tiny model instead of kernels;
that exercises everything but the CUPTI side.
"""

import gzip
import json
from pathlib import Path

import profile_step as ps
import pytest
import torch

KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_tst_128x64_64x4_1x2_h_bz_coopA_TNT": "gemm",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int>,"
    " cutlass::epilogue::collective::DefaultEpilogue<TransformsNone> > >(Params)": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
    "__nv_bfloat16, false, false, false>(cublasLt::cublasSplitKParams<float>)": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "gemm",
    "_paged_attention_kernel": "attention",
    "_combine_splits_kernel": "attention",
    "_store_kv_kernel": "kv_store",
    "_rms_norm_kernel": "norm",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<"
    "float, float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, "
    "at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4>)": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
    "pow_tensor_scalar_kernel_impl<float, float>(at::TensorIteratorBase&, float)::"
    "{lambda(float)#2}, std::array<char*, 2ul> >(int, ...)": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#1}::operator()() const, std::array<char*, 2ul> >": "norm",
    "_rotary_kernel": "rotary",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>"
    ", std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul>)": "elementwise",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)> >(int, ...)": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
    "func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()> > >(...)":
        "elementwise",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
    "namespace)::OpaqueType<2u>, unsigned int, 2, 128, 1>(...)": "elementwise",
    "void at::native::index_elementwise_kernel<128, 4, ...>(long, ...)": "elementwise",
    "_silu_mul_kernel": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<"
    "float>, unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<"
    "float>, unsigned int, long, 4, 4>)": "sampling",
    "Memcpy HtoD (Pageable -> Device)": "memcpy",
    "Memcpy DtoH (Device -> Pinned)": "memcpy",
    "Memset (Device)": "memcpy",
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "aten::rsqrt": "norm",
    "aten::copy_": "elementwise",
    "aten::view": "other",
    "some_kernel_nobody_knows": "other",
}


@pytest.mark.parametrize("name,category", list(KERNELS.items()))
def test_categorize(name: str, category: str) -> None:
    assert ps.categorize(name) == category
    assert category in ps.CATEGORIES


def test_aggregate_per_step() -> None:
    recs = [("_paged_attention_kernel", 10.0), ("nvjet_tst_128x64", 30.0),
            ("nvjet_tst_128x64", 30.0), ("Memcpy HtoD (Pinned -> Device)", 2.0)] * 2
    agg = ps.aggregate(recs, steps=2, top=2)
    cats = agg["categories"]
    assert cats["gemm"] == {"count": 2, "us": 60.0, "share_of_kernels": 0.8333}
    assert cats["attention"]["us"] == 10.0 and cats["memcpy"]["count"] == 1
    assert cats["other"]["us"] == 0.0
    assert agg["kernel_us"] == 72.0 and agg["kernel_count"] == 4
    top = [k["name"] for k in agg["top_kernels"]]
    assert top == ["nvjet_tst_128x64", "_paged_attention_kernel"]
    assert agg["top_kernels"][0] == {"name": "nvjet_tst_128x64", "category": "gemm", "count": 2,
                                     "us": 60.0}


def test_cpu_run(tmp_path: Path) -> None:
    out, png, trace = tmp_path / "p.json", tmp_path / "p.png", tmp_path / "t.json.gz"
    ps.main(["--model", "llama-tiny", "--dtype", "float32", "--device", "cpu", "--kv-gb", "0.001",
             "--configs", "2x64,1000x100000", "--warmup", "1", "--iters", "2", "--steps", "2",
             "--out", str(out), "--plot", str(png), "--trace", str(trace)])
    res = json.loads(out.read_text())
    assert [(r["batch"], r["ctx"]) for r in res["configs"]] == [(2, 64), (1000, 100000)]
    assert res["configs"][1]["skipped"]
    row = res["configs"][0]
    assert res["modes"] == ["eager", "graph"] and not row["captured"]
    assert row["floor_us"] > 0
    for mode in res["modes"]:
        r = row[mode]
        cats = r["categories"]
        assert set(cats) == set(ps.CATEGORIES)
        assert all((c["us"] > 0) == (c["count"] > 0) for c in cats.values())  # no time w/o kernels
        assert sum(c["us"] for c in cats.values()) == pytest.approx(r["kernel_us"], abs=1e-2)
        assert r["kernel_us"] > 0 and r["wall_us"] > 0 and r["kernels_reported"]
        assert cats["gemm"]["count"] > 0 and r["gemm_gbps"] is not None
        assert r["gap_us"] == pytest.approx(r["wall_us"] - r["kernel_us"], abs=1e-2)
        assert 0 < len(r["top_kernels"]) <= ps.TOP_KERNELS
    assert row["graph"]["graph_steps"] >= 2  # the static-buffer path really ran
    assert png.stat().st_size > 0
    with gzip.open(trace) as f:
        assert json.load(f)["traceEvents"]


def test_parse_configs() -> None:
    assert ps.parse_configs("1x512, 32X8192") == [(1, 512), (32, 8192)]


def test_gemm_weight_bytes_tied_head() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 4, bias=False)

    # The LM head is F.linear(h, embed.weight): the embedding counts as a GEMM weight.
    assert ps.gemm_weight_bytes(Tied()) == (10 * 4 + 4 * 4) * 4
