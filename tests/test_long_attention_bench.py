"""``python benchmarks/long_attention.py --cuda-graphs`` on a GPU: graph-replay times next to the
eager ones, and a decode sweep timed through graphs (small contexts, to keep it short)."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_graph_timing_fields() -> None:
    from long_attention import case

    pre = case(4096, 256, 1, ["bf16"], warmup=1, iters=3, graphs=True)
    dec = case(8192, 1, 2, ["bf16", "fp8"], warmup=1, iters=3, graphs=True)
    for r in (pre, dec):
        assert r["sdpa_s"] > 0 and r["ours_bf16_s"] > 0
        assert r["sdpa_graph_s"] is not None and r["sdpa_graph_s"] > 0
        assert r["ours_bf16_graph_s"] > 0
        assert r["ratio_bf16_graph"] == r["ours_bf16_graph_s"] / r["sdpa_graph_s"]
        assert r["max_err_bf16"] < 5e-2
    assert dec["ours_fp8_graph_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_sweep_through_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    import long_attention

    monkeypatch.setattr(long_attention, "SWEEP_TILES", [(16, 64, 4, 2), (16, 128, 4, 2)])
    monkeypatch.setattr(long_attention, "SWEEP_SPLITS", (4, 16))
    r = long_attention.case(8192, 1, 1, ["bf16"], warmup=1, iters=3, sweep=True, graphs=True)
    assert r["sweep_timing"] == "graph"
    assert tuple(r["best_bf16_tiles"]) in long_attention.SWEEP_TILES
    assert r["best_bf16_splits"] in (4, 16)
    assert r["best_ratio_bf16"] == r["best_bf16_s"] / r["sdpa_graph_s"]
    assert len(r["sweep_bf16"]) == 4
    assert min(t for _, _, t in r["sweep_bf16"]) == r["best_bf16_s"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fp8_prefill_takes_the_scratch() -> None:
    """An FP8 prefill row runs the runner's path (the scratch, by the cost rule), a decode row
    the direct kernel; ``fp8direct`` times the direct kernel; both agree with SDPA."""
    from long_attention import case

    pre = case(8192, 2048, 1, ["bf16", "fp8", "fp8direct"], warmup=1, iters=3, graphs=True)
    dec = case(8192, 1, 2, ["fp8"], warmup=1, iters=3)
    assert pre["ours_fp8_path"] == "scratch" and dec["ours_fp8_path"] == "direct"
    for kv in ("fp8", "fp8direct"):
        assert pre[f"ours_{kv}_graph_s"] > 0
        assert pre[f"max_err_{kv}"] < 0.25  # e4m3 KV against bf16 SDPA
