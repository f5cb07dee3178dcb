"""A step's scheduled ranges flattened into the token layout the attention kernels read.

Both ways a step runs build the same layout: the eager path (``ModelRunner.prepare_inputs``,
uploaded as it is) and the CUDA-graph path (``MixedGraphs.fill``, written into static
buffers). :func:`range_layout` computes it once, with numpy over all ranges at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pensieve.core.outputs import QueryRange, SchedulerOutput


@dataclass
class RangeLayout:
    """Per range, in the step's token order: ``req`` (the request's index), ``starts`` (its
    first position), ``qlens`` (its tokens), ``ends`` (where its tokens end in the step);
    per token: ``ids``, ``positions``, ``slots`` (KV cache slot); ``rows``: the last token of
    each sampled request's last range, in request order (its logits row)."""

    req: np.ndarray
    starts: np.ndarray
    qlens: np.ndarray
    ends: np.ndarray
    ids: list[int]
    positions: np.ndarray
    slots: np.ndarray
    rows: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0


def range_layout(sched: SchedulerOutput, items: list[tuple[int, int, QueryRange]],
                 tables: np.ndarray, chunk: int) -> RangeLayout:
    """The layout of ``items`` (``SchedulerOutput.ranges_in_order``). Writes each request's
    block table into its row of ``tables`` (``[num_requests or more, max_blocks]``; the rest of
    a row is left as it is) and reads the slots from there."""
    reqs = sched.requests
    for i, s in enumerate(reqs):
        tables[i, : len(s.block_table)] = s.block_table
    n = len(items)
    req = np.fromiter((i for i, _, _ in items), np.int64, n)
    starts = np.fromiter((rng.start_pos for _, _, rng in items), np.int64, n)
    qlens = np.fromiter((rng.query_len for _, _, rng in items), np.int64, n)
    ends = np.cumsum(qlens)
    t = int(ends[-1]) if n else 0
    pos = np.arange(t, dtype=np.int64) + np.repeat(starts - (ends - qlens), qlens)
    slots = tables[np.repeat(req, qlens), pos // chunk].astype(np.int64) * chunk + pos % chunk
    last = np.fromiter((j == len(reqs[i].ranges) - 1 for i, j, _ in items), np.bool_, n)
    req_end = np.zeros(len(reqs), dtype=np.int64)
    req_end[req[last]] = ends[last]
    sample = np.fromiter((s.sample for s in reqs), np.bool_, len(reqs))
    return RangeLayout(req=req, starts=starts, qlens=qlens, ends=ends,
                       ids=[tok for _, _, rng in items for tok in rng.token_ids],
                       positions=pos, slots=slots, rows=req_end[sample] - 1)
