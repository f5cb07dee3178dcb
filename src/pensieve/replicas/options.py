"""``pensieve serve``'s options for routing across replicas (``--data-parallel-size`` > 1).

Imports neither Ray nor torch, so ``pensieve serve --help`` stays quick without the replicas
extra."""

from __future__ import annotations

import argparse

from pensieve.core.routing import DEFAULT_SPILL_TOKENS


def spill_tokens_arg(text: str) -> int | None:
    """``--route-spill-tokens``: a count of tokens >= 0, or ``off`` (None)."""
    if text.strip().lower() == "off":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'off', got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0, got {n}")
    return n


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """The routing options of ``pensieve serve --data-parallel-size N``."""
    p.add_argument("--route-spill-tokens", type=spill_tokens_arg, default=DEFAULT_SPILL_TOKENS,
                   metavar="N",
                   help="replicas (--data-parallel-size) with a shared KV tier (--kv-remote): "
                        "a turn leaves its conversation's replica for the replica with the "
                        "fewest waiting prompt tokens when its own has more than N waiting "
                        "(its history's KV is read from the "
                        "tier); 'off': balance on requests in flight as without a shared tier "
                        f"(default {DEFAULT_SPILL_TOKENS}, the bound the simulator chose)")
