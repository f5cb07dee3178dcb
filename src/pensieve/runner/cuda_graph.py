"""Steps replayed from CUDA graphs: decode-only steps (:class:`DecodeGraphs`) and every other
step that fits (:class:`MixedGraphs`).

A decode-only step (every request computes exactly one token and samples it) launches the same
~15 kernels per layer every time; from Python that costs tens of milliseconds of host time per
step, more than the GPU needs at small batches. :class:`DecodeGraphs` captures the forward pass
plus the LM head once per *batch bucket* (1, 2, 4, 8, then multiples of 8 up to
``max_batch``) over static input buffers, and replays the smallest bucket that holds the batch.

Padding. A batch of ``n`` requests replays bucket ``b >= n``: tokens ``n..b-1`` get slot ``-1``
(the KV store skips them) and belong to no query range (``query_start_loc`` stays at ``n``), so
the attention kernel neither reads nor writes anything for them; their logits are garbage and
are never looked at. Block tables are ``[b, max_blocks]`` with ``max_blocks`` covering
``max_model_len``; the kernels read lengths from device memory, so one graph serves every
context length.

Inputs go through two pinned host buffers (int64: ids, positions, slots; int32: query offsets,
start positions, block tables) filled with numpy and copied with one non-blocking copy each
into device buffers whose views the graphs were captured on. The previous step has always
synchronised (sampling reads the tokens), so the host buffers are free to overwrite.

``capture=False`` runs the very same padded static-buffer forward eagerly: that is how the CPU
tests check the padding against the ordinary path, and what runs where CUDA graphs cannot.

Every other step that fits replays from :class:`~pensieve.runner.mixed_graphs.MixedGraphs`
(:mod:`pensieve.runner.mixed_graphs`), a :class:`StepGraphs` too.
"""

from __future__ import annotations

import numpy as np
import torch

from pensieve.core.outputs import SchedulerOutput
from pensieve.kernels.launch_policy import (
    LONG_DECODE_KV,
    decode_kv_splits,
    decode_split_span,
    is_long_decode,
    use_split_span,
)
from pensieve.layers.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... (multiples of 8) up to and including ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    sizes.append(max_batch)
    return sorted(set(sizes))


def capture_buckets(buckets: list[int], forward, device: torch.device, pool=None):  # noqa: ANN001, ANN202
    """One graph per bucket, largest first, sharing one memory pool (``pool``: another set's,
    None: a new one); returns (graphs, outputs, pool)."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for bucket in reversed(buckets):
            for _ in range(2):  # compile and autotune outside the capture
                forward(bucket)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[bucket] = forward(bucket)
            pool = graph.pool()
            graphs[bucket] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs, outputs, pool


def is_decode_step(sched: SchedulerOutput) -> bool:
    """Every request computes one token (one range of length 1) and samples it."""
    return bool(sched.requests) and all(
        s.sample and len(s.ranges) == 1 and s.ranges[0].query_len == 1 for s in sched.requests
    )


class StepGraphs:
    """What both graph kinds share: two pinned host buffers (int64, int32) mirrored by device
    buffers the graphs read, one graph per bucket, and the replay of a filled step.
    Subclasses lay out the buffers, and define ``_forward(bucket)``, ``_dummy_inputs()`` (what
    the buffers hold during capture), ``fill(sched) -> bucket`` and ``_rows(sched)`` (how
    many logits rows the step samples)."""

    buckets: list[int]

    def _init_buffers(self, n64: int, n32: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self._host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self._dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.captured = False
        self.pool = None
        """The memory pool of the captured graphs (:meth:`capture`)."""

    def _forward(self, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    def _dummy_inputs(self) -> None:
        raise NotImplementedError

    def fill(self, sched: SchedulerOutput) -> int:
        raise NotImplementedError

    def _rows(self, sched: SchedulerOutput) -> int:
        raise NotImplementedError

    def _copy_in(self, non_blocking: bool = True) -> None:
        """Everything is copied whole: one copy each, no per-bucket views to keep in sync."""
        self._dev64.copy_(self._host64, non_blocking=non_blocking)
        self._dev32.copy_(self._host32, non_blocking=non_blocking)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:  # noqa: ANN001
        """Capture one graph per bucket, largest first, sharing one memory pool: ``pool``
        (an earlier capture's: graph replays never overlap), or a new one (kept in
        ``self.pool``)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        self._dummy_inputs()
        self._copy_in(non_blocking=False)
        self._graphs, self._logits, self.pool = capture_buckets(self.buckets, self._forward,
                                                         self.device, pool)
        self.captured = True

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} exceeds the largest bucket {self.buckets[-1]}")

    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits of the step's sampled requests (caller checked ``can_run``)."""
        return self.replay(sched, self.fill(sched))

    def replay(self, sched: SchedulerOutput, bucket: int) -> torch.Tensor:
        """The step's forward from the buffers :meth:`fill` wrote (``bucket``: what it
        returned): the logits of its sampled requests."""
        if self.captured:
            self._graphs[bucket].replay()
            logits = self._logits[bucket]
        else:
            logits = self._forward(bucket)
        return logits[: self._rows(sched)]


class DecodeGraphs(StepGraphs):
    """Static-buffer decode forward for batches up to ``max_batch``, captured per bucket."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        chunk_size: int,
        max_batch: int,
        max_blocks: int,
        capture: bool = True,
        span_mode: str = "0",
    ) -> None:
        """``span_mode`` (as :data:`pensieve.kernels.launch_policy.DECODE_SPAN_MODE`):
        ``"1"``, decode attention splits each range's KV by a span set per step from its
        contexts (:func:`~pensieve.kernels.launch_policy.decode_split_span`); ``"0"``, the
        launcher's split rule; ``"auto"``, both variants are captured over the same buffers,
        and :meth:`fill` picks the span one for ragged steps.

        Decode tiles by context: where ``max_blocks * chunk_size`` reaches
        ``launch_policy.LONG_DECODE_KV``, every (span variant, bucket) is captured twice, for
        the short and the long class (``AttentionMetadata.long_context``: 128-position KV tiles,
        up to 128 splits), and :meth:`fill` picks the class from the step's longest context, so
        a replay never runs the other class's tile."""
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(f"max_batch {max_batch} and max_blocks {max_blocks} must be >= 1")
        self.model = model
        self.kv_caches = kv_caches
        self.chunk_size = chunk_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.buckets = batch_buckets(max_batch)
        device = kv_caches[0].device
        b = max_batch
        # int64: [ids | positions | slots]; int32: [query_start_loc | start_pos | tables | span]
        self._init_buffers(3 * b, (b + 1) + b + b * max_blocks + 1, device)
        self.input_ids = self._dev64[:b]
        self.positions = self._dev64[b : 2 * b]
        self.slot_mapping = self._dev64[2 * b :]
        self.query_start_loc = self._dev32[: b + 1]
        self.range_start_pos = self._dev32[b + 1 : 2 * b + 1]
        self.block_tables = self._dev32[2 * b + 1 : -1].view(b, max_blocks)
        self.kv_split_span = self._dev32[-1:]
        self.range_table = torch.arange(b, dtype=torch.int32, device=device)
        self.num_kv_heads = kv_caches[0].shape[-2]
        self.span_mode = span_mode
        self.variants = {"0": (False,), "1": (True,), "auto": (False, True)}[span_mode]
        """Which attention variants are captured: unsplit by span (False), split (True)."""
        self.split_span = self.variants[0]
        """The variant of the step :meth:`fill` last wrote (that :meth:`replay` runs)."""
        self.tile_classes = (False, True) if max_blocks * chunk_size >= LONG_DECODE_KV \
            else (False,)
        """The length classes captured: short (False) and, where a context can reach
        ``LONG_DECODE_KV``, long (True)."""
        self.long_context = False
        """The length class of the step :meth:`fill` last wrote."""
        self._by_variant: dict[tuple[bool, bool], tuple[dict, dict]] = {}
        """Each (span variant, length class)'s graphs and logits, per bucket, once captured."""
        self.logits_out: torch.Tensor | None = None
        """``[max_batch, vocab]`` float32: every bucket's logits, of either variant, are a view
        of it (one buffer held, not one per bucket: ~0.5 GB at 256 requests and a 32k
        vocabulary; the step's sampling reads it before the next replay)."""
        if capture:
            self.capture()

    @torch.inference_mode()
    def capture(self, pool=None) -> None:  # noqa: ANN001
        """Capture every (span variant, length class)'s graphs into one memory pool."""
        for v in self.variants:
            for long in self.tile_classes:
                self.split_span, self.long_context = v, long
                super().capture(pool)
                pool = self.pool
                self._by_variant[(v, long)] = (self._graphs, self._logits)

    # ------------------------------------------------------------------ forward on the buffers
    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            range_start_pos=self.range_start_pos[:bucket],
            range_table=self.range_table[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            long_context=self.long_context,
        )
        if self.split_span:
            meta.num_kv_splits = decode_kv_splits(bucket, self.num_kv_heads, self.device,
                                                  self.long_context)
            meta.kv_split_span = self.kv_split_span
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches,
                            meta)
        logits = self.model.compute_logits(hidden)
        if self.logits_out is None:  # the largest bucket comes first (outside any capture)
            self.logits_out = logits.new_empty((self.max_batch, logits.shape[1]))
        out = self.logits_out[:bucket]
        out.copy_(logits)
        return out

    def _dummy_inputs(self) -> None:
        """Every token skips the KV store and attends to position 0 of block 0."""
        b = self.max_batch
        self._np64[:] = 0
        self._np64[2 * b :] = -1
        self._np32[:] = 0
        self._np32[: b + 1] = np.arange(b + 1)

    def _rows(self, sched: SchedulerOutput) -> int:
        return len(sched.requests)

    # ------------------------------------------------------------------ one step
    def can_run(self, sched: SchedulerOutput) -> bool:
        return (
            len(sched.requests) <= self.max_batch
            and is_decode_step(sched)
            and all(len(s.block_table) <= self.max_blocks for s in sched.requests)
        )

    def fill(self, sched: SchedulerOutput) -> int:
        """Write a decode step's inputs into the static buffers; returns its bucket."""
        n = len(sched.requests)
        bucket = self.bucket_for(n)
        b, c, mb = self.max_batch, self.chunk_size, self.max_blocks
        np64, np32 = self._np64, self._np32
        pos = np.fromiter((s.ranges[0].start_pos for s in sched.requests), np.int64, n)
        np64[:n] = np.fromiter((s.ranges[0].token_ids[0] for s in sched.requests), np.int64, n)
        np64[b : b + n] = pos
        tables = np32[2 * b + 1 : -1].reshape(b, mb)
        for i, s in enumerate(sched.requests):
            table = s.block_table
            tables[i, : len(table)] = table
        np64[2 * b : 2 * b + n] = tables[np.arange(n), pos // c].astype(np.int64) * c + pos % c
        np64[2 * b + n : 2 * b + bucket] = -1
        np32[: n + 1] = np.arange(n + 1)
        np32[n + 1 : bucket + 1] = n
        np32[b + 1 : b + 1 + n] = pos
        kv_lens = (pos + 1).tolist()
        self.split_span = use_split_span(kv_lens, self.span_mode)
        if self.split_span:
            np32[-1] = decode_split_span(kv_lens, self.num_kv_heads, self.device)
        self.long_context = self.tile_classes[-1] and is_long_decode(kv_lens)
        if self.captured:
            self._graphs, self._logits = self._by_variant[(self.split_span, self.long_context)]
        self._copy_in()
        return bucket
