"""The KV layout: what one chunk of KV is on one device, resolved once per engine from the
model's shape and :class:`~pensieve.config.CacheConfig`. The one place that turns
``kv_cache_dtype`` into a torch dtype and shapes into bytes per chunk
(:attr:`KVLayout.block_bytes`, and its share in one layer, :attr:`KVLayout.layer_bytes`).

Who resolves it, and who reads it:

- :class:`~pensieve.engine.local.LocalExecutor`: :meth:`KVLayout.of` over the loaded model;
- :class:`~pensieve.parallel.tp_executor.TPExecutor`: :meth:`KVLayout.of` over its meta-device
  model with ``world`` ranks (each rank's KV heads), handed to every rank in its ``WorkerSpec``;
  a rank checks it against its shard and resolves nothing itself;
- sizing (:func:`pensieve.engine.tiers.tier_sizes`) takes :attr:`KVLayout.block_bytes`, so does
  ``TierSizes.block_bytes`` and everything after it (swap costs, the disk tier's capacity);
- allocation (:meth:`KVLayout.allocate`) and the FP8 scales (:attr:`KVLayout.fp8`) in
  :func:`pensieve.engine.local.start_runner`, which hands the layout to the
  :class:`~pensieve.runner.model_runner.ModelRunner` (:attr:`ModelRunner.layout`);
- past allocation: the runner's :class:`~pensieve.runner.swapper.KVSwapper` (its CPU tier's
  shape and dtype, the bytes of its copies and counts) and the disk tier
  (:class:`~pensieve.engine.disk_tier.DiskTier`: a file's shape, dtype and bytes; built by
  :func:`pensieve.engine.disk_build.build_disk_tier` from ``runner.layout``) take the layout
  at construction and check the tensors they are given against it (:meth:`KVLayout.check`);
  neither measures a chunk off its tensors.

Invariants: one chunk is ``[num_layers, 2 (K, V), chunk_size, num_kv_heads, head_dim]``
elements of :attr:`KVLayout.dtype`. An FP8 cache's scales are one float32 per layer and KV head
(K and V each), held by the attention layers (``layers.attention.init_kv_scales``), not in the
blocks: they add no bytes per chunk, and neither the swapper's copies nor the disk tier's files
carry them (a file holds the chunk's K and V only; the scales are the model's, the same for
every chunk). The simulator has no model and no torch dtype: it is given its bytes per chunk
(``block_bytes``) and sizes its tiers with the same ``tier_sizes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pensieve.config import CacheConfig

KV_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
"""Torch dtype of each ``CacheConfig.kv_cache_dtype`` but ``auto`` (the model's own)."""


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for ``CacheConfig.kv_cache_dtype`` (``auto``: the
    model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return KV_DTYPES[kv_cache_dtype]


@dataclass(frozen=True)
class KVLayout:
    """One device's KV cache: shapes and dtype of a chunk (module docstring)."""

    num_layers: int
    num_kv_heads: int
    """KV heads on this device: all of them, or one rank's under tensor parallelism."""
    head_dim: int
    chunk_size: int
    """Tokens per chunk (one block)."""
    dtype: torch.dtype
    """Element type of K and V (``kv_cache_dtype`` resolved: :func:`resolve_kv_dtype`)."""

    @classmethod
    def of(cls, model: Any, cache: CacheConfig, model_dtype: torch.dtype,
           world: int = 1) -> KVLayout:
        """The layout of ``model`` (a built model, meta-device or loaded, unsharded: its
        ``num_layers``, ``num_kv_heads``, ``head_dim``) with ``cache``'s chunk size and KV
        dtype, on one of ``world`` tensor-parallel ranks."""
        heads = int(model.num_kv_heads)
        if world > 1:  # one process: nothing of pensieve.parallel is imported
            from pensieve.parallel.tp import local_kv_heads

            heads = local_kv_heads(heads, world)
        return cls(int(model.num_layers), heads, int(model.head_dim), cache.chunk_size,
                   resolve_kv_dtype(cache.kv_cache_dtype, model_dtype))

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def fp8(self) -> bool:
        """Whether K and V are stored as float8 e4m3 (scaled per KV head)."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(chunk_size, num_kv_heads, head_dim)``: one chunk of K (or V) in one layer."""
        return (self.chunk_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, chunk_size, num_kv_heads, head_dim)``: one chunk over all layers
        (a disk file's payload, a row of a chunk-major CPU tier)."""
        return (self.num_layers, 2, *self.block_shape)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V of one chunk over all layers: the bytes per chunk."""
        return (2 * self.num_layers * self.chunk_size * self.num_kv_heads * self.head_dim
                * self.elem_bytes)

    @property
    def layer_bytes(self) -> int:
        """Bytes of K and V of one chunk in one layer (:attr:`block_bytes` over the layers)."""
        return self.block_bytes // self.num_layers

    def check(self, caches: list[torch.Tensor], what: str = "KV caches") -> None:
        """Raise ValueError unless ``caches`` are this layout's: one ``[2, N, chunk_size,
        num_kv_heads, head_dim]`` tensor of :attr:`dtype` per layer (any N, any strides)."""
        if len(caches) != self.num_layers:
            raise ValueError(f"{what}: {len(caches)} layers, the KV layout has "
                             f"{self.num_layers}")
        for c in caches:
            if c.dim() != 5 or c.shape[0] != 2 or tuple(c.shape[2:]) != self.block_shape:
                raise ValueError(f"{what}: shape {tuple(c.shape)} is not [2, N, "
                                 f"*{self.block_shape}] of the KV layout")
            if c.dtype != self.dtype:
                raise ValueError(f"{what}: dtype {c.dtype}, the KV layout has {self.dtype}")

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """``num_blocks`` chunks on ``device``: one ``[2, num_blocks, chunk_size, num_kv_heads,
        head_dim]`` tensor per layer, the views (``unbind(0)``) of one ``[num_layers, 2,
        num_blocks, ...]`` allocation, so that one swap kernel reaches every layer from one
        base pointer and a layer stride."""
        shape = (self.num_layers, 2, num_blocks, *self.block_shape)
        return list(torch.empty(shape, dtype=self.dtype, device=device).unbind(0))
