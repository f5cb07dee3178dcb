"""Pick the cost model behind the retention value: a measured profile, else the analytic one.

Profiles are JSON files named by :func:`pensieve.runner.profiler.config_profile_key` (model
shape and device), the name :func:`pensieve.runner.profiler.profile_cost`'s profiles are saved
under. They are looked up, in order, at the path given, then in ``$PENSIEVE_PROFILE_DIR``, then
in the ``profiles`` folder shipped inside the package.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from pensieve.core.cost_model import CostModel
from pensieve.runner.profiler import analytic_cost_model, config_profile_key

log = logging.getLogger("pensieve")
PACKAGE_PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def load_cost_model(path: str | None, hf_config: Any, chunk_size: int,
                    device: torch.device, dtype: torch.dtype) -> CostModel:
    """The measured profile for this model shape and device if there is one, else analytic."""
    key = config_profile_key(hf_config, device)
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
    return analytic_cost_model(hf_config, chunk_size, dtype)
