"""Decode steps replayed from CUDA graphs.

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
"""

from __future__ import annotations

import numpy as np
import torch

from pensieve.core.outputs import SchedulerOutput
from pensieve.layers.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... (multiples of 8) up to and including ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    sizes.append(max_batch)
    return sorted(set(sizes))


def is_decode_step(sched: SchedulerOutput) -> bool:
    """Every request computes one token (one range of length 1) and samples it."""
    return bool(sched.requests) and all(
        s.sample and len(s.ranges) == 1 and s.ranges[0].query_len == 1 for s in sched.requests
    )


class DecodeGraphs:
    """Static-buffer decode forward for batches up to ``max_batch``, captured per bucket."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        chunk_size: int,
        max_batch: int,
        max_blocks: int,
        capture: bool = True,
    ) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(f"max_batch {max_batch} and max_blocks {max_blocks} must be >= 1")
        self.model = model
        self.kv_caches = kv_caches
        self.chunk_size = chunk_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.buckets = batch_buckets(max_batch)
        device = kv_caches[0].device
        self.device = device
        b = max_batch
        pin = device.type == "cuda"
        # int64: [ids | positions | slots]; int32: [query_start_loc | start_pos | tables]
        self._n64 = 3 * b
        self._n32 = (b + 1) + b + b * max_blocks
        self._host64 = torch.zeros(self._n64, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(self._n32, dtype=torch.int32, pin_memory=pin)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        self._dev64 = torch.zeros(self._n64, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(self._n32, dtype=torch.int32, device=device)
        self.input_ids = self._dev64[:b]
        self.positions = self._dev64[b : 2 * b]
        self.slot_mapping = self._dev64[2 * b :]
        self.query_start_loc = self._dev32[: b + 1]
        self.range_start_pos = self._dev32[b + 1 : 2 * b + 1]
        self.block_tables = self._dev32[2 * b + 1 :].view(b, max_blocks)
        self.range_table = torch.arange(b, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.captured = False
        if capture:
            self.capture()

    # ------------------------------------------------------------------ forward on the buffers
    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            range_start_pos=self.range_start_pos[:bucket],
            range_table=self.range_table[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
        )
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches,
                            meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        # Dummy inputs: every token skips the KV store and attends to position 0 of block 0.
        b = self.max_batch
        self._np64[:] = 0
        self._np64[2 * b :] = -1
        self._np32[:] = 0
        self._np32[: b + 1] = np.arange(b + 1)
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                for _ in range(2):  # compile and autotune outside the capture
                    self._forward(bucket)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._logits[bucket] = self._forward(bucket)
                pool = graph.pool()
                self._graphs[bucket] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.captured = True

    # ------------------------------------------------------------------ one step
    def can_run(self, sched: SchedulerOutput) -> bool:
        return (
            len(sched.requests) <= self.max_batch
            and is_decode_step(sched)
            and all(len(s.block_table) <= self.max_blocks for s in sched.requests)
        )

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch {n} exceeds the largest bucket {self.max_batch}")

    def fill(self, sched: SchedulerOutput) -> int:
        """Write a decode step's inputs into the static buffers; returns its bucket."""
        n = len(sched.requests)
        bucket = self.bucket_for(n)
        b, c, mb = self.max_batch, self.chunk_size, self.max_blocks
        np64, np32 = self._np64, self._np32
        pos = np.fromiter((s.ranges[0].start_pos for s in sched.requests), np.int64, n)
        np64[:n] = np.fromiter((s.ranges[0].token_ids[0] for s in sched.requests), np.int64, n)
        np64[b : b + n] = pos
        tables = np32[2 * b + 1 :].reshape(b, mb)
        for i, s in enumerate(sched.requests):
            table = s.block_table
            tables[i, : len(table)] = table
        np64[2 * b : 2 * b + n] = tables[np.arange(n), pos // c].astype(np.int64) * c + pos % c
        np64[2 * b + n : 2 * b + bucket] = -1
        np32[: n + 1] = np.arange(n + 1)
        np32[n + 1 : bucket + 1] = n
        np32[b + 1 : b + 1 + n] = pos
        # Everything is copied whole: one copy each, no per-bucket views to keep in sync.
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        return bucket

    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode step (caller checked :meth:`can_run`)."""
        bucket = self.fill(sched)
        if self.captured:
            self._graphs[bucket].replay()
            logits = self._logits[bucket]
        else:
            logits = self._forward(bucket)
        return logits[: len(sched.requests)]
