"""Settings a checkpoint carries for serving: ``generation_config.json`` (its end-of-sequence
ids and default sampling) and the longest context its positions allow."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("pensieve.server")

SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def generation_defaults(model_dir: str | None) -> tuple[list[int], dict[str, Any]]:
    """``(eos ids, sampling defaults)`` from ``generation_config.json`` (empty without one).
    The eos ids stop every turn (as ``stop_token_ids``) besides the model config's own;
    the defaults apply to requests that leave those fields out."""
    if model_dir is None or not (Path(model_dir) / "generation_config.json").is_file():
        return [], {}
    try:
        cfg = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError) as e:
        log.warning("ignoring generation_config.json: %s", e)
        return [], {}
    eos = cfg.get("eos_token_id")
    eos_ids = [int(x) for x in (eos if isinstance(eos, list) else [eos]) if isinstance(x, int)]
    defaults = {k: cfg[k] for k in SAMPLING_KEYS
                if isinstance(cfg.get(k), int | float) and not isinstance(cfg.get(k), bool)}
    if cfg.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return eos_ids, defaults


def checked_max_model_len(requested: int | None, hf_config: Any,
                          default: int = 16384) -> int:
    """``--max-model-len``: refused beyond the model's ``max_position_embeddings``; without
    it, the model's own limit (``default`` for a config that states none). Whether one request
    of that length fits the GPU tier is checked once the tiers are sized
    (:func:`pensieve.engine.tiers.check_fits`)."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is not None:
        if requested < 1:
            raise SystemExit(f"--max-model-len must be >= 1, got {requested}")
        if limit is not None and requested > int(limit):
            raise SystemExit(f"--max-model-len {requested} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return requested
    return int(limit) if limit is not None else default
