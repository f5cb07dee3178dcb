"""Steps with prefill tokens replayed from CUDA graphs (:class:`MixedGraphs`).

Mixed steps (prefill ranges, with or without decodes) have ranges of any number and length,
and the attention kernel's grid normally follows them. :class:`MixedGraphs` captures per
*token bucket* with a fixed number of range slots and runs the attention kernel in its
static-grid mode: the host cuts the step's ranges into work items for fixed tiles
(:func:`pensieve.kernels.launch.work_items_for`), and the grid is the bound on the item count
of the bucket, the surplus programs exiting at once.
"""

from __future__ import annotations

import torch

from pensieve.core.outputs import SchedulerOutput
from pensieve.core.tiered_cache import cdiv
from pensieve.kernels.launch_policy import (
    SPAN_ALIGN,
    decode_kv_splits,
    decode_split_span,
    mixed_kv_splits,
    mixed_split_items,
    mixed_split_span,
    use_split_span,
)
from pensieve.layers.attention import AttentionMetadata, first_attention
from pensieve.runner.cuda_graph import StepGraphs
from pensieve.runner.graph_waits import GraphLayerWaits
from pensieve.runner.step_layout import range_layout

MIXED_GRAPH_MAX_TOKENS = 512
"""Mixed steps of more tokens run eagerly: past a few hundred prefill tokens an eager step's
host time already hides behind the GPU's work, while a graph padded to a coarse bucket pays
for its padding tokens (docs/performance_history.md, "Steps with prefill tokens: mixed-step CUDA
graphs"). Graphs pay off where the host's launch time dominates: few prefill tokens."""


def token_buckets(max_tokens: int) -> list[int]:
    """16, then multiples of 32 to 256, of 64 to 512, of 256 to 2048, then of 512, up to and
    including ``max_tokens``: a padded step wastes at most 32 tokens up to 256 and 64 up to
    512, where the step's time still grows with every token."""
    sizes = [16, *range(32, 257, 32), *range(320, 513, 64), *range(768, 2049, 256)]
    sizes = [b for b in sizes if b < max_tokens]
    sizes += [b for b in range(2560, max_tokens, 512)]
    sizes.append(max_tokens)
    return sorted(set(sizes))


MIXED_TILES = (64, 64, 4, 3)
"""Attention tiles of mixed-step graphs: the shape the launcher picks for batches of short
and long ranges together (docs/performance_history.md, "Attention kernel")."""


class MixedGraphs(StepGraphs):
    """Static-buffer forward of any step with up to ``max_tokens`` tokens in up to
    ``max_ranges`` query ranges (of at most as many requests), captured per token bucket.

    Padding: tokens past the step's get slot ``-1`` and belong to no range; range slots past
    the step's are empty (``query_start_loc`` repeats the token count) and have no work items;
    the logits rows past the sampled requests' are garbage and never read.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        chunk_size: int,
        max_tokens: int,
        max_ranges: int,
        max_blocks: int,
        capture: bool = True,
        layer_waits: GraphLayerWaits | None = None,
        decodes: str = "split",
        span_mode: str = "auto",
        kv_splits: bool = True,
    ) -> None:
        """``layer_waits``: captured per-group swap-in waits (:mod:`pensieve.runner.graph_waits`;
        None: a step with swap-ins waits for all of them before its replay). ``decodes``
        (:data:`~pensieve.kernels.launch_policy.MIXED_DECODES`): ``split`` gives the one-token
        ranges a decode launch of their own over ``min(bucket, max_ranges)`` range slots, KV
        split by a span set per step, where the step's decodes are ragged (``span_mode``: as
        :data:`~pensieve.kernels.launch_policy.DECODE_SPAN_MODE`);
        a step whose decodes are not puts them with its other ranges and leaves the decode
        launch empty (a launch of their own cost more there: docs/performance_history.md,
        "Steps with prefill over ragged decodes"). ``kv_splits``: the other ranges' attention
        splits KV by a span set per step (the default: unsplit, a turn of a few tokens after
        thousands of cached ones runs on a few programs per KV head; docs/performance_history.md,
        "KV splits for the turns of mixed-step graphs"); tests compare it with False."""
        if min(max_tokens, max_ranges, max_blocks) < 1:
            raise ValueError(f"max_tokens {max_tokens}, max_ranges {max_ranges} and max_blocks "
                             f"{max_blocks} must be >= 1")
        attn = first_attention(model)
        if attn is None:
            raise ValueError("the model has no PagedAttention layer")
        self.model = model
        self.kv_caches = kv_caches
        self.chunk_size = chunk_size
        self.layer_waits = layer_waits
        """Armed before a replay with swap-ins; None: wait for all of them instead."""
        self.split_decodes = decodes == "split"
        self.span_mode = span_mode
        self.kv_splits = kv_splits
        self.num_kv_heads = kv_caches[0].shape[-2]
        self._split_items = (mixed_split_items(self.num_kv_heads, kv_caches[0].device)
                             if self.kv_splits else 0)
        """The most work items the KV splits add to a step's (0 unsplit)."""
        self._captured_waits = layer_waits
        """Keeps the events the captured graphs wait on alive as long as the graphs."""
        self.max_tokens = max_tokens = min(max_tokens, MIXED_GRAPH_MAX_TOKENS)
        self.max_ranges = max_ranges
        self.max_blocks = max_blocks
        self.group = attn.num_heads // attn.num_kv_heads
        self.buckets = token_buckets(max_tokens)
        t, r, mb = max_tokens, max_ranges, max_blocks
        self.max_items = self._items_bound(t)
        # int64: [ids | positions | slots | logits rows]
        # int32: [query_start_loc | start_pos | range_table | tables | work items
        #         | the decode launch's query_start_loc | start_pos | range_table | span
        #         | the work items' split span | item count]
        self._init_buffers(3 * t + r, (r + 1) + 2 * r + r * mb + self.max_items
                           + (r + 1) + 2 * r + 3, kv_caches[0].device)
        d64, d32 = self._dev64, self._dev32
        self.input_ids, self.positions = d64[:t], d64[t : 2 * t]
        self.slot_mapping, self.logits_rows = d64[2 * t : 3 * t], d64[3 * t :]
        o = r + 1
        self.query_start_loc = d32[:o]
        self.range_start_pos, self.range_table = d32[o : o + r], d32[o + r : o + 2 * r]
        o += 2 * r
        self.block_tables = d32[o : o + r * mb].view(r, mb)
        o += r * mb
        self.work_items, self.num_work_items = d32[o : o + self.max_items], d32[-1:]
        self.items_span = d32[-2:-1]
        o += self.max_items
        self._dec_at = o  # where the decode launch's arrays start in the int32 buffers
        self.dec_query_start_loc = d32[o : o + r + 1]
        self.dec_start_pos = d32[o + r + 1 : o + 2 * r + 1]
        self.dec_range_table = d32[o + 2 * r + 1 : o + 3 * r + 1]
        self.dec_span = d32[o + 3 * r + 1 : o + 3 * r + 2]
        if capture:
            self.capture()

    def _items_bound(self, tokens: int) -> int:
        return cdiv(tokens * self.group, MIXED_TILES[0]) + self.max_ranges + self._split_items

    def _items_splits(self, bucket: int) -> int:
        """KV splits of the work items' launch in the graph of ``bucket`` tokens."""
        if not self.kv_splits:
            return 1
        return mixed_kv_splits(bucket, self.group, MIXED_TILES[0], self.num_kv_heads,
                               self.device)

    # ------------------------------------------------------------------ forward on the buffers
    def _forward(self, bucket: int) -> torch.Tensor:
        splits = self._items_splits(bucket)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc,
            range_start_pos=self.range_start_pos,
            range_table=self.range_table,
            block_tables=self.block_tables,
            max_query_len=bucket,
            work_items=self.work_items[: self._items_bound(bucket)],
            num_work_items=self.num_work_items,
            tiles=MIXED_TILES,
            num_kv_splits=splits,
            kv_split_span=self.items_span if splits > 1 else None,
            layer_ready=None if self.layer_waits is None else self.layer_waits.wait,
        )
        if self.split_decodes:
            n = min(bucket, self.max_ranges)
            meta.decode = AttentionMetadata(
                slot_mapping=meta.slot_mapping, query_start_loc=self.dec_query_start_loc[: n + 1],
                range_start_pos=self.dec_start_pos[:n], range_table=self.dec_range_table[:n],
                block_tables=self.block_tables, max_query_len=1,
                num_kv_splits=decode_kv_splits(n, self.num_kv_heads, self.device),
                kv_split_span=self.dec_span)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches,
                            meta)
        return self.model.compute_logits(hidden[self.logits_rows])

    def _dummy_inputs(self) -> None:
        """No ranges, no work items; every token skips the KV store."""
        t = self.max_tokens
        self._np64[:] = 0
        self._np64[2 * t : 3 * t] = -1
        self._np32[:] = 0
        self._np32[self._dec_at + 3 * self.max_ranges + 1] = SPAN_ALIGN
        self._np32[-2] = SPAN_ALIGN

    def _rows(self, sched: SchedulerOutput) -> int:
        return sum(1 for s in sched.requests if s.sample)

    # ------------------------------------------------------------------ one step
    def can_run(self, sched: SchedulerOutput) -> bool:
        reqs = sched.requests
        if not reqs or len(reqs) > self.max_ranges:
            return False
        ranges = sum(len(s.ranges) for s in reqs)
        tokens = sum(r.query_len for s in reqs for r in s.ranges)
        return (0 < tokens <= self.max_tokens and ranges <= self.max_ranges
                and all(len(s.block_table) <= self.max_blocks for s in reqs))

    def fill(self, sched: SchedulerOutput) -> int:
        """Write a step's inputs into the static buffers; returns its bucket. With
        :attr:`split_decodes` and ragged decodes the one-token ranges come first, in the
        decode launch's arrays, and the others after them."""
        from pensieve.kernels.launch import work_items_for

        t_max, r_max, mb, c = self.max_tokens, self.max_ranges, self.max_blocks, self.chunk_size
        np64, np32 = self._np64, self._np32
        ids, positions = np64[:t_max], np64[t_max : 2 * t_max]
        slots, rows = np64[2 * t_max : 3 * t_max], np64[3 * t_max :]
        qsl = np32[: r_max + 1]
        start, rtab = np32[r_max + 1 : 2 * r_max + 1], np32[2 * r_max + 1 : 3 * r_max + 1]
        o = 3 * r_max + 1
        tables = np32[o : o + r_max * mb].reshape(r_max, mb)
        work = np32[o + r_max * mb : o + r_max * mb + self.max_items]
        o = self._dec_at
        dqsl, dstart = np32[o : o + r_max + 1], np32[o + r_max + 1 : o + 2 * r_max + 1]
        drtab = np32[o + 2 * r_max + 1 : o + 3 * r_max + 1]
        dec_lens = sched.decode_kv_lens() if self.split_decodes else []
        split = bool(dec_lens) and use_split_span(dec_lens, self.span_mode)
        items, num_dec = sched.ranges_in_order(decodes_first=split)
        lay = range_layout(sched, items, tables, c)
        t, d, r = lay.num_tokens, num_dec, len(items) - num_dec
        ids[:t], positions[:t], slots[:t] = lay.ids, lay.positions, lay.slots
        # the decode launch's ranges, then the others'
        dstart[:d], drtab[:d], dqsl[1 : d + 1] = lay.starts[:d], lay.req[:d], lay.ends[:d]
        start[:r], rtab[:r], qsl[1 : r + 1] = lay.starts[d:], lay.req[d:], lay.ends[d:]
        k = len(lay.rows)
        rows[:k] = lay.rows
        bucket = self.bucket_for(t)
        ids[t:bucket] = 0
        positions[t:bucket] = 0
        slots[t:bucket] = -1
        qsl[0] = num_dec
        qsl[r + 1 :] = t
        start[r:] = 0
        rtab[r:] = 0
        rows[k:] = 0
        dqsl[0] = 0
        dqsl[d + 1 :] = d
        dstart[d:] = 0
        drtab[d:] = 0
        if self.split_decodes:  # an empty decode launch where the decodes are not ragged
            span = (decode_split_span(dec_lens, self.num_kv_heads, self.device) if split
                    else SPAN_ALIGN)
            np32[self._dec_at + 3 * r_max + 1] = span
        span = SPAN_ALIGN
        if self.kv_splits:
            span = mixed_split_span(lay.qlens[d:], lay.starts[d:], self.group, MIXED_TILES[0],
                                    self.num_kv_heads, self.device)
        items_ = work_items_for(lay.qlens[d:], self.group, MIXED_TILES[0], lay.starts[d:],
                                self._items_splits(bucket), span, MIXED_TILES[1])
        if len(items_) > self._items_bound(bucket):  # cannot happen (mixed_split_items)
            raise RuntimeError(f"{len(items_)} work items over the graph's bound")
        work[: len(items_)] = items_
        np32[-1] = len(items_)
        np32[-2] = span
        self._copy_in()
        return bucket
