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
}
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "opt": "OPTForCausalLM",
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


__all__ = ["CausalLM", "MODEL_REGISTRY", "get_model_class", "LlamaForCausalLM", "OPTForCausalLM"]
