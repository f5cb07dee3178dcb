"""Rotary position embeddings (RoPE), rotate-half convention as in HF Llama.

The model passes explicit ``positions`` ``[T]`` (int64) for the flattened batch; cos/sin are
computed from them once per forward and shared by every layer.

Frequencies. ``inv_freq`` and the cos/sin post-scaling (``attention_scaling``, != 1 only for
yarn / longrope) come from ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` so that we
reuse HF's code for every scaled type (linear, dynamic, llama3, yarn, ...). ``default`` is
computed here (transformers 5 no longer lists it in that table). The rope settings are read
from ``config.rope_parameters`` (transformers >= 5: ``rope_type``, ``rope_theta``, ...) or from
the older ``config.rope_scaling`` (``type`` / ``rope_type``) plus ``config.rope_theta``.

Dynamic NTK. HF recomputes ``inv_freq`` at run time from the longest sequence in the current
forward; with batched, cached serving there is no such single length. We freeze the frequencies
at HF's init-time value (``seq_len = max_position_embeddings``), which equals the unscaled
frequencies: identical to HF for every position ``< max_position_embeddings``, and a plain
extrapolation beyond it. ``longrope`` is likewise frozen at its init-time (short) factors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_config(config: Any) -> tuple[str, float, dict[str, Any]]:
    """``(rope_type, rope_theta, params)`` from an HF config, new (``rope_parameters``) or old
    (``rope_scaling`` + ``rope_theta``) style."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return str(rope_type), float(theta), params


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def compute_inv_freq(config: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2] float32 on CPU, attention_scaling)`` for ``config``."""
    rope_type, theta, params = rope_config(config)
    # Always on the CPU in float32, whatever device / default-dtype context the model is built in
    # (e.g. ``torch.device("meta")`` in the loader).
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            if rope_type == "default":
                partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
                dim = int(_head_dim(config) * partial)
                exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
                inv_freq, scaling = 1.0 / (theta**exponent), 1.0
            else:
                try:
                    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
                except ImportError as e:  # pragma: no cover - transformers < 4.45
                    raise NotImplementedError(
                        f"rope_type {rope_type!r} needs transformers.modeling_rope_utils"
                    ) from e
                if rope_type not in ROPE_INIT_FUNCTIONS:
                    raise NotImplementedError(f"unsupported rope_type {rope_type!r}")
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    finally:
        torch.set_default_dtype(prev_dtype)
    return inv_freq.detach().float().cpu(), float(scaling)


class RotaryEmbedding(nn.Module):
    """positions ``[T]`` -> ``(cos, sin)`` each ``[T, rotary_dim]`` float32 (already multiplied by
    ``attention_scaling``), laid out ``cat(freqs, freqs)`` as in HF."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(config)
        self.rotary_dim = 2 * inv_freq.numel()
        self.head_dim = _head_dim(config)
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} > head_dim {self.head_dim}")
        # A plain attribute, not a buffer: it must stay float32 when the model is cast to bf16,
        # and exist on a real device when the model is built on "meta". Moved lazily.
        self._inv_freq = inv_freq

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, attention_scaling={self.attention_scaling}"


__all__ = ["RotaryEmbedding", "compute_inv_freq", "rope_config"]
