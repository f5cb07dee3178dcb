"""benchmarks/decode_ragged.py: its ragged contexts, the decode steps it builds, its plot.

The timing itself needs CUDA graphs (a GPU); its runners are the engine's own
(``ModelRunner.enable_decode_graphs`` under ``PENSIEVE_DECODE_SPAN``), tested in
tests/test_engine.py.
"""

import random
import statistics

from bench_scripts import load

load("decode_step")
load("mixed_step")
dr = load("decode_ragged")


def test_ragged_contexts_follow_the_served_fit() -> None:
    rng = random.Random(0)
    xs = [c for _ in range(100) for c in dr.ragged_contexts(56, 1500.0, 1.23, 16000, rng)]
    assert min(xs) >= 16 and max(xs) <= 16000
    assert 1300 < statistics.median(xs) < 1700  # the median given
    assert statistics.mean(xs) > 1.8 * statistics.median(xs)  # a long tail (lognormal)


def test_step_gives_each_request_its_context_and_distinct_blocks() -> None:
    ctxs = [5, 40, 31, 100]
    free = list(range(64))
    sched = dr.step_for(ctxs, 16, random.Random(1), free)
    assert [r.ranges[0].start_pos for r in sched.requests] == ctxs
    assert all(len(r.ranges[0].token_ids) == 1 and r.sample for r in sched.requests)
    tables = [r.block_table for r in sched.requests]
    assert [len(t) for t in tables] == [c // 16 + 1 for c in ctxs]  # room for the new token
    blocks = [b for t in tables for b in t]
    assert len(set(blocks)) == len(blocks)


def test_plot_writes_a_figure(tmp_path) -> None:  # noqa: ANN001
    rows = [{"batch": b, "contexts": k, "floor_ms": 10.0, "unsplit_ms": 20.0, "span_ms": 15.0}
            for b in (32, 56) for k in ("uniform", "ragged")]
    dr.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_min_splits_sets_the_span_graphs_split_floor(monkeypatch) -> None:  # noqa: ANN001
    """--min-splits changes the split count the span graphs are captured with (the engine's
    rule reads the floor when a graph is captured); out-of-range values are refused."""
    import pytest
    import torch

    from pensieve.kernels import launch_policy

    monkeypatch.setattr(launch_policy, "DECODE_MIN_SPLITS", launch_policy.DECODE_MIN_SPLITS)
    cpu = torch.device("cpu")  # 4 "SMs": 56 x 10 programs fill it unsplit
    assert launch_policy.decode_kv_splits(56, 10, cpu) == 8
    dr.set_min_splits(2)
    assert launch_policy.decode_kv_splits(56, 10, cpu) == 2
    for bad in (0, launch_policy.MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="min-splits"):
            dr.set_min_splits(bad)
