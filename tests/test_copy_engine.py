"""The copy engine's batched copies (:mod:`pensieve.runner.copy_engine`): the address
arithmetic of chunk pieces and runs against tensor slicing, on the CPU (``memmove``) and on
the GPU (the driver's batch call, and one call per copy)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pensieve.runner.copy_engine import CopyEngine, _driver, pieces, run_pieces
from pensieve.runner.swap_staged import layer_groups

CHUNKS, LAYERS, LAYER_WORDS = 12, 5, 6  # a chunk: 5 layers of 6 int64 words


def tiers(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.arange(CHUNKS * LAYERS * LAYER_WORDS, dtype=torch.int64)
    host = host.view(CHUNKS, LAYERS, LAYER_WORDS)
    if device == "cuda":
        host = host.pin_memory()
    stage = torch.full((CHUNKS, LAYERS, LAYER_WORDS), -1, dtype=torch.int64, device=device)
    return host, stage


def chunk_bytes() -> int:
    return LAYERS * LAYER_WORDS * 8


def check_groups(engine: CopyEngine, device: str, seed: int) -> None:
    """Scattered chunks into the first rows of the stage, by groups of layers packed (row j
    of a group: its layers of one chunk)."""
    rng = random.Random(seed)
    host, stage = tiers(device)
    ids = rng.sample(range(CHUNKS), rng.randint(1, CHUNKS))
    lb = LAYER_WORDS * 8
    for a, b in layer_groups(LAYERS, rng.randint(1, LAYERS)):
        stage.fill_(-1)
        descs = pieces(stage.data_ptr(), np.arange(len(ids)), (b - a) * lb,
                       host.data_ptr() + a * lb, np.asarray(ids), chunk_bytes(), (b - a) * lb)
        engine.copy(*descs, to_device=True)
        if device == "cuda":
            torch.cuda.synchronize()
        flat = stage.view(-1).cpu()
        n = len(ids) * (b - a) * LAYER_WORDS
        got = flat[:n].view(len(ids), b - a, LAYER_WORDS)
        assert torch.equal(got, host[ids, a:b]), (a, b)
        assert bool((flat[n:] == -1).all())  # nothing beyond the packed rows


def check_runs(engine: CopyEngine, device: str, seed: int) -> None:
    """Runs of rows to runs of chunks and back (the staged swap-outs and swap-ins)."""
    rng = random.Random(seed)
    host, stage = tiers(device)
    stage.copy_(-host - 1)
    runs = [(0, 7, 2), (2, 1, 3), (5, 11, 1)]  # (row, chunk, length)
    engine.copy(*run_pieces(stage.data_ptr(), host.data_ptr(), runs, chunk_bytes(), True),
                to_device=False)
    if device == "cuda":
        torch.cuda.synchronize()
    want = torch.arange(CHUNKS * LAYERS * LAYER_WORDS).view(CHUNKS, LAYERS, LAYER_WORDS)
    for row, chunk, n in runs:
        want[chunk:chunk + n] = -want[row:row + n] - 1
    assert torch.equal(host, want)
    rng.shuffle(runs)
    stage.fill_(0)
    engine.copy(*run_pieces(stage.data_ptr(), host.data_ptr(), runs, chunk_bytes(), False),
                to_device=True)
    if device == "cuda":
        torch.cuda.synchronize()
    for row, chunk, n in runs:
        assert torch.equal(stage[row:row + n].cpu(), host[chunk:chunk + n])


@pytest.mark.parametrize("seed", range(6))
def test_groups_and_runs_on_the_cpu(seed: int) -> None:
    engine = CopyEngine(torch.device("cpu"))
    check_groups(engine, "cpu", seed)
    check_runs(engine, "cpu", seed)


def test_nothing_to_copy() -> None:
    empty = np.zeros(0, dtype=np.uint64)
    CopyEngine(torch.device("cpu")).copy(empty, empty, empty, to_device=True)


@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_groups_and_runs(seed: int, batch: bool) -> None:
    engine = CopyEngine(torch.device("cuda"), batch=batch)
    drv = _driver()
    assert drv is not None
    assert engine.batched == (batch and drv[0] is not None)
    with torch.cuda.stream(torch.cuda.Stream()):
        check_groups(engine, "cuda", seed)
        check_runs(engine, "cuda", seed)
