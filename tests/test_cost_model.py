"""Chunk recompute cost model (pure Python) and its profiler on a tiny random model (CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pensieve.core.cost_model import DEFAULT_CONTEXT_LENS, CostModel, profile_key

# Uneven slopes, so that picking the wrong segment shows.
HAND = CostModel(
    chunk_size=32,
    context_lens=(100, 200, 400),
    attention_s=(1.0, 3.0, 4.0),  # slopes 0.02 then 0.005
    other_s=0.5,
)


def test_exact_at_points_and_midpoints() -> None:
    for x, y in zip(HAND.context_lens, HAND.attention_s, strict=True):
        assert HAND.attention_cost(x) == y
        assert HAND.chunk_cost(x) == y + 0.5
    assert HAND.attention_cost(150) == pytest.approx(2.0)
    assert HAND.attention_cost(300) == pytest.approx(3.5)
    assert HAND.chunk_cost(250) == pytest.approx(3.25 + 0.5)


def test_extrapolation_beyond_both_ends_and_clamp() -> None:
    # above: slope of the last segment (0.005 per token)
    assert HAND.attention_cost(600) == pytest.approx(5.0)
    assert HAND.attention_cost(10_400) == pytest.approx(54.0)
    # below: slope of the first segment (0.02 per token): 1 - 0.02 * 40 = 0.2
    assert HAND.attention_cost(60) == pytest.approx(0.2)
    assert HAND.attention_cost(50) == pytest.approx(0.0, abs=1e-12)
    # 1 - 0.02 * 100 = -1 -> clamped at 0; the constant part is still there
    assert HAND.attention_cost(0) == 0.0
    assert HAND.chunk_cost(0) == 0.5
    # a decreasing profile is clamped when extrapolated far above
    dec = CostModel(32, (0, 10), (2.0, 1.0), 0.0)
    assert dec.attention_cost(15) == pytest.approx(0.5)
    assert dec.attention_cost(1000) == 0.0
    # a single sample is a constant
    one = CostModel(32, (512,), (0.25,), 1.0)
    assert one.chunk_cost(0) == one.chunk_cost(10**6) == 1.25
    # non-integer context lengths interpolate too; negative ones are errors
    assert HAND.attention_cost(150.5) == pytest.approx(2.01)
    with pytest.raises(ValueError, match="context_len"):
        HAND.chunk_cost(-1)


def test_monotone_when_attention_increases() -> None:
    m = CostModel(
        32, (0, 512, 1024, 4096, 16384), (0.0, 0.1, 0.15, 0.5, 2.0), other_s=1.0
    )
    costs = [m.chunk_cost(x) for x in range(0, 40_000, 37)]
    assert all(b >= a for a, b in zip(costs, costs[1:], strict=False))
    assert costs[-1] > costs[0]


def test_analytic_grows_with_context() -> None:
    m = CostModel.analytic(40, 5120, 40, 10, 128, 13824)  # llama2-13b-gqa10
    assert m.source == "analytic" and m.chunk_size == 32
    assert m.context_lens == DEFAULT_CONTEXT_LENS
    assert m.other_s > 0
    # FLOP-only non-attention part: 2 * 32 tokens * 40 layers * weights per layer / 800 TFLOP/s
    weights = 5120 * (5120 + 2 * 1280) + 5120 * 5120 + 3 * 5120 * 13824
    assert m.other_s == pytest.approx(2 * 32 * 40 * weights / 800e12)
    costs = [m.chunk_cost(x) for x in (0, 100, 1000, 5000, 16384, 30000)]
    assert all(b > a for a, b in zip(costs, costs[1:], strict=False))
    # GQA with 10 KV heads at C=32 is bandwidth-bound: KV bytes / HBM rate at l = 16384
    kv_bytes = 2 * (16384 + 32) * 10 * 128 * 2 * 40
    assert m.attention_cost(16384) == pytest.approx(kv_bytes / 4.3e12)
    # more KV heads read more bytes; OPT-style 2-matrix MLP costs less than a gated one
    mha = CostModel.analytic(40, 5120, 40, 40, 128, 13824)
    assert mha.attention_cost(8192) > m.attention_cost(8192)
    assert CostModel.analytic(40, 5120, 40, 40, 128, 13824, gated_mlp=False).other_s < mha.other_s
    with pytest.raises(ValueError, match="num_layers"):
        CostModel.analytic(0, 5120, 40, 10, 128, 13824)
    with pytest.raises(ValueError, match="rates"):
        CostModel.analytic(40, 5120, 40, 10, 128, 13824, flops_per_s=0.0)


def test_json_round_trip(tmp_path) -> None:  # noqa: ANN001
    m = CostModel(
        32, (0, 512, 2048), (0.0, 1e-4, 5e-4), 2.5e-3, model_key="k", device="NVIDIA H200",
        dtype="bfloat16", measured_s=(2.5e-3, 2.6e-3, 3.0e-3),
    )
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    path = tmp_path / "sub" / "p.json"
    m.save(path)
    assert CostModel.load(path) == m
    assert CostModel.load(str(path)) == m
    a = CostModel.analytic(2, 64, 4, 2, 16, 128, model_key="tiny")
    a.save(tmp_path / "a.json")
    assert CostModel.load(tmp_path / "a.json") == a
    # lists are normalised to tuples (frozen, hashable, equal to the tuple form)
    from_lists = CostModel(32, [0, 1], [0.0, 1.0], 1)  # type: ignore[arg-type]
    assert from_lists == CostModel(32, (0, 1), (0.0, 1.0), 1.0)
    assert isinstance(from_lists.context_lens, tuple) and isinstance(from_lists.other_s, float)
    hash(m)


def test_load_rejects_malformed(tmp_path) -> None:  # noqa: ANN001
    good = CostModel(32, (0, 8), (0.0, 1.0), 1.0).to_dict()
    for change, match in (
        ({"format": "other"}, "not a cost model"),
        ({"version": 99}, "version"),
        ({"chunk_size": "32"}, "chunk_size"),
        ({"context_lens": [0, 8.5]}, "context_lens"),
        ({"attention_s": "x"}, "attention_s must be a list"),
        ({"other_s": None}, "other_s"),
        ({"device": 3}, "device"),
    ):
        with pytest.raises(ValueError, match=match):
            CostModel.from_dict({**good, **change})
    missing = dict(good)
    del missing["other_s"]
    with pytest.raises(ValueError, match="lacks 'other_s'"):
        CostModel.from_dict(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        CostModel.load(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        CostModel.load(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(context_lens=(), attention_s=()), "at least one"),
        (dict(attention_s=(0.0,)), "attention_s has 1 values for 2"),
        (dict(context_lens=(8, 0)), "strictly increasing"),
        (dict(context_lens=(8, 8)), "strictly increasing"),
        (dict(context_lens=(-8, 0)), ">= 0"),
        (dict(attention_s=(0.0, -1.0)), "attention_s must be >= 0"),
        (dict(attention_s=(0.0, math.nan)), "finite"),
        (dict(other_s=-1e-3), "other_s must be >= 0"),
        (dict(other_s=math.inf), "finite"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(measured_s=(1.0,)), "measured_s has 1"),
        (dict(measured_s=(1.0, -1.0)), "measured_s must be >= 0"),
        (dict(source="guess"), "source"),
    ],
)
def test_validation_errors(kwargs: dict, match: str) -> None:
    base: dict = dict(chunk_size=32, context_lens=(0, 8), attention_s=(0.0, 1.0), other_s=1.0)
    with pytest.raises(ValueError, match=match):
        CostModel(**{**base, **kwargs})


def test_profile_key_stable() -> None:
    key = profile_key("llama", 40, 5120, 40, 10, 128, 13824, "NVIDIA H200")
    assert key == "llama-L40-H5120-q40-kv10-d128-i13824__NVIDIA_H200"
    assert key == profile_key("llama", 40, 5120, 40, 10, 128, 13824, "NVIDIA H200")
    assert profile_key("opt", 2, 64, 4, 4, 16, 128, " NVIDIA A100-SXM4-80GB (MIG 1g/10gb) ") == (
        "opt-L2-H64-q4-kv4-d16-i128__NVIDIA_A100-SXM4-80GB_MIG_1g_10gb"
    )
    assert profile_key("llama", 40, 5120, 40, 40, 128, 13824, "NVIDIA H200") != key


def test_cost_model_imports_no_torch() -> None:
    code = (
        "import sys, pensieve.core.cost_model\n"
        "heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\nprint('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


# --------------------------------------------------------------------------- profiler (torch)


def _sane(m: CostModel, lens: tuple[int, ...]) -> None:
    assert m.source == "profile" and m.device == "cpu" and m.dtype == "float32"
    assert m.context_lens == lens
    assert len(m.attention_s) == len(m.context_lens) == len(m.measured_s)
    assert all(math.isfinite(t) and t >= 0 for t in (*m.attention_s, *m.measured_s, m.other_s))
    assert m.other_s > 0
    assert m.attention_s[0] == 0.0
    assert m.other_s == m.measured_s[0]


def test_profile_cost_tiny_llama() -> None:
    torch = pytest.importorskip("torch")
    from pensieve.models.loader import load_model
    from pensieve.runner.profiler import config_profile_key, profile_cost

    model, cfg = load_model("llama-tiny", dtype=torch.float32, device="cpu", load_format="dummy")
    lens = (0, 64, 200, 1024)  # 200: a chunk straddling two blocks; 1024 > max positions (512)
    m = profile_cost(model, chunk_size=32, context_lens=lens, warmup=1, iters=3)
    _sane(m, lens)
    assert all(b >= a for a, b in zip(m.attention_s, m.attention_s[1:], strict=False))
    assert m.model_key == config_profile_key(cfg, "cpu") == "llama-L2-H64-q4-kv2-d16-i128__cpu"
    assert CostModel.from_dict(m.to_dict()) == m
    # unsorted input is sorted; the raw (non-monotone) variant keeps the measured differences
    raw = profile_cost(model, context_lens=(128, 0), warmup=0, iters=1, monotone=False)
    _sane(raw, (0, 128))
    assert raw.attention_s[1] == max(0.0, raw.measured_s[1] - raw.measured_s[0])
    with pytest.raises(ValueError, match="empty"):
        profile_cost(model, context_lens=())


def test_profile_cost_tiny_opt_batched_and_given_caches(tmp_path) -> None:  # noqa: ANN001
    torch = pytest.importorskip("torch")
    from pensieve.models.loader import load_model
    from pensieve.runner.profiler import load_cost_model, profile_cost

    model, cfg = load_model("opt-tiny", dtype=torch.float32, device="cpu", load_format="dummy")
    lens = (0, 96, 600)  # 600 > OPT's 512 learned positions: positions wrap, context does not
    m = profile_cost(model, context_lens=lens, chunks_per_batch=3, warmup=1, iters=2)
    _sane(m, lens)
    # caller-provided caches (too small ones are refused); they get random contents
    caches = [torch.zeros(2, 40, 32, 4, 16) for _ in range(2)]
    m2 = profile_cost(model, context_lens=(0, 64), kv_caches=caches, warmup=0, iters=1)
    _sane(m2, (0, 64))
    assert all(bool(c.abs().sum() > 0) for c in caches)
    with pytest.raises(ValueError, match="too small"):
        profile_cost(model, context_lens=(0, 4096), kv_caches=caches, iters=1)
    # lookup: the saved profile by key, else the analytic estimate
    assert load_cost_model(str(tmp_path), cfg, "cpu").source == "analytic"
    m.save(tmp_path / f"{m.model_key}.json")
    assert load_cost_model(str(tmp_path), cfg, "cpu") == m
    assert load_cost_model(str(tmp_path), cfg, "cpu", chunk_size=16).source == "analytic"
    assert load_cost_model(None, cfg, "cpu").other_s > 0
