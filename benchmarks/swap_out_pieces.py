"""What-if: background swap-outs copied to the host in smaller pieces.

The ``staged`` swap-ins go to the host tier's copy engines as one piece per chunk per group
of layers (with 8 groups of 40 layers: 5 layers, 800 KB a piece for the 13B GQA-10 shape);
the swap-outs as one piece per run of consecutive CPU blocks (6.5 MB or more). Issued at
once, the swap-outs took the copy engines from the first group of swap-ins
(``docs/results/swap_batched/out_early_e2ec187/``). This runs
``benchmarks/swap_bandwidth.py`` with the swap-outs' host copies cut into pieces of at most
``--piece-kb`` KB (the same bytes, more descriptors in the same one call), to see whether
pieces the size of the swap-ins' share the engines more evenly. Arguments after ``--`` go to
``swap_bandwidth.py``::

    python benchmarks/swap_out_pieces.py --piece-kb 800 -- --methods staged --sweep-programs

Measured on the H200 (``docs/results/swap_batched/out_pieces_7be8e94/``): the pieces made
layer 0's swap-ins 2-3x later and the bandwidth no better, so the engine keeps whole pieces
(that layer-0 column measures after ``swap_bandwidth.py``'s raw copies on the default stream,
which make later compute there wait for the step's copies: ``docs/performance.md``, "A
timeline of one swap step"). The swap-outs by groups of layers (``PENSIEVE_SWAP_OUT_GROUPS``,
default 8 since it was measured) copy one piece per chunk per group already; this what-if
cuts the swap-outs of all layers at once, so it runs with ``PENSIEVE_SWAP_OUT_GROUPS=1``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

from pensieve.runner.copy_engine import run_pieces
from pensieve.runner.swap_staged import StagedPaths


def split_pieces(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, piece: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same copies cut into pieces of at most ``piece`` bytes (in order)."""
    counts = -(-sizes.astype(np.int64) // piece)
    rep = np.repeat(np.arange(len(sizes)), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    k = (np.arange(int(counts.sum())) - np.repeat(starts, counts)).astype(np.uint64)
    off = k * np.uint64(piece)
    size = np.minimum(sizes[rep] - off, np.uint64(piece))
    return dsts[rep] + off, srcs[rep] + off, size


def patch(piece: int) -> None:
    """Make the staged paths' host copies of swap-outs go in pieces of ``piece`` bytes."""

    def dma_rows(self: StagedPaths, stage: torch.Tensor, runs: list[tuple[int, int, int]],
                 to_host: bool) -> None:
        descs = run_pieces(stage.data_ptr(), self._host.data_ptr(), runs, self._chunk_bytes,
                           to_host)
        if to_host:
            descs = split_pieces(*descs, piece)
        self._engine.copy(*descs, to_device=not to_host)
        self.num_copies += len(descs[0])

    StagedPaths._dma_rows = dma_rows  # type: ignore[method-assign]


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--piece-kb", type=int, default=800)
    args = ap.parse_args(own)
    patch(args.piece_kb * 1024)
    os.environ["PENSIEVE_SWAP_OUT_GROUPS"] = "1"  # the patched copies: all layers at once
    sys.path.insert(0, str(Path(__file__).parent))
    import swap_bandwidth

    sys.argv = ["swap_bandwidth.py", *rest]
    swap_bandwidth.main()


if __name__ == "__main__":
    main()
