"""benchmarks/kernel_compare.py (Figure 12): every variant computes the same attention.

Without CUDA the Triton kernels run in Triton's interpreter (the script sets
``TRITON_INTERPRET=1`` on import), so the shapes are tiny: 4 query heads, 2 KV heads,
head_dim 32, float32, 32-token blocks in a random order.
"""

import json
import math
import warnings
from pathlib import Path

import kernel_compare as kc
import kernel_configs as cfgs
import kernel_variants as variants
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("q_len,ctx,batch", [
    (1, 40, 3), pytest.param(20, 0, 2, marks=pytest.mark.slow), (7, 70, 3)])
def test_variants_agree(q_len: int, ctx: int, batch: int) -> None:
    config = cfgs.homogeneous(q_len, ctx, batch=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = kc.run_config(config, cfgs.CHECK_SHAPE, torch.float32, DEVICE, timing=False,
                            check_ref=True)
    assert "not_run_ours" not in row
    assert row["agree_ref"], row
    for v in ("a", "b", "c"):
        assert f"not_run_{v}" not in row, row[f"not_run_{v}"]
        assert row[f"agree_{v}"], (v, row[f"err_{v}"])
    # FlexAttention: either it agrees, or why it did not run is recorded
    if "not_run_d" in row:
        assert row["not_run_d"].startswith("not run: ")
    else:
        assert row["agree_d"], row["err_d"]
    assert row["backend_a"] and row["backend_b"]
    kind = variants.mask_kind(q_len, ctx)
    assert {"none": "no mask", "causal": "is_causal",
            "lower_right": "causal_lower_right"}[kind] in row["backend_a"]


def test_problem_is_paged_non_contiguously() -> None:
    p = cfgs.make_problem(cfgs.homogeneous(7, 70, batch=3), cfgs.CHECK_SHAPE, torch.float32, "cpu")
    assert p.k_cache.shape[0] % 4 == 0
    used = p.tables_cpu[:, :3].reshape(-1)
    assert len(set(used.tolist())) == used.numel()  # no block shared
    assert (used[1:] - used[:-1] != 1).any()  # not one contiguous run
    assert p.range_start_pos.tolist() == [70] * 3
    assert p.query_start_loc.tolist() == [0, 7, 14, 21]


def _dense_blocks(bm, full: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import BlockMask

    num = bm.full_kv_num_blocks if full else bm.kv_num_blocks
    idx = bm.full_kv_indices if full else bm.kv_indices
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=bm.BLOCK_SIZE,
                                    seq_lengths=bm.seq_lengths).to_dense().bool()


@pytest.mark.parametrize("kv_block", [128, 32])
@pytest.mark.parametrize("groups", [
    [(2, 150, 40), (3, 1, 300), (1, 300, 0)],  # several query blocks, mixed
    [(1, 200, 2000)],  # one long request: full blocks exist
])
def test_flex_block_mask_matches_create_block_mask(groups, kv_block: int) -> None:
    """The block sparsity built from the block tables equals create_block_mask's (dense)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    config = cfgs.mixed(*(cfgs.Group(*g) for g in groups))
    p = cfgs.make_problem(config, cfgs.CHECK_SHAPE, torch.float32, "cpu")
    bm = variants.flex_block_mask(p, kv_block=kv_block)
    slots = p.k_cache.shape[0] * p.shape.chunk
    ref = flex.create_block_mask(bm.mask_mod, None, None, p.num_tokens, slots, device="cpu",
                                 BLOCK_SIZE=(128, kv_block))
    assert torch.equal(bm.to_dense().bool(), ref.to_dense().bool())  # every block needed
    mine_full, ref_full = _dense_blocks(bm, True), _dense_blocks(ref, True)
    assert torch.equal(mine_full, ref_full)  # full exactly where the mask is all true
    if len(groups) == 1:
        assert mine_full.any()

    # the mask itself, densely: token t sees slot s iff s holds a position <= t's of its request
    q_idx = torch.arange(p.num_tokens)[:, None]
    kv_idx = torch.arange(slots)[None, :]
    dense = bm.mask_mod(None, None, q_idx, kv_idx)
    for r in range(len(p.q_lens)):
        t0, t1 = p.qsl[r], p.qsl[r + 1]
        kv_len = p.ctxs[r] + p.q_lens[r]
        pages = p.tables_cpu[r, :math.ceil(kv_len / 32)].long()
        pos = torch.arange(kv_len)
        s = pages[pos // 32] * 32 + pos % 32
        assert int(dense[t0:t1].sum()) == sum(p.ctxs[r] + i + 1 for i in range(p.q_lens[r]))
        assert torch.equal(dense[t1 - 1, s], torch.ones(kv_len, dtype=torch.bool))


def test_batch_size_and_grid() -> None:
    assert cfgs.batch_size(1, 16384) == 64
    assert cfgs.batch_size(512, 0) == 16
    assert cfgs.batch_size(16, 1024) == 64
    assert cfgs.batch_size(512, 16384, max_kv_tokens=100_000) == 5
    assert cfgs.batch_size(4096, 10**7) == 1
    configs = cfgs.grid_configs()
    names = [c.name for c in configs]
    assert len(names) == len(set(names)) == 6 * 4 + 2
    for c in configs:
        assert c.kv_tokens <= cfgs.MAX_KV_TOKENS
    assert [c.name for c in cfgs.select_configs(configs, "q1_*,mixed*")] == [
        "q1_ctx0", "q1_ctx1024", "q1_ctx4096", "q1_ctx16384",
        "mixed_1x512@0+63x1@2048", "mixed_4x128@4096+60x1@1024"]
    assert variants.mask_kind(1, 0) == "none" and variants.mask_kind(16, 0) == "causal"
    assert variants.mask_kind(16, 1024) == "lower_right"


def test_timing_table_plot_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing path's bookkeeping, with the CUDA-event timer replaced by a fixed time."""
    times = {"ours": 10.0, "a": 5.0, "b": 20.0, "c": 40.0, "d": 80.0}
    calls = []

    def fake_time(fn, warmup, iters, budget_s):  # noqa: ANN001, ANN202
        calls.append(fn)
        return 0.0

    monkeypatch.setattr(kc, "time_part", fake_time)
    config = cfgs.mixed(cfgs.Group(1, 5, 0), cfgs.Group(2, 1, 40))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = kc.run_config(config, cfgs.CHECK_SHAPE, torch.float32, DEVICE, timing=True,
                            variants=("ours", "a", "b", "c"))
    # one timed part for ours and c, one per homogeneous sub-batch for a and b
    assert len(calls) == 1 + 2 + 2 + 1
    assert row["a_parts"] == row["b_parts"] == 2 and "note" in row
    row.update({f"{v}_us": t for v, t in times.items()})
    row["ours_over_a"], row["b_over_ours"] = 2.0, 2.0
    table = kc.format_table([row], timing=True)
    assert config.name in table and "ours/a" in table and cfgs.MIXED_NOTE in table
    png = tmp_path / "fig12.png"
    kc.plot([row], str(png))
    assert png.stat().st_size > 1000

    out = tmp_path / "r.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = kc.main(["--check", "--configs", "q1_*", "--variants", "ours,a,b", "--out",
                        str(out)])
    saved = json.loads(out.read_text())
    assert [r["config"] for r in saved] == [r["config"] for r in rows] == ["q1_ctx40"]
    assert saved[0]["agree_a"] and saved[0]["agree_b"] and saved[0]["torch"]
