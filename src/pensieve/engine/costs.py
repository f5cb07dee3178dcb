"""Pick the cost model behind the retention value: a measured profile, else the analytic one.

Profiles are JSON files named by :func:`pensieve.runner.profiler.config_profile_key` (model
shape and device), the name :func:`pensieve.runner.profiler.profile_cost`'s profiles are saved
under. They are looked up, in order, at the path given, then in ``$PENSIEVE_PROFILE_DIR``, then
in the ``profiles`` folder shipped inside the package.

On a GPU with no profile of its own, a profile of the same model shape measured on another GPU
is taken before the analytic model (:func:`find_profile`, with a warning naming it). The
analytic roofline counts a chunk's FLOPs at the card's peak and is 4-5x below a measured
recompute (llama3.1-8b: 0.56 against 2.71 ms a chunk at the start of a conversation, on the
H200), so with it a disk read of a chunk (4 MiB; 0.7 ms at 6 GB/s) is never worth starting and
the disk tier only recomputes: what an H100 run without a profile of its own did
(docs/benchmarks.md, "The disk tier on an H100").
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
    """The measured profile for this model shape and device if there is one (on a GPU, else
    one of the same shape from another GPU), else analytic."""
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"cost profile {path} not found")
    p = Path(path) if path else find_profile(config_profile_key(hf_config, device),
                                             device.type == "cuda")
    if p is None:
        return analytic_cost_model(hf_config, chunk_size, dtype)
    cm = CostModel.load(p)
    if cm.chunk_size != chunk_size:
        raise ValueError(f"cost profile {p} is for chunk_size {cm.chunk_size}, "
                         f"the engine uses {chunk_size}")
    log.info("cost model: profile %s", p)
    return cm


def find_profile(key: str, gpu: bool, dirs: list[Path] | None = None) -> Path | None:
    """The profile file of ``key`` (shape and device) in ``dirs`` (None:
    ``$PENSIEVE_PROFILE_DIR``, then the package's), first found; on a ``gpu`` without one, the
    first (by name) of the same shape measured on another GPU, with a warning; None: neither."""
    if dirs is None:
        env = os.environ.get("PENSIEVE_PROFILE_DIR")
        dirs = ([Path(env)] if env else []) + [PACKAGE_PROFILES]
    for d in dirs:
        if (d / f"{key}.json").is_file():
            return d / f"{key}.json"
    shape = key.rsplit("__", 1)[0]
    others = [p for d in dirs for p in sorted(d.glob(f"{shape}__*.json"))
              if not p.stem.endswith("__cpu")] if gpu else []
    if others:
        log.warning("cost model: no profile for %s; using %s, the same shape on another GPU "
                    "(measure this card with benchmarks/profile_cost.py, then --cost-profile)",
                    key, others[0].name)
        return others[0]
    return None
