"""Settings a checkpoint carries for serving: ``generation_config.json`` (its end-of-sequence
ids and default sampling). The longest context its positions allow is settled for both command
lines by :func:`pensieve.options.settle_model_options`."""

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
