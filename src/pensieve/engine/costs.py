"""Pick the cost model behind the retention value: a measured profile, else the analytic one.

Profiles are JSON files named by :func:`pensieve.core.cost_model.profile_key` (model shape and
device). They are looked up, in order, at the path given, then in ``$PENSIEVE_PROFILE_DIR``,
then in the ``profiles`` folder shipped inside the package.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from pensieve.core.cost_model import CostModel, profile_key

log = logging.getLogger("pensieve")
PACKAGE_PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def model_profile_key(model: Any, hf_config: Any, device: torch.device) -> str:
    inter = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", 0)
    return profile_key(str(getattr(hf_config, "model_type", "model")), model.num_layers,
                       int(hf_config.hidden_size), model.num_heads, model.num_kv_heads,
                       model.head_dim, int(inter), device_name(device))


def load_cost_model(path: str | None, model: Any, hf_config: Any, chunk_size: int,
                    device: torch.device, dtype: torch.dtype) -> CostModel:
    """The measured profile for this model shape and device if there is one, else analytic."""
    key = model_profile_key(model, hf_config, device)
    candidates = [Path(path)] if path else []
    env = os.environ.get("PENSIEVE_PROFILE_DIR")
    if env:
        candidates.append(Path(env) / f"{key}.json")
    candidates.append(PACKAGE_PROFILES / f"{key}.json")
    for p in candidates:
        if p.is_file():
            cm = CostModel.load(p)
            if cm.chunk_size != chunk_size:
                raise ValueError(f"cost profile {p} is for chunk_size {cm.chunk_size}, "
                                 f"the engine uses {chunk_size}")
            log.info("cost model: profile %s", p)
            return cm
    if path:
        raise FileNotFoundError(f"cost profile {path} not found")
    inter = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", 0)
    gated = str(getattr(hf_config, "model_type", "")) != "opt"
    return CostModel.analytic(
        model.num_layers, int(hf_config.hidden_size), model.num_heads, model.num_kv_heads,
        model.head_dim, int(inter), chunk_size=chunk_size,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(), gated_mlp=gated, model_key=key,
    )
