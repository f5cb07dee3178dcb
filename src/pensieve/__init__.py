"""Pensieve: stateful LLM serving for multi-turn chat.

``from pensieve import LLM, SamplingParams``. The heavy parts (torch) load lazily, so
``pensieve.core`` stays importable without them.
"""

from __future__ import annotations

from typing import Any

from pensieve.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pensieve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pensieve' has no attribute {name!r}")
