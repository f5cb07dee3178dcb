"""The KV cache's configuration: tiers, chunks, eviction policy, sharing, the disk tier (a
frozen dataclass, no I/O when built). It lives in the core so that the cache and its store are
built from it whole (:meth:`pensieve.core.tiered_cache.TieredKVCache`): each option has its one
default here. ``pensieve.config`` composes it into the engine's config and re-exports it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pensieve.core.eviction import EvictionPolicy, get_policy

DEFAULT_SWAP_BANDWIDTH_GBPS = 45.0
"""One-way rate (GB/s) of KV chunk copies between the tiers that ``swap_bandwidth_gbps="auto"``
assumes on CUDA: the low end of what the H200 measured (docs/performance.md, "Swaps between
the tiers"). Measure another interconnect with ``python benchmarks/swap_bandwidth.py`` and pass
the figure."""

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3", "fp8")
"""Values of :attr:`CacheConfig.kv_cache_dtype` (``fp8`` is ``fp8_e4m3``, as in vLLM)."""

DEFAULT_CPU_KV_GB = {"cuda": 32.0, "cpu": 1.0}
"""GiB of the CPU tier when neither ``num_cpu_blocks`` nor ``cpu_kv_gb`` is given, by the
device type the engine runs on (other types take the CPU's)."""

DEFAULT_DEFER_ADMISSION = 3
"""Steps a turn short of GPU blocks may wait for background swap-outs (``defer_admission``)
instead of forcing urgent swap-outs: chosen by the A/B in docs/benchmarks.md, "Admissions that
wait for background swap-outs"."""



@dataclass(frozen=True)
class CacheConfig:
    """Size and shape of the paged KV cache."""

    chunk_size: int = 32
    """Tokens per KV block: the unit of paging, swapping and eviction."""
    num_gpu_blocks: int | None = None
    """Exact number of device blocks (overrides the sizes below)."""
    gpu_kv_gb: float | None = None
    """GiB of device memory for KV (default: on a GPU most of what is free after the weights;
    on the CPU what max_num_seqs requests of max_model_len need, at most 2 GiB).

    The CPU's bound is :data:`CPU_RUN_GPU_KV_GB`."""
    gpu_memory_utilization: float = 0.90
    """Fraction of total device memory the engine may use when gpu_kv_gb is not given."""
    num_cpu_blocks: int | None = None
    """Exact number of CPU-tier blocks (overrides cpu_kv_gb)."""
    cpu_kv_gb: float | None = None
    """GiB of (pinned) host memory for the CPU tier (default: 1 on a CPU run, 32 with
    CUDA).

    Those defaults are :data:`DEFAULT_CPU_KV_GB`."""
    cache_policy: str = "pensieve"
    """The eviction policy: pensieve (retention value), gpu-only (no CPU tier), lru,
    prefix-lru (tail-first LRU, as prefix caches evict), return (recompute saved times the
    chance the conversation returns) or stateless (no KV kept across turns).

    A name in :data:`pensieve.core.eviction.POLICIES`, resolved once, into :attr:`policy`."""
    swap_out_threshold: float = 0.25
    """Start ahead-of-time swap-out when free GPU blocks fall under this fraction."""
    decode_reserve: float = 0.10
    """Fraction of GPU blocks new turns may not take, kept for running decodes."""
    defer_admission: int = DEFAULT_DEFER_ADMISSION
    """Steps a turn short of GPU blocks may wait for background swap-outs to free them while
    other turns run, instead of urgent swap-outs that the whole step waits for (0: never).

    Applied by ``TieredKVCache.defer_admission``."""
    kv_cache_dtype: str = "auto"
    """Element type of the KV cache in both tiers and every copy between them: ``auto`` (the
    model's dtype), ``bf16``, ``fp16``, ``fp32``, or ``fp8_e4m3`` (``fp8``: float8 e4m3 with
    a float32 scale per layer and KV head, 1 unless set; half the bytes of bf16 per token,
    read directly by the attention kernels)."""
    tenant_kv_share: float | None = None
    """Share of each tier (0, 1] a tenant's conversations with retention hints may hold before
    their hints stop counting; none: no bound.

    The accounting: :mod:`pensieve.core.tenant_share`."""
    share_prefixes: bool = True
    """Full chunks with equal tokens at equal positions (a shared system prompt, few-shot
    examples, a branched conversation) are held once on the GPU, reference-counted; within a
    tenant unless share_prefixes_across_tenants.

    The bookkeeping: :mod:`pensieve.core.prefix_share`."""
    share_prefixes_across_tenants: bool = False
    """Let conversations of different tenants (API keys) share prefixes (their hashes are
    otherwise salted per tenant; a request's ``cache_salt`` still separates)."""
    disk_kv_gb: float | None = None
    """Size of the disk tier below the CPU tier (GiB of chunk files under disk_kv_path);
    none or 0: no disk tier. CPU chunks leaving the CPU tier by the retention order are
    written there instead of dropped, and read back for a later turn.

    The bookkeeping: :mod:`pensieve.core.disk_index`; the files:
    :mod:`pensieve.engine.disk_tier`."""
    disk_kv_path: str | None = None
    """Directory of the disk tier's files; kept across restarts (a restarted engine with the
    same path, model and layout resumes conversations from it)."""
    kv_remote: str | None = None
    """A KV store shared by several servers, below the local tiers: ``redis://host:port/db``
    (Redis or Valkey) or ``file:///path`` (a directory they all read and write); none: no
    shared tier. Each turn's full chunks are written through to it when the turn ends, and
    a turn looks its chunks up there when added, so a server taking a conversation over (or a
    prefix many conversations share) reads them instead of recomputing. A store that cannot
    be reached is a logged warning: the server runs without it.

    The I/O: :mod:`pensieve.engine.remote_tier`; the deployment: docs/remote_tier.md."""
    disk_read_gbps: float | None = None
    """The disk's read rate (GB/s) for reading a chunk back or recomputing it, whichever is
    sooner; none: measured on the reads on CUDA, always read on the CPU."""
    cost_profile: str | None = None
    """JSON cost profile for the retention value (default: the analytic model)."""
    policy: EvictionPolicy = field(init=False, repr=False, compare=False)
    """The :class:`EvictionPolicy` named by ``cache_policy``: what the engine passes down."""
    swap_bandwidth_gbps: float | str | None = "auto"
    """Measured one-way rate (GB/s, 1e9 bytes per second) of chunk copies between the tiers on
    this interconnect, with which a CPU-tier chunk is brought back by swap-in or by
    recomputation, whichever is expected sooner. auto: 45 on CUDA, off on the CPU (there a
    swap is a host memcpy, far cheaper than recomputing); off: always swap in. Under tensor
    parallelism each rank moves its own slice over its own link, so the time per chunk is one
    rank's slice over this rate.

    The engine passes ``chunk bytes (all layers) / rate`` to the cache as ``swap_chunk_s``
    (``TieredKVCache`` compares it with the cost model's Cost(l)); the simulator's cache does
    the same with its transfer model's rate. ``"auto"`` on CUDA is
    :data:`DEFAULT_SWAP_BANDWIDTH_GBPS`; None is ``"off"``."""

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size}")
        object.__setattr__(self, "policy", get_policy(self.cache_policy))  # raises if unknown
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if isinstance(self.defer_admission, bool) or not isinstance(self.defer_admission, int) \
                or self.defer_admission < 0:
            raise ValueError(f"defer_admission must be a whole number of steps >= 0, got "
                             f"{self.defer_admission!r}")
        if self.disk_kv_gb is not None and self.disk_kv_gb > 0 and not self.disk_kv_path:
            raise ValueError("disk_kv_gb needs disk_kv_path (the directory of the disk tier)")
        if self.kv_remote and not self.policy.uses_cpu_tier:
            raise ValueError(f"the shared KV tier (kv_remote) lies below the CPU tier, and "
                             f"cache_policy {self.cache_policy!r} keeps none: choose a policy "
                             f"with a CPU tier or leave kv_remote out")
        if self.kv_remote and not self.kv_remote.startswith(
                ("redis://", "rediss://", "unix://", "valkey://", "file:///")):
            raise ValueError(f"kv_remote must be redis://host:port/db or file:///path, got "
                             f"{self.kv_remote!r}")
        if self.disk_kv_gb and not self.policy.uses_cpu_tier:
            raise ValueError(f"the disk tier lies below the CPU tier, and cache_policy "
                             f"{self.cache_policy!r} keeps none: choose a policy with a CPU "
                             f"tier or leave disk_kv_gb out")
        if (self.disk_kv_gb is not None and self.disk_kv_gb < 0) or (
                self.disk_read_gbps is not None and not self.disk_read_gbps > 0):
            raise ValueError("disk_kv_gb must be >= 0 and disk_read_gbps > 0")
        bw = self.swap_bandwidth_gbps
        if isinstance(bw, str):
            if bw not in ("auto", "off"):
                raise ValueError("swap_bandwidth_gbps must be a positive number of GB/s, "
                                 f"'auto' or 'off', got {bw!r}")
        elif bw is not None:
            if isinstance(bw, bool) or not isinstance(bw, int | float) \
                    or not math.isfinite(bw) or bw <= 0:
                raise ValueError("swap_bandwidth_gbps must be a positive, finite number of "
                                 f"GB/s, 'auto' or 'off', got {bw!r}")
            object.__setattr__(self, "swap_bandwidth_gbps", float(bw))

    def swap_bandwidth(self, device_type: str) -> float | None:
        """The one-way swap rate in GB/s on a device of this type, or None (always swap)."""
        bw = self.swap_bandwidth_gbps
        if bw == "auto":
            return DEFAULT_SWAP_BANDWIDTH_GBPS if device_type == "cuda" else None
        if bw is None or isinstance(bw, str):
            return None
        return float(bw)
