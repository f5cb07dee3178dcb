"""Cache counters: where each prompt token's KV came from, and what the tiers moved."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    """Token and event counters, in total or per request."""

    gpu_hit_tokens: int = 0
    """Context tokens whose KV was already on the GPU when the turn was admitted."""
    cpu_hit_tokens: int = 0
    """Context tokens whose KV was swapped in from the CPU tier."""
    recomputed_tokens: int = 0
    """History tokens whose KV had been dropped (or never kept) and was computed again."""
    cpu_recomputed_tokens: int = 0
    """Of ``recomputed_tokens``: tokens whose KV was on the CPU tier but recomputed, because
    that was expected to be sooner than swapping it in (not in ``cpu_hit_tokens``)."""
    disk_hit_tokens: int = 0
    """Context tokens whose KV was read back from the disk tier (then swapped in through the
    CPU tier; not in ``cpu_hit_tokens``)."""
    shared_hit_tokens: int = 0
    """Context tokens whose KV was another conversation's GPU block of the same tokens (a
    shared prefix, ``core.prefix_share``; not in ``gpu_hit_tokens``)."""
    cpu_shared_tokens: int = 0
    """Of ``cpu_hit_tokens``: tokens whose KV was another conversation's CPU block of the same
    tokens, taken at admission and swapped in (a shared prefix, ``core.block_map``)."""
    new_prompt_tokens: int = 0
    """Tokens with no KV computed before: the new input (and the last answer's final token)."""
    swapped_out_tokens: int = 0
    swapped_in_tokens: int = 0
    dropped_tokens: int = 0
    disk_written_tokens: int = 0
    """Of ``dropped_tokens``: tokens of CPU chunks written to the disk tier as they left."""
    suspended_requests: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: CacheStats) -> None:
        for name, value in other.as_dict().items():
            setattr(self, name, getattr(self, name) + value)
