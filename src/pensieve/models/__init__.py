"""Model implementations over the paged KV cache, and the registry the loader picks from.

Every model class is built from an HF config (``cls(hf_config)``) and implements
:class:`CausalLM`. Models know nothing of scheduling: the runner flattens a step's tokens into
``input_ids`` / ``positions`` ``[T]`` and passes one :class:`AttentionMetadata` per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from pensieve.layers.attention import AttentionMetadata
from pensieve.models.llama import LlamaForCausalLM
from pensieve.models.opt import OPTForCausalLM
from pensieve.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM


class CausalLM(Protocol):
    """What the runner relies on."""

    num_layers: int
    """Number of decoder layers = number of KV cache tensors ``forward`` takes."""
    num_kv_heads: int
    head_dim: int
    """Each layer's KV cache is ``[2, num_blocks, chunk_size, num_kv_heads, head_dim]``."""
    hidden_size: int
    """Width of ``forward``'s output (= ``compute_logits``' input)."""
    vocab_size: int

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``input_ids`` / ``positions`` ``[T]`` int64 -> hidden ``[T, hidden_size]``.

        Writes this step's K/V of every layer into ``kv_caches`` at ``attn_metadata.slot_mapping``.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill parameters from HF-named checkpoint tensors (all of them in one call, converted to
        the parameter dtype); returns the names of the parameters filled."""
        ...


MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "opt": "OPTForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
}


def get_model_class(hf_config: Any) -> type[torch.nn.Module]:
    """Model class for an HF config, by ``architectures`` then by ``model_type``."""
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        names.append(_BY_MODEL_TYPE[model_type])
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model (architectures={names}, model_type={model_type!r}); "
        f"supported: {sorted(MODEL_REGISTRY)}"
    )


def sliding_window(hf_config: Any) -> int | None:
    """The attention window a checkpoint asks for, or None for full causal attention.

    Mistral-style configs set ``sliding_window``; Qwen2 / Qwen3 configs carry a
    ``sliding_window`` value but use it only with ``use_sliding_window``."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    if getattr(hf_config, "model_type", None) in ("qwen2", "qwen3") and not getattr(
            hf_config, "use_sliding_window", False):
        return None
    return int(window)


def check_max_model_len(hf_config: Any, max_model_len: int) -> None:
    """Refuse a ``max_model_len`` our full causal attention would serve differently from the
    checkpoint: beyond its sliding window (which is not implemented)."""
    window = sliding_window(hf_config)
    if window is not None and max_model_len > window:
        raise ValueError(
            f"this checkpoint uses sliding-window attention (window {window} tokens), which "
            f"Pensieve does not implement: max_model_len={max_model_len} is beyond the window; "
            f"pass max_model_len <= {window} (--max-model-len {window})")


__all__ = ["CausalLM", "MODEL_REGISTRY", "get_model_class", "LlamaForCausalLM", "OPTForCausalLM",
           "Qwen2ForCausalLM", "Qwen3ForCausalLM", "check_max_model_len", "sliding_window"]
