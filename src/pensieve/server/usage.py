"""Per-tenant usage: what each API key's requests computed, for ``GET /v1/usage``.

``/metrics`` is the operator's view of the whole server (every tenant's traffic together), so
with API keys set it needs the operator's key (``--metrics-key``) or ``--metrics-public``. A
tenant sees its own traffic here, read with its own key: the turns it completed and their
tokens since the server started (kept in memory, like ``/metrics``' counters).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class TenantUsage:
    """One tenant's counters."""

    requests: int = 0
    """Completed turns (a request of ``n`` choices counts once)."""
    prompt_tokens: int = 0
    """Context tokens of those turns."""
    cached_prompt_tokens: int = 0
    """Of those, the tokens whose KV came from the cache (``cached_tokens``)."""
    completion_tokens: int = 0
    """Tokens generated (every choice's)."""


class Usage:
    """The counters of every tenant. Thread-safe."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, TenantUsage] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, prompt: int, cached: int, completion: int,
            request: bool = True) -> None:
        """Count a finished turn (``request``) or another choice of one (its tokens only)."""
        with self._lock:
            u = self._by_tenant.setdefault(tenant, TenantUsage())
            u.completion_tokens += completion
            if request:
                u.requests += 1
                u.prompt_tokens += prompt
                u.cached_prompt_tokens += cached

    def of(self, tenant: str) -> dict[str, int]:
        with self._lock:
            return asdict(self._by_tenant.get(tenant, TenantUsage()))
