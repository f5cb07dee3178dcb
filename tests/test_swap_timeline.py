"""benchmarks/swap_timeline.py on the CPU: the stream wrapper changes no copy and labels each
operation; the summary and the figure come from the operations."""

from __future__ import annotations

import functools
import itertools
import random
from pathlib import Path

import pytest
from bench_scripts import load
from swap_util import apply_reference, assert_tiers, make_caches, make_swapper, run_step, snapshot

from pensieve.core.outputs import SwapPlan
from pensieve.runner.swap_streams import Immediate

tl_mod = load("swap_timeline")


class ClockEvent:
    """A timing event of a fake clock that ticks at each record."""

    ticks = itertools.count()

    def record(self, stream: object = None) -> None:
        self.t = next(self.ticks)

    def elapsed_time(self, other: ClockEvent) -> float:
        return float(other.t - self.t)


class NamedImmediate(Immediate):
    """Runs everything at once, with a distinct object per copy stream."""

    in_stream, out_stream, dma_stream, in_dma_stream = "in", "out", "dma", "indma"  # type: ignore[assignment]


def test_op_label_names_the_function_and_its_scalar_arguments() -> None:
    def _dma_group(stage: object, cpu: object, start: int, stop: int) -> None:
        pass

    assert tl_mod.op_label(functools.partial(_dma_group, object(), [1], 0, 5)) == \
        "dma_group 0 5"
    assert tl_mod.op_label(functools.partial(_dma_group, True, None, 5, 10)) == \
        "dma_group 5 10"
    assert tl_mod.op_label(lambda: None) == "<lambda>"


@pytest.mark.parametrize("out_groups", [1, 2])
def test_wrapped_staged_streams_copy_as_before_and_mark_every_operation(out_groups: int
                                                                        ) -> None:
    caches = make_caches(layers=4, blocks=24)
    inner = NamedImmediate()
    sw = make_swapper(caches, 16, "staged", streams=inner, in_groups=2, staging_chunks=2)
    sw.out_groups = out_groups
    tl = tl_mod.TimelineStreams(inner, event=ClockEvent)
    sw._streams = tl
    rng = random.Random(0)
    g = rng.sample(range(24), 6)
    c = rng.sample(range(16), 6)
    plan = SwapPlan(swap_in=list(zip(c[:3], g[:3], strict=True)),
                    swap_out=list(zip(g[3:], c[3:], strict=True)))
    gpu, cpu = snapshot(sw)
    apply_reference(gpu, cpu, plan)
    run_step(sw, plan)
    assert_tiers(sw, gpu, cpu)
    ops = {(s, label.split(" ")[0]) for s, label, _, _ in tl.marks}
    # swap-ins: copies by group into the staging halves (in-dma stream), scatters (in stream);
    # swap-outs: a gather on the out stream and the host copies on the dma stream (by
    # groups of layers: a gather and copies per group)
    out = ({("out", "kernel"), ("dma", "dma_rows")} if out_groups == 1 else
           {("out", "gather"), ("dma", "dma_out_group")})
    assert {("in_dma", "dma_group"), ("in", "scatter"), ("in", "upload"), *out} <= ops
    groups = sorted({label for s, label, _, _ in tl.marks if label.startswith("dma_group")})
    assert groups == ["dma_group 0 2", "dma_group 2 4"]
    for _, _, a, b in tl.marks:
        assert b.t > a.t


def test_summary_and_figure(tmp_path: Path) -> None:
    ops = [{"stream": "in", "op": "dma_group 0 5", "start_ms": 0.1, "end_ms": 1.0},
           {"stream": "in", "op": "scatter", "start_ms": 1.0, "end_ms": 1.1},
           {"stream": "out", "op": "kernel 0 40 out0", "start_ms": 0.2, "end_ms": 0.4},
           {"stream": "dma", "op": "dma_rows", "start_ms": 0.4, "end_ms": 9.0},
           {"stream": "compute", "op": "layer 0 ready", "start_ms": 1.2, "end_ms": 1.2},
           {"stream": "compute", "op": "last layer ready", "start_ms": 8.0, "end_ms": 8.0}]
    s = tl_mod.summary(ops)
    assert s == {"layer0_ms": 1.2, "last_layer_ms": 8.0, "in_done_ms": 1.1,
                 "out_done_ms": 9.0, "all_done_ms": 9.0}
    assert "dma_rows" in tl_mod.fmt_ops(ops)
    path = tmp_path / "t.png"
    tl_mod.plot({"staged in+out, 64 chunks": ops}, str(path))
    assert path.stat().st_size > 1000
