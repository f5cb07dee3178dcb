"""Buffers of the attention kernel's variants (no Triton import).

``FUSED`` (launcher ``fused_combine``, a variant for split decode, not the default): each
(range, row tile, KV head) of a split launch counts its finished splits in an int32 that must
be zero before the launch; the last split sets it back to zero, so one zeroed buffer per
device serves every launch, and a CUDA graph captured after the buffer exists replays with it.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def combine_counters(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters on ``device``, kept across calls (grown,
    never shrunk: a buffer a captured graph uses is not freed while it is the largest)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_combine: run the launch once before capturing it (its "
                               "counter buffer must exist outside the graph)")
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf
